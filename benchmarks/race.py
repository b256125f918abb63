"""The convergence race: every run, the sweep, the final runs of a task.

``Race`` runs each (or takes it from a resumed JSON) and rewrites the JSON
after each; ``sweep`` finds each optimizer's best swept value, ``race_task``
runs the winners with every seed and finds the target.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from benchmarks import race_optimizers, race_runs
from benchmarks.race_optimizers import (
  ADAPTIVE,
  CENTERS,
  EXTENSION_FACTOR,
  FIRST_ORDER,
  KFAC_OPTIMIZERS,
  LR_GRID,
)
from examples import tasks

# The race's workloads (issue 49): the transformers, the BatchNorm CNNs and
# the autoencoder; ``cifar`` (the plain CNN) on request.
RACE_TASKS = (
  "shakespeare",
  "shakespeare_wide",
  "resnet20",
  "mnist_bn",
  "autoencoder",
)
BUDGETS = {
  "autoencoder": 420.0,
  "cifar": 300.0,
  "shakespeare": 300.0,
  "shakespeare_wide": 300.0,
  "resnet20": 300.0,
  "mnist_bn": 300.0,
}


def run_key(run: dict[str, Any]) -> tuple:
  """What a run depends on beyond the code. A run recorded without one of
  these (an older JSON) matches no new run, so it is run again."""
  curvature = run.get("curvature")
  return (
    run["phase"],
    run["task"],
    run["optimizer"],
    run["lr"],
    run["seed"],
    run["budget"],
    None if curvature is None else tuple(curvature),
    run.get("min_damping"),
    run.get("inv_dtype", "float32"),
    run.get("eval_examples", "unrecorded"),
    run.get("eval_every"),
    run.get("max_steps", "unrecorded"),
    run.get("clock", "wall"),
  )


class Race:
  """Runs (or reads from a resumed JSON) each run; saves the JSON after each."""

  def __init__(
    self, args: argparse.Namespace, path: pathlib.Path, meta: dict[str, Any]
  ):
    self.args = args
    self.path = path
    self.meta = meta
    self.runs: list[dict[str, Any]] = []
    self.done: dict[tuple, dict[str, Any]] = {}
    for path in args.resume or ():
      previous = json.loads(path.read_text())
      for run in previous["runs"]:
        self.done[run_key(run)] = run
      if (
        previous.get("git_commit") != meta.get("git_commit")
        or previous.get("git_dirty")
        or meta.get("git_dirty")
      ):
        tqdm.write(
          f"Resuming runs recorded at commit {previous.get('git_commit')} "
          f"(dirty: {previous.get('git_dirty')}) under commit "
          f"{meta.get('git_commit')} (dirty: {meta.get('git_dirty')}): "
          "their optimizer settings (KFAC_SETTINGS, the sweep centres) "
          "are the code's of then; say so where the results are quoted."
        )

  def run(
    self,
    phase: str,
    task: tasks.Task,
    name: str,
    lr: float,
    seed: int,
    budget: float,
  ) -> dict[str, Any]:
    # kfac_adaptive's runs also depend on where its curvature comes from
    # and on λ's floor (the value in effect: a run recorded before the
    # floor was recorded, or under another default, is not reused), both
    # K-FAC contestants' on inv_dtype (runs recorded without it: float32).
    adaptive = name in ADAPTIVE
    inv_dtype = self.args.inv_dtype if name in KFAC_OPTIMIZERS else "float32"
    curvature = (
      (self.args.curvature, self.args.curvature_examples) if adaptive else None
    )
    min_damping = (
      race_optimizers.adaptive_config(self.args.min_damping).min_damping
      if adaptive
      else None
    )
    evaluation = dict(
      eval_examples=self.args.eval_examples,
      eval_every=self.args.eval_every,
      max_steps=self.args.max_steps,
      clock=self.args.clock,
    )
    key = run_key(
      dict(
        phase=phase,
        task=task.name,
        optimizer=name,
        lr=lr,
        seed=seed,
        budget=budget,
        curvature=curvature,
        min_damping=min_damping,
        inv_dtype=inv_dtype,
        **evaluation,
      )
    )
    # A final run at the sweep's budget with seed 0 is the sweep's run of
    # the winning value: the same experiment, taken rather than repeated.
    sweep_key = ("sweep", *key[1:])
    if key in self.done:
      record = self.done[key]
    elif phase == "final" and sweep_key in self.done:
      record = dict(self.done[sweep_key], phase="final", reused="sweep")
    else:
      optimizer = race_optimizers.build_optimizer(
        name,
        lr,
        task,
        self.args.curvature,
        self.args.curvature_examples,
        self.args.min_damping,
        inv_dtype,
      )
      label = f"{task.name} {phase} {name} {format_lr(name, lr)} seed={seed}"
      try:
        record = race_runs.train_run(
          task,
          optimizer,
          seed,
          budget,
          self.args.eval_every,
          self.args.max_steps,
          not self.args.no_progress,
          label,
          self.args.curvature_examples,
          self.args.curvature,
          self.args.clock,
          race_optimizers.stats_every(name),
        )
      except Exception as error:  # pylint: disable=broad-except
        # One failing run (a contestant that cannot compile or run this
        # task) is recorded as such, not the end of an hours-long race.
        tqdm.write(f"{label}: FAILED: {type(error).__name__}: {error}")
        record = dict(
          task=task.name,
          optimizer=name,
          seed=seed,
          budget=budget,
          error=f"{type(error).__name__}: {error}",
          final=math.nan,
          steps=0,
          ms_per_step=math.nan,
          compile_seconds=math.nan,
          diverged=False,
          curve=[],
        )
      record.update(phase=phase, lr=lr, **evaluation)
      if adaptive:
        record.update(curvature=list(curvature), min_damping=min_damping)
      if name in KFAC_OPTIMIZERS:
        record.update(inv_dtype=inv_dtype)
      tqdm.write(
        f"{label}: {task.metric} {record['final']:.4g} after "
        f"{record['steps']} steps ({record['ms_per_step']:.0f} "
        f"ms/step, compile {record['compile_seconds']:.1f} s)"
        + (" DIVERGED" if record["diverged"] else "")
      )
    self.done.setdefault(key, record)
    self.runs.append(record)
    self.path.write_text(json.dumps(dict(self.meta, runs=self.runs), indent=1))
    return record


def format_lr(name: str, lr: float) -> str:
  """``name``'s swept value as the tables and labels show it."""
  if name in ADAPTIVE:
    return f"λ₀={lr:.3g}"
  return f"κ={lr:.3g}" if name in race_optimizers.KL_SWEPT else f"lr={lr:.3g}"


def rounded(lr: float) -> float:
  return float(f"{lr:.3g}")


def sweep(
  task: tasks.Task,
  name: str,
  args: argparse.Namespace,
  race: Race,
  budget: float,
) -> tuple[float, dict[float, float]]:
  """The best value of ``center × LR_GRID`` (``name``'s learning rate, or
  λ₀), and every value's final metric.

  When the best rate is at an edge of the rates tried, the grid grows by one
  more factor of 3 past that edge, up to ``args.max_extensions`` times, so
  that no optimizer is left at the edge of its sweep.
  """
  center = args.center.get(name, CENTERS[name])
  finals: dict[float, float] = {}

  def best() -> float:
    rates = sorted(finals)
    winner = rates[0]
    for lr in rates[1:]:
      if task.better(finals[lr], finals[winner]):
        winner = lr
    return winner

  low, high = swept_range(name, args)

  def run(lr: float) -> bool:
    """Runs ``lr``; False (nothing run) outside the optimizer's range."""
    if not low <= lr <= high:
      return False
    finals[lr] = race.run("sweep", task, name, lr, 0, budget)["final"]
    return True

  for multiple in LR_GRID:
    run(rounded(center * multiple))
  for _ in range(args.max_extensions):
    winner = best()
    if winner == min(finals):
      grew = run(rounded(winner / EXTENSION_FACTOR))
    elif winner == max(finals):
      grew = run(rounded(winner * EXTENSION_FACTOR))
    else:
      break
    if not grew:
      break  # the winning edge is the end of the range
  return best(), dict(sorted(finals.items()))


def swept_range(name: str, args: argparse.Namespace) -> tuple[float, float]:
  """The values ``name``'s sweep may try: λ₀ within kfac_adaptive's
  [min_damping, max_damping] (``scale_by_kfac`` refuses others), any
  positive learning rate."""
  if name in ADAPTIVE:
    config = race_optimizers.adaptive_config(args.min_damping)
    return config.min_damping, config.max_damping
  return 0.0, math.inf


def race_task(
  task: tasks.Task, args: argparse.Namespace, race: Race
) -> dict[str, Any]:
  """Sweep, final runs and the time-to-target summary of one task."""
  budget = args.budget if args.budget is not None else BUDGETS[task.name]
  sweep_budget = args.sweep_budget if args.sweep_budget is not None else budget
  best_lr, sweeps = {}, {}
  contestants = []
  for name in args.optimizers:
    reason = race_optimizers.unsupported(name, task)
    if reason is not None:
      tqdm.write(f"{task.name}: leaving {name} out ({reason}).")
    else:
      contestants.append(name)
  for name in contestants:
    if args.no_sweep:
      best_lr[name] = args.center.get(name, CENTERS[name])
      continue
    best_lr[name], sweeps[name] = sweep(task, name, args, race, sweep_budget)

  finals = {
    name: [
      race.run("final", task, name, best_lr[name], seed, budget)
      for seed in args.seeds
    ]
    for name in contestants
  }
  baselines = [n for n in contestants if n in FIRST_ORDER]
  medians = {
    n: float(np.median([r["final"] for r in runs]))
    for n, runs in finals.items()
  }
  target_name = None
  for name in baselines:
    if target_name is None or task.better(medians[name], medians[target_name]):
      target_name = name
  target = medians[target_name] if target_name else None
  return dict(
    task=task,
    budget=budget,
    sweep_budget=sweep_budget,
    best_lr=best_lr,
    sweep=sweeps,
    finals=finals,
    medians=medians,
    target_name=target_name,
    target=target,
  )
