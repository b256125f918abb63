#!/usr/bin/env python3
"""K-FAC with its levers, one setting changed at a time, on one race task.

Each variant is the race's ``kfac_levers`` (``kfac_jax.kfac`` with
``KFAC_SETTINGS`` and ``KFAC_LEVERS``, ``race_optimizers``) at one learning
rate, with the settings of ``VARIANTS`` changed, trained as the race trains
(``race_runs.train_run``: the same seed, budget, clock and evaluations;
statistics only on factor steps where ``factor_update_steps > 1``). The
table gives each variant's final metric, steps, ms a step and its curve
(step: metric at each evaluation), so that variants compare at equal time
(the final) and at equal steps (the curves). One seed: a same-seed rerun
differs by the steps the clock allows, which the race's three seeds
average out.

  python -m benchmarks.ablation --task shakespeare --lr 0.3
  python -m benchmarks.ablation --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
from typing import Any

import kfac_jax
from benchmarks import bench_common, race_optimizers, race_runs
from examples import tasks, training

REPO = pathlib.Path(__file__).resolve().parent.parent

# Each variant's changes to kfac_levers' settings: statistics every step
# from the whole batch, positions expanded (the levers' statistics are 10
# steps old, from a quarter of the rows); damping; the KL clip; embeddings
# preconditioned; EKFAC's scaling, or the gradient's second moment, in the
# eigenbasis (eigen method).
VARIANTS: dict[str, dict[str, Any]] = {
  "levers": {},
  "stats_every_step": dict(
    factor_update_steps=1, factor_batch_size=None, weight_sharing="expand"
  ),
  "damping_1e-3": dict(damping=1e-3),
  "damping_0.1": dict(damping=0.1),
  "kl_clip_1": dict(kl_clip=1.0),
  "embeddings": dict(precondition_embeddings=True),
  "ekfac": dict(compute_method="eigen", eigenvalue_correction=True),
  "second_moment": race_optimizers.SECOND_MOMENT,
}


def variant_optimizer(
  name: str, lr: float, task: tasks.Task
) -> tuple[training.Optimizer, int]:
  """Variant ``name`` at rate ``lr``, and every how many steps it reads
  statistics."""
  settings = dict(race_optimizers.KFAC_SETTINGS, **race_optimizers.KFAC_LEVERS)
  settings.update(VARIANTS[name])
  tx = kfac_jax.kfac(
    learning_rate=lr, momentum=0.9, layers=task.layers, **settings
  )
  description = f"kfac_jax.kfac(lr={lr:g}, momentum=0.9, " + ", ".join(
    f"{k}={v!r}" for k, v in settings.items()
  )
  optimizer = training.Optimizer(
    name, tx, uses_kfac=True, description=description + ")"
  )
  return optimizer, settings["factor_update_steps"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--task", choices=tuple(tasks.TASK_BUILDERS))
  parser.add_argument("--lr", type=float, default=0.3)
  parser.add_argument(
    "--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS)
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--budget", type=float, default=60.0)
  parser.add_argument("--clock", choices=tuple(race_runs.CLOCKS), default="cpu")
  parser.add_argument("--eval-every", type=float, default=10.0)
  parser.add_argument("--eval-examples", type=int, default=2000)
  parser.add_argument("--out", type=pathlib.Path, default=REPO / "results")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="CI check: 2-step runs (the transformer unless --task)",
  )
  args = parser.parse_args(argv)
  args.max_steps = None
  if args.smoke:
    args.task = args.task or "shakespeare"
    args.max_steps, args.eval_examples, args.eval_every = 2, 64, 1e9
  if args.task is None:
    parser.error("--task is required (or --smoke)")
  if not (args.lr > 0 and args.budget > 0 and args.eval_every > 0):
    parser.error("--lr, --budget and --eval-every must be > 0")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  builder, batch_size = tasks.TASK_BUILDERS[args.task]
  task = builder(args.eval_examples, batch_size)
  runs, lines = [], []
  for name in args.variants:
    optimizer, every = variant_optimizer(name, args.lr, task)
    try:
      run = race_runs.train_run(
        task,
        optimizer,
        args.seed,
        args.budget,
        args.eval_every,
        args.max_steps,
        not args.no_progress,
        f"{args.task} {name}",
        clock=args.clock,
        stats_every=every if every > 1 else None,
      )
    except ValueError as error:
      # A variant the task's layers refuse (EKFAC on a convolution) is
      # reported by its message; the other variants still run.
      lines.append(f"| {name} | refused: {error} | | | | |")
      print(lines[-1], flush=True)
      continue
    runs.append(dict(run, variant=name, changes=repr(VARIANTS[name])))
    curve = " ".join(f"{p['step']}: {p['metric']:.4g}" for p in run["curve"])
    lines.append(
      f"| {name} | {run['final']:.4g} | {run['steps']} | "
      f"{run['ms_per_step']:.0f} | {run['compile_seconds']:.1f} | {curve} |"
    )
    print(lines[-1], flush=True)
  table = [
    f"{task.description}; lr {args.lr:g}, seed {args.seed}, "
    f"{args.budget:g} training seconds ({args.clock} clock)",
    "",
    f"| variant | final {task.metric} | steps | ms/step | compile s | "
    "curve (step: metric) |",
    "|---|---:|---:|---:|---:|---|",
    *lines,
  ]
  args.out.mkdir(parents=True, exist_ok=True)
  stem = args.out / (
    "ablation_" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  )
  meta = dict(
    command="python -m benchmarks.ablation " + " ".join(sys.argv[1:]),
    environment=bench_common.environment(),
    variants={name: repr(VARIANTS[name]) for name in args.variants},
  )
  stem.with_suffix(".json").write_text(json.dumps(dict(meta, runs=runs)))
  stem.with_suffix(".md").write_text("\n".join(table) + "\n")
  print("\n".join(table), f"\nWrote {stem}.json and {stem}.md.", sep="\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
