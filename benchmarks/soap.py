"""SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's factors.

"SOAP: Improving and Stabilizing Shampoo using Adam" (arXiv:2409.11321),
Algorithms 3 and 4, as the race's baseline (no optax release up to 0.2.8
has it). For a parameter ``W`` with gradient ``G``, every axis ``i`` of
size 2..``max_precond_dim`` keeps a Shampoo factor, for a matrix
``L = EMA(G Gᵀ)`` and ``R = EMA(Gᵀ G)``; for any number of axes
``F_i = EMA(G_(i) G_(i)ᵀ)`` with ``G_(i)`` the mode-``i`` unfolding (the
paper's code's default, ``merge_dims=False``), and an orthonormal basis
``Q_i`` of its eigenvectors. One step, with ``x ×ᵢ Q`` the product of axis
``i`` with ``Q`` (``Qᵀ G Q`` for a matrix):

1. ``G' = G ×₀ Q₀ᵀ ×₁ Q₁ᵀ ...``, the gradient in the eigenbasis;
2. Adam there: ``M ← β₁M + (1 − β₁)G``, ``V ← β₂V + (1 − β₂)G'²`` and
   ``N' = (M ×ᵢ Qᵢᵀ) / (√V + ε) · √(1 − β₂ᵏ)/(1 − β₁ᵏ)`` (step ``k``);
3. ``N = N' ×₀ Q₀ ×₁ Q₁ ...``, the update in the parameters' basis;
4. ``F_i ← β_s F_i + (1 − β_s) G_(i) G_(i)ᵀ``;
5. every ``precondition_frequency`` steps, each ``Q_i`` is refreshed by
   one step of power iteration, ``Q_i ← qr(F_i Q_i)`` with the columns
   first sorted by the estimated eigenvalues ``diag(Q_iᵀ F_i Q_i)``
   (descending), and ``V``'s axis ``i`` permuted alike (Algorithm 4); or
   by a full ``eigh`` (``refresh="eigh"``), leaving ``V`` as it is.

The first call only sets the factors and their bases (``eigh``) and
returns zeros: as in the paper's code, no step uses a basis computed from
its own gradient. ``M`` is kept in the eigenbasis and rotated into the new
basis at each refresh, ``M' ← M' ×ᵢ (Q_iᵀ Q_i_new)`` (what optax's
``contrib.soap`` on its main branch does), which equals the paper's ``M``
kept in the parameters' basis and projected every step, at the cost of a
rotation per refresh instead of a projection per step. 1-D parameters and
axes without a factor are plain Adam (the paper's ``precondition_1d=False``).
Written from the paper; no code is taken from its repository or optax's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Per parameter, one entry per axis: a [n, n] array, or None where the axis
# has no factor (plain Adam along it).
AxisMatrices = tuple[jax.Array | None, ...]
Refresh = Literal["qr", "eigh"]
_HIGHEST = jax.lax.Precision.HIGHEST


class ScaleBySoapState(NamedTuple):
  """``scale_by_soap``'s state.

  Attributes:
    count: calls so far (the first sets the factors and bases only).
    mu: Adam's first moment ``M``, in the eigenbasis (as the parameters).
    nu: Adam's second moment ``V``, in the eigenbasis (as the parameters).
    factors: per parameter, per axis, the running ``G_(i) G_(i)ᵀ`` or None.
    bases: per parameter, per axis, the eigenbasis ``Q_i`` or None.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  factors: Any
  bases: Any


def _has_factor(shape: Sequence[int], axis: int, max_precond_dim: int) -> bool:
  """Whether axis ``axis`` of a parameter of ``shape`` keeps a factor: the
  parameter has ≥ 2 axes and the axis is no larger than the bound (a
  size-1 axis has nothing to rotate)."""
  return len(shape) >= 2 and 1 < shape[axis] <= max_precond_dim


def _empty_factors(param: jax.Array, max_precond_dim: int) -> AxisMatrices:
  return tuple(
    jnp.zeros((n, n), jnp.float32)
    if _has_factor(param.shape, i, max_precond_dim)
    else None
    for i, n in enumerate(param.shape)
  )


def _mode_product(x: jax.Array, matrix: jax.Array, axis: int) -> jax.Array:
  """``x ×ᵢ matrix``: axis ``axis`` of ``x`` contracted with ``matrix``'s
  rows, the result's axis in the same place."""
  product = jnp.tensordot(x, matrix, axes=((axis,), (0,)), precision=_HIGHEST)
  return jnp.moveaxis(product, -1, axis)


def _project(x: jax.Array, bases: AxisMatrices) -> jax.Array:
  """``x`` in the eigenbasis: ``x ×ᵢ Q_i`` (``Q_iᵀ`` applied to axis i)."""
  for axis, basis in enumerate(bases):
    if basis is not None:
      x = _mode_product(x, basis, axis)
  return x


def _project_back(x: jax.Array, bases: AxisMatrices) -> jax.Array:
  """``x`` back in the parameters' basis: ``x ×ᵢ Q_iᵀ``."""
  for axis, basis in enumerate(bases):
    if basis is not None:
      x = _mode_product(x, basis.T, axis)
  return x


def _gram(g: jax.Array, axis: int) -> jax.Array:
  """``G_(i) G_(i)ᵀ``: every axis but ``axis`` summed over."""
  others = tuple(a for a in range(g.ndim) if a != axis)
  return jnp.tensordot(g, g, axes=(others, others), precision=_HIGHEST)


def _update_factors(
  g: jax.Array, factors: AxisMatrices, decay: float
) -> AxisMatrices:
  return tuple(
    None if f is None else decay * f + (1 - decay) * _gram(g, axis)
    for axis, f in enumerate(factors)
  )


def _eigh_basis(factor: jax.Array | None) -> jax.Array | None:
  """Eigenvectors by decreasing eigenvalue (the paper's order)."""
  if factor is None:
    return None
  return jnp.flip(jnp.linalg.eigh(factor)[1], axis=1)


def _power_qr(
  factor: jax.Array, basis: jax.Array, nu: jax.Array, axis: int
) -> tuple[jax.Array, jax.Array]:
  """Algorithm 4 on one axis: the columns sorted by ``diag(Qᵀ F Q)``
  (descending), ``nu``'s axis permuted alike, then ``qr(F Q)``."""
  product = jnp.matmul(factor, basis, precision=_HIGHEST)
  estimates = jnp.sum(basis * product, axis=0)  # diag(Qᵀ F Q), one product
  order = jnp.argsort(-estimates)
  q, _ = jnp.linalg.qr(product[:, order])
  return q, jnp.take(nu, order, axis=axis)


def _refresh(
  factors: AxisMatrices,
  bases: AxisMatrices,
  mu: jax.Array,
  nu: jax.Array,
  refresh: Refresh,
) -> tuple[AxisMatrices, jax.Array, jax.Array]:
  """New bases; ``mu`` rotated into them, ``nu`` permuted (QR) or kept."""
  new_bases = []
  for axis, (factor, basis) in enumerate(zip(factors, bases)):
    if factor is None:
      new_bases.append(None)
    elif refresh == "eigh":
      new_bases.append(_eigh_basis(factor))
    else:
      q, nu = _power_qr(factor, basis, nu, axis)
      new_bases.append(q)
  # M' in the old basis -> M in the parameters' basis -> the new basis.
  mu = _project(_project_back(mu, bases), tuple(new_bases))
  return tuple(new_bases), mu, nu


def _check(
  b1: float,
  b2: float,
  shampoo_decay: float | None,
  eps: float,
  precondition_frequency: int,
  max_precond_dim: int,
  refresh: str,
) -> None:
  for name, value in (("b1", b1), ("b2", b2), ("shampoo_decay", shampoo_decay)):
    if value is not None and not 0 <= value < 1:
      raise ValueError(
        f"scale_by_soap: {name} must be in [0, 1); got {value!r}."
      )
  if not eps > 0:
    raise ValueError(f"scale_by_soap: eps must be > 0; got {eps!r}.")
  for name, value in (
    ("precondition_frequency", precondition_frequency),
    ("max_precond_dim", max_precond_dim),
  ):
    if not (isinstance(value, int) and value >= 1):
      raise ValueError(
        f"scale_by_soap: {name} must be a positive integer; got {value!r}."
      )
  if refresh not in ("qr", "eigh"):
    raise ValueError(
      f"scale_by_soap: refresh must be 'qr' or 'eigh'; got {refresh!r}."
    )


def scale_by_soap(
  b1: float = 0.95,
  b2: float = 0.95,
  shampoo_decay: float | None = None,
  eps: float = 1e-8,
  precondition_frequency: int = 10,
  max_precond_dim: int = 10000,
  refresh: Refresh = "qr",
) -> optax.GradientTransformation:
  """SOAP's direction ``N`` (module docstring), to be scaled by ``-lr``.

  Args:
    b1: Adam's first-moment decay β₁ (the paper's default 0.95).
    b2: Adam's second-moment decay β₂ (0.95).
    shampoo_decay: the factors' decay β_s; ``None``: β₂, as the paper.
    eps: added to ``√V``.
    precondition_frequency: the bases are refreshed after every this many
      Adam steps (10).
    max_precond_dim: axes larger than this keep no factor (10000).
    refresh: ``"qr"``, one step of power iteration and a QR (Algorithm 4),
      or ``"eigh"``, a full eigendecomposition.

  Returns:
    An ``optax.GradientTransformation`` with a ``ScaleBySoapState``.
  """
  _check(
    b1, b2, shampoo_decay, eps, precondition_frequency, max_precond_dim, refresh
  )
  decay = b2 if shampoo_decay is None else shampoo_decay

  def init_fn(params: optax.Params) -> ScaleBySoapState:
    empty = lambda: jax.tree.map(
      lambda p: _empty_factors(p, max_precond_dim), params
    )
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
    # The bases are set by the first call; zeros hold their place (arrays
    # of their own: a train step may donate the state's buffers).
    return ScaleBySoapState(
      count=jnp.zeros([], jnp.int32),
      mu=jax.tree.map(zeros, params),
      nu=jax.tree.map(zeros, params),
      factors=empty(),
      bases=empty(),
    )

  def first_call(updates, state):
    """The factors from the first gradient, their ``eigh`` bases, no step."""
    factors = jax.tree.map(
      lambda g, f: _update_factors(g, f, decay), updates, state.factors
    )
    bases = jax.tree.map(
      lambda _, f: tuple(map(_eigh_basis, f)), updates, factors
    )
    zeros = jax.tree.map(jnp.zeros_like, updates)
    return zeros, state._replace(factors=factors, bases=bases)

  def adam_step(updates, state):
    """Steps 1-5 of the module docstring; ``k = count`` (1 on the 2nd call)."""
    k = state.count.astype(jnp.float32)
    rotated = jax.tree.map(_project, updates, state.bases)
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, rotated)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, rotated)
    correction = jnp.sqrt(1 - b2**k) / (1 - b1**k)
    directions = jax.tree.map(
      lambda g, m, v, q: (
        correction * _project_back(m / (jnp.sqrt(v) + eps), q)
      ).astype(g.dtype),
      updates,
      mu,
      nu,
      state.bases,
    )
    factors = jax.tree.map(
      lambda g, f: _update_factors(g, f, decay), updates, state.factors
    )

    def refreshed():
      # Per parameter (the gradients' leaves) a (bases, mu, nu) triple,
      # then the three trees.
      treedef = jax.tree.structure(updates)
      triples = [
        _refresh(f, q, m, v, refresh)
        for f, q, m, v in zip(
          *(treedef.flatten_up_to(t) for t in (factors, state.bases, mu, nu))
        )
      ]
      return tuple(treedef.unflatten(part) for part in zip(*triples))

    bases, mu, nu = jax.lax.cond(
      state.count % precondition_frequency == 0,
      refreshed,
      lambda: (state.bases, mu, nu),
    )
    return directions, ScaleBySoapState(state.count, mu, nu, factors, bases)

  def update_fn(updates, state, params=None):
    del params
    directions, state = jax.lax.cond(
      state.count == 0, first_call, adam_step, updates, state
    )
    return directions, state._replace(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def soap(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.95,
  b2: float = 0.95,
  weight_decay: float = 0.01,
  shampoo_decay: float | None = None,
  eps: float = 1e-8,
  precondition_frequency: int = 10,
  max_precond_dim: int = 10000,
  refresh: Refresh = "qr",
) -> optax.GradientTransformation:
  """SOAP with decoupled weight decay (the paper's defaults, lr aside).

  ``optax.chain(scale_by_soap(...), add_decayed_weights(weight_decay),
  scale_by_learning_rate(learning_rate))``: the paper's ``W ← W − η(N +
  wd·W)``, with the weight decay on the parameters before the step (as
  ``optax.adamw``; the paper's code decays the stepped ones, a difference
  of order ``η²``).

  Args:
    learning_rate: η, constant or schedule (the paper's default 3e-3).
    b1, b2, shampoo_decay, eps, precondition_frequency, max_precond_dim,
      refresh: ``scale_by_soap``'s.
    weight_decay: the decoupled weight decay (0.01).

  Returns:
    An ``optax.GradientTransformation``.
  """
  return optax.chain(
    scale_by_soap(
      b1,
      b2,
      shampoo_decay,
      eps,
      precondition_frequency,
      max_precond_dim,
      refresh,
    ),
    optax.add_decayed_weights(weight_decay),
    optax.scale_by_learning_rate(learning_rate),
  )
