"""``phases.py``'s report: the phases from the timed programs, as Markdown.

``derived(ms, period)`` turns the programs' times into the phases and
amortized steps of ``phases.py``'s docstring; ``markdown(result,
statistic)`` tabulates them from each program's median CPU time or its
least or median wall-clock time,
one column per task, each cell ``ms (×AdamW)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# (row label, key of ``derived``), in the table's order.
ROWS = (
  ("AdamW step", "adamw"),
  ("forward/backward (value_and_grad)", "grad"),
  ("AdamW's update (adamw − grad)", "adamw_update"),
  ("statistics capture (capture − grad)", "statistics"),
  ("factor update (stats − no_stats − statistics)", "factor_update"),
  ("preconditioning + SGD (no_stats − grad)", "preconditioning"),
  ("decomposition, inverse (decompose − no_stats)", "decomposition"),
  (
    "decomposition, eigen (eigen_decompose − eigen_no_stats)",
    "eigen_decomposition",
  ),
  ("K-FAC step with statistics, no decomposition (stats)", "stats"),
  ("K-FAC step without statistics, NO_STATS (no_stats)", "no_stats"),
  ("K-FAC step without statistics, eigen", "eigen_no_stats"),
  ("K-FAC decomposition step with statistics (full)", "full"),
  (
    "with statistics from 1/4 of the batch (factor_batch_size=0.25)",
    "fraction_stats",
  ),
  ("with weight_sharing='reduce'", "reduce_stats"),
  ("with both", "both_stats"),
  ("**amortized, statistics every step** (the race's K-FAC)", "amortized"),
  (
    "amortized, statistics only on factor steps (NO_STATS, k = 10)",
    "amortized_no_stats",
  ),
  ("amortized, NO_STATS + 1/4 of the batch + reduce", "amortized_all_levers"),
  (
    "amortized, that + max_factor_dim (the race's K-FAC + levers)",
    "amortized_levers",
  ),
)


def derived(ms: Mapping[str, float], period: int) -> dict[str, float]:
  """The phases and amortized steps (ms) from the programs' times."""
  out = dict(ms)
  out["adamw_update"] = ms["adamw"] - ms["grad"]
  out["statistics"] = ms["capture"] - ms["grad"]
  out["factor_update"] = ms["stats"] - ms["no_stats"] - out["statistics"]
  out["preconditioning"] = ms["no_stats"] - ms["grad"]
  out["decomposition"] = ms["decompose"] - ms["no_stats"]
  out["eigen_decomposition"] = ms["eigen_decompose"] - ms["eigen_no_stats"]
  plain = period - 1
  out["amortized"] = (plain * ms["stats"] + ms["full"]) / period
  out["amortized_no_stats"] = (plain * ms["no_stats"] + ms["full"]) / period
  # The factor step's statistics and factor update at the levers' cost.
  out["amortized_all_levers"] = (
    plain * ms["no_stats"] + ms["full"] - ms["stats"] + ms["both_stats"]
  ) / period
  out["amortized_levers"] = (
    plain * ms["levers_no_stats"] + ms["levers_full"]
  ) / period
  return out


def cell(value: float, baseline: float) -> str:
  return f"{value:.1f} ({value / baseline:.2f}×)"


def markdown(result: Mapping[str, Any], statistic: str = "cpu") -> str:
  """One column per task: each phase's ms and its ratio to AdamW's step,
  from each program's ``statistic`` (``"cpu"``, ``"min"`` or
  ``"median"``, ``phases.py --statistic``); then the largest factor's
  decompositions and the load."""
  columns = result["tasks"]
  values = [derived(t[f"{statistic}_ms"], result["period"]) for t in columns]
  header = (
    "| phase, ms (×AdamW step) | "
    + " | ".join(f"{t['task']} (b={t['batch_size']})" for t in columns)
    + " |"
  )
  lines = [header, "|---" + "|---:" * len(columns) + "|"]
  for label, key in ROWS:
    lines.append(
      f"| {label} | "
      + " | ".join(cell(v[key], v["adamw"]) for v in values)
      + " |"
    )
  largest = [t["largest_factor"] for t in columns]
  lines.append(
    "| largest factor: `eigh` / Cholesky inverse, alone | "
    + " | ".join(
      f"{f['factor']} ({f['size']}²): "
      f"{f['eigh_ms']:.0f} / "
      f"{f['cholesky_inverse_ms']:.0f}"
      for f in largest
    )
    + " |"
  )
  lines.append(
    "| load average before → after | "
    + " | ".join(
      f"{t['load_average_before'][0]:.1f} → {t['load_average_after'][0]:.1f}"
      if t["load_average_before"]
      else "—"
      for t in columns
    )
    + " |"
  )
  return "\n".join(lines)
