"""``scale_by_kfac``: K-FAC preconditioning as an optax transformation.

At optimizer step ``t`` (``count``), for every registered layer
(``transform.step``):

1. if ``t % factor_update_steps == 0``: ``F ← d·F + (1 − d)·F_batch`` for
   ``F ∈ {A, G}`` (``factors.batch`` gives ``F_batch`` from the captured stats);
2. if ``t % inv_update_steps == 0``: eigendecompose (or invert) the factors;
3. ``P = (A ⊗ G + λI)⁻¹ vec(∇)`` (eigen) or ``(A + λI)⁻¹ ∇ (G + λI)⁻¹``
   (inverse), then KL clipping scales every ``P`` by ``ν``. With
   ``gradient_from_stats``, a dense layer's ``∇`` enters as the captured
   ``aᵀg`` where that form is cheaper (``gradient_matrix.sandwich``).

Steps 1 and 2 run under ``lax.cond``: a step that does neither pays for
neither. Gradients of parameters that are not registered layers pass through.
With ``accumulation_steps > 1`` the step runs on the means of the
micro-batches' sums (``transform.accumulation``).

With ``adaptive``, λ is state, ``G`` is on the Fisher's scale, the inverse
method splits λ between the factors, there is no KL clipping, and step 3 is
followed by ``transform.quadratic_model.step``, which turns ``−P`` and the
previous update into the final update and adapts λ.

The arguments are validated once into a ``KFACConfig`` (``transform.config``);
the state is ``ScaleByKFACState`` (``transform.state``); what ``update`` is
given is checked against both (``transform.checks``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from kfac_jax.capture import layers as layers_lib
from kfac_jax.capture.layers import LayerTable
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.distribution import sharding
from kfac_jax.distribution.strategy import (
  AssignmentStrategy,
  DistributedStrategy,
)
from kfac_jax.factors.running import LayerFactors, init_factors
from kfac_jax.hyperparameters import (
  ComputeMethod,
  DampingMode,
  ScalarOrSchedule,
  WeightSharing,
)
from kfac_jax.preconditioning import ekfac, second_moment
from kfac_jax.preconditioning.subspace import SubspaceSolver
from kfac_jax.transform import (
  boxing,
  checks,
  nnx_variables,
  pinning,
  quadratic_model,
  stats_blocks,
  step,
)
from kfac_jax.transform.accumulation import accumulate
from kfac_jax.transform.config import (
  DEFAULT_DAMPING,
  DEFAULT_INV_DTYPE,
  DEFAULT_KL_CLIP,
  KFACConfig,
  with_config_args_doc,
)
from kfac_jax.transform.quadratic_model import AdaptiveConfig, SplitLoss
from kfac_jax.transform.state import AccumulatorState, ScaleByKFACState

__all__ = [
  "AccumulatorState",
  "DEFAULT_DAMPING",
  "ScaleByKFACState",
  "scale_by_kfac",
  "transformation",
]


@with_config_args_doc
def scale_by_kfac(
  *,
  learning_rate: ScalarOrSchedule = 0.1,
  damping: ScalarOrSchedule = DEFAULT_DAMPING,
  damping_mode: DampingMode | str | None = None,
  factor_decay: ScalarOrSchedule = 0.95,
  kl_clip: ScalarOrSchedule | None = DEFAULT_KL_CLIP,
  momentum: ScalarOrSchedule | None = 0.0,
  factor_update_steps: ScalarOrSchedule = 1,
  inv_update_steps: ScalarOrSchedule = 1,
  compute_method: ComputeMethod | str | None = None,
  compute_eigenvalue_outer_product: bool = True,
  accumulation_steps: int = 1,
  skip_layers: Sequence[str] | str | None = None,
  max_factor_dim: int | None = None,
  factor_dtype: jnp.dtype | None = None,
  inv_dtype: jnp.dtype = DEFAULT_INV_DTYPE,
  mesh_axes: str | Sequence[str] | None = None,
  grad_worker_fraction: DistributedStrategy | float = (
    DistributedStrategy.COMM_OPT
  ),
  assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
  params_partition_specs: Any = None,
  layers: LayerTable | None = None,
  precondition_embeddings: bool = False,
  decomposition_batch_size: int | None = None,
  factor_batch_size: int | float | None = None,
  weight_sharing: WeightSharing | str = WeightSharing.EXPAND,
  gradient_from_stats: bool = False,
  adaptive: AdaptiveConfig | None = None,
  eigen_solver: str | SubspaceSolver = "eigh",
  eigenvalue_correction: bool = False,
  second_moment_decay: ScalarOrSchedule | None = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC gradient preconditioning (KAISA's algorithm) as an optax transform.

  Each registered layer's gradient ``∇`` is replaced by
  ``(A ⊗ G + λI)⁻¹ vec(∇)``, with ``A`` and ``G`` running averages of the
  layer's input and output-cotangent second moments (the Kronecker-factored
  approximate curvature), optionally spread over a mesh as KAISA does.
  Chain it before a first-order optimizer:

  >>> import kfac_jax, optax
  >>> tx = optax.chain(kfac_jax.scale_by_kfac(damping=1e-3),
  ...                  optax.sgd(0.1, momentum=0.9))

  and call its ``update`` with the stats of the same loss call::

    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)

  Args: KFACConfig's.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes the
    keyword argument ``kfac_stats`` (from ``value_grad_and_stats``), and
    with ``adaptive`` also ``split_loss``.

  References:
    Martens & Grosse, `Optimizing Neural Networks with Kronecker-factored
    Approximate Curvature <https://arxiv.org/abs/1503.05671>`_, 2015.

    Grosse & Martens, `A Kronecker-factored approximate Fisher matrix for
    convolution layers <https://arxiv.org/abs/1602.01407>`_, 2016.

    Pauloski et al., Convolutional Neural Network Training with Distributed
    K-FAC, SC'20.

    Pauloski et al., KAISA: An Adaptive Second-Order Optimizer Framework for
    Deep Neural Networks, SC'21.
  """
  # The arguments are KFACConfig's fields, in the same order, with the same
  # annotations and defaults (tests/test_validation.py checks it).
  return transformation(
    KFACConfig(
      learning_rate=learning_rate,
      damping=damping,
      damping_mode=damping_mode,
      factor_decay=factor_decay,
      kl_clip=kl_clip,
      momentum=momentum,
      factor_update_steps=factor_update_steps,
      inv_update_steps=inv_update_steps,
      compute_method=compute_method,
      compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
      accumulation_steps=accumulation_steps,
      skip_layers=skip_layers,
      max_factor_dim=max_factor_dim,
      factor_dtype=factor_dtype,
      inv_dtype=inv_dtype,
      mesh_axes=mesh_axes,
      grad_worker_fraction=grad_worker_fraction,
      assignment_strategy=assignment_strategy,
      params_partition_specs=params_partition_specs,
      layers=layers,
      precondition_embeddings=precondition_embeddings,
      decomposition_batch_size=decomposition_batch_size,
      factor_batch_size=factor_batch_size,
      weight_sharing=weight_sharing,
      gradient_from_stats=gradient_from_stats,
      adaptive=adaptive,
      eigen_solver=eigen_solver,
      eigenvalue_correction=eigenvalue_correction,
      second_moment_decay=second_moment_decay,
    )
  )


def transformation(config: KFACConfig) -> optax.GradientTransformationExtraArgs:
  """``scale_by_kfac`` of an already built ``config``."""
  # optax types every transformation's state as a generic ArrayTree; this
  # one's is a ScaleByKFACState.
  tx = optax.GradientTransformationExtraArgs(
    functools.partial(init, config),  # pyright: ignore[reportArgumentType]
    functools.partial(update, config),  # pyright: ignore[reportArgumentType]
  )
  # Flax-boxed params (nn.with_logical_partitioning) in, boxed state out.
  return boxing.boxed_transformation(tx, config.mesh_axes)


def init(config: KFACConfig, params: Any) -> ScaleByKFACState:
  """Identity factors and preconditioners for the layers of ``params``."""
  checks.check_not_params_placeholder(params)
  if config.params_partition_specs is not None:
    sharding.check_params_specs(params, config.params_partition_specs)
  layers, _ = config.find_layers(params, warn_untraced=True)
  factors = {}
  for layer in layers.values():
    kernel = layers_lib.get_layer_params(params, layer)[layer.kernel_key]
    for block in layer.block_names:
      factors[block] = init_factors(
        layer.activation_dim,
        layer.gradient_dim,
        config.factor_dtype or jnp.promote_types(kernel.dtype, jnp.float32),
      )
  blocks = layers_lib.blocks_of(layers)
  accumulator = None
  if config.accumulation_steps > 1:
    accumulator = AccumulatorState(
      micro_step=jnp.zeros([], jnp.int32),
      gradients=pinning.constrain_to_params(
        config, optax.tree.zeros_like(params)
      ),
      factors={
        block: LayerFactors(
          jnp.zeros((a, a), jnp.float32), jnp.zeros((g, g), jnp.float32)
        )
        for block, (a, g) in blocks.items()
      },
      scales=(
        None
        if not config.eigenvalue_correction
        else {
          block: jnp.zeros(dims, jnp.float32) for block, dims in blocks.items()
        }
      ),
    )
  return ScaleByKFACState(
    count=jnp.zeros([], jnp.int32),
    factors=factors,
    preconditioners=config.placement.init(blocks),
    accumulator=accumulator,
    skipped_factor_updates=jnp.zeros([], jnp.int32),
    rejected_decompositions=jnp.zeros([], jnp.int32),
    quadratic_model=_init_quadratic_model(config, params),
    eigh_fallbacks=(
      None if config.subspace_solver is None else jnp.zeros([], jnp.int32)
    ),
    eigenvalue_scales=_init_eigenvalue_scales(config, blocks),
  )


def _init_eigenvalue_scales(
  config: KFACConfig, blocks: Mapping[str, tuple[int, int]]
) -> dict[str, jax.Array] | None:
  """EKFAC's ``S`` of identity factors, the gradient's ``v = 0``, or
  ``None`` without either."""
  if config.eigenvalue_correction:
    return {block: ekfac.init_scales(*dims) for block, dims in blocks.items()}
  if config.second_moment_decay is not None:
    return {
      block: second_moment.init_moment(*dims) for block, dims in blocks.items()
    }
  return None


def _init_quadratic_model(
  config: KFACConfig, params: Any
) -> quadratic_model.QuadraticModelState | None:
  """The adaptive mode's state, ``None`` without it."""
  if config.adaptive is None:
    return None
  damping = config.damping.value
  # The initial λ of the adaptive mode is a number (KFACConfig checks).
  assert not callable(damping)
  return quadratic_model.init(
    pinning.constrain_to_params(config, params), damping, config.adaptive
  )


def update(
  config: KFACConfig,
  updates: Any,
  state: ScaleByKFACState,
  params: Any = None,
  *,
  kfac_stats: Mapping[str, LayerStatistics] | checks.NoStats | None = None,
  split_loss: SplitLoss | None = None,
  **extra_args: Any,
) -> tuple[Any, ScaleByKFACState]:
  """The preconditioned ``updates`` and the state after them.

  NNX's functional API passes ``nnx.State`` trees of Variables (and ``init``
  put them in the state's params-shaped parts): the layers are read in their
  values, and the results come back in the containers given.
  """
  del extra_args
  new_updates, new_state = _update_values(
    config,
    nnx_variables.values(updates),
    nnx_variables.values(state),
    nnx_variables.values(params),
    kfac_stats,
    split_loss,
  )
  return (
    nnx_variables.like(updates, new_updates),
    nnx_variables.like(state, new_state),
  )


def _update_values(
  config: KFACConfig,
  updates: Any,
  state: ScaleByKFACState,
  params: Any,
  kfac_stats: Mapping[str, LayerStatistics] | checks.NoStats | None,
  split_loss: SplitLoss | None,
) -> tuple[Any, ScaleByKFACState]:
  """``update`` on trees of arrays: the checks, then the step."""
  adaptive = config.adaptive
  checks.check_split_loss(split_loss, params, adaptive is not None)
  layers, left_out = config.find_layers(updates)
  sharded = {}
  if config.params_partition_specs is not None:
    sharded = stats_blocks.sharded_kernels(
      layers,
      sharding.check_params_specs(updates, config.params_partition_specs),
    )
  checks.check_state(layers, state, config)
  if adaptive is not None:
    # Only a restored λ can be out of range (NaN/Inf from a corrupted
    # checkpoint): it would enter this step's decompositions and step sizes
    # as it is until the next adaptation step cleaned it up.
    model = state.quadratic_model
    assert model is not None  # check_state: the adaptive mode's state
    state = state._replace(
      quadratic_model=model._replace(
        damping=quadratic_model.clip_damping(model.damping, adaptive)
      )
    )
  dims = layers_lib.blocks_of(layers)
  checks.check_preconditioners(
    state.preconditioners,
    jax.eval_shape(lambda: config.placement.init(dims)),
  )
  if kfac_stats is checks.NO_STATS:
    checks.check_no_stats(config)
    active, batch_factors, batch_scales, factored = (
      list(layers),
      None,
      None,
      None,
    )
  else:
    active, batch_factors, batch_scales, factored = _from_stats(
      config, kfac_stats, layers, left_out, updates, sharded
    )
  inputs = step.step_inputs(
    layers, active, sharded, batch_factors, factored, batch_scales, dims
  )
  if config.accumulation_steps > 1:
    # check_no_stats refuses NO_STATS with accumulation_steps > 1.
    assert batch_factors is not None
    return accumulate(config, state, updates, inputs)
  preconditioned, new_state = step.optimizer_step(
    config, state, updates, inputs
  )
  if adaptive is None:
    return preconditioned, new_state
  assert split_loss is not None  # check_split_loss: the adaptive mode's
  return step.adaptive_step(
    config, state, new_state, preconditioned, updates, params, split_loss
  )


def _from_stats(
  config: KFACConfig,
  kfac_stats: Any,
  layers: Mapping[str, layers_lib.LayerInfo],
  left_out: frozenset[str],
  updates: Any,
  sharded: Mapping[str, tuple[str, ...]],
):
  """The layers to precondition and what the step reads from ``kfac_stats``:
  the batch factors and EKFAC's scales (as thunks), and the factored
  gradients of ``gradient_from_stats`` (else ``None``)."""
  active = checks.check_stats(
    kfac_stats, layers, config.skip_layers, updates, left_out
  )
  if config.layers is None:
    layers_lib.warn_unmatched_skips(
      updates,
      config.skip_layers,
      {s.signature.module_type or "" for s in kfac_stats.values()},
    )
  batch_factors = functools.partial(
    stats_blocks.stats_factors, config, kfac_stats, layers, active
  )
  batch_scales = None
  if config.eigenvalue_correction:
    checks.check_dense_only(kfac_stats, active, "eigenvalue_correction=True")
    batch_scales = functools.partial(
      stats_blocks.stats_scales, config, kfac_stats, layers, active
    )
  factored = (
    stats_blocks.factored_gradients(kfac_stats, layers, active, sharded)
    if config.gradient_from_stats
    else None
  )
  return active, batch_factors, batch_scales, factored
