"""One K-FAC optimizer step, as functions of the ``KFACConfig``.

``optimizer_step`` runs, for the layers being preconditioned:

1. ``update_factors``: ``F ← d·F + (1 − d)·F_batch`` on factor steps, a
   batch with NaN/Inf skipped, a corrupted running factor restarted;
2. ``guarded_decomposition``: the eigendecompositions (or inverses) on
   decomposition steps, a non-finite one discarded;
3. ``precondition``: ``P`` of every layer's gradient matrix;
4. ``kl_clip``: every ``P`` scaled by ``ν``;

and ``adaptive_step`` turns ``−P`` into the adaptive mode's update. The
constraints of ``pinning`` keep the state where
``get_opt_state_partition_specs`` says it is; ``stats_blocks`` reads the
step's inputs from the captured statistics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax import hyperparameters as hp
from kfac_jax import linalg
from kfac_jax.capture import layers as layers_lib
from kfac_jax.capture.layers import LayerInfo
from kfac_jax.distribution import placement as placement_lib
from kfac_jax.distribution.layout import Dims
from kfac_jax.distribution.placement import DecompositionCounts
from kfac_jax.factors import running
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import ekfac
from kfac_jax.preconditioning import inverse as inverse_lib
from kfac_jax.preconditioning.eigen import EigenPreconditioner
from kfac_jax.preconditioning.gradient_matrix import (
  FactoredGradient,
  divided,
  from_matrix,
  to_matrix,
)
from kfac_jax.preconditioning.kl_clip import kl_clip_scale
from kfac_jax.transform import eigenbasis_scaling as scaling_lib
from kfac_jax.transform import pinning, quadratic_model
from kfac_jax.transform.config import KFACConfig
from kfac_jax.transform.quadratic_model import SplitLoss
from kfac_jax.transform.state import (
  ScaleByKFACState,
  decomposition_counts,
  with_counts,
)

Blocks = dict[str, jax.Array]
# {block: eigenbases} -> {block: EKFAC's S_batch}
# (``stats_blocks.stats_scales``).
BatchScales = Callable[[Mapping[str, EigenPreconditioner]], Blocks]


class StepInputs(NamedTuple):
  """What one ``update`` reads besides the config, state and gradients,
  computed once per update (``scale_by_kfac._update_values``)."""

  # The registered layers.
  layers: Mapping[str, LayerInfo]
  # The layers to precondition.
  active: Sequence[str]
  # {block: (dA, dG)} of every registered layer (``layers.blocks_of``).
  dims: Dims
  # The blocks of ``active`` (``block_names``).
  active_blocks: Sequence[str]
  # {layer: mesh axes} of kernels sharded by ``params_partition_specs``.
  sharded: Mapping[str, tuple[str, ...]]
  # Gives the batch factors of ``active``'s blocks; ``None`` on a step
  # without statistics (``NO_STATS``): no factor update.
  batch_factors: Callable[[], dict[str, LayerFactors]] | None
  # {block: aᵀg} preconditioned in that form instead of the block of the
  # gradients (``gradient_from_stats``), else ``None``.
  factored: Mapping[str, FactoredGradient] | None = None
  # With ``eigenvalue_correction``, gives EKFAC's batch ``S_batch`` of
  # ``active``'s blocks in the given eigenbases (``None`` without
  # statistics).
  batch_scales: BatchScales | None = None


def step_inputs(
  layers: Mapping[str, LayerInfo],
  active: Sequence[str],
  sharded: Mapping[str, tuple[str, ...]],
  batch_factors: Callable[[], dict[str, LayerFactors]] | None,
  factored: Mapping[str, FactoredGradient] | None = None,
  batch_scales: BatchScales | None = None,
  dims: Dims | None = None,
) -> StepInputs:
  """The ``StepInputs`` of ``layers`` and ``active`` (``dims``, if given,
  the ``blocks_of(layers)`` already computed)."""
  return StepInputs(
    layers=layers,
    active=active,
    dims=layers_lib.blocks_of(layers) if dims is None else dims,
    active_blocks=block_names(layers, active),
    sharded=sharded,
    batch_factors=batch_factors,
    factored=factored,
    batch_scales=batch_scales,
  )


def optimizer_step(
  config: KFACConfig,
  state: ScaleByKFACState,
  grads: Any,
  inputs: StepInputs,
) -> tuple[Any, ScaleByKFACState]:
  """Factor update, decomposition and preconditioning of one optimizer step.

  Args:
    config: the transformation's configuration.
    state: the state before the step.
    grads: the (mean) gradients of the step.
    inputs: the step's layers and what it reads from the statistics.

  Returns:
    The updates and the state after the step (accumulator untouched).
  """
  count = state.count
  if config.adaptive is None:
    damping = config.damping(count)
  else:
    # The adaptive mode's state carries λ (init made it, checks.py checks).
    assert state.quadratic_model is not None
    damping = state.quadratic_model.damping
  layers, active, dims, active_blocks = (
    inputs.layers,
    inputs.active,
    inputs.dims,
    inputs.active_blocks,
  )
  decomposition_step = count % config.inv_update_steps(count) == 0
  # Scheduled (or traced) values out of range at this step cannot raise
  # under jit: the parts of the step they feed leave the state as it was
  # and count it.
  scheduled_damping = config.damping if config.adaptive is None else None
  factors, skipped = update_factors(
    config, state, inputs.batch_factors, decomposition_step
  )
  preconditioners, counts = guarded_decomposition(
    config.placement,
    dims,
    {block: factors[block] for block in active_blocks},
    state.preconditioners,
    decomposition_counts(state),
    damping,
    hp.all_valid(count, scheduled_damping),
    config.factored_damping,
    when=decomposition_step,
  )
  gradient_matrices = gradient_blocks(grads, inputs)
  scales, applied, scaling = None, preconditioners, None
  if config.keeps_eigenvalue_scales:
    # Every active basis on every device: S (v) is kept replicated, as the
    # factors are, and each device preconditions every layer with it.
    applied = config.placement.replicated(dims, preconditioners, active_blocks)
    scales, scaling = (
      pinning.replicate(config, blocks)
      for blocks in scaling_lib.eigenbasis_scaling(
        config,
        state,
        inputs,
        scaling_lib.eigenbases(applied),
        gradient_matrices,
        decomposition_step,
      )
    )
  preconditioned = precondition(
    config, gradient_matrices, inputs, applied, damping, scaling
  )
  updates_ok = hp.all_valid(
    count,
    scheduled_damping,
    config.second_moment_decay,
    config.kl_clip,
    *(
      (None, None)
      if config.kl_clip is None
      else (config.learning_rate, config.momentum)
    ),
  )
  if updates_ok is not None:
    preconditioned = {
      b: jnp.where(updates_ok, p, 0.0) for b, p in preconditioned.items()
    }
  if config.kl_clip is not None and active:
    preconditioned = kl_clip(
      config, count, preconditioned, gradient_matrices, active_blocks
    )
  layer_updates = {
    name: from_matrix(
      jnp.stack([preconditioned[b] for b in layers[name].block_names]),
      layers[name],
      layers_lib.get_layer_params(grads, layers[name]),
    )
    for name in active
  }
  factors, preconditioners = pinning.pin_to_specs(
    config, factors, preconditioners, dims
  )
  new_state = with_counts(
    state._replace(
      count=count + 1,
      factors=factors,
      preconditioners=preconditioners,
      skipped_factor_updates=skipped,
      eigenvalue_scales=scales,
    ),
    counts,
  )
  updates = replace_layers(grads, layers, layer_updates)
  return pinning.constrain_to_params(config, updates), new_state


def update_factors(
  config: KFACConfig,
  state: ScaleByKFACState,
  batch_factors: Callable[[], dict[str, LayerFactors]] | None,
  decomposition_step: jax.Array,
) -> tuple[dict[str, LayerFactors], jax.Array]:
  """The running factors and skipped-update count after this step's update.

  On factor steps, ``F ← d·F + (1 − d)·F_batch`` for the blocks
  ``batch_factors`` gives; a batch whose factors hold NaN/Inf (or a
  scheduled ``d`` out of range), or a factor step without statistics
  (``batch_factors`` ``None``), never enters them and is counted. Factor
  updates only average finite batches into finite factors, so a non-finite
  running factor comes from outside (a corrupted restore, float16 storage
  overflowing): the exact O(d²) check runs on decomposition steps only, and
  a flagged factor restarts from the identity in a factor update forced on
  that step, before it is decomposed. A step that does neither pays for
  neither (``lax.cond``).
  """
  count = state.count
  factor_step = count % config.factor_update_steps(count) == 0
  decay_ok = hp.all_valid(count, config.factor_decay)
  corrupted = lax.cond(
    decomposition_step,
    lambda: {b: running.non_finite(f) for b, f in state.factors.items()},
    lambda: {
      b: LayerFactors(jnp.array(False), jnp.array(False)) for b in state.factors
    },
  )
  any_corrupted = functools.reduce(
    jnp.logical_or, jax.tree.leaves(corrupted), jnp.array(False)
  )  # no layers: False

  def updated():
    # (The gradients are not checked: they do not enter the factors, and
    # the check would add to every step and to its compile time.)
    if batch_factors is None:  # a step without statistics (NO_STATS)
      new, ok = {}, jnp.array(False)
    else:
      new = batch_factors()
      ok = linalg.psd_all_finite(f for factors in new.values() for f in factors)
    if decay_ok is not None:
      ok = ok & decay_ok
    decay = config.factor_decay(count)
    factors = {}
    for name, old in state.factors.items():
      start = running.restart(old, corrupted[name])
      # Selects, not conds: they fuse into the averaging pass.
      factors[name] = (
        running.update_factors(start, new[name], decay, apply=ok & factor_step)
        if name in new
        else start
      )
    skipped = state.skipped_factor_updates + (factor_step & ~ok).astype(
      jnp.int32
    )
    return factors, skipped

  return lax.cond(
    factor_step | any_corrupted,
    updated,
    lambda: (dict(state.factors), state.skipped_factor_updates),
  )


def decomposition_inputs(
  factors: Mapping[str, LayerFactors],
  damping: jax.Array,
  factored_damping: bool,
) -> tuple[dict[str, LayerFactors], jax.Array]:
  """The factors and λ a decomposition step hands to the placement.

  As given, or, for the adaptive mode's inverse method (``factored_damping``),
  pre-scaled for π-split damping (``inverse.factored_damping_scaled``) with
  λ = 1.
  """
  if not factored_damping:
    return dict(factors), damping
  return (
    inverse_lib.factored_damping_scaled(factors, damping),
    jnp.ones([], jnp.float32),
  )


def guarded_decomposition(
  placement: placement_lib.Placement,
  dims: Dims,
  factors: Mapping[str, LayerFactors],
  previous: Any,
  counts: DecompositionCounts,
  damping: jax.Array,
  damping_ok: jax.Array | None,
  factored_damping: bool,
  when: jax.Array | bool = True,
) -> tuple[Any, DecompositionCounts]:
  """A decomposition step's preconditioners and counts.

  ``factors`` (the blocks to decompose) go through ``decomposition_inputs``
  and ``placement.decompose`` if ``when``; a block whose decomposition comes
  out non-finite keeps its ``previous`` preconditioner (in the layout
  ``placement.init`` makes: a dict, or the packed ``ShardedPreconditioners``)
  and adds one to ``counts.rejected``; eigh fallbacks of the subspace solver
  add to ``counts.fallbacks``. ``damping_ok``: whether a scheduled λ is in
  range at this step (``None``: not checked); where it is not, nothing is
  decomposed and every block counts as rejected. Off ``when``, ``previous``
  and ``counts`` come back as they are. A ``previous`` packed in another
  layout (``placement.stale``: a checkpoint restored under another strategy)
  is decomposed whatever ``when``, from the identity's preconditioners.
  """
  stale = placement.stale(dims, previous)
  if stale is not None and when is not True:
    when = when | stale
  add = lambda new: jax.tree.map(jnp.add, counts, new)

  def decomposed():
    to_decompose, decomposition_damping = decomposition_inputs(
      factors, damping, factored_damping
    )
    preconditioners, new_counts = placement.decompose(
      dims, to_decompose, previous, decomposition_damping
    )
    return preconditioners, add(new_counts)

  if damping_ok is None:
    if when is True:
      return decomposed()
    return lax.cond(when, decomposed, lambda: (previous, counts))
  skipped = (when & ~damping_ok).astype(jnp.int32) * len(factors)
  return lax.cond(
    when & damping_ok,
    decomposed,
    lambda: (
      previous,
      add(DecompositionCounts(skipped, jnp.zeros_like(skipped))),
    ),
  )


def gradient_blocks(grads: Any, inputs: StepInputs) -> Blocks:
  """The gradient matrices ``∇ [dA, dG]`` float32 of ``inputs.active``'s
  blocks (``gradient_matrix.to_matrix``)."""
  blocks = {}
  for name in inputs.active:
    layer = inputs.layers[name]
    matrices = to_matrix(
      layers_lib.get_layer_params(grads, layer), layer, jnp.float32
    )
    blocks.update(zip(layer.block_names, matrices))
  return blocks


def precondition(
  config: KFACConfig,
  gradient_matrices: Blocks,
  inputs: StepInputs,
  preconditioners: Any,
  damping: jax.Array,
  scales: Blocks | None = None,
) -> Blocks:
  """``P`` of every block of ``inputs.active``.

  ``P = (A ⊗ G + λI)⁻¹ vec(∇)`` (eigen) or ``(A + λI)⁻¹ ∇ (G + λI)⁻¹``
  (inverse), with ``∇`` the block of ``gradient_matrices`` or its
  ``factored`` form, from ``preconditioners``, the placement's state. With
  ``scales`` (EKFAC's ``S``, or ``√v̂``), ``Q_A [(Q_Aᵀ ∇ Q_G) / (S + λ)]
  Q_Gᵀ``, and ``preconditioners`` are the active blocks' eigenbases on every
  device (``Placement.replicated``).
  """
  sharded = inputs.sharded
  gradients = {**gradient_matrices, **(inputs.factored or {})}
  if config.factored_damping:
    # Undo the λ factor of `factored_damping_scaled`, P = λ·P(∇/λ), so the
    # layers keep their scale against unregistered parameters' ∇ (with the
    # current λ, off from the decomposition's by the adaptations since, a
    # factor ω each, which the step size absorbs). On ∇, where XLA fuses
    # it into the gradient's assembly, not on P (a kernel per block).
    gradients = {b: divided(g, damping) for b, g in gradients.items()}
  if scales is None:
    return config.placement.precondition(
      inputs.dims, preconditioners, gradients, damping, sharded
    )
  return config.placement.precondition_replicated(
    {
      b: ekfac.with_scales(p, scales[b], damping, config.relative_damping)
      for b, p in preconditioners.items()
    },
    gradients,
    damping,
    sharded,
  )


def kl_clip(
  config: KFACConfig,
  count: jax.Array,
  preconditioned: Blocks,
  gradient_matrices: Blocks,
  active_blocks: Sequence[str],
) -> Blocks:
  """``preconditioned`` scaled by KL clipping's ``ν`` (``kl_clip_scale``),
  measured on the steady step of the chained momentum, ``lr / (1 − μ)``."""
  assert config.kl_clip is not None  # called only with KL clipping on
  rate = config.learning_rate(count) / (1 - config.momentum(count))
  nu = kl_clip_scale(
    [preconditioned[b] for b in active_blocks],
    [gradient_matrices[b] for b in active_blocks],
    rate,
    config.kl_clip(count),
  )
  return {b: nu * p for b, p in preconditioned.items()}


def adaptive_step(
  config: KFACConfig,
  state: ScaleByKFACState,
  new_state: ScaleByKFACState,
  preconditioned: Any,
  grads: Any,
  params: Any,
  split_loss: SplitLoss,
) -> tuple[Any, ScaleByKFACState]:
  """The adaptive mode's update from ``P = −Δ`` and the previous update
  (``quadratic_model.step``), and ``new_state`` with its model state."""
  adaptive, model = config.adaptive, state.quadratic_model
  # Called in the adaptive mode only, whose state init made.
  assert adaptive is not None and model is not None
  step_updates, model_state = quadratic_model.step(
    model,
    preconditioned,
    grads,
    params,
    split_loss,
    state.count % adaptive.damping_adaptation_interval == 0,
    adaptive,
  )
  return pinning.constrain_to_params(config, step_updates), new_state._replace(
    quadratic_model=model_state
  )


def block_names(
  layers: Mapping[str, LayerInfo], names: Sequence[str]
) -> list[str]:
  """State keys of the blocks of ``names``, in order."""
  return [block for name in names for block in layers[name].block_names]


def replace_layers(
  grads: Any,
  layers: Mapping[str, LayerInfo],
  layer_updates: Mapping[str, Mapping[str, jax.Array]],
) -> Any:
  """``grads`` with each preconditioned layer's kernel/bias swapped in."""

  def replace(path, leaf):
    values = layer_updates.get(layers_lib.layer_name(path[:-1]))
    return (
      leaf
      if values is None
      else values.get(layers_lib.path_key_name(path[-1]), leaf)
    )

  return jax.tree_util.tree_map_with_path(replace, grads)
