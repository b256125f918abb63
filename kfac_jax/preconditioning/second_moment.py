"""The gradient's running second moment in K-FAC's Kronecker eigenbasis.

K-FAC's eigen method scales a layer's rotated gradient
``R = Q_Aᵀ ∇ Q_G [dA, dG]`` by ``1 / (outer(d_A, d_G) + λ)``: the curvature
along each direction of the eigenbasis ``Q = Q_A ⊗ Q_G`` is taken from the
factors, refreshed with them. Here it is taken, as Adam takes it along the
coordinate axes and SOAP in Shampoo's eigenbasis, from the running second
moment of the mini-batch gradient in that basis, updated every step,

    v ← β·v + (1 − β)·R²,        v̂ = v / (1 − β^(t+1))    (entrywise),

and the gradient is preconditioned by

    P = Q_A [R / (√v̂ + λ)] Q_Gᵀ,

or, with relative damping, by ``R / (√v̂ / mean(√v̂) + λ)``: λ is then a
fraction of the layer's mean RMS and ``P`` keeps the scale of ``∇``, so the
rate and the KL clip mean what they mean for K-FAC's own scaling (the bias
correction, a common factor, cancels there). The bases are the factors'
(refreshed every ``inv_update_steps``); at a refresh ``v`` is carried into
the new bases as EKFAC's ``S`` is (``ekfac.reproject``).

Cost per block and step: two products ``2·dA·dG·(dA + dG)`` FLOPs for ``R``
beside the eigen method's own; memory one float32 ``[dA, dG]`` (the kernel's
size). No per-example rows: it needs no statistics beyond the factors'.

References:
  Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
  <https://arxiv.org/abs/2409.11321>`_, 2024.

  Martens & Grosse, `Optimizing Neural Networks with Kronecker-factored
  Approximate Curvature <https://arxiv.org/abs/1503.05671>`_, ICML 2015.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax.preconditioning.eigen import (
  DECOMPOSITION_DTYPE,
  EigenPreconditioner,
)


def init_moment(activation_dim: int, gradient_dim: int) -> jax.Array:
  """``v = 0`` ``[dA, dG]`` float32 (the bias correction makes up for it)."""
  return jnp.zeros((activation_dim, gradient_dim), DECOMPOSITION_DTYPE)


def rotate(gradient: jax.Array, basis: EigenPreconditioner) -> jax.Array:
  """``R = Q_Aᵀ ∇ Q_G`` ``[dA, dG]`` float32 of ``∇ [dA, dG]``."""
  q_a = basis.activation_eigenvectors.astype(DECOMPOSITION_DTYPE)
  q_g = basis.gradient_eigenvectors.astype(DECOMPOSITION_DTYPE)
  return q_a.T @ gradient.astype(DECOMPOSITION_DTYPE) @ q_g


def update_moment(
  moment: jax.Array,
  gradient: jax.Array,
  basis: EigenPreconditioner,
  decay: jax.Array,
) -> jax.Array:
  """``β·v + (1 − β)·R²`` ``[dA, dG]``, with ``R = rotate(gradient, basis)``.

  Args:
    moment: ``v`` in ``basis`` ``[dA, dG]``.
    gradient: the block's gradient matrix ``∇ [dA, dG]``.
    basis: the block's eigenbases ``Q_A``, ``Q_G``.
    decay: β in [0, 1).
  """
  return decay * moment + (1 - decay) * jnp.square(rotate(gradient, basis))


def root_mean_square(
  moment: jax.Array, decay: jax.Array, count: jax.Array
) -> jax.Array:
  """``√v̂ = √(v / (1 − β^(count+1)))`` ``[dA, dG]``: the scaling that
  ``ekfac.with_scales`` applies in place of EKFAC's ``S``.

  Args:
    moment: ``v`` after ``count + 1`` updates (``count``: the steps before).
    decay: β in [0, 1).
    count: the optimizer step, int32.
  """
  correction = 1 - decay ** (count + 1).astype(DECOMPOSITION_DTYPE)
  return jnp.sqrt(moment / correction)
