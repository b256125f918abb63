"""EKFAC: the eigen method's scaling re-estimated in the Kronecker eigenbasis.

K-FAC's eigen method preconditions a layer's gradient matrix ``∇ [dA, dG]``
with ``Q_A [(Q_Aᵀ ∇ Q_G) / (outer(d_A, d_G) + λ)] Q_Gᵀ``: in the Kronecker
eigenbasis ``Q = Q_A ⊗ Q_G`` the curvature is taken to be diagonal with
entries ``d_A,i · d_G,j``. EKFAC keeps the basis but replaces those entries by
the second moments of the gradient rows expressed in it,

    S_ij = E_n[(Q_Aᵀ a_n)_i² (Q_Gᵀ g_n)_j²],

the best diagonal approximation of ``E_n[vec(a_n g_nᵀ) vec(a_n g_nᵀ)ᵀ]`` in
that basis in Frobenius norm (``S = outer(d_A, d_G)`` when ``a`` and ``g``
are independent). ``S`` is a running average, updated on factor steps,

    S ← d·S + (1 − d)·S_batch,   S_batch = (Ãᵀ)² (G̃)² / N  (squares entrywise),

with ``Ã = a Q_A [N, dA]``, ``G̃ = g Q_G [N, dG]`` the rows (``a_n``: a layer
input with the bias's 1, ``g_n``: its output cotangent, each with the scale
its factor gets, ``factors.batch``). When the eigenbases change, ``S`` is
carried into the new ones (``reproject``), and the gradient is preconditioned
by

    P = Q_A [(Q_Aᵀ ∇ Q_G) / (S + λ)] Q_Gᵀ = (Q (diag vec(S) + λI) Qᵀ)⁻¹ vec(∇).

Cost per block and factor step: ``2N(dA² + dG²)`` FLOPs for the rotations and
``2N·dA·dG`` for ``S_batch`` (about the gradient's own ``aᵀg``); at a
refresh, ``2(dA³ + dG³) + 2dA·dG(dA + dG)`` for ``reproject``; memory one
float32 ``[dA, dG]`` per block (the kernel's size). The rows are the
factors' rows: the examples of a dense layer, every position of a sequence.

References:
  George et al., `Fast Approximate Natural Gradient Descent in a
  Kronecker-factored Eigenbasis <https://arxiv.org/abs/1806.03884>`_, NeurIPS
  2018.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kfac_jax import linalg
from kfac_jax.preconditioning.eigen import (
  DECOMPOSITION_DTYPE,
  EigenPreconditioner,
  mean_or_one,
)


def init_scales(activation_dim: int, gradient_dim: int) -> jax.Array:
  """``S`` of identity factors, ``outer(1, 1)``: ``[dA, dG]`` float32."""
  return jnp.ones((activation_dim, gradient_dim), DECOMPOSITION_DTYPE)


def kfac_scales(preconditioner: EigenPreconditioner) -> jax.Array:
  """K-FAC's own scaling ``outer(d_A, d_G)`` ``[dA, dG]``, float32."""
  return (
    preconditioner.activation_eigenvalues.astype(DECOMPOSITION_DTYPE)[:, None]
    * preconditioner.gradient_eigenvalues.astype(DECOMPOSITION_DTYPE)[None, :]
  )


def batch_scales(
  calls: Sequence[tuple[jax.Array, jax.Array, float]],
  preconditioner: EigenPreconditioner,
) -> jax.Array:
  """``S_batch [dA, dG]`` of one block, summed over the layer's calls.

  Args:
    calls: per call of the layer, ``(a [N, dA], g [N, dG], scale)``: its rows
      and the product of its A and G scales (``factors.batch.dense_calls``).
    preconditioner: the block's eigenbases ``Q_A``, ``Q_G``.
  """
  q_a = preconditioner.activation_eigenvectors.astype(DECOMPOSITION_DTYPE)
  q_g = preconditioner.gradient_eigenvectors.astype(DECOMPOSITION_DTYPE)
  total = None
  for activation, gradient, scale in calls:
    rotated_a = jnp.square(activation.astype(DECOMPOSITION_DTYPE) @ q_a)
    rotated_g = jnp.square(gradient.astype(DECOMPOSITION_DTYPE) @ q_g)
    term = linalg.contract_rows(rotated_a, rotated_g) * (
      scale / activation.shape[0]
    )
    total = term if total is None else total + term
  assert total is not None  # a captured layer was called at least once
  return total


def reproject(
  scales: jax.Array, old: EigenPreconditioner, new: EigenPreconditioner
) -> jax.Array:
  """``S`` of the basis ``old`` carried into ``new``: ``R_A S R_Gᵀ``.

  ``R = (Q_newᵀ Q_old)²`` entrywise, a doubly stochastic matrix for
  orthogonal bases: taking the rotated entries as uncorrelated, their second
  moments mix with these weights (exact for the diagonal part; the identity
  when the basis did not change, a permutation for a re-ordered one).
  """

  def mixing(new_q: jax.Array, old_q: jax.Array) -> jax.Array:
    return jnp.square(
      new_q.astype(DECOMPOSITION_DTYPE).T @ old_q.astype(DECOMPOSITION_DTYPE)
    )

  r_a = mixing(new.activation_eigenvectors, old.activation_eigenvectors)
  r_g = mixing(new.gradient_eigenvectors, old.gradient_eigenvectors)
  return r_a @ scales @ r_g.T


def with_scales(
  preconditioner: EigenPreconditioner,
  scales: jax.Array,
  damping: jax.Array,
  relative: bool = False,
) -> EigenPreconditioner:
  """``preconditioner`` whose ``eigen.precondition`` gives EKFAC's ``P``.

  Its ``damped_inverse`` becomes ``1/(S + λ)``, so
  ``eigen.precondition`` computes ``Q_A [(Q_Aᵀ ∇ Q_G) / (S + λ)] Q_Gᵀ``;
  ``relative``: ``1/(S / mean(S) + λ)``, as the eigen method's relative
  damping normalizes ``outer(d_A, d_G)``.
  """
  if relative:
    scales = scales / mean_or_one(scales)
  return preconditioner._replace(damped_inverse=1.0 / (scales + damping))
