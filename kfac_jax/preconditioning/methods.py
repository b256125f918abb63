"""The eigen and inverse methods behind one interface."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax import finite
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import batched, eigen, inverse, subspace
from kfac_jax.preconditioning.batched import Crop, FactorFn, Results
from kfac_jax.preconditioning.subspace import SubspaceSolver

Preconditioner = eigen.EigenPreconditioner | inverse.InversePreconditioner


class Method(NamedTuple):
  """How a layer's preconditioner is made and applied.

  Attributes:
    init: ``(activation_dim, gradient_dim) -> Preconditioner`` of identity
      factors.
    factor_fn: decomposition of one factor ``[d, d]`` (batched by
      ``batched.decompose_layers``): ``factor_fn(F, λ)``, or with
      ``warm_start``, ``factor_fn(F, λ, warm start [d, d])``.
    assemble: ``(factor_fn(A), factor_fn(G), λ) -> Preconditioner``.
    precondition: ``(Preconditioner, ∇ [dA, dG], λ[, reshard]) -> P [dA, dG]``
      (``reshard``: see ``gradient_matrix.Reshard``; ``∇`` may be a
      ``gradient_matrix.FactoredGradient``).
    are_finite: ``[Preconditioner] -> [bool scalar]``, whether each
      layer's decomposition came out finite (a non-finite one is rejected).
    decomposition_batch_size: factors decomposed at once per size
      (``batched.decompose_layers``); ``None``: all of them.
    crop: ``factor_fn``'s results for ``diag(F, I)`` cut back to those for
      ``F`` (``batched.Crop``), where that is exact; factors are then padded
      to shared sizes. ``None``: never padded.
    decompose_each_on: platforms where each factor is decomposed by a call
      of its own, not stacked by size (``batched.decompose_layers``).
    warm_start: ``Preconditioner -> (start for A, start for G)``, what
      ``factor_fn`` refines (the previous eigenbases); ``None``: it starts
      from nothing.
    finish: ``(F, factor_fn(F, …), start) -> (results for assemble,
      fell_back int32)``, run per factor outside ``vmap`` (it may
      ``lax.cond``); ``None``: ``factor_fn``'s results as they are.
    prepare: ``({layer: LayerFactors}, λ) -> (factors, λ)`` handed to
      ``factor_fn`` instead, before anything else (the inverse method's
      relative damping: ``inverse.normalized`` factors and ``√λ``);
      ``None``: as they are.
    keep: ``(ok, candidate, previous) -> Preconditioner``, the candidate
      where ``ok`` else the previous one: ``finite.keep`` (a ``lax.cond``)
      for the eigen method, whose leaves come from ``eigh``, a library call
      nothing fuses with; ``finite.select`` for the inverse method, whose
      leaves XLA computes and fuses the selects into.
  """

  init: Callable[[int, int], Preconditioner]
  factor_fn: FactorFn
  # Typed by the method's own preconditioner type, which this record
  # does not carry: ``...`` for their arguments.
  assemble: Callable[..., Preconditioner]
  precondition: Callable[..., jax.Array]
  are_finite: Callable[..., Sequence[jax.Array]]
  decomposition_batch_size: int | None = None
  crop: Crop | None = None
  decompose_each_on: tuple[str, ...] = batched.EACH_ON_CPU
  warm_start: Callable[[Preconditioner], tuple[jax.Array, jax.Array]] | None = (
    None
  )
  finish: (
    Callable[[jax.Array, Results, jax.Array], tuple[Results, jax.Array]] | None
  ) = None
  keep: Callable[
    [jax.Array, Preconditioner, Preconditioner], Preconditioner
  ] = finite.select
  prepare: (
    Callable[
      [Mapping[str, LayerFactors], jax.Array],
      tuple[Mapping[str, LayerFactors], jax.Array],
    ]
    | None
  ) = None


def _eigenbases(
  preconditioner: eigen.EigenPreconditioner,
) -> tuple[jax.Array, jax.Array]:
  return (
    preconditioner.activation_eigenvectors,
    preconditioner.gradient_eigenvectors,
  )


def make_method(
  use_eigen: bool,
  dtype: jnp.dtype,
  precompute_damped_inverse: bool,
  decomposition_batch_size: int | None = None,
  solver: SubspaceSolver | None = None,
  relative_damping: bool = False,
) -> Method:
  """The eigen (``use_eigen``) or inverse method, storing results as ``dtype``.

  ``solver``: the eigen method refreshes its eigenbases by subspace
  iteration (``SubspaceSolver``); ``None``: a full ``eigh`` each time.
  ``relative_damping``: the eigen method divides the eigenvalues by their
  means before adding λ (``eigen``'s module docstring); the inverse method is
  inverts ``inverse.normalized`` factors with ``√λ`` added to each
  (``Method.prepare``).
  """
  if use_eigen and solver is not None:
    return make_method(
      True,
      dtype,
      precompute_damped_inverse,
      decomposition_batch_size,
      relative_damping=relative_damping,
    )._replace(
      factor_fn=lambda factor, damping, start: subspace.subspace_refresh(
        factor, start, solver.steps
      ),
      warm_start=_eigenbases,
      finish=lambda factor, refreshed, start: subspace.refresh_or_eigh(
        factor, refreshed, start, solver.drift_threshold
      ),
    )
  if use_eigen:
    return Method(
      init=functools.partial(
        eigen.init_eigen,
        dtype=dtype,
        precompute_damped_inverse=precompute_damped_inverse,
      ),
      factor_fn=eigen.eigh_factor,
      assemble=functools.partial(
        eigen.assemble,
        dtype=dtype,
        precompute_damped_inverse=precompute_damped_inverse,
        relative=relative_damping,
      ),
      precondition=functools.partial(
        eigen.precondition, relative=relative_damping
      ),
      are_finite=eigen.are_finite,
      keep=finite.keep,
      decomposition_batch_size=decomposition_batch_size,
      # cuSOLVER's stacked eigh is slower than one call per factor.
      decompose_each_on=(*batched.EACH_ON_CPU, "cuda"),
    )
  return Method(
    init=functools.partial(inverse.init_inverse, dtype=dtype),
    factor_fn=inverse.damped_inverse,
    assemble=functools.partial(inverse.assemble, dtype=dtype),
    precondition=inverse.precondition,
    are_finite=inverse.are_finite,
    decomposition_batch_size=decomposition_batch_size,
    crop=inverse.crop,
    prepare=_normalized if relative_damping else None,
  )


def _normalized(
  factors: Mapping[str, LayerFactors], damping: jax.Array
) -> tuple[dict[str, LayerFactors], jax.Array]:
  """The inverse method's relative damping: ``(Â + √λI)⁻¹ ∇ (Ĝ + √λI)⁻¹``
  (``inverse.normalized``)."""
  if not factors:
    return dict(factors), damping
  return inverse.normalized(factors), jnp.sqrt(damping)
