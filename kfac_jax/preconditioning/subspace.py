"""Eigenbases refreshed by warm-started subspace iteration.

Between two decompositions a running factor ``F ← d·F + (1 − d)·F_batch``
moves little, so its previous eigenbasis ``Q₀`` is close to the new one.
Instead of a full ``eigh``, the eigen method's ``eigen_solver="subspace"``
refreshes it by ``k`` steps of simultaneous (subspace) iteration, as SOAP
refreshes its Shampoo eigenbases:

    ρ = diag(Qᵀ F Q),   Q ← Q[:, argsort(−ρ)],   Q ← qr(F Q),

then eigenvalues from the Rayleigh quotients of the result,
``d = max(diag(Qᵀ F Q), 0)``. With ``k = 0`` the basis is kept as it is
(its columns sorted) and only the eigenvalues are refreshed, for one
``[d, d]`` product: the refresh by drift, which pays while the basis holds.
Sorting the columns by decreasing ``ρ`` before each QR keeps column ``j``
on the ``j``-th eigenvector: QR orthogonalizes each column against those
before it, which removes from the small eigenvalues' columns the large
eigenvalues' components that ``F Q`` amplifies.
A step costs two ``[d, d]`` products and one QR (``O(d³)`` FLOPs, but a
fraction of ``eigh``'s time: ``benchmarks/decomposition_time.py``).

The result is checked: ``F ≈ Q diag(ρ) Qᵀ`` is off by exactly the
off-diagonal part of ``B = Qᵀ F Q``, so its *drift*

    δ = ‖F − Q diag(ρ) Qᵀ‖_F / ‖F‖_F = √(1 − Σⱼ ρⱼ² / ‖F‖²_F)

(``‖B‖_F = ‖F‖_F`` for orthogonal ``Q``) costs ``O(d²)``. A factor with
``δ`` above a threshold (an abrupt change of ``F``), and one whose stored
basis is still the identity of the initial state, is decomposed by a full
``eigh`` instead (``refresh_or_eigh``).

References:
  Vyas et al., `SOAP: Improving and Stabilizing Shampoo using Adam
  <https://arxiv.org/abs/2409.11321>`_, 2024 (its ``get_orthogonal_matrix_QR``).

  Golub & Van Loan, *Matrix Computations*, 4th ed., §8.2.4 (orthogonal
  iteration).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.preconditioning.eigen import DECOMPOSITION_DTYPE, eigh_factor

# ‖F − Q diag(ρ) Qᵀ‖_F ≤ 5 % of ‖F‖_F: a basis further off is replaced by
# eigh's (see ``KFACConfig.subspace_drift_threshold``).
DEFAULT_DRIFT_THRESHOLD = 0.05


class SubspaceSolver(NamedTuple):
  """``scale_by_kfac(eigen_solver=SubspaceSolver(...))``: the eigen method's
  eigenbases refreshed by subspace iteration (``eigen_solver="subspace"``
  is ``SubspaceSolver()``).

  Attributes:
    steps: k ≥ 0 steps of ``Q ← qr(F·Q)`` per refresh; 0 keeps the basis
      and refreshes its eigenvalues ``diag(Qᵀ F Q)`` only, until the drift
      passes ``drift_threshold`` and ``eigh`` replaces it.
    drift_threshold: in ``(0, 1]``: a refresh with
      ``‖F − Q diag(d) Qᵀ‖_F > drift_threshold·‖F‖_F`` is replaced by a
      full ``eigh`` (and counted in the state's ``eigh_fallbacks``).

  Example:
    >>> import kfac_jax
    >>> tx = kfac_jax.scale_by_kfac(
    ...     eigen_solver=kfac_jax.SubspaceSolver(steps=2))
  """

  steps: int = 1
  drift_threshold: float = DEFAULT_DRIFT_THRESHOLD


def rayleigh_quotients(basis: jax.Array, product: jax.Array) -> jax.Array:
  """``diag(Qᵀ F Q)`` from ``Q`` and ``F Q`` (``[d, d]``): ``[d]``, in O(d²)."""
  return jnp.sum(basis * product, axis=0)


def drift(factor: jax.Array, quotients: jax.Array) -> jax.Array:
  """``‖offdiag(Qᵀ F Q)‖_F / ‖F‖_F`` from ``F`` and ``ρ = diag(Qᵀ F Q)``.

  Exact for an orthogonal ``Q``; 0 for ``F = 0``. Computed from squared
  norms, it reads about ``√(d·ε₃₂)`` where the true value is 0.
  """
  total = jnp.sum(jnp.square(factor))
  off = jnp.maximum(total - jnp.sum(jnp.square(quotients)), 0.0)
  return jnp.where(
    total > 0, jnp.sqrt(off / jnp.where(total > 0, total, 1.0)), 0.0
  )


def subspace_refresh(
  factor: jax.Array, basis: jax.Array, steps: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``steps`` steps of ``Q ← qr(F Q[:, argsort(−ρ)])`` from ``basis``.

  Args:
    factor: ``F``, symmetric ``[d, d]`` (any float dtype; run in float32).
    basis: ``Q₀``, the previous eigenbasis ``[d, d]`` (columns in any order).
    steps: ``k ≥ 0`` (0: ``Q₀`` with its columns sorted).

  Returns:
    ``(d, Q, δ)``: the Rayleigh quotients clamped at 0 ``[d]``, the basis
    ``[d, d]`` with its columns by decreasing quotient, and the drift
    (``drift``) of the result.
  """
  f = factor.astype(DECOMPOSITION_DTYPE)
  f = (f + f.T) / 2  # Round-off in the factor products breaks the symmetry.
  q = basis.astype(DECOMPOSITION_DTYPE)
  product = f @ q
  for _ in range(steps):
    order = jnp.argsort(-rayleigh_quotients(q, product))
    q, _ = jnp.linalg.qr(product[:, order])
    product = f @ q
  quotients = rayleigh_quotients(q, product)
  if steps == 0:
    order = jnp.argsort(-quotients)
    q, quotients = q[:, order], quotients[order]
  return jnp.maximum(quotients, 0.0), q, drift(f, quotients)


def is_identity(basis: jax.Array) -> jax.Array:
  """Whether ``basis`` is exactly ``I`` (the state before any decomposition)."""
  return jnp.all(basis == jnp.eye(basis.shape[0], dtype=basis.dtype))


def refresh_or_eigh(
  factor: jax.Array,
  refreshed: tuple[jax.Array, ...],
  basis: jax.Array,
  threshold: float,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
  """``subspace_refresh``'s ``(d, Q)``, or ``eigh_factor(F)``'s where needed.

  ``eigh`` replaces the refresh where the stored ``basis`` is the identity
  (first decomposition, or a state restored into another layout) or where
  the refresh drifted past ``threshold``. Runs as a ``lax.cond``, so a
  factor that keeps its refresh pays for no ``eigh``: call it per factor,
  outside ``vmap`` (which would turn the cond into a select).

  Returns:
    ``((d, Q), fell_back)``, ``fell_back`` an int32 scalar: 1 where the
    drift (not a first decomposition) called for ``eigh``.
  """
  eigenvalues, eigenvectors, refreshed_drift = refreshed
  fresh = is_identity(basis)
  drifted = refreshed_drift > threshold
  result = lax.cond(
    fresh | drifted,
    lambda: eigh_factor(factor, jnp.zeros([], DECOMPOSITION_DTYPE)),
    lambda: (eigenvalues, eigenvectors),
  )
  return result, (drifted & ~fresh).astype(jnp.int32)
