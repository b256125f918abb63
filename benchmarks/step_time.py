#!/usr/bin/env python3
"""Step-time benchmark: K-FAC (eigen, inverse, adaptive) vs SGD+momentum, AdamW.

Every optimizer ("variant") of one configuration (model, batch size) is timed
in the same process, interleaved: after each variant's first call (compile
included) and a few warm-up steps, the variants take turns doing
``--steps-per-round`` steps each, for ``--rounds`` rounds, each step timed on
its own with ``jax.block_until_ready``. K-FAC steps are split into those that
recompute the decompositions (``count % inv_update_steps == 0``) and the rest.
Figures are medians, reported as ratios to SGD's median step in the same run,
beside an analytic FLOP floor. See benchmarks/README.md for the columns and
formulas.

  python benchmarks/step_time.py                       # both models
  python benchmarks/step_time.py --models autoencoder --batch-sizes 256
  python benchmarks/step_time.py --dm                  # + DeepMind kfac-jax
  python benchmarks/step_time.py --smoke --out /tmp/x  # CI-cheap, < 30 s
  python benchmarks/step_time.py --variants sgd kfac-inverse --kfac-revs HEAD~1
                                    # A/B: the working tree against HEAD~1
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


def _preset_blas_threads(argv: Sequence[str]) -> None:
  """Applies ``--blas-threads N`` before numpy/scipy load OpenBLAS."""
  for i, arg in enumerate(argv):
    value = None
    if arg == "--blas-threads" and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith("--blas-threads="):
      value = arg.split("=", 1)[1]
    if value is not None:
      for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = value


if __name__ == "__main__":
  _preset_blas_threads(sys.argv[1:])

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position

import kfac_jax  # pylint: disable=g-import-not-at-top,wrong-import-position

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position
from bench_common import Contestant  # pylint: disable=g-import-not-at-top,wrong-import-position
from convergence import CENTERS, KFAC_ADAPTIVE_SETTINGS  # pylint: disable=g-import-not-at-top,wrong-import-position
import models  # pylint: disable=g-import-not-at-top,wrong-import-position

ALL_MODELS = ("autoencoder", "resnet")
# "-gfs": scale_by_kfac(gradient_from_stats=True), the dense layers'
# gradients preconditioned in their factored form aᵀg where that is cheaper.
# "kfac-adaptive": the adaptive mode as convergence.py races it (its
# settings, the quadratic model and the factors on a quarter of the batch),
# with this run's --inv-update-steps, also as its damping-adaptation interval
# (the race's 5 and 5) so that the extra loss evaluation of an adaptation
# step falls on the decomposition steps, not among the plain ones; autoencoder
# only (it needs a SplitLoss), no FLOP floor (the quadratic model's products
# are not in it).
ALL_VARIANTS = ("sgd", "adamw", "kfac-eigen", "kfac-inverse", "kfac-eigen-gfs",
                "kfac-inverse-gfs", "kfac-adaptive")
DEFAULT_DM_PYTHON = "/tmp/dm-venv/bin/python"
DM_VENV_COMMAND = (
    "python3 -m venv /tmp/dm-venv && /tmp/dm-venv/bin/pip install "
    "kfac-jax==0.0.8 jax==0.8.2 jaxlib==0.8.2 flax optax tqdm")
# Targets for (ours / DeepMind) of each ratio-to-SGD, K-FAC inverse method.
DM_TARGETS = dict(plain_x=0.9, decomposition_x=0.5, amortized_x=0.75,
                  compile_x=0.5)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--models", nargs="+", choices=ALL_MODELS, default=None,
                 help="models to time; None: all (with --smoke: "
                 "autoencoder only, to stay under 30 s)")
  p.add_argument("--batch-sizes", nargs="+", type=int, default=[256, 1024],
                 help="autoencoder batch sizes")
  p.add_argument("--resnet-batch", type=int, default=128,
                 help="ResNet batch size (32x32x3 inputs)")
  p.add_argument("--resnet-depth", type=int, default=8,
                 help="ResNet depth 6n+2 (8, 14, 20, ...)")
  p.add_argument("--resnet-width", type=int, default=1,
                 help="channel multiplier of the 16/32/64 stages")
  p.add_argument("--no-batch-norm", dest="batch_norm", action="store_false",
                 help="ResNet without BatchNorm (convs get biases); without "
                 "the flag, BatchNorm is on: batch_norm=%(default)s")
  p.add_argument("--variants", nargs="+", choices=ALL_VARIANTS, default=None,
                 help="optimizers to time; sgd is the baseline, keep it. "
                 "None: all (with --smoke: all but adamw and kfac-eigen-gfs)")
  p.add_argument("--kfac-revs", nargs="+", default=[], metavar="REV",
                 help="A/B in one run: also time every K-FAC variant with "
                 "kfac_jax as of these git revisions (named "
                 "<variant>@<commit>), interleaved with the working tree's")
  p.add_argument("--rounds", type=int, default=4,
                 help="round-robin rounds per configuration")
  p.add_argument("--steps-per-round", type=int, default=10,
                 help="consecutive steps per variant per round")
  p.add_argument("--warmup-steps", type=int, default=2,
                 help="untimed steps per variant after its first call")
  p.add_argument("--inv-update-steps", type=int, default=10,
                 help="K-FAC decomposition period T")
  p.add_argument("--learning-rate", type=float, default=1e-3,
                 help="SGD / K-FAC learning rate (timing does not depend on it)")
  p.add_argument("--damping", type=float, default=1e-3, help="K-FAC damping")
  p.add_argument("--eigh-flops", type=float, default=4.0,
                 help="FLOP-floor constant c in eigh(d) ≈ c·d³ (LAPACK syevd: "
                 "4/3 tridiagonalization + 2 back-transformation + divide and "
                 "conquer; 9 is Golub & Van Loan's QR-iteration figure)")
  p.add_argument("--inverse-flops", type=float, default=1.0,
                 help="FLOP-floor constant c in Cholesky inverse(d) ≈ c·d³ "
                 "(potrf d³/3 + potri 2d³/3)")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"),
                 help="directory for the JSON (and markdown) results")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--smoke", action="store_true",
                 help="tiny sizes, 2 rounds of 3 steps, no DeepMind run (CI)")
  p.add_argument("--dm", action="store_true",
                 help="also time DeepMind's kfac-jax 0.0.8 (separate venv)")
  p.add_argument("--dm-python", default=DEFAULT_DM_PYTHON,
                 help="python of the venv that has DeepMind's kfac-jax; "
                 f"create it with: {DM_VENV_COMMAND}")
  p.add_argument("--dm-create-venv", action="store_true",
                 help="create the DeepMind venv at /tmp/dm-venv if missing")
  p.add_argument("--dm-rounds", type=int, default=None,
                 help="rounds for the DeepMind run (default: --rounds)")
  p.add_argument("--dm-estimation-mode", default="fisher_empirical",
                 help="DeepMind estimation_mode (fisher_empirical matches our "
                 "empirical-Fisher G; DeepMind's default is ggn_curvature_prop)")
  p.add_argument("--blas-threads", type=int, default=None,
                 help="set OPENBLAS_NUM_THREADS (and OMP/MKL) for this run and "
                 "the DeepMind subprocess; jaxlib's CPU LAPACK (eigh, Cholesky, "
                 "LU) runs on scipy's OpenBLAS. Default: the environment's")
  p.add_argument("--no-progress", action="store_true",
                 help="disable the tqdm progress bar")
  args = p.parse_args(argv)
  if args.variants is None:
    args.variants = [v for v in ALL_VARIANTS
                     if not (args.smoke and v in ("adamw", "kfac-eigen-gfs"))]
  if "sgd" not in args.variants:
    p.error("--variants must include sgd (the baseline of every ratio)")
  if args.models is None:
    args.models = ["autoencoder"] if args.smoke else list(ALL_MODELS)
  for flag in ("rounds", "steps_per_round", "resnet_batch", "resnet_depth",
               "resnet_width", "inv_update_steps"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1")
  if args.warmup_steps < 0 or min(args.batch_sizes) < 1:
    p.error("--warmup-steps must be >= 0 and every --batch-sizes >= 1")
  for rev in args.kfac_revs:
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet",
                       f"{rev}^{{commit}}"], cwd=HERE.parent,
                      capture_output=True).returncode:
      p.error(f"--kfac-revs: {rev!r} is not a commit of this repository")
  if args.dm and not args.smoke and not (os.path.exists(args.dm_python) or
                                         args.dm_create_venv):
    # Checked now: the DeepMind run comes after all of ours (~15 min).
    p.error(f"--dm: {args.dm_python} not found. Create it with "
            f"{DM_VENV_COMMAND}, or pass --dm-create-venv or --dm-python.")
  if args.smoke:
    args.batch_sizes = [16]
    args.resnet_batch = 4
    args.rounds = 2
    args.steps_per_round = 3
    args.warmup_steps = 0
    args.inv_update_steps = 2
    args.dm = False
  return args


def kfac_jax_provenance() -> dict[str, Any]:
  """Which kfac_jax was timed: path, source hash and git commit (if any)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  package = pathlib.Path(kfac_jax.__file__).resolve().parent
  digest = hashlib.sha256()
  for source in sorted(package.rglob("*.py")):
    digest.update(str(source.relative_to(package)).encode())
    digest.update(source.read_bytes())
  out = dict(kfac_jax=kfac_jax.__version__, kfac_jax_path=str(package),
             kfac_jax_source_sha256=digest.hexdigest()[:16])
  try:
    git = lambda *a: subprocess.run(
        ["git", *a], cwd=package, capture_output=True, text=True,
        check=True).stdout.strip()
    out["git_commit"] = git("rev-parse", "HEAD")
    out["git_dirty_kfac_jax"] = bool(git("status", "--porcelain", "--", "."))
  except (OSError, subprocess.CalledProcessError):
    pass
  return out


# --------------------------------------------------------------------------
# Optimizers and step functions.


def load_kfac_revision(rev: str) -> tuple[str, Any]:
  """``(commit, module)``: kfac_jax as of git revision ``rev``.

  ``git archive`` copies the package into a temporary directory as
  ``kfac_jax_<commit>`` (its own imports renamed), so it imports beside the
  working tree's ``kfac_jax`` in one process.
  """
  git = lambda *a: subprocess.run(["git", *a], cwd=HERE.parent,
                                  capture_output=True, check=True).stdout
  commit = git("rev-parse", "--short", rev).decode().strip()
  name = f"kfac_jax_{commit}"
  root = pathlib.Path(tempfile.mkdtemp(prefix="kfac_rev_"))
  with tarfile.open(fileobj=io.BytesIO(git("archive", commit, "kfac_jax")),
                    mode="r") as archive:
    # (Our own repository's archive; the filter exists from Python 3.11.4.)
    archive.extractall(root, **({"filter": "data"} if hasattr(
        tarfile, "data_filter") else {}))
  (root / "kfac_jax").rename(root / name)
  for source in (root / name).rglob("*.py"):
    source.write_text(re.sub(r"\bkfac_jax\b", name, source.read_text()))
  sys.path.insert(0, str(root))
  return commit, importlib.import_module(name)


def kfac_method(variant: str) -> str:
  """``eigen``, ``inverse`` or ``adaptive``: ``kfac-<method>[-gfs][@<rev>]``."""
  return variant.split("@")[0].split("-")[1]


def from_stats(variant: str) -> bool:
  """Whether a K-FAC variant uses ``gradient_from_stats`` (``-gfs``)."""
  return variant.split("@")[0].endswith("-gfs")


def make_tx(variant: str, args: argparse.Namespace, batch: int,
            lib: Any = kfac_jax) -> optax.GradientTransformation:
  lr = args.learning_rate
  if variant == "sgd":
    return optax.sgd(lr, momentum=0.9)
  if variant == "adamw":
    return optax.adamw(1e-3, weight_decay=1e-4)
  method = kfac_method(variant)
  if method == "adaptive":
    settings = dict(KFAC_ADAPTIVE_SETTINGS,
                    damping=CENTERS["kfac_adaptive"],
                    inv_update_steps=args.inv_update_steps,
                    factor_batch_size=curvature_examples(batch))
    return lib.scale_by_kfac(
        adaptive=lib.AdaptiveConfig(
            damping_adaptation_interval=args.inv_update_steps), **settings)
  # Only where asked, so that --kfac-revs can time commits before the option.
  extra = dict(gradient_from_stats=True) if from_stats(variant) else {}
  return optax.chain(
      lib.scale_by_kfac(
          learning_rate=lr, damping=args.damping, factor_decay=0.95,
          kl_clip=1e-3, factor_update_steps=1,
          inv_update_steps=args.inv_update_steps, compute_method=method,
          **extra),
      optax.sgd(lr, momentum=0.9))


def is_kfac(variant: str) -> bool:
  return variant.startswith("kfac")


def curvature_examples(batch: int) -> int:
  """``kfac-adaptive``'s curvature mini-batch: a quarter of the batch (the
  race's 250 of 1000)."""
  return max(1, batch // 4)


def kfac_count(opt_state: Any) -> int:
  """The step count of a K-FAC state, alone (adaptive) or first in a chain."""
  alone = "count" in getattr(opt_state, "_fields", ())  # a chain's is a tuple
  kfac_state = opt_state if alone else opt_state[0]
  return int(kfac_state.count)


class Config:
  """One (model, batch) configuration: params, data, loss and FLOP shapes."""

  name: str
  batch: int
  params: Any
  extra_state: Any  # threaded through the step (BatchNorm stats) or None
  data: tuple[jax.Array, ...]
  loss_fn: Callable[..., Any]  # (params, extra_state, *data) -> (loss, extra)
  # (lib, *data) -> lib.SplitLoss on the curvature examples, or None.
  split_loss: Callable[..., Any] | None
  description: str


def autoencoder_config(batch: int, args: argparse.Namespace) -> Config:
  widths = (bench_common.SMOKE_AUTOENCODER_WIDTHS if args.smoke else
            bench_common.AUTOENCODER_WIDTHS)
  pixels = bench_common.SMOKE_PIXELS if args.smoke else bench_common.MNIST_PIXELS
  model = bench_common.Autoencoder(widths, out_features=pixels)
  key_data, key_init = jax.random.split(jax.random.PRNGKey(args.seed))
  x = bench_common.random_images(key_data, batch, pixels)
  c = Config()
  c.name = "autoencoder"
  c.batch = batch
  c.params = model.init(key_init, x[:1])["params"]
  c.extra_state = None
  c.data = (x,)
  c.description = "-".join(map(str, (pixels, *widths, pixels))) + ", float32"

  def loss_fn(params, extra, x):
    logits = model.apply({"params": params}, x)
    return bench_common.autoencoder_loss(logits, x), extra

  def split_loss(lib, x):
    curvature = x[:curvature_examples(len(x))]
    return lib.SplitLoss(
        outputs_fn=lambda params: model.apply({"params": params}, curvature),
        loss_fn=lambda logits: bench_common.autoencoder_loss(logits,
                                                             curvature))

  c.loss_fn = loss_fn
  c.split_loss = split_loss
  return c


def resnet_config(args: argparse.Namespace) -> Config:
  size = 8 if args.smoke else 32
  model = models.CifarResNet(depth=args.resnet_depth, width=args.resnet_width,
                             batch_norm=args.batch_norm)
  key_x, key_y, key_init = jax.random.split(jax.random.PRNGKey(args.seed), 3)
  images = jax.random.normal(key_x, (args.resnet_batch, size, size, 3))
  labels = jax.random.randint(key_y, (args.resnet_batch,), 0, 10)
  variables = model.init(key_init, images[:1], train=False)
  c = Config()
  c.name = f"resnet{args.resnet_depth}"
  c.batch = args.resnet_batch
  c.params = variables["params"]
  c.extra_state = variables.get("batch_stats", {})
  c.data = (images, labels)
  c.description = (f"CIFAR ResNet-{args.resnet_depth}, width {args.resnet_width}"
                   f", {'BatchNorm' if args.batch_norm else 'no BatchNorm'}, "
                   f"{size}x{size}x3, float32")
  c.loss_fn = models.resnet_loss_fn(model)
  c.split_loss = None  # BatchNorm's state: no SplitLoss, no adaptive mode
  return c


def make_contestant(variant: str, config: Config, args: argparse.Namespace,
                    lib: Any = kfac_jax) -> Contestant:
  """``lib``: the kfac_jax module to time (``load_kfac_revision``)."""
  tx = make_tx(variant, args, config.batch, lib)
  # Each contestant gets its own copies: its step donates them.
  params, extra_state = (jax.tree.map(jnp.copy, t)
                         for t in (config.params, config.extra_state))
  opt_state = tx.init(params)
  loss_fn = config.loss_fn

  if is_kfac(variant):

    def step(params, extra, opt_state, *data):
      (loss, extra), grads, stats = lib.value_grad_and_stats(
          loss_fn, has_aux=True)(params, extra, *data)
      adaptive = (dict(split_loss=config.split_loss(lib, *data))
                  if kfac_method(variant) == "adaptive" else {})
      updates, opt_state = tx.update(grads, opt_state, params,
                                     kfac_stats=stats, **adaptive)
      return optax.apply_updates(params, updates), extra, opt_state, loss
  else:

    def step(params, extra, opt_state, *data):
      (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, extra, *data)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), extra, opt_state, loss

  # Params and states are donated (as DeepMind's kfac-jax does), so that
  # what a step leaves unchanged (K-FAC's preconditioners off decomposition
  # steps) is not copied.
  jitted = jax.jit(step, donate_argnums=(0, 1, 2))
  data = config.data

  def call(carry):
    params, extra, opt_state, _ = carry
    return jitted(params, extra, opt_state, *data)

  return Contestant(
      name=variant,
      step=call,
      carry=(params, extra_state, opt_state, jnp.zeros([])),
      inv_update_steps=args.inv_update_steps if is_kfac(variant) else None,
      read_count=(lambda carry: kfac_count(carry[2])) if is_kfac(variant)
      else None,
      state_bytes=bench_common.tree_nbytes(opt_state),
      lower=lambda: jitted.lower(params, extra_state, opt_state, *data),
  )


# --------------------------------------------------------------------------
# FLOP floor.


def layer_shapes(config: Config) -> list[dict[str, int]]:
  """Rows, fan-in (kh·kw·cin), fan-out and bias of every Dense/Conv layer.

  Shapes only: ``jax.eval_shape`` of the capture gives each layer's output
  cotangent shape (rows = batch · output positions), the params give the
  kernel shape. In call order: the first layer is the one applied to the
  data.
  """

  def loss_only(params, extra, *data):
    return config.loss_fn(params, extra, *data)

  _, _, stats = jax.eval_shape(
      kfac_jax.value_grad_and_stats(loss_only, has_aux=True), config.params,
      config.extra_state, *config.data)
  shapes = []
  for name, s in stats.items():
    node = config.params
    for key in name.split("/"):
      node = node[key]
    kernel = node["kernel"].shape
    rows = sum(math.prod(g.shape[:-1]) for g in s.output_cotangents)
    shapes.append(dict(name=name, rows=int(rows),
                       fan_in=int(math.prod(kernel[:-1])),
                       fan_out=int(kernel[-1]),
                       bias=int(s.signature.has_bias),
                       conv=int(s.signature.conv is not None)))
  return shapes


def flop_floor(shapes: Sequence[dict[str, int]], method: str, period: int,
               eigh_c: float, inverse_c: float,
               gradient_from_stats: bool = False) -> dict[str, float]:
  """Analytic FLOPs of an SGD step and of K-FAC's additions.

  sgd:            6 · Σ rows·in·out − 2 · rows₀·in₀·out₀
                  (forward + backward; no step computes the gradient of
                  the first layer's input, the data)
  factors:        2 · Σ rows·(dA² + dG²)            (every step here)
  precondition:   pairs · 2 · Σ (dA²·dG + dA·dG²)   (pairs: eigen 2, inverse 1)
  decomposition:  c · Σ (dA³ + dG³)                 (every ``period`` steps;
                                                     c = eigh_c or inverse_c)
  with dA = in + bias, dG = out. With ``gradient_from_stats`` a dense
  layer's first pair costs ``2 · rows·(dA² + dG² + dA·dG)`` instead where
  that is less (``gradient_matrix.factored_is_cheaper``).
  """
  sgd = sum(6 * s["rows"] * s["fan_in"] * s["fan_out"] for s in shapes)
  sgd -= 2 * shapes[0]["rows"] * shapes[0]["fan_in"] * shapes[0]["fan_out"]
  factors = precondition = decomposition = 0.0
  pairs = 2 if method == "eigen" else 1
  c = eigh_c if method == "eigen" else inverse_c
  for s in shapes:
    da, dg = s["fan_in"] + s["bias"], s["fan_out"]
    factors += 2 * s["rows"] * (da**2 + dg**2)
    pair = 2 * (da**2 * dg + da * dg**2)
    first_pair = pair
    if gradient_from_stats and not s["conv"]:
      first_pair = min(pair, 2 * s["rows"] * (da**2 + dg**2 + da * dg))
    precondition += first_pair + (pairs - 1) * pair
    decomposition += c * (da**3 + dg**3)
  plain = factors + precondition
  return dict(
      sgd_flops=float(sgd),
      factor_flops=float(factors),
      precondition_flops=float(precondition),
      decomposition_flops=float(decomposition),
      floor_plain_x=(sgd + plain) / sgd,
      floor_decomposition_x=(sgd + plain + decomposition) / sgd,
      floor_amortized_x=(sgd + plain + decomposition / period) / sgd,
  )


# --------------------------------------------------------------------------
# Running one configuration.


def run_config(config: Config, args: argparse.Namespace) -> dict[str, Any]:
  variants = [v for v in args.variants
              if config.split_loss is not None or v != "kfac-adaptive"]
  contestants = [make_contestant(v, config, args) for v in variants]
  contestants += [
      make_contestant(f"{v}@{commit}", config, args, lib)
      for commit, lib in args.kfac_libs.items()
      for v in variants if is_kfac(v)]
  meta, summary = bench_common.run_with_progress(
      contestants, args, f"{config.name} b={config.batch}")
  shapes = layer_shapes(config)
  for c in contestants:
    s = summary[c.name]
    s["final_loss"] = float(c.carry[3])
    if is_kfac(c.name) and kfac_method(c.name) != "adaptive":
      floor = flop_floor(shapes, kfac_method(c.name),
                         args.inv_update_steps, args.eigh_flops,
                         args.inverse_flops, from_stats(c.name))
      s.update(floor)
      s["plain_over_floor"] = s["plain_x"] / floor["floor_plain_x"]
      s["decomposition_over_floor"] = (s["decomposition_x"] /
                                       floor["floor_decomposition_x"])
      s["amortized_over_floor"] = (s["amortized_x"] /
                                   floor["floor_amortized_x"])
  return dict(model=config.name, batch=config.batch,
              description=config.description,
              param_bytes=bench_common.tree_nbytes(config.params),
              layers=shapes, rounds=meta, variants=summary)


# --------------------------------------------------------------------------
# DeepMind kfac-jax (separate venv, subprocess).


def ensure_dm_python(args: argparse.Namespace) -> str | None:
  python = args.dm_python
  if os.path.exists(python):
    return python
  if not args.dm_create_venv:
    print(f"--dm: {python} not found. Create it with\n  {DM_VENV_COMMAND}\n"
          "or pass --dm-create-venv.", file=sys.stderr)
    return None
  print(f"Creating the DeepMind venv: {DM_VENV_COMMAND}", file=sys.stderr)
  subprocess.run(DM_VENV_COMMAND, shell=True, check=True)
  return "/tmp/dm-venv/bin/python"


def run_dm(args: argparse.Namespace, out_dir: pathlib.Path,
           stamp: str) -> dict[str, Any] | None:
  python = ensure_dm_python(args)
  if python is None:
    return None
  out_file = out_dir.resolve() / f"dm_kfac_{stamp}.json"
  cmd = [python, str(HERE / "dm_kfac_step_time.py"),
         "--batch-size", "256",
         "--rounds", str(args.dm_rounds or args.rounds),
         "--steps-per-round", str(args.steps_per_round),
         "--warmup-steps", str(args.warmup_steps),
         "--inverse-update-period", str(args.inv_update_steps),
         "--learning-rate", str(args.learning_rate),
         "--damping", str(args.damping),
         "--estimation-mode", args.dm_estimation_mode,
         "--seed", str(args.seed),
         "--out", str(out_file)]
  if args.no_progress:
    cmd.append("--no-progress")
  if args.smoke:
    cmd.append("--smoke")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  print("Running DeepMind kfac-jax:", " ".join(cmd), file=sys.stderr)
  # cwd outside the repository, so that ``import kfac_jax`` cannot find ours.
  done = subprocess.run(cmd, check=False, env=env, cwd="/tmp")
  if done.returncode != 0 or not out_file.exists():
    print(f"DeepMind run failed (exit {done.returncode}); no comparison.",
          file=sys.stderr)
    return None
  return json.loads(out_file.read_text())


def dm_comparison(results: list[dict[str, Any]],
                  dm: dict[str, Any]) -> dict[str, Any] | None:
  ours = next((r for r in results
               if r["model"] == "autoencoder" and r["batch"] == 256), None)
  if ours is None:
    return None
  table = {}
  for variant in ("kfac-inverse", "kfac-inverse-gfs", "kfac-eigen",
                  "kfac-eigen-gfs"):
    s = ours["variants"].get(variant)
    if s is None:
      continue
    d = dm["variants"]["dm-kfac"]
    table[variant] = {
        key: dict(ours=s[key], dm=d[key], ratio=s[key] / d[key],
                  target=(DM_TARGETS[key] if kfac_method(variant) == "inverse"
                          else None))
        for key in DM_TARGETS
    }
  return table


# --------------------------------------------------------------------------
# Markdown.


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "—"
  return fmt.format(x)


def markdown(results: list[dict[str, Any]], comparison: dict[str, Any] | None,
             dm: dict[str, Any] | None) -> str:
  lines = [
      "| model | batch | variant | step ms | ×SGD | decomp step ms | ×SGD | "
      "amortized ×SGD | compile s | ×SGD | opt state MiB |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in results:
    for name, s in r["variants"].items():
      lines.append(
          f"| {r['model']} | {r['batch']} | {name} | "
          f"{_f(s['plain_s'] * 1e3, '{:.1f}')} | {_f(s['plain_x'])} | "
          f"{_f(s['decomposition_s'] * 1e3, '{:.1f}')} | "
          f"{_f(s['decomposition_x'])} | {_f(s['amortized_x'])} | "
          f"{_f(s['compile_s'], '{:.1f}')} | {_f(s['compile_x'])} | "
          f"{_f(s['state_bytes'] / 2**20, '{:.1f}')} |")
  lines += [
      "",
      "FLOP floor (K-FAC): measured ×SGD, floor ×SGD and measured/floor.",
      "",
      "| model | batch | variant | SGD GFLOP | K-FAC GFLOP plain / decomp | "
      "plain ×SGD (floor) | /floor | decomp ×SGD (floor) | /floor | "
      "amortized ×SGD (floor) | /floor |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in results:
    for name, s in r["variants"].items():
      if "floor_plain_x" not in s:
        continue
      plain_g = (s["factor_flops"] + s["precondition_flops"]) / 1e9
      decomp_g = plain_g + s["decomposition_flops"] / 1e9
      lines.append(
          f"| {r['model']} | {r['batch']} | {name} | "
          f"{s['sgd_flops'] / 1e9:.3g} | {plain_g:.3g} / {decomp_g:.3g} | "
          f"{_f(s['plain_x'])} ({s['floor_plain_x']:.2f}) | "
          f"{_f(s['plain_over_floor'])} | "
          f"{_f(s['decomposition_x'])} ({s['floor_decomposition_x']:.2f}) | "
          f"{_f(s['decomposition_over_floor'])} | "
          f"{_f(s['amortized_x'])} ({s['floor_amortized_x']:.2f}) | "
          f"{_f(s['amortized_over_floor'])} |")
  if dm is not None:
    d = dm["variants"]
    lines += [
        "",
        f"DeepMind kfac-jax {dm['environment'].get('kfac_jax')} (jax "
        f"{dm['environment']['jax']}), autoencoder batch {dm['batch']}, "
        f"estimation_mode={dm['estimation_mode']}, separate run:",
        "",
        "| variant | step ms | ×SGD | inverse step ms | ×SGD | amortized ×SGD "
        "| compile s | ×SGD | opt state MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in d.items():
      lines.append(
          f"| {name} | {_f(s['plain_s'] * 1e3, '{:.1f}')} | "
          f"{_f(s['plain_x'])} | {_f(s['decomposition_s'] * 1e3, '{:.1f}')} | "
          f"{_f(s['decomposition_x'])} | {_f(s['amortized_x'])} | "
          f"{_f(s['compile_s'], '{:.1f}')} | {_f(s['compile_x'])} | "
          f"{_f(s['state_bytes'] / 2**20, '{:.1f}')} |")
  if comparison:
    lines += [
        "",
        "Ours / DeepMind, each a ratio to its own run's SGD (autoencoder, "
        "batch 256); targets apply to the inverse method:",
        "",
        "| ours | plain | with inverse | amortized | compile |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, row in comparison.items():
      cells = []
      for key in DM_TARGETS:
        v = row[key]
        mark = ""
        if v["target"] is not None:
          mark = " ✓" if v["ratio"] <= v["target"] else f" ✗ (≤ {v['target']})"
        cells.append(f"{v['ratio']:.2f}{mark}")
      lines.append(f"| {variant} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  args.kfac_libs = dict(map(load_kfac_revision, args.kfac_revs))
  started = time.time()
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  args.out.mkdir(parents=True, exist_ok=True)
  env = bench_common.environment()
  env.update(kfac_jax_provenance())
  configs: list[Callable[[], Config]] = []
  if "autoencoder" in args.models:
    configs += [lambda b=b: autoencoder_config(b, args)
                for b in args.batch_sizes]
  if "resnet" in args.models:
    configs.append(lambda: resnet_config(args))
  path = args.out / f"step_time_{stamp}.json"
  command = (" ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:])
             if argv is None else " ".join(argv))

  def save(results, dm=None, comparison=None, table=None):
    record = dict(
        command=command,
        args={k: str(v) if isinstance(v, pathlib.Path) else v
              for k, v in vars(args).items() if k != "kfac_libs"},
        environment=env,
        load_average_at_end=bench_common.load_average(),
        wall_s=time.time() - started,
        complete=table is not None,
        results=results,
        deepmind=dm,
        deepmind_comparison=comparison,
        markdown=table,
    )
    path.write_text(json.dumps(record, indent=1))
    return record

  results = []
  for make in configs:
    results.append(run_config(make(), args))
    save(results)  # partial results survive a later failure
  dm = run_dm(args, args.out, stamp) if args.dm else None
  comparison = dm_comparison(results, dm) if dm else None
  table = markdown(results, comparison, dm)
  record = save(results, dm, comparison, table)
  (args.out / f"step_time_{stamp}.md").write_text(
      f"`{command}`\n\n{table}\n")
  print(table)
  print(f"\nwrote {path} ({record['wall_s']:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
