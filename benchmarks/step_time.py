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

  python -m benchmarks.step_time                       # both models
  python -m benchmarks.step_time --models autoencoder --batch-sizes 256
  python -m benchmarks.step_time --dm                  # + DeepMind kfac-jax
  python -m benchmarks.step_time --smoke --out /tmp/x  # CI-cheap, < 30 s
  python -m benchmarks.step_time --variants sgd kfac-inverse --kfac-revs HEAD~1
                                    # A/B: the working tree against HEAD~1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
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
      for name in (
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
      ):
        os.environ[name] = value


if __name__ == "__main__":
  _preset_blas_threads(sys.argv[1:])

# pylint: disable=g-import-not-at-top,wrong-import-position
import kfac_jax
from benchmarks import (
  bench_common,
  dm_comparison,
  step_time_report,
  step_variants,
)
from benchmarks.step_variants import Config
from examples import flops

# pylint: enable=g-import-not-at-top,wrong-import-position

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
# "kfac-eigen-subspace", "kfac-eigen-ekfac": the eigen method refreshing its
# bases by subspace iteration, without and with EKFAC's scaling
# (step_variants.EIGEN_OPTIONS); no FLOP floor (it counts eigh's).
ALL_VARIANTS = (
  "sgd",
  "adamw",
  "kfac-eigen",
  "kfac-inverse",
  "kfac-eigen-gfs",
  "kfac-inverse-gfs",
  "kfac-adaptive",
  "kfac-eigen-subspace",
  "kfac-eigen-ekfac",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--models",
    nargs="+",
    choices=ALL_MODELS,
    default=None,
    help="models to time; None: all (with --smoke: "
    "autoencoder only, to stay under 30 s)",
  )
  p.add_argument(
    "--batch-sizes",
    nargs="+",
    type=int,
    default=[256, 1024],
    help="autoencoder batch sizes",
  )
  p.add_argument(
    "--resnet-batch",
    type=int,
    default=128,
    help="ResNet batch size (32x32x3 inputs)",
  )
  p.add_argument(
    "--resnet-depth",
    type=int,
    default=8,
    help="ResNet depth 6n+2 (8, 14, 20, ...)",
  )
  p.add_argument(
    "--resnet-width",
    type=int,
    default=1,
    help="channel multiplier of the 16/32/64 stages",
  )
  p.add_argument(
    "--no-batch-norm",
    dest="batch_norm",
    action="store_false",
    help="ResNet without BatchNorm (convs get biases); without "
    "the flag, BatchNorm is on: batch_norm=%(default)s",
  )
  p.add_argument(
    "--variants",
    nargs="+",
    choices=ALL_VARIANTS,
    default=None,
    help="optimizers to time; sgd is the baseline, keep it. "
    "None: all (with --smoke: all but adamw, kfac-eigen-gfs and "
    "the -subspace/-ekfac ones)",
  )
  p.add_argument(
    "--kfac-revs",
    nargs="+",
    default=[],
    metavar="REV",
    help="A/B in one run: also time every K-FAC variant with "
    "kfac_jax as of these git revisions (named "
    "<variant>@<commit>), interleaved with the working tree's",
  )
  p.add_argument(
    "--rounds", type=int, default=4, help="round-robin rounds per configuration"
  )
  p.add_argument(
    "--steps-per-round",
    type=int,
    default=10,
    help="consecutive steps per variant per round",
  )
  p.add_argument(
    "--warmup-steps",
    type=int,
    default=2,
    help="untimed steps per variant after its first call",
  )
  p.add_argument(
    "--inv-update-steps",
    type=int,
    default=10,
    help="K-FAC decomposition period T",
  )
  p.add_argument(
    "--learning-rate",
    type=float,
    default=1e-3,
    help="SGD / K-FAC learning rate (timing does not depend on it)",
  )
  p.add_argument("--damping", type=float, default=1e-3, help="K-FAC damping")
  p.add_argument(
    "--eigh-flops",
    type=float,
    default=4.0,
    help="FLOP-floor constant c in eigh(d) ≈ c·d³ (LAPACK syevd: "
    "4/3 tridiagonalization + 2 back-transformation + divide and "
    "conquer; 9 is Golub & Van Loan's QR-iteration figure)",
  )
  p.add_argument(
    "--inverse-flops",
    type=float,
    default=1.0,
    help="FLOP-floor constant c in Cholesky inverse(d) ≈ c·d³ "
    "(potrf d³/3 + potri 2d³/3)",
  )
  p.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("results"),
    help="directory for the JSON (and markdown) results",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--smoke",
    action="store_true",
    help="tiny sizes, 2 rounds of 3 steps, no DeepMind run (CI)",
  )
  p.add_argument(
    "--dm",
    action="store_true",
    help="also time DeepMind's kfac-jax 0.0.8 (separate venv)",
  )
  p.add_argument(
    "--dm-python",
    default=dm_comparison.DEFAULT_DM_PYTHON,
    help="python of the venv that has DeepMind's kfac-jax; "
    f"create it with: {dm_comparison.DM_VENV_COMMAND}",
  )
  p.add_argument(
    "--dm-create-venv",
    action="store_true",
    help="create the DeepMind venv at /tmp/dm-venv if missing",
  )
  p.add_argument(
    "--dm-rounds",
    type=int,
    default=None,
    help="rounds for the DeepMind run (default: --rounds)",
  )
  p.add_argument(
    "--dm-estimation-mode",
    default="fisher_empirical",
    help="DeepMind estimation_mode (fisher_empirical matches our "
    "empirical-Fisher G; DeepMind's default is ggn_curvature_prop)",
  )
  p.add_argument(
    "--blas-threads",
    type=int,
    default=None,
    help="set OPENBLAS_NUM_THREADS (and OMP/MKL) for this run and "
    "the DeepMind subprocess; jaxlib's CPU LAPACK (eigh, Cholesky, "
    "LU) runs on scipy's OpenBLAS. Default: the environment's",
  )
  p.add_argument(
    "--no-progress", action="store_true", help="disable the tqdm progress bar"
  )
  args = p.parse_args(argv)
  if args.variants is None:
    args.variants = [
      v
      for v in ALL_VARIANTS
      if not (
        args.smoke
        and v
        in (
          "adamw",
          "kfac-eigen-gfs",
          "kfac-eigen-subspace",
          "kfac-eigen-ekfac",
        )
      )
    ]
  if "sgd" not in args.variants:
    p.error("--variants must include sgd (the baseline of every ratio)")
  if args.models is None:
    args.models = ["autoencoder"] if args.smoke else list(ALL_MODELS)
  for flag in (
    "rounds",
    "steps_per_round",
    "resnet_batch",
    "resnet_depth",
    "resnet_width",
    "inv_update_steps",
  ):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1")
  if args.warmup_steps < 0 or min(args.batch_sizes) < 1:
    p.error("--warmup-steps must be >= 0 and every --batch-sizes >= 1")
  for rev in args.kfac_revs:
    if subprocess.run(
      ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
      cwd=step_variants.REPO,
      capture_output=True,
    ).returncode:
      p.error(f"--kfac-revs: {rev!r} is not a commit of this repository")
  if (
    args.dm
    and not args.smoke
    and not (os.path.exists(args.dm_python) or args.dm_create_venv)
  ):
    # Checked now: the DeepMind run comes after all of ours (~15 min).
    p.error(
      f"--dm: {args.dm_python} not found. Create it with "
      f"{dm_comparison.DM_VENV_COMMAND}, or pass --dm-create-venv or "
      "--dm-python."
    )
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
  out = dict(
    kfac_jax=kfac_jax.__version__,
    kfac_jax_path=str(package),
    kfac_jax_source_sha256=digest.hexdigest()[:16],
  )
  try:
    git = lambda *a: subprocess.run(
      ["git", *a], cwd=package, capture_output=True, text=True, check=True
    ).stdout.strip()
    out["git_commit"] = git("rev-parse", "HEAD")
    out["git_dirty_kfac_jax"] = bool(git("status", "--porcelain", "--", "."))
  except (OSError, subprocess.CalledProcessError):
    pass
  return out


def run_config(config: Config, args: argparse.Namespace) -> dict[str, Any]:
  variants = [
    v
    for v in args.variants
    if config.split_loss is not None or v != "kfac-adaptive"
  ]
  contestants = [
    step_variants.make_contestant(v, config, args) for v in variants
  ]
  contestants += [
    step_variants.make_contestant(f"{v}@{commit}", config, args, lib)
    for commit, lib in args.kfac_libs.items()
    for v in variants
    if step_variants.is_kfac(v)
  ]
  meta, summary = bench_common.run_with_progress(
    contestants, args, f"{config.name} b={config.batch}"
  )
  shapes = step_variants.layer_shapes(config)
  for c in contestants:
    s = summary[c.name]
    s["final_loss"] = float(c.carry[3])
    if (
      step_variants.is_kfac(c.name)
      and step_variants.kfac_method(c.name) != "adaptive"
      and not step_variants.eigen_options(c.name)
    ):
      floor = flops.flop_floor(
        shapes,
        step_variants.kfac_method(c.name),
        args.inv_update_steps,
        args.eigh_flops,
        args.inverse_flops,
        step_variants.from_stats(c.name),
      )
      s.update(floor)
      s["plain_over_floor"] = s["plain_x"] / floor["floor_plain_x"]
      s["decomposition_over_floor"] = (
        s["decomposition_x"] / floor["floor_decomposition_x"]
      )
      s["amortized_over_floor"] = s["amortized_x"] / floor["floor_amortized_x"]
  return dict(
    model=config.name,
    batch=config.batch,
    description=config.description,
    param_bytes=bench_common.tree_nbytes(config.params),
    layers=shapes,
    rounds=meta,
    variants=summary,
  )


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  args.kfac_libs = dict(map(step_variants.load_kfac_revision, args.kfac_revs))
  started = time.time()
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  args.out.mkdir(parents=True, exist_ok=True)
  env = bench_common.environment()
  env.update(kfac_jax_provenance())
  configs: list[Callable[[], Config]] = []
  if "autoencoder" in args.models:
    configs += [
      lambda b=b: step_variants.autoencoder_config(b, args)
      for b in args.batch_sizes
    ]
  if "resnet" in args.models:
    configs.append(lambda: step_variants.resnet_config(args))
  path = args.out / f"step_time_{stamp}.json"
  command = (
    " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:])
    if argv is None
    else " ".join(argv)
  )

  def save(results, dm=None, comparison=None, table=None):
    record = dict(
      command=command,
      args={
        k: str(v) if isinstance(v, pathlib.Path) else v
        for k, v in vars(args).items()
        if k != "kfac_libs"
      },
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
  dm = dm_comparison.run_dm(args, args.out, stamp) if args.dm else None
  comparison = dm_comparison.dm_comparison(results, dm) if dm else None
  table = step_time_report.markdown(results, comparison, dm)
  record = save(results, dm, comparison, table)
  (args.out / f"step_time_{stamp}.md").write_text(f"`{command}`\n\n{table}\n")
  print(table)
  print(f"\nwrote {path} ({record['wall_s']:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
