"""Finiteness checks that keep the optimizer state usable."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _leaf_sum(leaf: jax.Array) -> jax.Array | None:
  """``Σ leaf`` in at least float32 precision; None for non-float or empty."""
  if not jnp.issubdtype(leaf.dtype, jnp.inexact) or leaf.size == 0:
    return None
  return jnp.sum(leaf, dtype=jnp.promote_types(leaf.dtype, jnp.float32))


def leaves_finite(tree: Any) -> Any:
  """Per leaf, whether it is finite: ``tree`` with a bool scalar per leaf.

  A leaf counts as finite when its sum is: one NaN or ±Inf anywhere makes
  the sum NaN or ±Inf, so a sum is exact for non-finite entries and costs
  one plain reduction per leaf (a library call on XLA:CPU, no kernel to
  compile). Its one false alarm is a finite leaf whose float32 sum
  overflows (entries ~3e38 / size), values no K-FAC factor, decomposition
  or update survives anyway; the checks' callers then take the safe side
  (restart a factor, keep the previous decomposition, skip a step).

  Not ``max``/``min``: XLA:CPU (jax 0.9.2) reduces large float arrays with
  YNNPACK, whose max and min drop NaN (a 200 × 200 array with one NaN has a
  finite max), and ``all(isfinite(x))`` or ``sum(x * 0)`` compile to an
  elementwise pass plus a tree reduction, three kernels per leaf
  (``benchmarks/README.md``, *Finiteness checks and compile time*).
  Non-float and empty leaves are finite.

  Each flag is its own scalar rather than an entry of one stacked vector:
  kernels that read a flag then stay identical across same-shaped leaves,
  and XLA:CPU compiles identical kernels once.
  """

  def leaf_finite(leaf: jax.Array) -> jax.Array:
    total = _leaf_sum(leaf)
    return jnp.array(True) if total is None else jnp.isfinite(total)

  return jax.tree.map(leaf_finite, tree)


def all_finite(tree: Any) -> jax.Array:
  """Whether every float leaf of ``tree`` is finite (bool scalar).

  The sum of the leaves' sums (``leaves_finite``): exact for NaN/±Inf
  entries; a finite tree whose float32 total overflows counts as
  non-finite.
  """
  sums = [s for s in map(_leaf_sum, jax.tree.leaves(tree)) if s is not None]
  if not sums:
    return jnp.array(True)
  return jnp.isfinite(jnp.sum(jnp.stack(sums)))


def select(predicate: jax.Array, on_true: Any, on_false: Any) -> Any:
  """``on_true`` where ``predicate`` else ``on_false``, leaf by leaf.

  A ``jnp.where`` per leaf, which XLA fuses into whatever computes the
  leaves; for leaves that nothing fuses with (a library call's), ``keep``.
  """
  return jax.tree.map(
    lambda t, f: jnp.where(predicate, t, f), on_true, on_false
  )


def keep(predicate: jax.Array, on_true: Any, on_false: Any) -> Any:
  """``on_true`` if the scalar ``predicate`` else ``on_false``, whole trees.

  A ``lax.cond`` that passes one tree's buffers through: where the leaves
  come from a library call (``eigh``) a ``jnp.where`` per leaf is an
  elementwise kernel each, which XLA:CPU compiles one by one.
  """
  return jax.lax.cond(predicate, lambda: on_true, lambda: on_false)
