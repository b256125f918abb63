"""The state of ``scale_by_kfac`` and its layout.

``ScaleByKFACState`` holds arrays only, one entry per registered layer;
``AccumulatorState`` the micro-batch sums of gradient accumulation.
``state_partition_specs`` gives a state's ``PartitionSpec``s (factors and
counters replicated, preconditioners as the placement lays them out,
params-shaped parts as the params).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kfac_jax.distribution import placement as placement_lib
from kfac_jax.distribution.placement import (
  DecompositionCounts,
  ShardedPreconditioners,
)
from kfac_jax.factors.running import LayerFactors, factor_dims
from kfac_jax.preconditioning.methods import Preconditioner
from kfac_jax.transform.quadratic_model import QuadraticModelState


class AccumulatorState(NamedTuple):
  """Sums over the micro-batches of the optimizer step in progress.

  Attributes:
    micro_step: micro-batches seen in this optimizer step, in
      ``[0, accumulation_steps)``.
    gradients: sum of the micro-batch gradients (structure of the params).
    factors: sum of the micro-batch factors ``{layer: LayerFactors}`` (float32).
    scales: with ``eigenvalue_correction``, the sum of the micro-batches'
      EKFAC ``S_batch`` in the state's eigenbases ``{layer: [dA, dG]}``;
      else None.
  """

  micro_step: jax.Array
  gradients: Any
  factors: dict[str, LayerFactors]
  scales: dict[str, jax.Array] | None = None


class ScaleByKFACState(NamedTuple):
  """State of ``scale_by_kfac``: arrays only, one entry per registered layer.

  Attributes:
    count: optimizer steps taken (int32 scalar); schedules are called with it.
    factors: running ``{layer: LayerFactors(A, G)}``.
    preconditioners: ``{layer: EigenPreconditioner | InversePreconditioner}``
      from the last decomposition; with ``mesh_axes``, the same packed per
      device in a ``ShardedPreconditioners``.
    accumulator: micro-batch sums when ``accumulation_steps > 1``, else None.
    skipped_factor_updates: factor updates skipped because the batch factors
      held NaN/Inf (int32 scalar).
    rejected_decompositions: per-layer decompositions that came out non-finite
      and were discarded, keeping the previous one (int32 scalar).
    quadratic_model: with ``adaptive``, the damping, previous update and
      step sizes (``QuadraticModelState``); else None.
    eigh_fallbacks: with ``eigen_solver="subspace"``, the factors whose
      subspace refresh drifted past ``subspace_drift_threshold`` and were
      decomposed by ``eigh`` instead (int32 scalar); else None.
    eigenvalue_scales: with ``eigenvalue_correction``, EKFAC's running
      second moments of the gradients in the Kronecker eigenbasis,
      ``{layer: S [activation_dim, gradient_dim]}`` (float32); else None.
  """

  count: jax.Array
  factors: dict[str, LayerFactors]
  preconditioners: dict[str, Preconditioner] | ShardedPreconditioners
  accumulator: AccumulatorState | None
  skipped_factor_updates: jax.Array
  rejected_decompositions: jax.Array
  quadratic_model: QuadraticModelState | None = None
  eigh_fallbacks: jax.Array | None = None
  eigenvalue_scales: dict[str, jax.Array] | None = None


def decomposition_counts(state: ScaleByKFACState) -> DecompositionCounts:
  """The state's counters of decomposition outcomes."""
  fallbacks = state.eigh_fallbacks
  return DecompositionCounts(
    state.rejected_decompositions,
    jnp.zeros([], jnp.int32) if fallbacks is None else fallbacks,
  )


def with_counts(
  state: ScaleByKFACState, counts: DecompositionCounts
) -> ScaleByKFACState:
  """``state`` with ``counts`` (fallbacks only where the state keeps them)."""
  return state._replace(
    rejected_decompositions=counts.rejected,
    eigh_fallbacks=(None if state.eigh_fallbacks is None else counts.fallbacks),
  )


def without_params_shaped(state: ScaleByKFACState) -> ScaleByKFACState:
  """``state`` without its params-shaped parts (accumulated gradients, the
  previous update), which a chain (``optax.multi_transform``) masks."""
  accumulator, model = state.accumulator, state.quadratic_model
  return state._replace(
    accumulator=None
    if accumulator is None
    else accumulator._replace(gradients=None),
    quadratic_model=None
    if model is None
    else model._replace(previous_update=None),
  )


def state_partition_specs(
  state: ScaleByKFACState,
  placement: placement_lib.Placement,
  params_specs_of: Callable[[Any], Any],
) -> ScaleByKFACState:
  """``PartitionSpec``s of a state (or of its ``eval_shape``).

  Factors and counters are replicated; the preconditioners are laid out by
  ``placement``; the params-shaped parts (accumulated gradients, the
  previous update) get ``params_specs_of(part)``.
  """
  replicated = lambda tree: jax.tree.map(lambda _: PartitionSpec(), tree)
  # The state's NamedTuples type their leaves as arrays; the spec tree
  # reuses them with a PartitionSpec at each leaf.
  leaf: Any = PartitionSpec()

  def params_shaped(part: Any) -> Any:
    specs = params_specs_of(part)
    # None: masked whole (K-FAC given none of the params in a
    # multi_transform): the MaskedNodes, no arrays.
    return replicated(part) if specs is None else specs

  dims = factor_dims(state.factors)
  accumulator = state.accumulator
  if accumulator is not None:
    accumulator = AccumulatorState(
      micro_step=leaf,
      gradients=params_shaped(accumulator.gradients),
      factors=replicated(accumulator.factors),
      scales=(
        None if accumulator.scales is None else replicated(accumulator.scales)
      ),
    )
  model = state.quadratic_model
  if model is not None:
    model = QuadraticModelState(
      damping=leaf,
      previous_update=params_shaped(model.previous_update),
      step_sizes=leaf,
      reduction_ratio=leaf,
    )
  return ScaleByKFACState(
    count=leaf,
    factors=replicated(state.factors),
    preconditioners=placement.partition_specs(dims),
    accumulator=accumulator,
    skipped_factor_updates=leaf,
    rejected_decompositions=leaf,
    quadratic_model=model,
    eigh_fallbacks=(None if state.eigh_fallbacks is None else leaf),
    eigenvalue_scales=(
      None
      if state.eigenvalue_scales is None
      else replicated(state.eigenvalue_scales)
    ),
  )


def shapes_and_dtypes(tree: Any) -> Any:
  """``tree`` with each array as ``(shape, dtype)``: equal for like states."""
  return jax.tree.map(
    lambda leaf: (tuple(leaf.shape), jnp.dtype(leaf.dtype)), tree
  )
