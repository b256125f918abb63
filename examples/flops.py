"""FLOP counts: the analytic floor of a K-FAC step and XLA's count.

``flop_floor`` counts, from the Dense/Conv layer shapes, the FLOPs of an SGD
step and of K-FAC's additions (``benchmarks/step_time.py`` reports measured
step times against it); ``compiled_flops`` reads XLA's count of a compiled
function (``benchmarks/race_flops.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax


def flop_floor(
  shapes: Sequence[dict[str, int]],
  method: str,
  period: int,
  eigh_c: float,
  inverse_c: float,
  gradient_from_stats: bool = False,
) -> dict[str, float]:
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


def compiled_flops(fun: Callable[..., Any], *args: Any) -> float:
  """FLOPs of ``jax.jit(fun)(*args)`` by XLA's cost analysis."""
  analysis = jax.jit(fun).lower(*args).compile().cost_analysis()
  if isinstance(analysis, list):  # One entry per device program in old jax.
    analysis = analysis[0]
  return float(analysis["flops"])
