"""The examples' command line: shared flags and the optimizers they build."""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import optax

import kfac_jax
from examples import training


def base_parser(
  description: str,
  *,
  epochs: int,
  batch_size: int,
  kfac_lr: float,
  sgd_lr: float,
  adam_lr: float,
  damping: float,
  kl_clip: float,
  inv_update_steps: int,
  factor_decay: float,
  compute_method: str,
  optimizers: str = "kfac,sgd,adam",
  factor_update_steps: int = 1,
  weight_decay: float = 1e-4,
  gradient_from_stats: bool = True,
) -> argparse.ArgumentParser:
  """The flags both examples share, with each example's defaults."""
  parser = argparse.ArgumentParser(
    description=description,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--epochs", type=int, default=epochs, help="passes over the training set"
  )
  parser.add_argument(
    "--batch-size",
    type=int,
    default=batch_size,
    help="examples per step (all optimizers)",
  )
  parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="cap on the number of steps, for smoke runs "
    "(None: epochs × steps per epoch)",
  )
  parser.add_argument(
    "--seed",
    type=int,
    default=0,
    help="seed of the initialization and the shuffling",
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("results"),
    help="folder for the loss-curve PNG and the table",
  )
  parser.add_argument(
    "--eval-size",
    type=int,
    default=None,
    help="evaluate on the first N examples of each "
    "evaluated split only, for quick runs (None: all)",
  )
  parser.add_argument(
    "--optimizers",
    default=optimizers,
    help="comma-separated subset of kfac,kfac-adaptive,sgd,"
    "adam,adamw (kfac-adaptive where the example splits "
    "its loss and samples its curvature)",
  )
  group = parser.add_argument_group("K-FAC (scale_by_kfac + SGD momentum 0.9)")
  group.add_argument(
    "--kfac-lr",
    type=float,
    default=kfac_lr,
    help="learning rate of the SGD after K-FAC",
  )
  group.add_argument(
    "--compute-method",
    choices=("eigen", "inverse"),
    default=compute_method,
    help="eigen: (A⊗G + λI)⁻¹ via eigenbases; inverse: (A + λI)⁻¹ ∇ (G + λI)⁻¹",
  )
  group.add_argument(
    "--damping", type=float, default=damping, help="K-FAC damping λ"
  )
  group.add_argument(
    "--kl-clip",
    type=float,
    default=kl_clip,
    help="KL-clipping bound (<= 0 turns it off)",
  )
  group.add_argument(
    "--inv-update-steps",
    type=int,
    default=inv_update_steps,
    help="steps between recomputing the eigendecompositions or inverses",
  )
  group.add_argument(
    "--factor-update-steps",
    type=int,
    default=factor_update_steps,
    help="steps between updates of the Kronecker factors",
  )
  group.add_argument(
    "--factor-decay",
    type=float,
    default=factor_decay,
    help="running-average decay of the Kronecker factors",
  )
  group.add_argument(
    "--gradient-from-stats",
    default=gradient_from_stats,
    action=argparse.BooleanOptionalAction,
    help="precondition dense layers' gradients in the "
    "factored form aᵀg of the captured stats where that is "
    "cheaper (scale_by_kfac(gradient_from_stats=True); the "
    "examples' losses hold no regularizer, and weight decay "
    "comes after K-FAC)",
  )
  group = parser.add_argument_group(
    "K-FAC adaptive (scale_by_kfac(adaptive=...): no learning rate; "
    "inverse method, factors every step, inverses every 5 steps)"
  )
  group.add_argument(
    "--initial-damping",
    type=float,
    default=150.0,
    help="initial λ, then adapted (DeepMind kfac-jax's autoencoder value)",
  )
  group = parser.add_argument_group("baselines")
  group.add_argument(
    "--sgd-lr",
    type=float,
    default=sgd_lr,
    help="learning rate of SGD with momentum 0.9",
  )
  group.add_argument(
    "--adam-lr",
    type=float,
    default=adam_lr,
    help="learning rate of Adam and AdamW",
  )
  group.add_argument(
    "--weight-decay",
    type=float,
    default=weight_decay,
    help="decoupled weight decay of AdamW",
  )
  return parser


def build_optimizers(
  args: argparse.Namespace,
  layers: Mapping[str, kfac_jax.LayerInfo] | None = None,
  adaptive: bool = False,
) -> list[training.Optimizer]:
  """K-FAC, SGD with momentum, Adam and AdamW from the shared flags.

  ``layers``: the layer table (``kfac_jax.trace_layers``) for models with
  scanned layers, grouped convolutions or ``DenseGeneral``. ``adaptive``:
  whether the example offers ``kfac-adaptive`` (it splits its loss and
  samples its curvature).
  """
  kl_clip = args.kl_clip if args.kl_clip > 0 else None
  available = {
    "kfac": lambda: training.Optimizer(
      "K-FAC",
      kfac_jax.kfac(
        learning_rate=args.kfac_lr,
        momentum=0.9,
        damping=args.damping,
        kl_clip=kl_clip,
        factor_decay=args.factor_decay,
        factor_update_steps=args.factor_update_steps,
        inv_update_steps=args.inv_update_steps,
        compute_method=args.compute_method,
        gradient_from_stats=args.gradient_from_stats,
        layers=layers,
      ),
      uses_kfac=True,
      description=(
        f"kfac_jax.kfac: lr {args.kfac_lr:g}, momentum 0.9, damping "
        f"{args.damping:g}, kl_clip {kl_clip}, factor_decay "
        f"{args.factor_decay:g}, factor_update_steps "
        f"{args.factor_update_steps}, "
        f"inv_update_steps {args.inv_update_steps}, "
        f"compute_method {args.compute_method!r}, "
        f"gradient_from_stats {args.gradient_from_stats}"
      ),
    ),
    "kfac-adaptive": lambda: training.Optimizer(
      "K-FAC adaptive",
      kfac_jax.scale_by_kfac(
        damping=args.initial_damping,
        kl_clip=None,
        factor_decay=args.factor_decay,
        compute_method="inverse",
        inv_update_steps=5,
        layers=layers,
        adaptive=kfac_jax.AdaptiveConfig(),
      ),
      uses_kfac=True,
      needs_split_loss=True,
      separate_curvature=True,
      description=(
        "kfac_jax.scale_by_kfac(adaptive=AdaptiveConfig()): initial "
        f"damping {args.initial_damping:g}, factor_decay "
        f"{args.factor_decay:g}, inverse method, inv_update_steps 5, "
        "Gauss-Newton factors (kfac_jax.sampled_curvature)"
      ),
    ),
    "sgd": lambda: training.Optimizer(
      "SGD",
      optax.sgd(args.sgd_lr, momentum=0.9),
      description=f"optax.sgd: lr {args.sgd_lr:g}, momentum 0.9",
    ),
    "adam": lambda: training.Optimizer(
      "Adam",
      optax.adam(args.adam_lr),
      description=f"optax.adam: lr {args.adam_lr:g}, betas (0.9, 0.999)",
    ),
    "adamw": lambda: training.Optimizer(
      "AdamW",
      optax.adamw(args.adam_lr, weight_decay=args.weight_decay),
      description=(
        f"optax.adamw: lr {args.adam_lr:g}, betas (0.9, 0.999), "
        f"weight_decay {args.weight_decay:g}"
      ),
    ),
  }
  if not adaptive:
    del available["kfac-adaptive"]
  chosen = [s.strip().lower() for s in args.optimizers.split(",") if s.strip()]
  if "kfac-adaptive" in chosen and not adaptive:
    raise SystemExit(
      "--optimizers kfac-adaptive: this example does not split its loss "
      "into network and loss (kfac_jax.SplitLoss) nor sample Gauss-Newton "
      "curvature; examples/mnist_autoencoder.py does."
    )
  unknown = sorted(set(chosen) - set(available))
  if unknown or not chosen:
    raise SystemExit(
      f"--optimizers: unknown {unknown}; use a comma-separated "
      f"subset of {','.join(available)}."
    )
  return [available[name]() for name in dict.fromkeys(chosen)]


def check_args(args: argparse.Namespace) -> None:
  for flag in (
    "epochs",
    "batch_size",
    "inv_update_steps",
    "factor_update_steps",
  ):
    if getattr(args, flag) < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  for flag in ("steps", "eval_size"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  for flag in ("kfac_lr", "sgd_lr", "adam_lr", "damping"):
    if not getattr(args, flag) > 0:
      raise SystemExit(f"--{flag.replace('_', '-')} must be > 0.")
  if not 0 <= args.factor_decay <= 1:
    raise SystemExit("--factor-decay must be in [0, 1].")


def head(arrays: Sequence[np.ndarray], n: int | None) -> tuple[np.ndarray, ...]:
  """The first ``n`` examples of each array (all when ``n`` is None)."""
  return tuple(a if n is None else a[:n] for a in arrays)


def describe_setup() -> str:
  devices = jax.devices()
  return (
    f"jax {jax.__version__} on {len(devices)} {devices[0].platform} "
    f"device(s), {os.cpu_count()} CPU cores"
  )
