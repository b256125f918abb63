"""Soak test: a long bfloat16 K-FAC run that must stay finite at every step.

Trains an MLP whose params and activations are bfloat16
(``param_dtype=dtype=bfloat16``; ``--dtype float32`` for a baseline), with
bfloat16 Kronecker factors (``--factor-dtype``) and float32 decompositions,
using ``kfac_jax.kfac`` (K-FAC + SGD with momentum; by default lr 0.1,
momentum 0.9, damping 3e-3, kl_clip 1e-3, the eigen method) on the 8x8
digits of scikit-learn (``--dataset digits``, 1,797 images, no files needed)
or on MNIST's training images (``--dataset mnist``, found as the examples
find it: ``$KFAC_JAX_DATA``, the shared data folder, or the copy in
``examples/data``).

After every step it checks that the loss, every parameter and every optimizer
state leaf are finite. At the end it writes a JSON result to ``--out``: steps,
non-finite step count (and the first one), K-FAC's skipped factor updates and
rejected decompositions, full-dataset loss and accuracy before and after and
every ``--log-every`` steps, the final parameter norm, and wall time (with the
first step, compilation included, also on its own). Exit status 0 when no step
was non-finite and the final loss is below the initial one, 1 otherwise.

  python -m benchmarks.soak                     # 10,000 steps on digits
  python -m benchmarks.soak --steps 50 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import kfac_jax
from examples import datasets, models


def load_dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
  """``(x [N, features] float32 in [0, 1], y [N] int32)``."""
  if name == "digits":
    try:
      from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
    except ImportError:
      sys.exit(
        "soak.py: --dataset digits needs scikit-learn (pip install "
        "scikit-learn), or use --dataset mnist."
      )
    digits = load_digits()
    return (
      (digits.data / 16.0).astype(np.float32),
      digits.target.astype(np.int32),
    )
  mnist = datasets.load_mnist()
  return mnist.x_train, mnist.y_train


def batches(
  x: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Shuffled mini-batches, a new permutation each epoch (last part dropped)."""
  while True:
    order = rng.permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
      index = order[start : start + batch_size]
      yield x[index], y[index]


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every floating leaf of ``tree`` is finite."""
  checks = [
    jnp.all(jnp.isfinite(leaf))
    for leaf in jax.tree.leaves(tree)
    if jnp.issubdtype(leaf.dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(checks))


def kfac_states(opt_state: Any) -> list[kfac_jax.ScaleByKFACState]:
  is_state = lambda n: isinstance(n, kfac_jax.ScaleByKFACState)
  return [
    n for n in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(n)
  ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--steps", type=int, default=10_000, help="optimizer steps to run"
  )
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("results"),
    help="directory for the JSON result",
  )
  parser.add_argument(
    "--dataset",
    choices=("digits", "mnist"),
    default="digits",
    help="scikit-learn's 8x8 digits or MNIST's 60,000 training images",
  )
  parser.add_argument(
    "--widths",
    type=int,
    nargs="+",
    default=[128, 64],
    help="hidden layer widths",
  )
  parser.add_argument(
    "--dtype",
    choices=("bfloat16", "float32"),
    default="bfloat16",
    help="params and activations",
  )
  parser.add_argument(
    "--factor-dtype",
    choices=("bfloat16", "float32"),
    default="bfloat16",
    help="Kronecker factor storage",
  )
  parser.add_argument(
    "--batch-size", type=int, default=128, help="examples per step"
  )
  parser.add_argument(
    "--learning-rate",
    type=float,
    default=0.1,
    help="SGD learning rate (and K-FAC's, for the KL clip)",
  )
  parser.add_argument(
    "--momentum",
    type=float,
    default=0.9,
    help="SGD momentum after K-FAC (0 for none)",
  )
  parser.add_argument(
    "--damping", type=float, default=3e-3, help="K-FAC damping λ"
  )
  parser.add_argument(
    "--kl-clip", type=float, default=1e-3, help="K-FAC KL clip"
  )
  parser.add_argument(
    "--factor-decay",
    type=float,
    default=0.95,
    help="running average decay of A and G",
  )
  parser.add_argument(
    "--inv-update-steps",
    type=int,
    default=10,
    help="steps between decompositions",
  )
  parser.add_argument(
    "--compute-method", choices=("eigen", "inverse"), default="eigen"
  )
  parser.add_argument(
    "--log-every",
    type=int,
    default=500,
    help="record the full-dataset loss every this many steps",
  )
  parser.add_argument("--seed", type=int, default=0, help="init and data order")
  parser.add_argument(
    "--no-progress", action="store_true", help="no tqdm progress bar"
  )
  args = parser.parse_args(argv)
  if args.steps < 1 or args.log_every < 1:
    parser.error("--steps and --log-every must be >= 1.")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  x, y = load_dataset(args.dataset)
  classes = int(y.max()) + 1
  dtype = jnp.dtype(args.dtype)
  model = models.MLP(
    tuple(args.widths),
    classes,
    activation=jnp.tanh,
    dtype=dtype,
    param_dtype=dtype,
  )
  params = model.init(jax.random.PRNGKey(args.seed), x[:1])["params"]
  tx = kfac_jax.kfac(
    args.learning_rate,
    momentum=args.momentum,
    damping=args.damping,
    kl_clip=args.kl_clip,
    factor_decay=args.factor_decay,
    inv_update_steps=args.inv_update_steps,
    compute_method=args.compute_method,
    factor_dtype=jnp.dtype(args.factor_dtype),
  )
  opt_state = tx.init(params)

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, all_finite((loss, params, opt_state))

  @jax.jit
  def evaluate(params):
    logits = model.apply({"params": params}, x).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)

  initial_loss, initial_accuracy = map(float, evaluate(params))
  data = batches(x, y, args.batch_size, np.random.default_rng(args.seed))
  non_finite_steps, first_non_finite = 0, None
  curve = []
  start = time.perf_counter()
  progress = tqdm(
    range(args.steps), desc="soak", mininterval=2.0, disable=args.no_progress
  )
  for t in progress:
    params, opt_state, loss, finite = step(params, opt_state, *next(data))
    if t == 0:
      compile_time = time.perf_counter() - start
    if not bool(finite):
      non_finite_steps += 1
      first_non_finite = t if first_non_finite is None else first_non_finite
    if (t + 1) % args.log_every == 0 or t + 1 == args.steps:
      full_loss, accuracy = map(float, evaluate(params))
      curve.append(
        {
          "step": t + 1,
          "batch_loss": float(loss),
          "loss": full_loss,
          "accuracy": accuracy,
        }
      )
      progress.set_postfix(loss=f"{full_loss:.4f}", non_finite=non_finite_steps)
  jax.block_until_ready(params)
  wall_time = time.perf_counter() - start

  final_loss, final_accuracy = map(float, evaluate(params))
  param_norm = float(
    optax.global_norm(jax.tree.map(lambda p: p.astype(jnp.float32), params))
  )
  states = kfac_states(opt_state)
  ok = (
    non_finite_steps == 0
    and np.isfinite(final_loss)
    and final_loss < initial_loss
  )
  result = {
    "ok": bool(ok),
    "steps": args.steps,
    "non_finite_steps": non_finite_steps,
    "first_non_finite_step": first_non_finite,
    "skipped_factor_updates": sum(
      int(s.skipped_factor_updates) for s in states
    ),
    "rejected_decompositions": sum(
      int(s.rejected_decompositions) for s in states
    ),
    "initial_loss": initial_loss,
    "final_loss": final_loss,
    "initial_accuracy": initial_accuracy,
    "final_accuracy": final_accuracy,
    "final_param_norm": param_norm,
    "wall_time_s": wall_time,
    "first_step_s": compile_time,
    "steps_per_s_after_first": (
      (args.steps - 1) / (wall_time - compile_time) if args.steps > 1 else None
    ),
    "curve": curve,
    "config": {
      k: (str(v) if isinstance(v, pathlib.Path) else v)
      for k, v in vars(args).items()
    },
    "dtypes": {
      "params": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
      "factors": sorted(
        {str(f.dtype) for s in states for f in jax.tree.leaves(s.factors)}
      ),
      "preconditioners": sorted(
        {
          str(p.dtype)
          for s in states
          for p in jax.tree.leaves(s.preconditioners)
        }
      ),
    },
    "platform": {
      "jax": jax.__version__,
      "device": str(jax.devices()[0]),
      "python": platform.python_version(),
      "machine": platform.machine(),
    },
  }
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / (
    f"soak_{args.dataset}_{args.steps}steps_"
    f"{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.json"
  )
  path.write_text(json.dumps(result, indent=2) + "\n")
  print(
    json.dumps(
      {
        k: v
        for k, v in result.items()
        if k not in ("curve", "config", "platform")
      }
    )
  )
  print(f"result: {path}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
