"""Running (exponentially averaged) Kronecker factors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax import finite


class LayerFactors(NamedTuple):
  """Running Kronecker factors of one layer.

  Attributes:
    activation_factor: A, ``[activation_dim, activation_dim]``.
    gradient_factor: G, ``[gradient_dim, gradient_dim]``.
  """

  activation_factor: jax.Array
  gradient_factor: jax.Array


def factor_dims(
  factors: Mapping[str, LayerFactors],
) -> dict[str, tuple[int, int]]:
  """``{layer: (activation_dim, gradient_dim)}`` of a state's factors."""
  return {
    name: (f.activation_factor.shape[0], f.gradient_factor.shape[0])
    for name, f in factors.items()
  }


def init_factors(
  activation_dim: int, gradient_dim: int, dtype: jnp.dtype
) -> LayerFactors:
  """Factors start at the identity (KAISA)."""
  return LayerFactors(
    activation_factor=jnp.eye(activation_dim, dtype=dtype),
    gradient_factor=jnp.eye(gradient_dim, dtype=dtype),
  )


def update_factors(
  factors: LayerFactors,
  batch: LayerFactors,
  decay: jax.Array,
  apply: jax.Array | bool = True,
) -> LayerFactors:
  """``F ← d·F + (1 − d)·F_batch`` for A and G where ``apply``, else ``F``.

  Written as ``s·F + where(apply, (1 − d)·F_batch, 0)`` with the scalar
  ``s = d`` or 1: ``F`` is read once and never selected between, so the
  average fuses with whatever produced ``F`` (``restart``) into one pass
  over the factor, and a non-finite ``F_batch`` that is not applied cannot
  leak in. The storage dtype is kept, and the average runs in it or in
  float32, whichever is wider (float64 factors keep float64's precision).
  """
  scale = jnp.where(apply, decay, 1.0)

  def average(running: jax.Array, new: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(running.dtype, jnp.float32)
    added = jnp.where(apply, (1 - decay) * new.astype(dtype), 0.0)
    return (scale * running.astype(dtype) + added).astype(running.dtype)

  return LayerFactors(*map(average, factors, batch))


def non_finite(factors: LayerFactors) -> LayerFactors:
  """Per factor, whether it holds NaN/Inf: bool scalars, O(d²).

  One sum per factor (``finite.leaves_finite``).
  """
  return LayerFactors(*(~flag for flag in finite.leaves_finite(factors)))


def restart(factors: LayerFactors, flags: LayerFactors) -> LayerFactors:
  """The identity (as ``init_factors``) in place of each flagged factor."""
  return LayerFactors(
    *(
      finite.select(flag, jnp.eye(f.shape[0], dtype=f.dtype), f)
      for f, flag in zip(factors, flags)
    )
  )
