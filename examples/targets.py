"""Time to target: when a training curve first meets a metric value.

A run's ``curve`` is its evaluations, ``[{"step", "seconds", "metric"}]`` in
order; ``task.reaches(value, target)`` says whether a metric value meets the
target (``examples.tasks.Task``: below it for a loss, above it for an
accuracy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from examples import tasks


def first_reach(
  task: tasks.Task, run: dict[str, Any], target: float
) -> tuple[int, float] | None:
  """(steps, seconds) at the run's first evaluation meeting ``target``."""
  for point in run["curve"]:
    if task.reaches(point["metric"], target):
      return point["step"], point["seconds"]
  return None


def crossing(
  task: tasks.Task, run: dict[str, Any], target: float
) -> tuple[float, float] | None:
  """(steps, seconds) where the curve first meets ``target``, read off the
  straight line between the evaluations on either side of it."""
  previous = None
  for point in run["curve"]:
    if task.reaches(point["metric"], target):
      if previous is None or point["metric"] == previous["metric"]:
        return float(point["step"]), float(point["seconds"])
      fraction = (target - previous["metric"]) / (
        point["metric"] - previous["metric"]
      )
      return tuple(
        float(previous[k] + fraction * (point[k] - previous[k]))
        for k in ("step", "seconds")
      )
    previous = point
  return None


def metric_at(run: dict[str, Any], seconds: float) -> float | None:
  """The metric of the last evaluation at or before ``seconds`` of training
  (``None`` before the first)."""
  values = [p["metric"] for p in run["curve"] if p["seconds"] <= seconds]
  return values[-1] if values else None


def readouts(
  task: tasks.Task,
  run: dict[str, Any],
  targets: Sequence[float],
  at_seconds: Sequence[float],
) -> dict[str, Any]:
  """Per target: the first evaluation meeting it and the interpolated
  crossing; per time: the metric then."""
  reached = {}
  for target in targets:
    hit, line = first_reach(task, run, target), crossing(task, run, target)
    reached[f"{target:g}"] = (
      None
      if hit is None
      else dict(
        step=hit[0],
        seconds=hit[1],
        crossing_step=line[0],
        crossing_seconds=line[1],
      )
    )
  return dict(
    reached=reached, at={f"{s:g}": metric_at(run, s) for s in at_seconds}
  )


def median_reach(
  hits: Sequence[tuple[int, float] | None], index: int
) -> float | None:
  """Median steps (``index`` 0) or seconds (1) to the target over all seeds,
  a seed that never reached it counting as infinitely late; ``None`` when
  that median is a miss. (Over the seeds that reached it alone, one lucky
  seed of three would stand for the optimizer.)"""
  value = float(
    np.median([h[index] if h is not None else np.inf for h in hits])
  )
  return value if np.isfinite(value) else None
