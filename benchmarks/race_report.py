"""The convergence race's report: Markdown tables and the plot."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import race
from examples import tasks
from examples.targets import first_reach, median_reach, readouts


def readouts_table(
  task: tasks.Task,
  runs: Sequence[tuple[str, dict[str, Any]]],
  targets: Sequence[float],
  at_seconds: Sequence[float],
) -> str:
  """Markdown: per run, ``readouts`` (``--targets``, ``--at-seconds``)."""
  header = ["run"]
  for target in targets:
    header += [f"s to {target:g} (steps)", f"crossing {target:g}: steps, s"]
  header += [f"at {s:g} s" for s in at_seconds] + ["final", "steps", "ms/step"]
  lines = [
    "| " + " | ".join(header) + " |",
    "|---" + "|---:" * (len(header) - 1) + "|",
  ]
  for label, run in runs:
    values = readouts(task, run, targets, at_seconds)
    cells = [label]
    for target in targets:
      hit = values["reached"][f"{target:g}"]
      cells += (
        ["never", "—"]
        if hit is None
        else [
          f"{hit['seconds']:.0f} ({hit['step']})",
          f"{hit['crossing_step']:.0f}, {hit['crossing_seconds']:.1f}",
        ]
      )
    cells += ["—" if v is None else f"{v:.4g}" for v in values["at"].values()]
    cells += [
      f"{run['final']:.4g}",
      str(run["steps"]),
      f"{run['ms_per_step']:.0f}",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> str:
  """Markdown: per optimizer, best rate, final metric, time to target."""
  task, target = result["task"], result["target"]
  reach = {}
  for name, runs in result["finals"].items():
    reach[name] = [
      first_reach(task, r, target) if target is not None else None for r in runs
    ]
  base_seconds = None
  if result["target_name"] is not None:
    base_seconds = median_reach(reach[result["target_name"]], 1)
  header = (
    "| optimizer | lr or λ₀ | final "
    + task.metric
    + " (median; min–max) | reached target | steps to target (median) "
    "| seconds to target (median) | × best baseline's seconds | "
    "ms/step | compile s |"
  )
  lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, runs in result["finals"].items():
    values = [r["final"] for r in runs]
    hits = [h for h in reach[name] if h is not None]
    median_steps = median_reach(reach[name], 0)
    steps = "—" if median_steps is None else f"{median_steps:.0f}"
    seconds = median_reach(reach[name], 1)
    ratio = (
      f"{seconds / base_seconds:.2f}"
      if seconds is not None and base_seconds
      else "—"
    )
    spread = (
      f" ({min(values):.4g}–{max(values):.4g})" if len(values) > 1 else ""
    )
    lines.append(
      f"| {name} | {race.format_lr(name, result['best_lr'][name])} | "
      f"{np.median(values):.4g}{spread} | {len(hits)}/{len(runs)} | {steps} "
      f"| {'—' if seconds is None else f'{seconds:.0f}'} | {ratio} | "
      f"{np.median([r['ms_per_step'] for r in runs]):.0f} | "
      f"{np.median([r['compile_seconds'] for r in runs]):.1f} |"
    )
  return "\n".join(lines)


def sweep_table(result: dict[str, Any]) -> str:
  if not result["sweep"]:
    return "(no sweep)"
  lines = [
    "| optimizer | learning rate (kfac_adaptive: λ₀): final metric | best |",
    "|---|---|---:|",
  ]
  for name, finals in result["sweep"].items():
    cells = ", ".join(f"{lr:g}: {value:.4g}" for lr, value in finals.items())
    lines.append(f"| {name} | {cells} | {result['best_lr'][name]:g} |")
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Metric vs steps and vs training seconds; one colour per optimizer."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  task = result["task"]
  fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, (name, runs) in enumerate(result["finals"].items()):
    color = f"C{i}"
    for j, run in enumerate(runs):
      points = [p for p in run["curve"] if math.isfinite(p["metric"])]
      label = (
        f"{name} ({race.format_lr(name, result['best_lr'][name])})"
        if j == 0
        else None
      )
      for ax, x in ((ax_step, "step"), (ax_time, "seconds")):
        ax.plot(
          [p[x] for p in points],
          [p["metric"] for p in points],
          color=color,
          lw=1.4,
          alpha=1.0 if j == 0 else 0.45,
          label=label,
        )
  for ax in (ax_step, ax_time):
    if result["target"] is not None:
      ax.axhline(
        result["target"],
        color="k",
        ls="--",
        lw=0.8,
        label=f"target ({result['target_name']}'s final "
        f"{result['target']:.4g})",
      )
    ax.set_ylabel(task.metric)
    ax.grid(True, alpha=0.3)
    if not task.higher_is_better:
      ax.set_yscale("log")  # losses fall by orders of magnitude at first
    ax.legend(fontsize=8)
  ax_step.set_xlabel("step")
  ax_time.set_xlabel("training seconds (compilation and evaluation excluded)")
  fig.suptitle(task.description, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
