"""All of a step's factor decompositions, batched by factor size.

Factors of equal size (A or G, of any layers) are stacked ``[k, d, d]`` and
decomposed by one ``vmap``ped call, or by ``lax.map`` over batches of
``batch_size`` factors when memory is tight (many scanned layers). The stack is padded with identity blocks to
a multiple of ``stack_multiple`` and handed to ``place_stack`` first: on a mesh,
that shards the stack axis so each device decomposes only its share (see
``kfac_jax.distribution``); on one device both are no-ops.
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


def _identity_stack(count: int, like: jax.Array) -> jax.Array:
  eye = jnp.eye(like.shape[-1], dtype=like.dtype)
  return jnp.broadcast_to(eye, (count,) + eye.shape)


def decompose_layers(
    factors: Mapping[str, LayerFactors],
    factor_fn: FactorFn,
    damping: jax.Array,
    stack_multiple: int = 1,
    place_stack: Callable[[jax.Array], jax.Array] = lambda stack: stack,
    batch_size: int | None = None,
) -> dict[str, tuple[Results, Results]]:
  """Applies ``factor_fn`` to every A and G, batched by ``(size, dtype)``.

  Args:
    factors: ``{layer: LayerFactors(A [dA, dA], G [dG, dG])}``.
    factor_fn: decomposition of one factor, ``vmap``-able.
    damping: λ, passed to every call.
    stack_multiple: stacks are padded with identities to a multiple of this.
    place_stack: applied to each padded ``[k, d, d]`` stack before
      decomposing (a sharding constraint on a mesh).
    batch_size: decompose at most this many factors of a stack at once
      (``lax.map`` over ``vmap``ped batches); ``None``: the whole stack.

  Returns:
    ``{layer: (factor_fn(A), factor_fn(G))}``.
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
    padding = -len(members) % stack_multiple
    if padding:
      stack = jnp.concatenate([stack, _identity_stack(padding, stack)])
    stack = place_stack(stack)
    if batch_size is None or batch_size >= len(stack):
      decomposed: Sequence[jax.Array] = jax.vmap(
          factor_fn, in_axes=(0, None))(stack, damping)
    else:
      decomposed = lax.map(lambda factor: factor_fn(factor, damping), stack,
                           batch_size=batch_size)
    for index, (name, which, _) in enumerate(members):
      results[name][which] = tuple(array[index] for array in decomposed)
  return {name: (pair[0], pair[1]) for name, pair in results.items()}
