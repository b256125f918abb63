"""Finiteness checks that keep the optimizer state usable."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every floating leaf is finite (bool scalar).

  Per leaf, ``max`` and ``min`` are both finite exactly when every element
  is: a NaN propagates through both and ±Inf is an extreme. Unlike a sum
  they cannot overflow, and XLA:CPU lowers each to one plain reduction,
  where ``sum(x * 0)`` became a materialized product, a windowed tree
  reduction and a final reduce: three kernels to compile and an extra write
  per array (``benchmarks/README.md``, *Finiteness checks and compile
  time*). Complex leaves are checked through their real and imaginary parts.
  """
  flags = []
  for leaf in jax.tree.leaves(tree):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact) or leaf.size == 0:
      continue
    parts = ((jnp.real(leaf), jnp.imag(leaf))
             if jnp.issubdtype(leaf.dtype, jnp.complexfloating) else (leaf,))
    flags.extend(jnp.isfinite(extreme(part)) for part in parts
                 for extreme in (jnp.max, jnp.min))
  return functools.reduce(jnp.logical_and, flags, jnp.array(True))


def select(predicate: jax.Array, on_true: Any, on_false: Any) -> Any:
  """``on_true`` where ``predicate`` else ``on_false``, leaf by leaf."""
  return jax.tree.map(lambda t, f: jnp.where(predicate, t, f), on_true,
                      on_false)
