"""The examples' report: a Markdown table per optimizer and the loss curves."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from examples import training


def batched_means(
  fn: Callable[..., Sequence[jax.Array]],
  arrays: Sequence[np.ndarray],
  chunk: int = 5000,
) -> tuple[float, ...]:
  """Means over a data set of per-example quantities, computed in chunks.

  ``fn(*chunk_arrays)`` returns a tuple of per-example arrays ``[n]``; the
  result holds the mean of each over all the examples.
  """
  n = len(arrays[0])
  totals = None
  for start in range(0, n, chunk):
    parts = fn(*(a[start : start + chunk] for a in arrays))
    sums = [float(np.sum(np.asarray(p, np.float64))) for p in parts]
    totals = sums if totals is None else [t + s for t, s in zip(totals, sums)]
  return tuple(t / n for t in totals)


@dataclasses.dataclass(frozen=True)
class Column:
  header: str
  value: Callable[[training.RunResult], Any]
  fmt: str = "{}"


def standard_columns(metric_columns: Sequence[Column]) -> list[Column]:
  """Optimizer name, the caller's metrics, then steps and timings."""
  return [
    Column("optimizer", lambda r: r.name),
    *metric_columns,
    Column("steps", lambda r: r.steps, "{:d}"),
    Column("train time (s)", lambda r: r.train_seconds, "{:.1f}"),
    Column("time/step (ms)", lambda r: r.ms_per_step, "{:.1f}"),
    Column("compile (s)", lambda r: r.compile_seconds, "{:.1f}"),
  ]


def classification_columns(
  results: Mapping[str, training.RunResult],
  evaluate: Callable[
    [training.RunResult, np.ndarray, np.ndarray], Sequence[jax.Array]
  ],
  train_eval: Sequence[np.ndarray],
  test_eval: Sequence[np.ndarray],
) -> list[Column]:
  """Evaluates each classifier; returns the table's columns.

  ``evaluate(result, x, y) -> (per-example loss, per-example correct)``. Fills
  ``metrics`` ``train_loss`` and ``train_acc`` over ``train_eval`` and
  ``test_acc`` over ``test_eval``.
  """
  for result in results.values():
    fn = lambda x, y, r=result: evaluate(r, x, y)
    (result.metrics["train_loss"], result.metrics["train_acc"]) = batched_means(
      fn, train_eval
    )
    result.metrics["test_acc"] = batched_means(fn, test_eval)[1]
  return standard_columns(
    [
      Column("final train loss", lambda r: r.metrics["train_loss"], "{:.4f}"),
      Column("train acc (%)", lambda r: 100 * r.metrics["train_acc"], "{:.2f}"),
      Column("test acc (%)", lambda r: 100 * r.metrics["test_acc"], "{:.2f}"),
    ]
  )


def format_table(
  results: Mapping[str, training.RunResult], columns: Sequence[Column]
) -> str:
  """A Markdown table, one row per optimizer."""
  rows = [[c.header for c in columns]]
  for result in results.values():
    row = []
    for c in columns:
      value = c.value(result)
      row.append(c.fmt.format(value) if value is not None else "-")
    rows.append(row)
  widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]

  def line(cells):
    padded = [cells[0].ljust(widths[0])] + [
      cell.rjust(w) for cell, w in zip(cells[1:], widths[1:])
    ]
    return "| " + " | ".join(padded) + " |"

  rule = (
    "|"
    + "|".join(
      "-" * (w + 1) + ":" if i else ":" + "-" * (w + 1)
      for i, w in enumerate(widths)
    )
    + "|"
  )
  return "\n".join([line(rows[0]), rule] + [line(r) for r in rows[1:]])


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (shorter windows at the start)."""
  if window <= 1 or len(values) < 2:
    return values
  cumulative = np.cumsum(np.insert(values, 0, 0.0))
  idx = np.arange(1, len(values) + 1)
  lo = np.maximum(idx - window, 0)
  return (cumulative[idx] - cumulative[lo]) / (idx - lo)


def plot_curves(
  results: Mapping[str, training.RunResult],
  path: pathlib.Path,
  title: str,
  ylabel: str,
  log_y: bool = False,
) -> pathlib.Path:
  """Loss vs step and loss vs training seconds, one line per optimizer."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  steps = max(r.steps for r in results.values())
  window = max(1, steps // 50)
  fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
  for result in results.values():
    curve = smooth(result.losses, window)
    x = np.arange(1, result.steps + 1)
    (line,) = ax_step.plot(x, curve, label=result.name, lw=1.6)
    ax_time.plot(
      result.seconds, curve, label=result.name, lw=1.6, color=line.get_color()
    )
  suffix = f" (moving average of {window} steps)" if window > 1 else ""
  ax_step.set_xlabel("step")
  ax_time.set_xlabel("training time (s, compilation excluded)")
  for ax in (ax_step, ax_time):
    ax.set_ylabel(ylabel + suffix)
    if log_y:
      ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def report(
  results: Mapping[str, training.RunResult],
  optimizers: Sequence[training.Optimizer],
  columns: Sequence[Column],
  out_dir: pathlib.Path,
  stem: str,
  header: str,
  plot_title: str,
  ylabel: str,
  log_y: bool = False,
) -> str:
  """Prints the table and hyper-parameters; writes ``<stem>.md``, ``.png``."""
  table = format_table(results, columns)
  details = "\n".join(
    f"- {o.name}: {o.description}" for o in optimizers if o.description
  )
  text = f"{header}\n\n{table}\n\n{details}\n"
  print("\n" + text, flush=True)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.md").write_text(text)
  png = plot_curves(
    results, out_dir / f"{stem}.png", plot_title, ylabel, log_y=log_y
  )
  print(f"Wrote {png} and {out_dir / f'{stem}.md'}", flush=True)
  return text
