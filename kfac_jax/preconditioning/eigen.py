"""Eigen-method preconditioning: ``(A ⊗ G + λI)⁻¹`` through eigenbases.

With ``A = Q_A diag(d_A) Q_Aᵀ`` and ``G = Q_G diag(d_G) Q_Gᵀ``, for a gradient
matrix ``∇: [activation_dim, gradient_dim]``

    P = Q_A [(Q_Aᵀ ∇ Q_G) / (outer(d_A, d_G) + λ)] Q_Gᵀ,

which is exactly ``(A ⊗ G + λI)⁻¹ vec(∇)`` reshaped. With relative damping
(``hyperparameters.DampingMode.RELATIVE``) the eigenvalues enter divided by
their means ``ā = mean(d_A)``, ``ḡ = mean(d_G)``:

    P = Q_A [(Q_Aᵀ ∇ Q_G) / (outer(d_A, d_G) / (ā ḡ) + λ)] Q_Gᵀ
      = ā ḡ (A ⊗ G + λ ā ḡ I)⁻¹ vec(∇),

so λ is a fraction of the layer's mean curvature and ``P`` has the scale of
``∇`` whatever the scale of the factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning.gradient_matrix import (
  FactoredGradient,
  Reshard,
  no_reshard,
  sandwich,
)

# Decompositions always run in float32, whatever the storage dtypes.
DECOMPOSITION_DTYPE = jnp.float32


class EigenPreconditioner(NamedTuple):
  """Eigenbases of one layer's factors.

  Attributes:
    activation_eigenvectors: Q_A, ``[activation_dim, activation_dim]``.
    activation_eigenvalues: d_A ≥ 0, ``[activation_dim]``.
    gradient_eigenvectors: Q_G, ``[gradient_dim, gradient_dim]``.
    gradient_eigenvalues: d_G ≥ 0, ``[gradient_dim]``.
    damped_inverse: ``1 / (outer(d_A, d_G) + λ)`` frozen at the decomposition,
      ``[activation_dim, gradient_dim]``; ``None`` when the outer product is
      formed each step with the current damping.
  """

  activation_eigenvectors: jax.Array
  activation_eigenvalues: jax.Array
  gradient_eigenvectors: jax.Array
  gradient_eigenvalues: jax.Array
  damped_inverse: jax.Array | None


def eigh_factor(
  factor: jax.Array, damping: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """``(d, Q)`` of a symmetric factor ``[d, d]`` in float32, ``d`` clamped ≥ 0.

  ``damping`` is unused (the eigenbasis does not depend on it); it keeps the
  signature of ``inverse.damped_inverse`` so both batch the same way. As the
  inverse method's Cholesky, ``eigh`` reads one triangle of the factor
  (symmetric up to the rounding of its products): symmetrizing it first
  was a kernel per factor for a change at that rounding.
  """
  del damping
  eigenvalues, eigenvectors = jnp.linalg.eigh(
    factor.astype(DECOMPOSITION_DTYPE), symmetrize_input=False
  )
  # Round-off can make a PSD factor's smallest eigenvalues slightly negative.
  return jnp.maximum(eigenvalues, 0.0), eigenvectors


def init_eigen(
  activation_dim: int,
  gradient_dim: int,
  dtype: jnp.dtype,
  precompute_damped_inverse: bool,
) -> EigenPreconditioner:
  """The eigenbasis of identity factors (before the first decomposition)."""
  return EigenPreconditioner(
    activation_eigenvectors=jnp.eye(activation_dim, dtype=dtype),
    activation_eigenvalues=jnp.ones((activation_dim,), dtype),
    gradient_eigenvectors=jnp.eye(gradient_dim, dtype=dtype),
    gradient_eigenvalues=jnp.ones((gradient_dim,), dtype),
    damped_inverse=(
      jnp.ones((activation_dim, gradient_dim), dtype)
      if precompute_damped_inverse
      else None
    ),
  )


def mean_or_one(values: jax.Array) -> jax.Array:
  """The mean of non-negative ``values`` (a matrix), float32; 1 where it is
  0 (a dead layer's factor), so that dividing by it is a no-op there."""
  mean = jnp.mean(values.astype(DECOMPOSITION_DTYPE))
  return jnp.where(mean > 0, mean, 1.0)


def damped_inverse(
  activation_eigenvalues: jax.Array,
  gradient_eigenvalues: jax.Array,
  damping: jax.Array,
  relative: bool,
) -> jax.Array:
  """``1 / (outer(d_A, d_G) + λ)`` ``[dA, dG]``, float32; ``relative``: with
  ``outer(d_A, d_G) / (mean(d_A) mean(d_G))`` (module docstring)."""
  outer = (
    activation_eigenvalues.astype(DECOMPOSITION_DTYPE)[:, None]
    * gradient_eigenvalues.astype(DECOMPOSITION_DTYPE)[None, :]
  )
  if relative:
    # mean(outer) = mean(d_A)·mean(d_G), summed as a matrix: XLA:CPU
    # compiles a [d] vector's sum as a windowed tree reduction of its own
    # (design notes, *Compile time*).
    outer = outer / mean_or_one(outer)
  return 1.0 / (outer + damping)


def assemble(
  activation: tuple[jax.Array, jax.Array],
  gradient: tuple[jax.Array, jax.Array],
  damping: jax.Array,
  dtype: jnp.dtype,
  precompute_damped_inverse: bool,
  relative: bool = False,
) -> EigenPreconditioner:
  """A layer's preconditioner from ``eigh_factor`` of A and of G, as ``dtype``.

  ``relative``: λ relative to the mean eigenvalues (module docstring), in
  the ``damped_inverse`` frozen here.
  """
  (activation_eigenvalues, activation_eigenvectors) = activation
  (gradient_eigenvalues, gradient_eigenvectors) = gradient
  frozen = None
  if precompute_damped_inverse:
    frozen = damped_inverse(
      activation_eigenvalues, gradient_eigenvalues, damping, relative
    ).astype(dtype)
  return EigenPreconditioner(
    activation_eigenvectors=activation_eigenvectors.astype(dtype),
    activation_eigenvalues=activation_eigenvalues.astype(dtype),
    gradient_eigenvectors=gradient_eigenvectors.astype(dtype),
    gradient_eigenvalues=gradient_eigenvalues.astype(dtype),
    damped_inverse=frozen,
  )


def decompose(
  factors: LayerFactors,
  damping: jax.Array,
  dtype: jnp.dtype,
  precompute_damped_inverse: bool,
  relative: bool = False,
) -> EigenPreconditioner:
  """Eigendecomposes one layer's A and G (float32), stored as ``dtype``."""
  return assemble(
    eigh_factor(factors.activation_factor, damping),
    eigh_factor(factors.gradient_factor, damping),
    damping,
    dtype,
    precompute_damped_inverse,
    relative,
  )


def is_finite(preconditioner: EigenPreconditioner) -> jax.Array:
  """Whether a decomposition came out finite (bool scalar), in O(d²).

  ``Σ Q_A·d_A + Σ Q_G·d_G (+ Σ damped_inverse)``, products taken column by
  column: every column of an orthogonal ``Q`` has a nonzero entry, so a
  NaN/±Inf eigenvalue, like one in ``Q``, makes its sum non-finite. Summing
  ``[d, d]`` products rather than the ``[d]`` eigenvalues on their own keeps
  XLA:CPU from compiling a windowed tree reduction per vector (see the
  design notes, *Compile time*).
  """
  totals = [
    jnp.sum(
      vectors.astype(DECOMPOSITION_DTYPE)
      * values.astype(DECOMPOSITION_DTYPE)[None, :]
    )
    for vectors, values in (
      (
        preconditioner.activation_eigenvectors,
        preconditioner.activation_eigenvalues,
      ),
      (
        preconditioner.gradient_eigenvectors,
        preconditioner.gradient_eigenvalues,
      ),
    )
  ]
  if preconditioner.damped_inverse is not None:
    totals.append(
      jnp.sum(preconditioner.damped_inverse, dtype=DECOMPOSITION_DTYPE)
    )
  return jnp.isfinite(sum(totals))


def are_finite(
  preconditioners: Sequence[EigenPreconditioner],
) -> list[jax.Array]:
  """``[is_finite(p) for p in preconditioners]``: bool scalars."""
  return [is_finite(p) for p in preconditioners]


def precondition(
  preconditioner: EigenPreconditioner,
  gradient: jax.Array | FactoredGradient,
  damping: jax.Array,
  reshard: Reshard = no_reshard,
  relative: bool = False,
) -> jax.Array:
  """``P = Q_A [(Q_Aᵀ ∇ Q_G) ⊙ 1/(outer(d_A, d_G) + λ)] Q_Gᵀ``, float32.

  ``∇ [dA, dG]`` dense or factored (``gradient_matrix.sandwich``: the first
  pair of products only; the scaled middle is dense). ``reshard(x, axis)`` is
  applied to each ``[dA, dG]`` operand before a product contracting its
  ``axis`` (see ``Reshard``). The frozen ``damped_inverse`` when stored, else
  ``damped_inverse(d_A, d_G, λ, relative)`` with the current λ.
  """
  # Eigenbases as stored: ``sandwich`` multiplies in ``product_dtype``.
  q_a = preconditioner.activation_eigenvectors
  q_g = preconditioner.gradient_eigenvectors
  rotated = sandwich(q_a.T, gradient, q_g, reshard)
  if preconditioner.damped_inverse is not None:
    scale = preconditioner.damped_inverse.astype(DECOMPOSITION_DTYPE)
  else:
    scale = damped_inverse(
      preconditioner.activation_eigenvalues,
      preconditioner.gradient_eigenvalues,
      damping,
      relative,
    )
  return sandwich(q_a, rotated * scale, q_g.T, reshard)
