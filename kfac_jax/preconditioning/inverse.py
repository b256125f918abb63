"""Inverse-method preconditioning: ``P = (A + λI)⁻¹ ∇ (G + λI)⁻¹``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax.factors.running import LayerFactors
from kfac_jax.linalg import diagonal_sums, scalars
from kfac_jax.preconditioning.eigen import DECOMPOSITION_DTYPE
from kfac_jax.preconditioning.gradient_matrix import (
  FactoredGradient,
  Reshard,
  no_reshard,
  sandwich,
)


class InversePreconditioner(NamedTuple):
  """Damped factor inverses of one layer.

  Attributes:
    activation_inverse: ``(A + λI)⁻¹``, ``[activation_dim, activation_dim]``;
      in the adaptive mode, of the π-split factor: ``(A/(π√λ) + I)⁻¹``
      (``factored_damping_scaled``).
    gradient_inverse: ``(G + λI)⁻¹``, ``[gradient_dim, gradient_dim]``; in
      the adaptive mode ``(Gπ/√λ + I)⁻¹``.
  """

  activation_inverse: jax.Array
  gradient_inverse: jax.Array


def init_inverse(
  activation_dim: int, gradient_dim: int, dtype: jnp.dtype
) -> InversePreconditioner:
  """The inverses of identity factors, undamped (before the first update)."""
  return InversePreconditioner(
    activation_inverse=jnp.eye(activation_dim, dtype=dtype),
    gradient_inverse=jnp.eye(gradient_dim, dtype=dtype),
  )


# About this many columns per triangular-solve block of ``damped_inverse``:
# small enough that skipping the zero upper part of ``L⁻¹`` pays, large
# enough that each LAPACK call still runs at speed and that few factor sizes
# get the blocked form's extra kernels (slices, the assembly: XLA compiles
# them once per factor size). Factors of 501, 785 and 1001 rows get 2, 3 and
# 4 blocks, 251 rows one. Larger blocks (350) made the decomposition steps
# slower; smaller ones (200, 150) gained nothing more and compile more
# kernels (``benchmarks/README.md``, *Blocked triangular solves*).
INVERSE_BLOCK_SIZE = 250


def damped_inverse(factor: jax.Array, damping: jax.Array) -> tuple[jax.Array]:
  """``((F + λI)⁻¹,)`` of one symmetric PSD factor ``[d, d]`` via Cholesky.

  ``F + λI = LLᵀ`` and ``(F + λI)⁻¹ = L⁻ᵀL⁻¹``, from two triangular solves
  per block of columns. ``L⁻¹`` is lower triangular, so with the columns cut
  at ``0 = c₀ < c₁ < … < c_k = d`` into blocks ``b_j``, the rows ``≥ c_j`` of
  block column ``j`` of the inverse need only the trailing triangle
  ``L_j = L[c_j:, c_j:]``::

    (F + λI)⁻¹[c_j:, b_j] = L_j⁻ᵀ (L_j⁻¹ I[c_j:, b_j])

  and the blocks above come from symmetry. That is ``Σ_j 2(d − c_j)²·|b_j|``
  solve flops against ``2d³`` for whole solves (53 % fewer for 4 blocks);
  the Cholesky adds ``d³/3``. Everything is float32. A failed Cholesky
  (``F + λI`` not positive definite) comes out NaN throughout, which
  ``are_finite`` rejects. The factorization reads only one triangle, so ``F``
  is not symmetrized first; the result's diagonal blocks are symmetric up to
  rounding and are not symmetrized after (a pass over every factor on every
  decomposition step for a change at the level of float32 rounding). The
  preconditioning products use the inverse as stored, so both sides of the
  factored and dense forms agree (``gradient_matrix.sandwich``).
  """
  size = factor.shape[0]
  identity = jnp.eye(size, dtype=DECOMPOSITION_DTYPE)
  damped = factor.astype(DECOMPOSITION_DTYPE) + damping * identity
  # lax directly: jax.scipy's cho_factor/cho_solve wrap the same calls in
  # nested jits, which cost trace and lowering time per factor size. LAPACK
  # takes column-major arrays, so XLA:CPU lays its operands out transposed;
  # handing it the (symmetric) transpose turns that transposing copy into a
  # straight one (and likewise for the result, below).
  lower = lax.linalg.cholesky(damped.T, symmetrize_input=False)
  num_blocks = max(1, round(size / INVERSE_BLOCK_SIZE))
  cuts = [size * block // num_blocks for block in range(num_blocks + 1)]
  spans = list(zip(cuts[:-1], cuts[1:]))
  # trailing[j] = (F + λI)⁻¹[c_j:, b_j].
  trailing = []
  for start, stop in spans:
    lower_tail = lower[start:, start:]
    inverse_lower_block = lax.linalg.triangular_solve(
      lower_tail, identity[start:, start:stop], left_side=True, lower=True
    )
    trailing.append(
      lax.linalg.triangular_solve(
        lower_tail,
        inverse_lower_block,
        left_side=True,
        lower=True,
        transpose_a=True,
      )
    )
  block_columns = [
    jnp.concatenate(
      [
        trailing[above][start - cuts[above] : stop - cuts[above]].T
        for above in range(block)
      ]
      + [trailing[block]],
      axis=0,
    )
    for block, (start, stop) in enumerate(spans)
  ]
  # Returned transposed (the same matrix up to rounding): with one block,
  # XLA's copy out of LAPACK's column-major result is then a straight one.
  return (jnp.concatenate(block_columns, axis=1).T,)


def crop(padded: tuple[jax.Array, ...], size: int) -> tuple[jax.Array, ...]:
  """``damped_inverse`` of ``F [size, size]`` from that of ``diag(F, I)``.

  ``(diag(F, I) + λI)⁻¹ = diag((F + λI)⁻¹, I/(1 + λ))``: its leading block,
  exactly (``batched.decompose_layers`` pads factors to shared sizes).
  """
  return (padded[0][:size, :size],)


def assemble(
  activation: tuple[jax.Array],
  gradient: tuple[jax.Array],
  damping: jax.Array,
  dtype: jnp.dtype,
) -> InversePreconditioner:
  """A layer's preconditioner from ``damped_inverse`` of A and of G."""
  del damping  # Already folded into the inverses.
  return InversePreconditioner(
    activation_inverse=activation[0].astype(dtype),
    gradient_inverse=gradient[0].astype(dtype),
  )


def invert(
  factors: LayerFactors, damping: jax.Array, dtype: jnp.dtype
) -> InversePreconditioner:
  """Damped inverses of one layer's A and G, stored as ``dtype``."""
  return assemble(
    damped_inverse(factors.activation_factor, damping),
    damped_inverse(factors.gradient_factor, damping),
    damping,
    dtype,
  )


def are_finite(
  preconditioners: Sequence[InversePreconditioner],
) -> tuple[jax.Array, ...]:
  """Whether each layer's inverses are finite, from their diagonals (O(d)).

  ``(F + λI)⁻¹`` is symmetric positive definite (``linalg.psd_all_finite``);
  the full check was a pass over every inverse on every decomposition step.
  One ``linalg.diagonal_sums`` over all the layers' inverses: per layer, a
  sum each compiled its own kernels.

  Args:
    preconditioners: n layers' preconditioners.

  Returns:
    n bool scalars (``linalg.scalars``), whether both of a layer's inverses
    are finite.
  """
  sums = diagonal_sums([inverse for p in preconditioners for inverse in p])
  return scalars(jnp.isfinite(jnp.sum(sums.reshape(-1, 2), axis=1)))


def _mean_eigenvalues(
  factors: Mapping[str, LayerFactors],
) -> tuple[dict[str, LayerFactors], jax.Array, jax.Array]:
  """The factors in float32, and their mean eigenvalues ``tr F / d`` ``[n]``
  (A's, then G's), from one ``linalg.diagonal_sums`` over all of them."""
  cast = {
    name: LayerFactors(*(f.astype(DECOMPOSITION_DTYPE) for f in pair))
    for name, pair in factors.items()
  }
  pairs = list(cast.values())
  sizes = np.array(
    [[f.shape[0] for f in pair] for pair in pairs], np.float32
  ).reshape(-1, 2)
  means = (
    diagonal_sums([f for pair in pairs for f in pair]).reshape(-1, 2) / sizes
  )
  return cast, means[:, 0], means[:, 1]


def normalized(factors: Mapping[str, LayerFactors]) -> dict[str, LayerFactors]:
  """``(A / ā, G / ḡ)`` per layer, ``ā = tr A / dA``, ``ḡ = tr G / dG``.

  Relative damping (``hyperparameters.DampingMode.RELATIVE``) inverts these
  with ``√λ`` added to each: ``(Â + √λI)⁻¹ ∇ (Ĝ + √λI)⁻¹ = ā ḡ (A + π√λ'I)⁻¹
  ∇ (G + √λ'/π I)⁻¹`` with ``λ' = λ ā ḡ`` and ``π = √(ā / ḡ)``: Martens &
  Grosse's factored damping with λ relative to the layer's mean curvature,
  scaled to the gradient's size. A zero factor (a dead layer) is left as
  it is.

  Args:
    factors: ``{layer: LayerFactors(A [dA, dA], G [dG, dG])}``.

  Returns:
    ``{layer: LayerFactors(Â, Ĝ)}``, float32, each of mean eigenvalue 1.
  """
  cast, activation_mean, gradient_mean = _mean_eigenvalues(factors)

  def safe(mean: jax.Array) -> jax.Array:
    return jnp.where(mean > 0, mean, 1.0)

  return {
    name: LayerFactors(pair.activation_factor / a, pair.gradient_factor / g)
    for a, g, (name, pair) in zip(
      scalars(safe(activation_mean)), scalars(safe(gradient_mean)), cast.items()
    )
  }


def factored_damping_scaled(
  factors: Mapping[str, LayerFactors], damping: jax.Array
) -> dict[str, LayerFactors]:
  """``(A / (π√λ), G·π/√λ)`` per layer: with damping 1, Martens & Grosse's
  factored damping.

  ``(A/(π√λ) + I)⁻¹ ∇ (Gπ/√λ + I)⁻¹ = λ · (A + π√λI)⁻¹ ∇ (G + √λ/π I)⁻¹``,
  with ``π = √((tr A / dA) / (tr G / dG))``: the damping split between the
  factors in proportion to their average eigenvalues (K-FAC §6.3), rather
  than KAISA's λ on each. The result is ``λ`` times that preconditioned
  gradient, a scale the adaptive mode's step size absorbs. Every layer's
  traces come from one ``linalg.diagonal_sums``.

  Args:
    factors: ``{layer: LayerFactors(A [dA, dA], G [dG, dG])}``.
    damping: λ.

  Returns:
    ``{layer: LayerFactors(A / (π√λ), G·π/√λ)}``, float32.
  """
  cast, activation_mean, gradient_mean = _mean_eigenvalues(factors)
  # A zero factor (a dead layer) gets π = 1 rather than 0 or ∞.
  # √a/√g, not √(a/g): the ratio overflows float32 for π past ~1.8e19
  # (large activations, small cotangents), π = ∞ zeroed A's side and made
  # G's inverse zero, a finite preconditioner that froze the layer.
  pi = jnp.where(
    (activation_mean > 0) & (gradient_mean > 0),
    jnp.sqrt(activation_mean)
    / jnp.sqrt(jnp.where(gradient_mean > 0, gradient_mean, 1.0)),
    1.0,
  )
  root = jnp.sqrt(damping)
  return {
    name: LayerFactors(
      pair.activation_factor / (layer_pi * root),
      pair.gradient_factor * (layer_pi / root),
    )
    for layer_pi, (name, pair) in zip(scalars(pi), cast.items())
  }


def precondition(
  preconditioner: InversePreconditioner,
  gradient: jax.Array | FactoredGradient,
  damping: jax.Array,
  reshard: Reshard = no_reshard,
) -> jax.Array:
  """``(A + λI)⁻¹ ∇ (G + λI)⁻¹`` with the damping frozen at inversion; float32.

  ``∇ [dA, dG]`` dense or factored (``gradient_matrix.sandwich``);
  ``reshard`` as in ``eigen.precondition``.
  """
  del damping  # Folded into the inverses when they were computed.
  return sandwich(
    preconditioner.activation_inverse,
    gradient,
    preconditioner.gradient_inverse,
    reshard,
  )
