"""Time to target on real data: K-FAC against first-order optimizers.

Each optimizer trains each task for a fixed budget of *training* seconds
(compilation and evaluation excluded; the clock stops while the objective is
evaluated), on the wall clock or, with ``--clock cpu``, in the process's
CPU seconds (for a shared machine: ``race_runs``). The race has two phases:

1. **Sweep.** Every optimizer tries the same three-point grid of its one
   swept setting, ``center × (1/3, 1, 3)`` around its customary value
   (``CENTERS``), with seed 0 and the sweep budget; when an edge of the grid
   wins, the grid grows past it by factors of 3 (``--max-extensions``). The
   value with the best final metric wins. The swept setting is the learning
   rate, except for ``kfac_adaptive``, which has none: its initial damping
   λ₀ (``lr`` in the JSON and tables holds it).
2. **Final.** Each optimizer's winning value runs with every seed and the full
   budget. Where the sweep's budget is the full one, its seed-0 run of the
   winning value is that final run (the same experiment), not repeated.

The target of a task is the best first-order optimizer's final metric (median
over seeds). For every optimizer and seed the script reports the steps and
training seconds at the first evaluation that reaches it.

Tasks (``--tasks``; ``examples/tasks.py``):

* ``autoencoder``: the MNIST deep autoencoder 784-1000-500-250-30-250-500-
  1000-784 (tanh, linear code). The objective is the sigmoid cross-entropy,
  summed over the 784 pixels and averaged over the training images, plus
  ``1e-5 · ½‖θ‖²`` over all weights and biases. Batch 1000, reshuffled each
  epoch. Weights are drawn from a normal truncated to ±2σ, σ = 1/√fan_in;
  biases start at 0. Metric: that objective over the first ``--eval-examples``
  training images (default all 60,000). Lower is better.
* ``cifar``: a 3-stage CNN (``models.SmallConvNet``) on the shared CIFAR-10
  subset (10k train / 1k test), or on scikit-learn's digits when CIFAR-10 is
  absent. Softmax cross-entropy plus ``1e-4 · ½‖θ‖²``, batch 128. Metric: test
  accuracy (%). Higher is better.
* ``resnet20``: ResNet-20 (``models.CifarResNet(depth=20)``, BatchNorm) on
  the same data and objective, batch 128.
* ``mnist_bn``: Flax's NNX MNIST example's CNN with BatchNorm
  (``models.BatchNormCNN``: conv 32, conv 64, dense 3136→256→10) on MNIST,
  softmax cross-entropy, batch 128. Metric: test accuracy (%) over the
  first ``--eval-examples`` of the 10,000 test images.
  With BatchNorm the running statistics are model state, threaded through
  every contestant's step (K-FAC's through ``value_grad_and_stats(...,
  has_aux=True)``) and used by the evaluation.
* ``shakespeare``: the character transformer of
  ``examples/shakespeare_transformer.py`` (width 64, 2 scanned blocks,
  context 64) on Tiny Shakespeare, batch 64. Metric: validation loss
  (nats/char) over the first ``--eval-examples`` held-out sequences (default
  all). Lower is better.
* ``shakespeare_wide``: the same at width 128 and context 128, batch 32
  (the same characters per step).

Optimizers (``--optimizers``; ``race_optimizers.py``): ``adamw``
(optax.adamw, its default weight decay 1e-4), ``muon``
(optax.contrib.muon on the kernels of the task's layer table, contracted
axes reduced and ``nn.scan``'s stacked; its Adam for the other parameters
at lr 1e-3), ``soap`` (``benchmarks/soap.py``: SOAP with the paper's
defaults, β₁ = β₂ = 0.95, weight decay 0.01, its bases refreshed every 10
steps), ``kron`` (PSGD Kron from the ``distributed-kron`` package, if
installed), ``kfac`` (kfac_jax.kfac: scale_by_kfac + SGD momentum 0.9, with
``KFAC_SETTINGS``, the same on every task) and ``kfac_adaptive``
(``scale_by_kfac(adaptive=...)``: learning rate, momentum and damping from
the exact quadratic model, with DeepMind kfac-jax's autoencoder-example
settings, ``KFAC_ADAPTIVE_SETTINGS``, except for λ's floor: the library's
``AdaptiveConfig`` default, 1e-4, where the example has 1e-5,
``--min-damping``; each run records λ, α, μ and ρ per step; it needs a
split loss and no model state, so it leaves out the BatchNorm tasks); on
request ``sgd`` (Nesterov momentum 0.9), ``adam``, ``kfac_levers``
(``kfac`` with ``KFAC_LEVERS``, statistics only every 10th step) and
``kfac_levers_kl`` (the same swept over its KL clip κ, center 0.1, at
learning rate 0.1: once the clip binds, the step taken no longer depends
on the rate), ``kfac_levers_adamw`` (that, with AdamW on the params K-FAC
leaves out) and ``kfac_levers_scaled`` (``kfac_levers`` swept over the
rate with the clip scaled along, κ = 10·lr²: the rate then scales the step
whether or not the clip binds), ``kfac_second_moment`` (that, with the
gradient's second moment in K-FAC's eigenbasis, ``second_moment_decay``)
and ``kfac_second_moment_adamw`` (that on K-FAC's layers, AdamW at 0.01·lr
on the other params).
Having no learning
rate, ``kfac_adaptive`` is swept over its initial damping λ₀ (the example's
150 the center): λ then moves by at most a factor 0.95⁵ every 5 steps, so λ₀
sets the step sizes of the first ~100 steps. On request, the same mode with
the eigen method (``EIGEN_ADAPTIVE``): ``kfac_eigh`` (eigh every 5 steps),
``kfac_subspace`` and ``kfac_subspace2`` (``eigen_solver="subspace"`` every
5 and 2 steps), ``kfac_drift`` (``SubspaceSolver(steps=0)`` every 5 steps:
the bases kept, their eigenvalues refreshed) and ``kfac_ekfac`` (the
subspace solver every 5 steps with ``eigenvalue_correction=True``), swept
over λ₀ like ``kfac_adaptive``.
Its quadratic model is computed on the
first ``--curvature-examples`` of each batch (default 250: a quarter of the
autoencoder's batch, all of the others'), Martens' curvature mini-batch. Its
Kronecker factors come from as many evenly spaced examples of the whole
batch's capture (``--curvature subset``, the default:
``scale_by_kfac(factor_batch_size=...)``, the empirical Fisher, no extra
pass), from all of it (``batch``), from the loss on the curvature examples
(``empirical``) or from a ``kfac_jax.sampled_curvature`` surrogate on them
(``gauss-newton``, kfac-jax's default estimator); with these two the
gradient's loss is split at the curvature examples
(``curvature_shared_loss``) so that their forward pass runs once.
``subset`` is the default
because it costs no extra pass on any task; on the autoencoder
``gauss-newton`` reaches the targets in fewer steps at the same step time
(``benchmarks/README.md``, *Gauss-Newton factors at the 1e-4 floor*).
``--inv-dtype bfloat16`` gives both K-FAC contestants ``inv_dtype=bfloat16``:
their inverses stored and applied in bfloat16 (float32 accumulation), the
products at twice float32's rate on CPUs with AVX512-BF16.

Outputs in ``--out``: ``convergence_<stamp>.json`` (every run's curve,
settings and versions, rewritten after each run; ``--resume FILE ...``
continues an interrupted race, or joins races run apart, e.g. in parallel
processes, into one report), ``convergence_<stamp>.md`` (tables) and
``convergence_<stamp>_<task>.png`` (metric vs steps and vs seconds).

Run from the repository root::

  python -m benchmarks.convergence --help
  python -m benchmarks.convergence --smoke --out /tmp/x    # CI check, tiny
  python -m benchmarks.convergence --tasks autoencoder     # the full race
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import flax
import jax
import optax
from tqdm.auto import tqdm

import kfac_jax
from benchmarks import race, race_optimizers, race_report
from benchmarks.race_optimizers import (
  ADAPTIVE,
  CENTERS,
  DEFAULT_OPTIMIZERS,
  EIGEN_ADAPTIVE,
  KFAC_ADAPTIVE_SETTINGS,
  KFAC_SETTINGS,
  LR_GRID,
  OPTIMIZERS,
)
from examples import tasks

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_centers(values: Sequence[str]) -> dict[str, float]:
  centers = {}
  for value in values:
    name, _, lr = value.partition("=")
    if name not in CENTERS or not lr:
      raise SystemExit(
        f"--center {value!r}: use NAME=VALUE (the learning "
        f"rate, kfac_adaptive's λ₀) with NAME in "
        f"{tuple(CENTERS)}."
      )
    try:
      centers[name] = float(lr)
    except ValueError:
      raise SystemExit(f"--center {value!r}: {lr!r} is not a number.") from None
  return centers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    epilog="Protocol and outputs: see the module docstring and "
    "benchmarks/README.md.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--tasks",
    nargs="+",
    default=list(race.RACE_TASKS),
    choices=list(tasks.TASK_BUILDERS),
  )
  parser.add_argument(
    "--optimizers",
    nargs="+",
    default=list(DEFAULT_OPTIMIZERS),
    choices=OPTIMIZERS,
  )
  parser.add_argument(
    "--seeds",
    nargs="+",
    type=int,
    default=[0, 1, 2],
    help="seeds of the final runs (init and shuffling)",
  )
  parser.add_argument(
    "--budget",
    type=float,
    default=None,
    help=f"training seconds per final run (default per task: {race.BUDGETS})",
  )
  parser.add_argument(
    "--sweep-budget",
    type=float,
    default=None,
    help="training seconds per sweep run (default: the budget)",
  )
  parser.add_argument(
    "--no-sweep",
    action="store_true",
    help="skip the sweep: every optimizer runs at its "
    "center (learning rate, or kfac_adaptive's λ₀)",
  )
  parser.add_argument(
    "--max-extensions",
    type=int,
    default=2,
    help="times the sweep may grow past a winning edge of its grid",
  )
  parser.add_argument(
    "--center",
    nargs="*",
    default=[],
    help="override sweep centers, e.g. kfac=0.3 adam=1e-3 "
    "kfac_adaptive=15 (its λ₀)",
  )
  parser.add_argument(
    "--clock",
    choices=("wall", "cpu"),
    default="wall",
    help="what the budget's training seconds count: the "
    "wall clock, or the process's CPU seconds (the "
    "steps' work, which other processes on a shared "
    "machine do not lengthen; equal to the wall clock on "
    "an otherwise idle core)",
  )
  parser.add_argument(
    "--eval-every",
    type=float,
    default=10.0,
    help="training seconds between evaluations",
  )
  parser.add_argument(
    "--targets",
    nargs="*",
    type=float,
    default=[],
    help="also report, per final run, when the metric "
    "first met each of these values (first evaluation, "
    "and the crossing interpolated between evaluations)",
  )
  parser.add_argument(
    "--at-seconds",
    nargs="*",
    type=float,
    default=[],
    help="also report, per final run, the metric at the "
    "last evaluation by each of these training seconds",
  )
  parser.add_argument(
    "--eval-examples",
    type=int,
    default=None,
    help="evaluate on the first N examples of the task's "
    "evaluation set (default: all)",
  )
  parser.add_argument(
    "--curvature-examples",
    type=int,
    default=250,
    help="kfac_adaptive: the quadratic model's curvature "
    "and reduction ratio use the first N examples of each "
    "batch (all of a smaller batch), the factors' "
    "statistics N examples (see --curvature); Martens' "
    "curvature mini-batch",
  )
  parser.add_argument(
    "--curvature",
    choices=("batch", "subset", "empirical", "gauss-newton"),
    default="subset",
    help="kfac_adaptive's factor statistics, from the "
    "capture of the whole batch's loss (the empirical "
    "Fisher): on its whole batch, or on "
    "--curvature-examples evenly spaced examples "
    "(factor_batch_size); or from the loss on the "
    "curvature examples, or from the task's "
    "kfac_jax.sampled_curvature surrogate (Gauss-Newton) "
    "on them",
  )
  parser.add_argument(
    "--min-damping",
    type=float,
    default=None,
    help="kfac_adaptive: AdaptiveConfig.min_damping, the "
    "floor of λ (default: the library's, "
    f"{kfac_jax.AdaptiveConfig().min_damping:g})",
  )
  parser.add_argument(
    "--inv-dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="kfac and kfac_adaptive: scale_by_kfac's "
    "inv_dtype, in which the inverses are stored and "
    "applied",
  )
  parser.add_argument(
    "--max-steps",
    type=int,
    default=None,
    help="also stop every run after this many steps",
  )
  parser.add_argument("--out", type=pathlib.Path, default=REPO / "results")
  parser.add_argument(
    "--resume",
    type=pathlib.Path,
    nargs="+",
    default=None,
    help="previous runs' JSONs: runs recorded there are not repeated",
  )
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="CI check: every task and optimizer, one seed, "
    "2-step runs on small evaluation sets, no sweep",
  )
  args = parser.parse_args(argv)
  args.center = parse_centers(args.center)
  if args.smoke:
    args.seeds, args.no_sweep = [0], True
    args.budget, args.max_steps = 60.0, 2
    args.eval_examples, args.eval_every = 64, 1e9
  for flag in ("budget", "sweep_budget", "eval_every"):
    value = getattr(args, flag)
    if value is not None and not value > 0:
      raise SystemExit(f"--{flag.replace('_', '-')} must be > 0.")
  if args.min_damping is not None and not args.min_damping > 0:
    raise SystemExit("--min-damping must be > 0.")
  for name, center in args.center.items():
    low, high = race.swept_range(name, args)
    if not (center > 0 and low <= center <= high):
      raise SystemExit(
        f"--center {name}={center:g}: must be > 0"
        + (
          f" and within [{low:g}, {high:g}], the range of λ"
          if name in ADAPTIVE
          else ""
        )
        + "."
      )
  for path in args.resume or ():
    if not path.is_file():
      raise SystemExit(f"--resume {path}: no such file.")
  if args.curvature_examples < 1:
    raise SystemExit("--curvature-examples must be >= 1.")
  if args.max_extensions < 0:
    raise SystemExit("--max-extensions must be >= 0.")
  for flag in ("eval_examples", "max_steps"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  if "kron" in args.optimizers and race_optimizers.import_kron() is None:
    tqdm.write("distributed-kron is not installed: leaving kron out.")
    args.optimizers = [n for n in args.optimizers if n != "kron"]
  return args


def metadata(args: argparse.Namespace) -> dict[str, Any]:
  try:
    commit = subprocess.run(
      ["git", "rev-parse", "HEAD"],
      cwd=REPO,
      text=True,
      capture_output=True,
      check=True,
    ).stdout.strip()
    dirty = bool(
      subprocess.run(
        ["git", "status", "--porcelain", "kfac_jax", "benchmarks", "examples"],
        cwd=REPO,
        text=True,
        capture_output=True,
        check=True,
      ).stdout.strip()
    )
  except (OSError, subprocess.CalledProcessError):
    commit, dirty = None, None
  return dict(
    command=" ".join([sys.executable.rsplit("/", 1)[-1], *map(str, sys.argv)]),
    args={
      k: (
        str(v)
        if isinstance(v, pathlib.Path)
        else [str(p) for p in v]
        if k == "resume" and v
        else v
      )
      for k, v in vars(args).items()
    },
    centers=CENTERS,
    lr_grid=LR_GRID,
    kfac_settings=KFAC_SETTINGS,
    kfac_adaptive_settings=KFAC_ADAPTIVE_SETTINGS,
    eigen_adaptive_settings=EIGEN_ADAPTIVE,
    git_commit=commit,
    git_dirty=dirty,
    jax=jax.__version__,
    optax=optax.__version__,
    flax=flax.__version__,
    machine=platform.machine(),
    cpus=os.cpu_count(),
    blas_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
    xla_flags=os.environ.get("XLA_FLAGS"),
    load_average_at_start=list(os.getloadavg()),
    started=datetime.datetime.now().isoformat(timespec="seconds"),
  )


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  stem = args.out / f"convergence_{stamp}"
  contest = race.Race(args, stem.with_suffix(".json"), metadata(args))
  report = [f"`{contest.meta['command']}`", ""]
  for name in args.tasks:
    builder, batch_size = tasks.TASK_BUILDERS[name]
    task = builder(args.eval_examples, batch_size)
    result = race.race_task(task, args, contest)
    png = pathlib.Path(f"{stem}_{name}.png")
    race_report.plot(result, png)
    target = (
      "no first-order optimizer ran"
      if result["target"] is None
      else f"{result['target_name']}'s median final {task.metric}, "
      f"{result['target']:.4g}"
    )
    report += [
      f"## {name}: {task.description}",
      "",
      f"Budget {result['budget']:g} training seconds per run, seeds "
      f"{args.seeds}; sweep {result['sweep_budget']:g} s, seed 0. Target: "
      f"{target}.",
      "",
      race_report.summary_table(result),
      "",
      "Sweep (final metric):",
      "",
      race_report.sweep_table(result),
      "",
      f"Plot: `{png.name}`",
      "",
    ]
    if args.targets or args.at_seconds:
      runs = [
        (f"{optimizer}, seed {run['seed']}", run)
        for optimizer, seeds in result["finals"].items()
        for run in seeds
      ]
      report += [
        "Readouts (`--targets`, `--at-seconds`):",
        "",
        race_report.readouts_table(task, runs, args.targets, args.at_seconds),
        "",
      ]
    print("\n".join(report[-16:]), flush=True)
  pathlib.Path(f"{stem}.md").write_text("\n".join(report))
  print(f"Wrote {stem}.json, {stem}.md and the plots.", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
