"""Linear-algebra helpers shared by the factors, the preconditioning and the
quadratic model: row contractions, inner products of arrays and pytrees
(float32 accumulation, mesh-aware), a matrix's diagonal, many matrices'
diagonal sums in one pass, and the O(d) finiteness test of symmetric PSD
matrices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

# Factors and inner products are accumulated in float32 whatever the dtype.
COMPUTE_DTYPE = jnp.float32


def contract_rows(left: jax.Array, right: jax.Array) -> jax.Array:
  """``leftᵀ right`` over rows: ``[..., N, d1], [..., N, d2] -> [..., d1, d2]``.

  Accumulated and returned in float32, for float32 or narrower operands.
  Leading axes are batch axes. On a mesh with Explicit axes and batch-sharded
  rows, a contraction over them must say where the result lives: here
  replicated, as the factors and gradients it makes are.
  """
  replicated = jax.typeof(left).sharding.update(spec=PartitionSpec())
  batch_axes = tuple(range(left.ndim - 2))
  rows_axis = left.ndim - 2
  return lax.dot_general(
    left,
    right,
    (((rows_axis,), (rows_axis,)), (batch_axes, batch_axes)),
    precision=lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
    out_sharding=replicated,
  )


def inner_products(
  arrays: Sequence[jax.Array], pairs: Sequence[tuple[int, int]]
) -> jax.Array:
  """``[Σ arrays[i] ⊙ arrays[j] for (i, j) in pairs]`` over every axis, float32.

  ``arrays`` share one shape; the result is ``[len(pairs)]``. Several pairs make
  variadic reductions (each row's sums, then theirs), so each array is read once
  however many pairs use it (a ``dot_general`` per pair reads both operands
  every time, and on XLA:CPU runs single-threaded once fused with the sum over
  leaves). On a mesh, a leaf sharded on another axis than its first exchanges
  its row sums (``rows`` floats per device and pair) where one sum would do:
  small beside the leaf itself. One pair stays a ``dot_general``: it reads the
  same two arrays, and is one kernel where XLA:CPU compiles a large reduction as
  a windowed tree reduction and a reduce (KL clipping's inner product on every
  step). Not ``jnp.vdot``: flattening a sharded kernel's gradient gathers it
  whole; both forms stay on each device's shard and the result is replicated.
  """
  arrays = [a.astype(COMPUTE_DTYPE) for a in arrays]
  axes = tuple(range(arrays[0].ndim))
  if len(pairs) == 1:
    ((i, j),) = pairs
    # On a mesh with Explicit axes the contraction must say where its
    # result lives.
    replicated = jax.typeof(arrays[i]).sharding.update(spec=PartitionSpec())
    return lax.dot_general(
      arrays[i],
      arrays[j],
      ((axes, axes), ((), ())),
      precision=lax.Precision.HIGHEST,
      out_sharding=replicated,
    )[None]
  products = tuple(arrays[i] * arrays[j] for i, j in pairs)
  zeros = (np.zeros([], COMPUTE_DTYPE),) * len(products)
  add = lambda xs, ys: tuple(x + y for x, y in zip(xs, ys))
  if len(axes) > 1:
    # Rows first, then their sums: XLA:CPU runs a reduction to a scalar on
    # one thread, one that keeps the leading axis on all of them, and for
    # leaves with a long leading axis summing row sums is far more accurate
    # (two short sums accumulate less rounding than one long one).
    products = lax.reduce(products, zeros, add, axes[1:])
  return jnp.stack(lax.reduce(products, zeros, add, axes[:1]))


def tree_inner_products(
  trees: Sequence[Any], pairs: Sequence[tuple[int, int]]
) -> jax.Array:
  """``inner_products`` of pytrees of one structure, summed over the leaves.

  ``[Σ_leaves Σ trees[i] ⊙ trees[j] for (i, j) in pairs]``, ``[len(pairs)]``.
  Trees with different numbers of leaves raise ``ValueError`` (rather than
  pairing leaves up to the shorter one).
  """
  per_leaf = [
    inner_products(arrays, pairs)
    for arrays in zip(*(jax.tree.leaves(t) for t in trees), strict=True)
  ]
  return sum(per_leaf, jnp.zeros([len(pairs)], COMPUTE_DTYPE))


def diagonal(matrix: jax.Array) -> jax.Array:
  """The diagonal of ``[..., d, d]``, ``[..., d]``, reading only those entries.

  A strided slice of the flattened matrix (stride ``d + 1``): ``jnp.trace``
  and ``jnp.diagonal`` select through a ``[d, d]`` mask, a pass over every
  entry.
  """
  size = matrix.shape[-1]
  flat = matrix.reshape(matrix.shape[:-2] + (size * size,))
  return flat[..., :: size + 1]


def diagonal_sums(matrices: Sequence[jax.Array]) -> jax.Array:
  """``[tr M for M in matrices]`` (``[len(matrices)]``, float32), in one pass.

  The diagonals are concatenated (one kernel), gathered into an
  ``[n, rows, _ROW]`` array zero-padded to the longest, and summed: entries
  of ``_ROW``, then the row sums. Summed alone, XLA:CPU splits each
  diagonal's sum into a slice, a windowed tree reduction and a reduce, each
  compiled on its own (the design notes, *Compile time*); here every matrix
  shares those kernels. A NaN or ±Inf on a diagonal stays in that matrix's
  entry.
  """
  diagonals = [diagonal(m).astype(COMPUTE_DTYPE) for m in matrices]
  if not diagonals:
    return jnp.zeros([0], COMPUTE_DTYPE)
  width = max(d.shape[0] for d in diagonals)
  width += -width % _ROW
  starts = np.cumsum([0] + [d.shape[0] for d in diagonals])
  padding = starts[-1]  # the index of a zero appended to the concatenation
  index = np.full((len(diagonals), width), padding)
  for row, (start, stop) in enumerate(zip(starts[:-1], starts[1:])):
    index[row, : stop - start] = np.arange(start, stop)
  # Unseen through the barrier, XLA cannot split the sum back into one per
  # diagonal.
  flat = lax.optimization_barrier(
    jnp.concatenate([*diagonals, jnp.zeros([1], COMPUTE_DTYPE)])
  )
  return jnp.sum(
    jnp.sum(flat[index].reshape(len(diagonals), -1, _ROW), axis=2), axis=1
  )


def scalars(vector: jax.Array) -> tuple[jax.Array, ...]:
  """``vector``'s entries as scalars that XLA cannot fuse back into slices.

  A kernel reading ``vector[i]`` has ``i`` built in, so kernels that are
  otherwise alike (the same-sized factors of two layers) differ by it and
  are compiled once each; past an optimization barrier each reads a scalar
  operand, and XLA:CPU compiles them once.
  """
  return lax.optimization_barrier(tuple(vector))


def psd_all_finite(matrices: Iterable[jax.Array]) -> jax.Array:
  """Whether symmetric PSD matrices are all finite, from their diagonals.

  For PSD ``M``, ``|M_ij| ≤ √(M_ii M_jj)``: finite diagonals bound every
  other entry, so the diagonals decide in O(d) what an elementwise check
  decides in O(d²). Used for the batch factors ``xᵀx / N`` (a NaN or ±Inf
  in column i of ``x`` makes ``(i, i)`` non-finite; sums of such factors,
  as in micro-batch accumulation, qualify too) and for damped inverses (a
  failed Cholesky comes out NaN throughout). A diagonal sum that overflows
  float32 counts as non-finite: the safe side for both.
  """
  return jnp.isfinite(jnp.sum(diagonal_sums(list(matrices))))


# Entries per row in ``diagonal_sums``' two-level sum.
_ROW = 128
