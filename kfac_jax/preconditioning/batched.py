"""All of a step's factor decompositions, batched by factor size.

Factors of equal size (A or G, of any layers) are stacked ``[k, d, d]`` and
decomposed by one ``vmap``ped call, or by ``lax.map`` over batches of
``batch_size`` factors when memory is tight (many scanned layers).

Except on CPU (``lax.platform_dependent``, decided when the step is lowered
for its platform): there a batched LAPACK call loops over its stack on one
thread, while independent calls run concurrently on XLA:CPU's thread pool,
so each factor is decomposed on its own. Same-sized factors still share
their compiled kernels (XLA:CPU compiles identical kernels once), and no
stacking copies are made. ``benchmarks/README.md``, *Decompositions one by
one on CPU*, has the measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.factors.running import LayerFactors

# factor [d, d], damping -> per-factor results (eigenvalues/vectors or inverse).
FactorFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, ...]]
Results = tuple[jax.Array, ...]
Decomposed = dict[str, tuple[Results, Results]]


def decompose_each(factors: Mapping[str, LayerFactors], factor_fn: FactorFn,
                   damping: jax.Array) -> Decomposed:
  """``{layer: (factor_fn(A), factor_fn(G))}``, one call per factor."""
  return {name: (factor_fn(pair.activation_factor, damping),
                 factor_fn(pair.gradient_factor, damping))
          for name, pair in factors.items()}


def decompose_stacked(factors: Mapping[str, LayerFactors], factor_fn: FactorFn,
                      damping: jax.Array,
                      batch_size: int | None = None) -> Decomposed:
  """``decompose_each``'s result from one call per ``(size, dtype)`` stack.

  ``batch_size``: decompose at most this many factors of a stack at once
  (``lax.map`` over ``vmap``ped batches); ``None``: the whole stack.
  """
  groups: dict[tuple[int, jnp.dtype], list[tuple[str, int, jax.Array]]] = {}
  for name, layer_factors in factors.items():
    for which, factor in enumerate(layer_factors):
      groups.setdefault((factor.shape[-1], factor.dtype), []).append(
          (name, which, factor))

  results: dict[str, list[Results | None]] = {
      name: [None, None] for name in factors
  }
  for members in groups.values():
    stack = jnp.stack([factor for _, _, factor in members])
    if batch_size is None or batch_size >= len(stack):
      decomposed: Sequence[jax.Array] = jax.vmap(
          factor_fn, in_axes=(0, None))(stack, damping)
    else:
      decomposed = lax.map(lambda factor: factor_fn(factor, damping), stack,
                           batch_size=batch_size)
    for index, (name, which, _) in enumerate(members):
      results[name][which] = tuple(array[index] for array in decomposed)
  return {name: (pair[0], pair[1]) for name, pair in results.items()}


def decompose_layers(factors: Mapping[str, LayerFactors], factor_fn: FactorFn,
                     damping: jax.Array,
                     batch_size: int | None = None) -> Decomposed:
  """Applies ``factor_fn`` to every A and G: one by one on CPU, else stacked.

  Args:
    factors: ``{layer: LayerFactors(A [dA, dA], G [dG, dG])}``.
    factor_fn: decomposition of one factor, ``vmap``-able.
    damping: λ, passed to every call.
    batch_size: bounds the factors decomposed at once, on every platform
      (``decompose_stacked``); ``None``: no bound.

  Returns:
    ``{layer: (factor_fn(A), factor_fn(G))}``.
  """
  stacked = lambda factors, damping: decompose_stacked(
      factors, factor_fn, damping, batch_size)
  if batch_size is not None:
    return stacked(factors, damping)
  return lax.platform_dependent(
      dict(factors), damping,
      cpu=lambda factors, damping: decompose_each(factors, factor_fn, damping),
      default=stacked)
