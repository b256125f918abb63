"""``step_time.py``'s Markdown: step times, FLOP floors, DeepMind's run."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.dm_comparison import DM_TARGETS


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "—"
  return fmt.format(x)


def markdown(
  results: list[dict[str, Any]],
  comparison: dict[str, Any] | None,
  dm: dict[str, Any] | None,
) -> str:
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
        f"{_f(s['state_bytes'] / 2**20, '{:.1f}')} |"
      )
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
        f"{_f(s['amortized_over_floor'])} |"
      )
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
        f"{_f(s['state_bytes'] / 2**20, '{:.1f}')} |"
      )
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
