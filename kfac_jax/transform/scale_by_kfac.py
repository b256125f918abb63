"""``scale_by_kfac``: K-FAC preconditioning as an optax transformation.

At optimizer step ``t`` (``count``), for every registered layer:

1. if ``t % factor_update_steps == 0``: ``F ← d·F + (1 − d)·F_batch`` for
   ``F ∈ {A, G}`` (``factors.batch`` gives ``F_batch`` from the captured stats);
2. if ``t % inv_update_steps == 0``: eigendecompose (or invert) the factors;
3. ``P = (A ⊗ G + λI)⁻¹ vec(∇)`` (eigen) or ``(A + λI)⁻¹ ∇ (G + λI)⁻¹``
   (inverse), then KL clipping scales every ``P`` by ``ν``. With
   ``gradient_from_stats``, a dense layer's ``∇`` enters as the captured
   ``aᵀg`` where that form is cheaper (``gradient_matrix.sandwich``).

Steps 1 and 2 run under ``lax.cond``: a step that does neither pays for
neither. Gradients of parameters that are not registered layers pass through.

With ``adaptive``, λ is state, ``G`` is on the Fisher's scale, the inverse
method splits λ between the factors, there is no KL clipping, and step 3 is
followed by ``transform.quadratic_model.step``, which turns ``−P`` and the
previous update into the final update and adapts λ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
import optax

from kfac_jax.transform.hyperparameters import static_bool, static_positive_integer
from kfac_jax.capture import layers as layers_lib
from kfac_jax.capture.layers import LayerInfo, LayerTable
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.factors import batch as batch_lib
from kfac_jax.distribution import placement as placement_lib
from kfac_jax.distribution import strategy
from kfac_jax.distribution.layout import Dims
from kfac_jax.distribution.placement import ShardedPreconditioners
from kfac_jax.distribution.strategy import AssignmentStrategy, DistributedStrategy
from kfac_jax.factors import running
from kfac_jax.factors.running import (LayerFactors, factor_dims,
                                      init_factors, update_factors)
from kfac_jax.preconditioning import inverse as inverse_lib
from kfac_jax.preconditioning.gradient_matrix import (FactoredGradient,
                                                     factored_is_cheaper,
                                                     from_matrix, to_matrix)
from kfac_jax.preconditioning.methods import Preconditioner, make_method
from kfac_jax.preconditioning.kl_clip import kl_clip_scale
from kfac_jax.transform import hyperparameters as hp
from kfac_jax.transform import nnx_variables
from kfac_jax.transform import quadratic_model
from kfac_jax.transform.quadratic_model import (AdaptiveConfig,
                                                QuadraticModelState, SplitLoss)
from kfac_jax.transform.hyperparameters import ComputeMethod, ScalarOrSchedule

class AccumulatorState(NamedTuple):
  """Sums over the micro-batches of the optimizer step in progress.

  Attributes:
    micro_step: micro-batches seen in this optimizer step, in
      ``[0, accumulation_steps)``.
    gradients: sum of the micro-batch gradients (structure of the params).
    factors: sum of the micro-batch factors ``{layer: LayerFactors}`` (float32).
  """

  micro_step: jax.Array
  gradients: Any
  factors: dict[str, LayerFactors]


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
  """

  count: jax.Array
  factors: dict[str, LayerFactors]
  preconditioners: dict[str, Preconditioner] | ShardedPreconditioners
  accumulator: AccumulatorState | None
  skipped_factor_updates: jax.Array
  rejected_decompositions: jax.Array
  quadratic_model: QuadraticModelState | None = None


# scale_by_kfac's λ unless given (the kfac alias's too).
DEFAULT_DAMPING = 0.001


def scale_by_kfac(
    learning_rate: ScalarOrSchedule = 0.1,
    damping: ScalarOrSchedule = DEFAULT_DAMPING,
    factor_decay: ScalarOrSchedule = 0.95,
    kl_clip: ScalarOrSchedule | None = 0.001,
    factor_update_steps: ScalarOrSchedule = 1,
    inv_update_steps: ScalarOrSchedule = 1,
    compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
    compute_eigenvalue_outer_product: bool = True,
    accumulation_steps: int = 1,
    skip_layers: Sequence[str] | str | None = None,
    factor_dtype: jnp.dtype | None = None,
    inv_dtype: jnp.dtype = jnp.dtype(jnp.float32),
    mesh_axes: str | Sequence[str] | None = None,
    grad_worker_fraction: DistributedStrategy | float = (
        DistributedStrategy.COMM_OPT),
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    params_partition_specs: Any = None,
    layers: LayerTable | None = None,
    precondition_embeddings: bool = False,
    decomposition_batch_size: int | None = None,
    factor_batch_size: int | None = None,
    gradient_from_stats: bool = False,
    adaptive: AdaptiveConfig | None = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC gradient preconditioning (KAISA's algorithm) as an optax transform.

  Chain it before a first-order optimizer::

    tx = optax.chain(kfac_jax.scale_by_kfac(...), optax.sgd(0.1, momentum=0.9))
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)

  Args:
    learning_rate: the learning rate of the chained optimizer; only KL clipping
      uses it (``vg = lr² Σ P ⊙ ∇``). Constant or schedule, ≥ 0 (at 0, as
      a warmup from 0 starts, nothing is clipped: ν = 1).
    damping: λ in ``(A ⊗ G + λI)⁻¹``. Constant or schedule, > 0.
    factor_decay: d in ``F ← d·F + (1 − d)·F_batch``. Constant or schedule,
      in [0, 1]: 0 replaces F by ``F_batch``, 1 keeps F.
      ``kfac_jax.schedules.exp_decay_factor_averaging()`` is KAISA's
      ``min(1 − 1/max(step, 1), 0.95)``.
    kl_clip: KL-clipping bound κ. Constant or schedule, > 0; ``None``
      turns clipping off.
    factor_update_steps: factors update when ``step % factor_update_steps ==
      0``. Positive integer or schedule.
    inv_update_steps: eigendecompositions (or inverses) are recomputed when
      ``step % inv_update_steps == 0``. Positive integer or schedule.
    compute_method: ``"eigen"`` or ``"inverse"``.
    compute_eigenvalue_outer_product: eigen method only: store
      ``1/(outer(d_A, d_G) + λ)`` at each decomposition (λ then stays fixed
      until the next one) instead of forming it every step.
    accumulation_steps: k > 1 accumulates k micro-batches per optimizer step:
      gradients and batch factors are averaged over them (G also divided by
      k²: each micro-batch's loss is its own mean), as for one step on the
      concatenated batch, and the preconditioned update is emitted on the
      k-th call (zeros before). Wrap
      the rest of the chain in ``optax.MultiSteps(..., every_k_schedule=k,
      use_grad_mean=False)`` so it steps once per k calls (``kfac`` does).
    skip_layers: regexes (``re.search``) matched against each layer's module
      path (joined with ``/``) and its Flax class name; matched layers and all
      modules under them are left to the chained optimizer. Class-name matches
      are known from the layer table or once stats arrive, so without a
      table such layers still get (unused) state, and the capture given the
      same pattern leaves them without stats, which ``update`` refuses: skip
      by path there.
    factor_dtype: storage dtype of A and G; default float32 (the kernel's
      dtype if wider). A bfloat16 running average stalls: once ``(1 − d)·|F_batch
      − F|`` is below half a bfloat16 step of ``F`` it stops moving (32 %
      off after 3000 steps at ``d = 0.99``), so bfloat16 is an explicit
      choice.
    inv_dtype: dtype of eigenbases/inverses (decompositions always run in
      float32): stored in it, and, when bfloat16, applied in it (operands
      rounded, products accumulated in float32;
      ``gradient_matrix.product_dtype``). It needs float32's range: float16
      raises (``hyperparameters.preconditioner_dtype``). The default is a
      dtype instance, not the callable ``jnp.float32``, which
      ``optax.inject_hyperparams`` would take for a schedule.
    mesh_axes: axis names of the mesh set by ``jax.set_mesh`` over which the
      decompositions and preconditioner memory are spread (KAISA); ``None``
      computes everything where the program runs.
    grad_worker_fraction: with ``mesh_axes``, the fraction f of the n devices
      that keep each layer's eigenbasis/inverse: ``DistributedStrategy``
      ``COMM_OPT`` (1), ``HYBRID_OPT`` (1/2), ``MEM_OPT`` (1/n), or a float
      with f·n a divisor of n.
    assignment_strategy: ``"compute"`` balances the layers over devices by
      ``dA³ + dG³``, ``"memory"`` by ``dA² + dG²`` (greedy, largest first).
    params_partition_specs: ``PartitionSpec`` tree of the params (FSDP or
      tensor parallel); the updates and the accumulated gradients are
      constrained to it. Inside ``optax.multi_transform`` the full tree:
      the specs of params withheld from K-FAC (``optax.MaskedNode``) are
      passed over. For an ``nnx.State`` of Params, a tree of its shape
      (specs in the Variables, or in their place). ``None``: as the
      incoming gradients.
    layers: the layer table from ``kfac_jax.trace_layers(loss_fn, params,
      ...)``, needed for scanned layers, grouped convolutions and
      ``DenseGeneral``, whose structure the params alone do not tell. With it,
      kernels of modules the capture does not know are left to the chained
      optimizer (with a warning at ``init``). ``None``: every kernel is a
      ``Dense``/``Conv`` ``[*window, in, out]``.
    precondition_embeddings: also precondition the table's ``Embed`` layers,
      with ``A = diag(token frequencies)`` stored and decomposed as a dense
      ``[vocab, vocab]`` matrix (O(vocab²) memory, O(vocab³) per
      decomposition: meant for vocabularies of a few thousand at most).
      Off by default: embedding rows are updated only by the tokens of the
      batch, so their curvature is a diagonal the first-order optimizer's
      per-row scaling already approximates well, at no cost.
    decomposition_batch_size: same-sized factors (e.g. of many scanned
      layers) are decomposed by one ``vmap`` (one call per factor where
      that is faster: ``preconditioning.batched``); with a positive integer k,
      by ``lax.map`` over batches of k instead, bounding the decomposition
      workspace. ``None``: all at once.
    factor_batch_size: with a positive integer k, the batch factors come from
      k examples of each batch (evenly spaced along the inputs' and
      cotangents' example axis, the first after the stack axes;
      ``factors.batch.example_subset``) instead of all B: the factor
      products, ``2·k·Σ(dA² + dG²)`` FLOPs, cost k/B of the whole batch's,
      and estimate the same factors (Martens & Grosse's curvature
      mini-batch). The gradients still use the whole batch. ``None``, or
      k ≥ B: every example.
    gradient_from_stats: precondition each dense layer's gradient in the
      factored form its ``kfac_stats`` give, ``∇ = aᵀg`` (``a [N, dA]`` the
      inputs, with the bias's ones column; ``g [N, dG]`` the output
      cotangents; ``N`` the rows of all calls), wherever that is cheaper:
      ``L ∇ R = (a Lᵀ)ᵀ(g R)`` costs ``2·N·(dA² + dG² + dA·dG)`` FLOPs
      instead of ``2·dA·dG·(dA + dG)`` (``gradient_matrix.sandwich``; the
      inverse method's one pair of products, the eigen method's first), e.g.
      1.5 against 4 GFLOP for a 1000×1000 layer at batch 256. The result is
      the same, *provided* the incoming gradients of those layers are exactly
      the gradient of the loss the stats were captured from: the stats of
      ``value_grad_and_stats`` of the training loss (not
      ``sampled_curvature``'s), with nothing before ``scale_by_kfac`` in the
      chain changing them (weight decay, clipping, noise) and no regularizer
      inside the loss acting on those kernels. Their gradient values are then
      read only by KL clipping and the adaptive mode's quadratic model.
      Convolutions, embeddings and kernels sharded by
      ``params_partition_specs`` keep the dense form. Needs
      ``accumulation_steps=1`` and ``mesh_axes=None``.
    adaptive: an ``AdaptiveConfig`` turns on DeepMind kfac-jax's adaptive
      mode (``transform.quadratic_model``): the update is ``α Δ + μ δ`` with
      ``Δ`` the negated K-FAC direction, ``δ`` the previous update and
      ``(α, μ)`` minimising the exact Gauss-Newton quadratic model of the
      batch loss, and ``damping`` (the initial λ, a constant) follows the
      Levenberg-Marquardt rule. ``G`` is kept at the scale of the mean loss's
      Fisher (``factors.batch.fisher_scales``), so λ means what it means in
      kfac-jax; the inverse method splits λ between the factors
      (``inverse.factored_damping_scaled``) instead of adding it to each. The updates are then the final parameter updates (apply them
      with ``optax.apply_updates``; chain nothing that rescales them), and
      ``update`` also needs ``params`` and ``split_loss=SplitLoss(...)``.
      Needs ``kl_clip=None`` and ``accumulation_steps=1``; ``learning_rate``
      is unused.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes the
    keyword argument ``kfac_stats`` (from ``value_grad_and_stats``), and
    with ``adaptive`` also ``split_loss``.
  """
  # 0 allowed: a warmup schedule starts there, and KL clipping's ν is 1 then.
  learning_rate_fn = hp.non_negative("learning_rate", learning_rate)
  damping_fn = hp.positive("damping", damping)
  factor_decay_fn = hp.decay("factor_decay", factor_decay)
  if kl_clip is False:
    raise TypeError("kl_clip=False: pass kl_clip=None to turn KL clipping "
                    "off.")
  kl_clip_fn = None if kl_clip is None else hp.positive("kl_clip", kl_clip)
  factor_update_steps_fn = hp.positive_integer("factor_update_steps",
                                               factor_update_steps)
  inv_update_steps_fn = hp.positive_integer("inv_update_steps",
                                            inv_update_steps)
  method = ComputeMethod.parse(compute_method)
  accumulation_steps = static_positive_integer("accumulation_steps",
                                                  accumulation_steps)
  skip = layers_lib.compile_patterns(skip_layers)
  if layers is not None and not (isinstance(layers, Mapping) and all(
      isinstance(layer, LayerInfo) for layer in layers.values())):
    raise TypeError(
        "layers must be the table from kfac_jax.trace_layers(loss_fn, params, "
        f"*batch) or None; got {type(layers).__name__}.")
  table = layers
  if adaptive is not None:
    AdaptiveConfig.check(adaptive)
    if kl_clip is not None:
      raise ValueError(
          "scale_by_kfac(adaptive=...) chooses the step size from the "
          f"quadratic model; pass kl_clip=None (got kl_clip={kl_clip!r}).")
    if accumulation_steps != 1:
      raise ValueError(
          "scale_by_kfac(adaptive=...) evaluates the quadratic model on the "
          "batch of the step; it does not support accumulation_steps="
          f"{accumulation_steps} (use accumulation_steps=1 and a larger "
          "batch).")
    if callable(damping):
      raise TypeError(
          "scale_by_kfac(adaptive=...): damping is the initial λ, which the "
          "Levenberg-Marquardt rule then adapts; pass a number, not a "
          "schedule.")
    # Under optax.inject_hyperparams the value is traced in update (it is
    # only read at init, where it is concrete and checked).
    if not isinstance(damping, jax.core.Tracer) and not (
        adaptive.min_damping <= damping <= adaptive.max_damping):
      raise ValueError(
          f"scale_by_kfac(adaptive=...): the initial damping={damping!r} "
          "lies outside the range the rule keeps λ in, AdaptiveConfig's "
          f"[min_damping={adaptive.min_damping!r}, "
          f"max_damping={adaptive.max_damping!r}].")
  precondition_embeddings = static_bool("precondition_embeddings",
                                           precondition_embeddings)
  if precondition_embeddings and table is None:
    raise ValueError(
        "precondition_embeddings=True needs the layer table: "
        "scale_by_kfac(..., layers=kfac_jax.trace_layers(loss_fn, params, "
        "*batch)).")
  find_layers = functools.partial(layers_lib.find_layers, skip=skip,
                                  table=table,
                                  include_embeddings=precondition_embeddings)
  factor_dtype = hp.factor_dtype("factor_dtype", factor_dtype)
  if factor_dtype == jnp.bfloat16 and method is ComputeMethod.INVERSE:
    raise ValueError(
        "factor_dtype=bfloat16 does not work with compute_method='inverse': "
        "rounding a running factor to bfloat16 moves each entry by up to "
        "2⁻⁹ of its size, which makes a rank-deficient factor (a batch "
        "smaller than the layer's width, correlated inputs) indefinite, so "
        "F + λI has no Cholesky factor unless λ outweighs the rounding; "
        "those decompositions are rejected and the layer goes "
        "unpreconditioned. Use compute_method='eigen' (it clamps the "
        "negative eigenvalues at 0) or float32 factors (the default).")
  inv_dtype = hp.preconditioner_dtype("inv_dtype", inv_dtype)
  if decomposition_batch_size is not None:
    decomposition_batch_size = static_positive_integer(
        "decomposition_batch_size", decomposition_batch_size)
  if factor_batch_size is not None:
    factor_batch_size = static_positive_integer("factor_batch_size",
                                                   factor_batch_size)
  gradient_from_stats = static_bool("gradient_from_stats",
                                       gradient_from_stats)
  if gradient_from_stats and accumulation_steps != 1:
    raise ValueError(
        "scale_by_kfac(gradient_from_stats=True) reads each step's gradient "
        "from that step's kfac_stats, which hold one micro-batch; it does not "
        f"support accumulation_steps={accumulation_steps}.")
  if gradient_from_stats and mesh_axes is not None:
    raise ValueError(
        "scale_by_kfac(gradient_from_stats=True) preconditions where the "
        "program runs; it does not support mesh_axes (got "
        f"{mesh_axes!r}). Drop one of the two.")
  # The adaptive mode's λ is on the Fisher's scale: the inverse method then
  # splits it between the factors (π-damping) instead of adding λ to each.
  factored_damping = adaptive is not None and method is ComputeMethod.INVERSE
  placement = make_placement(method, compute_eigenvalue_outer_product,
                             inv_dtype, mesh_axes, grad_worker_fraction,
                             assignment_strategy, decomposition_batch_size)
  # Specs made by jax.tree.map over an nnx.State sit in its Variables.
  params_partition_specs = nnx_variables.values(params_partition_specs)

  def constrain_to_params(tree: Any) -> Any:
    if params_partition_specs is None:
      return tree
    return placement_lib.constrain_like_params(tree, params_partition_specs)

  def replicate(tree: Any) -> Any:
    """``tree`` pinned replicated, as factors are (with sharded kernels the
    factor products would otherwise follow them)."""
    if params_partition_specs is None:
      return tree
    return jax.tree.map(
        lambda x: placement_lib.constrain(x, PartitionSpec(), ()), tree)

  def pin_to_specs(factors: Any, preconditioners: Any, dims: Any) -> tuple[
      Any, Any]:
    """Factors replicated, preconditioners as ``placement.partition_specs``.

    With sharded kernels and no ``mesh_axes`` nothing else pins them: the
    in-place preconditioning of a sharded kernel pulled its preconditioner,
    the decomposition and the running factors onto the kernel's sharding,
    off ``get_opt_state_partition_specs`` (a donated step then compiled
    twice), or into shardings XLA could not lay out.
    """
    if params_partition_specs is None:
      return factors, preconditioners
    place = lambda spec, x: placement_lib.constrain(x, spec, ())
    is_spec = lambda x: isinstance(x, PartitionSpec)
    factors = replicate(factors)
    preconditioners = jax.tree.map(place, placement.partition_specs(dims),
                                   preconditioners, is_leaf=is_spec)
    return factors, preconditioners

  def init_fn(params: Any) -> ScaleByKFACState:
    _check_not_params_placeholder(params)
    if params_partition_specs is not None:
      placement_lib.check_params_specs(params, params_partition_specs)
    layers = find_layers(params, warn_untraced=True)
    factors = {}
    for layer in layers.values():
      kernel = layers_lib.get_layer_params(params, layer)[layer.kernel_key]
      for block in layer.block_names:
        factors[block] = init_factors(layer.activation_dim, layer.gradient_dim,
                                      factor_dtype or jnp.promote_types(
                                          kernel.dtype, jnp.float32))
    accumulator = None
    if accumulation_steps > 1:
      accumulator = AccumulatorState(
          micro_step=jnp.zeros([], jnp.int32),
          gradients=constrain_to_params(optax.tree.zeros_like(params)),
          factors={
              block: LayerFactors(jnp.zeros((a, a), jnp.float32),
                                  jnp.zeros((g, g), jnp.float32))
              for block, (a, g) in layers_lib.blocks_of(layers).items()
          })
    return ScaleByKFACState(
        count=jnp.zeros([], jnp.int32),
        factors=factors,
        preconditioners=placement.init(layers_lib.blocks_of(layers)),
        accumulator=accumulator,
        skipped_factor_updates=jnp.zeros([], jnp.int32),
        rejected_decompositions=jnp.zeros([], jnp.int32),
        quadratic_model=(None if adaptive is None else quadratic_model.init(
            constrain_to_params(params), damping, adaptive)))

  def optimizer_step(
      state: ScaleByKFACState, grads: Any, layers: Mapping[str, LayerInfo],
      active: Sequence[str],
      batch_factors: Callable[[], dict[str, LayerFactors]],
      sharded: Mapping[str, tuple[str, ...]],
      factored: Mapping[str, FactoredGradient] | None = None,
  ) -> tuple[Any, ScaleByKFACState]:
    """Factor update, decomposition and preconditioning of one optimizer step.

    ``active``: the layers to precondition; ``batch_factors`` gives their
    blocks' batch factors. ``sharded``: ``{layer: mesh axes}`` of kernels
    sharded by ``params_partition_specs``. ``factored``: ``{block: aᵀg}``
    preconditioned in that form instead of the block of ``grads``
    (``gradient_from_stats``). Returns the updates and the state after the
    step (accumulator untouched).
    """
    count = state.count
    damping_value = (damping_fn(count) if adaptive is None else
                     state.quadratic_model.damping)
    dims = layers_lib.blocks_of(layers)
    active_blocks = _block_names(layers, active)

    factor_step = count % factor_update_steps_fn(count) == 0
    decomposition_step = count % inv_update_steps_fn(count) == 0
    # Scheduled (or traced) values out of range at this step cannot raise
    # under jit: the parts of the step they feed leave the state as it was
    # and count it (README, *scale_by_kfac arguments*).
    scheduled_damping = damping_fn if adaptive is None else None
    decay_ok = hp.all_valid(count, factor_decay_fn)
    damping_ok = hp.all_valid(count, scheduled_damping)
    updates_ok = hp.all_valid(
        count, scheduled_damping, kl_clip_fn,
        None if kl_clip_fn is None else learning_rate_fn)
    # Factor updates only average finite batches into finite factors, so a
    # non-finite running factor comes from outside (a corrupted restore,
    # float16 storage overflowing). The exact O(d²) check runs on
    # decomposition steps only; a flagged factor restarts from the identity
    # in a factor update forced on that step, before it is decomposed.
    corrupted = lax.cond(
        decomposition_step,
        lambda: {b: running.non_finite(f) for b, f in state.factors.items()},
        lambda: {b: LayerFactors(jnp.array(False), jnp.array(False))
                 for b in state.factors})
    any_corrupted = functools.reduce(jnp.logical_or, jax.tree.leaves(corrupted),
                                     jnp.array(False))  # no layers: False

    def updated_factors():
      # A batch whose factors hold NaN/Inf never enters the running factors.
      # (The gradients are not checked: they do not enter the factors, and
      # the check cost ~10 % of a step and of its compile time.)
      new = batch_factors()
      ok = batch_lib.psd_all_finite(
          f for factors in new.values() for f in factors)
      if decay_ok is not None:
        ok = ok & decay_ok
      decay_value = factor_decay_fn(count)
      factors = {}
      for name, old in state.factors.items():
        start = running.restart(old, corrupted[name])
        # Selects, not conds: they fuse into the averaging pass.
        factors[name] = (update_factors(start, new[name], decay_value,
                                        apply=ok & factor_step)
                         if name in new else start)
      skipped = state.skipped_factor_updates + (factor_step & ~ok).astype(
          jnp.int32)
      return factors, skipped

    factors, skipped = lax.cond(
        factor_step | any_corrupted, updated_factors,
        lambda: (dict(state.factors), state.skipped_factor_updates))

    preconditioners, rejected = guarded_decomposition(
        placement, dims, {block: factors[block] for block in active_blocks},
        state.preconditioners, state.rejected_decompositions, damping_value,
        damping_ok, factored_damping, when=decomposition_step)

    gradient_matrices = {}
    for name in active:
      layer = layers[name]
      blocks = to_matrix(layers_lib.get_layer_params(grads, layer), layer,
                         jnp.float32)
      gradient_matrices.update(zip(layer.block_names, blocks))
    preconditioned = placement.precondition(
        dims, preconditioners, {**gradient_matrices, **(factored or {})},
        damping_value, sharded)
    if factored_damping:
      # Undo the λ factor of `factored_damping_scaled` so the layers keep
      # their scale against unregistered parameters' ∇ (with the current λ,
      # off from the decomposition's by the adaptations since, a factor ω
      # each, which the step size absorbs).
      preconditioned = {b: p / damping_value
                        for b, p in preconditioned.items()}
    if updates_ok is not None:
      preconditioned = {b: jnp.where(updates_ok, p, 0.0)
                        for b, p in preconditioned.items()}
    if kl_clip_fn is not None and active:
      nu = kl_clip_scale([preconditioned[b] for b in active_blocks],
                         [gradient_matrices[b] for b in active_blocks],
                         learning_rate_fn(count), kl_clip_fn(count))
      preconditioned = {b: nu * p for b, p in preconditioned.items()}
    layer_updates = {
        name: from_matrix(
            jnp.stack([preconditioned[b] for b in layers[name].block_names]),
            layers[name], layers_lib.get_layer_params(grads, layers[name]))
        for name in active
    }
    factors, preconditioners = pin_to_specs(factors, preconditioners, dims)
    new_state = state._replace(
        count=count + 1,
        factors=factors,
        preconditioners=preconditioners,
        skipped_factor_updates=skipped,
        rejected_decompositions=rejected)
    updates = _replace_layers(grads, layers, layer_updates)
    return constrain_to_params(updates), new_state

  def update_fn(
      updates: Any,
      state: ScaleByKFACState,
      params: Any = None,
      *,
      kfac_stats: Mapping[str, LayerStatistics] | None = None,
      split_loss: SplitLoss | None = None,
      **extra_args: Any,
  ) -> tuple[Any, ScaleByKFACState]:
    del extra_args
    # NNX's functional API passes nnx.State trees of Variables (and init
    # put them in the state's params-shaped parts): the layers are read in
    # their values, and the results come back in the containers given.
    new_updates, new_state = update_values(
        nnx_variables.values(updates), nnx_variables.values(state),
        nnx_variables.values(params), kfac_stats, split_loss)
    return (nnx_variables.like(updates, new_updates),
            nnx_variables.like(state, new_state))

  def update_values(
      updates: Any,
      state: ScaleByKFACState,
      params: Any,
      kfac_stats: Mapping[str, LayerStatistics] | None,
      split_loss: SplitLoss | None,
  ) -> tuple[Any, ScaleByKFACState]:
    """``update_fn`` on trees of arrays."""
    if adaptive is not None:
      _check_split_loss(split_loss, params)
    elif split_loss is not None:
      # Likely meant for the adaptive mode, which this transformation is not.
      raise ValueError(
          "update got split_loss, which only scale_by_kfac(adaptive="
          "kfac_jax.AdaptiveConfig(...)) reads; this one was built without "
          "adaptive. Pass adaptive=... to scale_by_kfac, or drop split_loss.")
    layers = find_layers(updates)
    sharded = {}
    if params_partition_specs is not None:
      sharded = _sharded_kernels(layers, placement_lib.check_params_specs(
          updates, params_partition_specs))
    _check_state(layers, state, accumulation_steps, adaptive is not None)
    if adaptive is not None:
      # Only a restored λ can be out of range (NaN/Inf from a corrupted
      # checkpoint): it would enter this step's decompositions and step sizes
      # as it is until the next adaptation step cleaned it up.
      state = state._replace(quadratic_model=state.quadratic_model._replace(
          damping=quadratic_model.clip_damping(state.quadratic_model.damping,
                                               adaptive)))
    _check_preconditioners(state.preconditioners, jax.eval_shape(
        lambda: placement.init(layers_lib.blocks_of(layers))))
    active = _check_stats(kfac_stats, layers, skip, updates)
    if table is None:
      layers_lib.warn_unmatched_skips(
          updates, skip, {s.signature.module_type or ""
                          for s in kfac_stats.values()})

    def stats_factors() -> dict[str, LayerFactors]:
      blocks = {}
      for name in active:
        factors = batch_lib.batch_factors(kfac_stats[name],
                                          fisher_scaled=adaptive is not None,
                                          examples=factor_batch_size)
        blocks.update((block, LayerFactors(a, g)) for block, a, g in zip(
            layers[name].block_names, *factors))
      return blocks

    if accumulation_steps == 1:
      factored = (_factored_gradients(kfac_stats, layers, active, sharded)
                  if gradient_from_stats else None)
      preconditioned, new_state = optimizer_step(state, updates, layers,
                                                 active, stats_factors, sharded,
                                                 factored)
      if adaptive is None:
        return preconditioned, new_state
      step_updates, model_state = quadratic_model.step(
          state.quadratic_model, jax.tree.map(jnp.negative, preconditioned),
          updates, params, split_loss,
          state.count % adaptive.damping_adaptation_interval == 0, adaptive)
      return constrain_to_params(step_updates), new_state._replace(
          quadratic_model=model_state)

    accumulator = state.accumulator
    batch_blocks = _block_names(layers, active)
    factor_step = state.count % factor_update_steps_fn(state.count) == 0
    # Off factor steps the sums are not used; adding zeros keeps the factor
    # computation inside the cond.
    batch = lax.cond(
        factor_step, stats_factors,
        lambda: {b: jax.tree.map(jnp.zeros_like, accumulator.factors[b])
                 for b in batch_blocks})
    # Pinned: G's sums followed a sharded kernel's sharding, off the specs.
    factor_sums = replicate({
        block: (LayerFactors(*(s + b for s, b in zip(sums, batch[block])))
                if block in batch else sums)
        for block, sums in accumulator.factors.items()
    })
    gradient_sums = constrain_to_params(
        jax.tree.map(lambda s, g: s + g.astype(s.dtype), accumulator.gradients,
                     updates))

    def emit():
      # The micro-batches summed: accumulation_steps, unless the state came
      # from a larger accumulation_steps (emitted at once, see below).
      k = (accumulator.micro_step + 1).astype(jnp.float32)
      mean_grads = jax.tree.map(
          lambda s, g: (s / k.astype(s.dtype)).astype(g.dtype), gradient_sums,
          updates)
      # Each micro-batch's cotangents are those of its own mean loss, k
      # times the concatenated batch's: its G is k² times that batch's.
      mean_factors = {
          b: LayerFactors(factor_sums[b].activation_factor / k,
                          factor_sums[b].gradient_factor / k**3)
          for b in batch_blocks
      }
      new_updates, new_state = optimizer_step(state, mean_grads, layers,
                                              active, lambda: mean_factors,
                                              sharded)
      reset = AccumulatorState(
          micro_step=jnp.zeros([], jnp.int32),
          gradients=optax.tree.zeros_like(gradient_sums),
          factors=replicate(jax.tree.map(jnp.zeros_like, factor_sums)))
      return new_updates, new_state._replace(accumulator=reset)

    def hold():
      held = AccumulatorState(accumulator.micro_step + 1, gradient_sums,
                              factor_sums)
      return optax.tree.zeros_like(updates), state._replace(accumulator=held)

    # ">=": a micro_step past the last (a state from a larger
    # accumulation_steps that a traced update could not refuse) emits at once
    # rather than holding forever.
    return lax.cond(accumulator.micro_step >= accumulation_steps - 1, emit,
                    hold)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_placement(
    compute_method: ComputeMethod | str,
    compute_eigenvalue_outer_product: bool,
    inv_dtype: jnp.dtype,
    mesh_axes: str | Sequence[str] | None,
    grad_worker_fraction: DistributedStrategy | float,
    assignment_strategy: AssignmentStrategy | str,
    decomposition_batch_size: int | None = None,
) -> placement_lib.Placement:
  """Where ``scale_by_kfac``'s preconditioners are computed and kept."""
  method = make_method(
      use_eigen=ComputeMethod.parse(compute_method) is ComputeMethod.EIGEN,
      dtype=hp.preconditioner_dtype("inv_dtype", inv_dtype),
      precompute_damped_inverse=static_bool(
          "compute_eigenvalue_outer_product",
          compute_eigenvalue_outer_product),
      decomposition_batch_size=decomposition_batch_size)
  distribution = strategy.make_config(mesh_axes, grad_worker_fraction,
                                      assignment_strategy)
  if distribution is None:
    return placement_lib.local_placement(method)
  return placement_lib.mesh_placement(method, distribution)


def decomposition_inputs(
    factors: Mapping[str, LayerFactors], damping: jax.Array,
    factored_damping: bool) -> tuple[dict[str, LayerFactors], jax.Array]:
  """The factors and λ a decomposition step hands to the placement.

  As given, or, for the adaptive mode's inverse method (``factored_damping``),
  pre-scaled for π-split damping (``inverse.factored_damping_scaled``) with
  λ = 1.
  """
  if not factored_damping:
    return dict(factors), damping
  return ({block: inverse_lib.factored_damping_scaled(f, damping)
           for block, f in factors.items()}, jnp.ones([], jnp.float32))


def _check_not_params_placeholder(params: Any) -> None:
  """Refuses ``optax.tree_utils.tree_map_params``'s stand-in for the params.

  That helper calls ``init`` on one opaque placeholder to find the params
  trees in a state; K-FAC's state is built from the layers in the params,
  so it cannot be derived from a placeholder (and failed with a key
  mismatch deep in optax).
  """
  if type(params).__name__ == "_ParamsPlaceholder":
    raise TypeError(
        "scale_by_kfac: init was given optax's params placeholder, as "
        "optax.tree_utils.tree_map_params does. K-FAC's state is built "
        "from the layers found in the params, which a placeholder hides. "
        "For partition specs of the optimizer state use "
        "kfac_jax.get_opt_state_partition_specs(params, ...); to map over "
        "a state, use jax.tree.map on it.")


def guarded_decomposition(
    placement: placement_lib.Placement, dims: Dims,
    factors: Mapping[str, LayerFactors], previous: Any,
    rejected: jax.Array, damping: jax.Array, damping_ok: jax.Array | None,
    factored_damping: bool, when: jax.Array | bool = True,
) -> tuple[Any, jax.Array]:
  """A decomposition step's preconditioners and rejection count.

  ``factors`` (the blocks to decompose) go through ``decomposition_inputs``
  and ``placement.decompose`` if ``when``; a block whose decomposition comes
  out non-finite keeps its ``previous`` preconditioner (in the layout
  ``placement.init`` makes: a dict, or the packed ``ShardedPreconditioners``)
  and adds one to ``rejected``. ``damping_ok``: whether a scheduled λ is in
  range at this step (``None``: not checked); where it is not, nothing is
  decomposed and every block counts as rejected. Off ``when``, ``previous``
  and ``rejected`` come back as they are. A ``previous`` packed in another
  layout (``placement.stale``: a checkpoint restored under another strategy)
  is decomposed whatever ``when``, from the identity's preconditioners.
  """
  stale = placement.stale(dims, previous)
  if stale is not None and when is not True:
    when = when | stale

  def decomposed():
    to_decompose, decomposition_damping = decomposition_inputs(
        factors, damping, factored_damping)
    preconditioners, newly_rejected = placement.decompose(
        dims, to_decompose, previous, decomposition_damping)
    return preconditioners, rejected + newly_rejected

  if damping_ok is None:
    if when is True:
      return decomposed()
    return lax.cond(when, decomposed, lambda: (previous, rejected))
  return lax.cond(
      when & damping_ok, decomposed,
      lambda: (previous, rejected +
               (when & ~damping_ok).astype(jnp.int32) * len(factors)))


def without_params_shaped(state: ScaleByKFACState) -> ScaleByKFACState:
  """``state`` without its params-shaped parts (accumulated gradients, the
  previous update), which a chain (``optax.multi_transform``) masks."""
  accumulator, model = state.accumulator, state.quadratic_model
  return state._replace(
      accumulator=None if accumulator is None else accumulator._replace(
          gradients=None),
      quadratic_model=None if model is None else model._replace(
          previous_update=None))


def state_partition_specs(state: ScaleByKFACState,
                          placement: placement_lib.Placement,
                          params_specs_of: Callable[[Any], Any]
                          ) -> ScaleByKFACState:
  """``PartitionSpec``s of a state (or of its ``eval_shape``).

  Factors and counters are replicated; the preconditioners are laid out by
  ``placement``; the params-shaped parts (accumulated gradients, the
  previous update) get ``params_specs_of(part)``.
  """
  replicated = lambda tree: jax.tree.map(lambda _: PartitionSpec(), tree)

  def params_shaped(part: Any) -> Any:
    specs = params_specs_of(part)
    # None: masked whole (K-FAC given none of the params in a
    # multi_transform): the MaskedNodes, no arrays.
    return replicated(part) if specs is None else specs

  dims = factor_dims(state.factors)
  accumulator = state.accumulator
  if accumulator is not None:
    accumulator = AccumulatorState(
        micro_step=PartitionSpec(),
        gradients=params_shaped(accumulator.gradients),
        factors=replicated(accumulator.factors))
  model = state.quadratic_model
  if model is not None:
    model = QuadraticModelState(
        damping=PartitionSpec(),
        previous_update=params_shaped(model.previous_update),
        step_sizes=PartitionSpec(), reduction_ratio=PartitionSpec())
  return ScaleByKFACState(
      count=PartitionSpec(),
      factors=replicated(state.factors),
      preconditioners=placement.partition_specs(dims),
      accumulator=accumulator,
      skipped_factor_updates=PartitionSpec(),
      rejected_decompositions=PartitionSpec(),
      quadratic_model=model)


def _sharded_kernels(layers: Mapping[str, LayerInfo],
                     params_specs: Any) -> dict[str, tuple[str, ...]]:
  """``{layer: mesh axes}`` of the layers whose kernel spec shards it."""
  sharded = {}
  for name, layer in layers.items():
    if layer.num_blocks > 1:
      continue  # its blocks are sliced from the whole gradient.
    spec = layers_lib.get_layer_params(params_specs, layer)[layer.kernel_key]
    axes = tuple(placement_lib.named_axes(spec or PartitionSpec()))
    if axes:
      sharded[name] = axes
  return sharded


def _block_names(layers: Mapping[str, LayerInfo],
                 names: Sequence[str]) -> list[str]:
  """State keys of the blocks of ``names``, in order."""
  return [block for name in names for block in layers[name].block_names]


def _factored_gradients(
    stats: Mapping[str, LayerStatistics], layers: Mapping[str, LayerInfo],
    active: Sequence[str],
    sharded: Mapping[str, tuple[str, ...]]) -> dict[str, FactoredGradient]:
  """``{block: aᵀg}`` of the dense layers for which that form is cheaper.

  Decided per layer from static shapes (``factored_is_cheaper``); sharded
  kernels keep the dense form, which ``precondition_in_place`` needs.
  """
  factored = {}
  for name in active:
    layer, signature = layers[name], stats[name].signature
    if (name in sharded or signature.conv is not None or
        signature.num_embeddings is not None):
      continue
    activation, gradient = batch_lib.gradient_rows_of_dense(stats[name])
    if factored_is_cheaper(activation.shape[1], layer.activation_dim,
                           layer.gradient_dim):
      factored.update(
          (block, FactoredGradient(a, g))
          for block, a, g in zip(layer.block_names, activation, gradient))
  return factored


def _replace_layers(grads: Any, layers: Mapping[str, LayerInfo],
                    layer_updates: Mapping[str, Mapping[str, jax.Array]]) -> Any:
  """``grads`` with each preconditioned layer's kernel/bias swapped in."""
  def replace(path, leaf):
    values = layer_updates.get(layers_lib.layer_name(path[:-1]))
    return leaf if values is None else values.get(
        layers_lib.path_key_name(path[-1]), leaf)

  return jax.tree_util.tree_map_with_path(replace, grads)


def _check_state(layers: Mapping[str, LayerInfo], state: ScaleByKFACState,
                 accumulation_steps: int, adaptive: bool) -> None:
  """The state must have been made by ``init`` for these params and this
  configuration."""
  if not isinstance(state, ScaleByKFACState):
    raise TypeError(
        "scale_by_kfac.update: expected the state made by its init, got "
        f"{type(state).__name__}.")
  accumulating = accumulation_steps > 1
  for field, needed, setting in (
      ("accumulator", accumulating, "accumulation_steps > 1"),
      ("quadratic_model", adaptive, "adaptive=AdaptiveConfig(...)")):
    if (getattr(state, field) is not None) != needed:
      raise ValueError(
          f"scale_by_kfac.update: the state {'lacks' if needed else 'has'} "
          f"the {field} that {setting} {'needs' if needed else 'makes'}, so "
          f"it was made by a transformation {'without' if needed else 'with'} "
          f"{setting}. Start from this transformation's tx.init(params) "
          "(tx.init(params)._replace(factors=old_state.factors) keeps the "
          "curvature gathered so far).")
  micro_step = None if state.accumulator is None else state.accumulator.micro_step
  if micro_step is not None and not isinstance(micro_step, jax.core.Tracer):
    if int(micro_step) < 0:
      raise ValueError(
          f"scale_by_kfac.update: the state's accumulator is at micro-step "
          f"{int(micro_step)}; a state from tx.init counts from 0. The state "
          "is corrupted: start from tx.init(params).")
  if (micro_step is not None and not isinstance(micro_step, jax.core.Tracer)
      and int(micro_step) >= accumulation_steps):
    raise ValueError(
        f"scale_by_kfac.update: the state's accumulator is at micro-step "
        f"{int(micro_step)}, outside [0, accumulation_steps={accumulation_steps}"
        "): it was saved by a transformation with a larger accumulation_steps. "
        "Resume with that accumulation_steps, or start from this "
        "transformation's tx.init(params)._replace(factors=old_state.factors, "
        "preconditioners=old_state.preconditioners, count=old_state.count).")
  blocks = layers_lib.blocks_of(layers)
  missing = sorted(set(blocks) - set(state.factors))
  extra = sorted(set(state.factors) - set(blocks))
  if missing or extra:
    raise ValueError(
        "scale_by_kfac: the optimizer state does not match the gradients' "
        f"layers (in the gradients but not the state: {missing}; in the state "
        f"but not the gradients: {extra}). Call tx.init with the same params "
        "(and skip_layers and layers) the gradients come from.")
  for layer in layers.values():
    for block in layer.block_names:
      a_shape = state.factors[block].activation_factor.shape
      g_shape = state.factors[block].gradient_factor.shape
      if a_shape != (layer.activation_dim,) * 2 or g_shape != (
          layer.gradient_dim,) * 2:
        raise ValueError(
            f"Layer {block!r}: state factors A{a_shape}, G{g_shape} do not fit "
            f"a kernel {layer.kernel_shape} (bias={layer.has_bias}); re-run "
            "tx.init with the current params.")


def shapes_and_dtypes(tree: Any) -> Any:
  """``tree`` with each array as ``(shape, dtype)``: equal for like states."""
  return jax.tree.map(
      lambda leaf: (tuple(leaf.shape), jnp.dtype(leaf.dtype)), tree)


def _check_preconditioners(preconditioners: Any, expected: Any) -> None:
  """The state's preconditioners must be what this transformation makes.

  ``checkpoint.restore`` of a state saved without them gives ``None``; a
  state of another method, outer-product setting, ``inv_dtype`` or
  distribution has other arrays. Either failed deep inside the update.
  """
  if preconditioners is None:
    raise ValueError(
        "scale_by_kfac.update: the state has no preconditioners (restored "
        "from a checkpoint saved with include_preconditioners=False). Call "
        "kfac_jax.checkpoint.recompute_preconditioners(state, damping, ...) "
        "with this transformation's arguments first.")
  try:
    found = shapes_and_dtypes(preconditioners)
  except (AttributeError, TypeError):
    found = None
  if found != shapes_and_dtypes(expected):
    raise ValueError(
        "scale_by_kfac.update: the state's preconditioners are not the ones "
        "this transformation makes: "
        f"{_difference(preconditioners, expected)}. Call "
        "kfac_jax.checkpoint.recompute_preconditioners(state, damping, ...) "
        "with this transformation's arguments, or build the transformation "
        "with the arguments the state was made with.")


def _difference(found: Any, expected: Any) -> str:
  """What differs between two preconditioner states (arrays or
  ``ShapeDtypeStruct``s), and which argument would explain it."""

  def kinds(tree: Any) -> list[str]:
    nodes = tree.values() if isinstance(tree, Mapping) else [tree]
    return sorted({type(node).__name__ for node in nodes})

  if kinds(found) != kinds(expected):
    return (f"the state holds {kinds(found)}, this transformation makes "
            f"{kinds(expected)} (another compute_method, or mesh_axes)")
  if jax.tree.structure(found) != jax.tree.structure(expected):
    return ("other arrays of the same kind (another "
            "compute_eigenvalue_outer_product)")
  dtypes = lambda tree: sorted({str(x.dtype) for x in jax.tree.leaves(tree)})
  if dtypes(found) != dtypes(expected):
    return (f"stored as {dtypes(found)}, this transformation stores "
            f"{dtypes(expected)} (another inv_dtype)")
  return ("other shapes (another device count, grad_worker_fraction or "
          "assignment_strategy)")


def _check_split_loss(split_loss: SplitLoss | None, params: Any) -> None:
  """The adaptive mode's extra arguments must be there."""
  if split_loss is None or params is None:
    raise ValueError(
        "scale_by_kfac(adaptive=...).update needs params and split_loss: "
        "tx.update(grads, state, params, kfac_stats=stats, "
        "split_loss=kfac_jax.SplitLoss(outputs_fn, loss_fn)) with the batch "
        "loss = loss_fn(outputs_fn(params)) of the same batch.")
  if not isinstance(split_loss, SplitLoss):
    raise TypeError(
        "split_loss must be a kfac_jax.SplitLoss(outputs_fn, loss_fn, "
        f"regularizer=None); got {type(split_loss).__name__}.")
  for name in ("outputs_fn", "loss_fn"):
    if not callable(getattr(split_loss, name)):
      raise TypeError(f"SplitLoss.{name} must be callable; got "
                      f"{getattr(split_loss, name)!r}.")
  if split_loss.regularizer is not None and not callable(
      split_loss.regularizer):
    raise TypeError("SplitLoss.regularizer must be callable or None; got "
                    f"{split_loss.regularizer!r}.")


def _check_stats(stats: Mapping[str, LayerStatistics] | None,
                 layers: Mapping[str, LayerInfo], skip,
                 gradients: Any) -> list[str]:
  """Validates ``kfac_stats`` against the layers; returns the layers to precondition."""
  if stats is None:
    raise ValueError(
        "scale_by_kfac.update needs kfac_stats=...: compute "
        "(loss, grads, stats) = kfac_jax.value_grad_and_stats(loss_fn)(params, "
        "...) and call tx.update(grads, state, params, kfac_stats=stats). "
        "A wrapper that does not forward extra arguments to tx.update "
        "(flax's TrainState.apply_gradients, optax.lookahead) drops them: "
        "call tx.update yourself (or use nnx.Optimizer.update, which "
        "forwards them).")
  if not isinstance(stats, Mapping) or not all(
      isinstance(s, LayerStatistics) for s in stats.values()):
    raise TypeError(
        "kfac_stats must be the dict of LayerStatistics returned by "
        f"kfac_jax.value_grad_and_stats; got {type(stats).__name__}.")
  active = []
  for name, layer in layers.items():
    layer_stats = stats.get(name)
    if layer_stats is None:
      raise ValueError(
          f"kfac_stats has no entry for layer {name!r} (kernel "
          f"{layer.kernel_shape}), which the optimizer state holds. Either the "
          "layer was not called in the loss (or is not a layer the capture "
          "knows: Dense, DenseGeneral, Conv, Embed and NNX's Linear, "
          "LinearGeneral, Conv, Embed), was skipped by the capture, or the "
          "stats come from another model. Add "
          f"{layers_lib.skip_pattern(name)!r} to skip_layers to leave it to "
          "the chained optimizer."
          + ("" if layer.module_type is not None else
             " A skip_layers pattern naming its Flax class skips it in the "
             "capture, but scale_by_kfac cannot see the class without the "
             "layer table: skip it by path, or pass "
             "layers=kfac_jax.trace_layers(...)."))
    signature = layer_stats.signature
    if layers_lib.matches_any(skip, signature.module_type):
      continue
    _check_shapes(name, layer, layer_stats)
    active.append(name)
  for name, layer_stats in stats.items():
    # Embed tables are layers only with precondition_embeddings.
    if name in layers or layer_stats.signature.num_embeddings is not None:
      continue
    path = tuple(name.split("/")) if name else ()
    if layers_lib.is_skipped_layer(path, layer_stats.signature.module_type,
                                   skip) or layers_lib.is_masked_layer(
                                       gradients, path):
      continue
    if layers_lib.has_kernel(gradients, path):
      raise ValueError(
          f"kfac_stats has layer {name!r} "
          f"({layer_stats.signature.module_type}), and the gradients have "
          "its kernel, but the optimizer's layers (the layers= table, or "
          "those found in the params at init) lack it: trace the table from "
          "the training loss (kfac_jax.trace_layers), "
          f"or add {layers_lib.skip_pattern(name)!r} to skip_layers to leave "
          "it to the chained optimizer.")
    raise ValueError(
        f"kfac_stats has layer {name!r} ({layer_stats.signature.module_type}) "
        "but the gradients have no kernel at that path. Pass the stats and "
        "grads of the same loss call, and init with the same params; a "
        "wrapper that reshapes the gradients (optax.flatten) hides the "
        "layers from scale_by_kfac.")
  return active


def _check_shapes(name: str, layer: LayerInfo, stats: LayerStatistics) -> None:
  signature = stats.signature
  conv = signature.conv
  captured = (signature.stack_ndim, signature.contracted_ndim, signature.groups)
  expected = (layer.stack_ndim, len(layer.contracted_shape), layer.groups)
  if captured != expected:
    raise ValueError(
        f"Layer {name!r} ({signature.module_type}): the captured call has "
        f"{signature.stack_ndim} stack axes, {signature.contracted_ndim} "
        f"contracted kernel axes and {signature.groups} groups, but the "
        f"optimizer reads kernel {layer.kernel_shape} as {expected[0]}, "
        f"{expected[1]} and {expected[2]}. Scanned layers, grouped "
        "convolutions and DenseGeneral need the layer table: "
        "scale_by_kfac(..., layers=kfac_jax.trace_layers(loss_fn, params, "
        f"*batch)). Or add {layers_lib.skip_pattern(name)!r} to skip_layers.")
  stack = layer.stack_ndim
  contracted = layer.contracted_shape
  problems = []
  if signature.has_bias != layer.has_bias:
    problems.append(f"the captured layer has use_bias={signature.has_bias} but "
                    f"the params {'have' if layer.has_bias else 'lack'} a bias")
  if conv is not None and contracted[:-1] != conv.window:
    problems.append(f"conv window {conv.window} != kernel window "
                    f"{contracted[:-1]}")
  for x in stats.inputs:
    if x.shape[:stack] != layer.stack_shape:
      problems.append(f"input stack axes {x.shape[:stack]} != kernel "
                      f"{layer.stack_shape}")
    elif conv is not None and x.shape[-1] != contracted[-1] * layer.groups:
      problems.append(f"input channels {x.shape[-1]} != kernel in "
                      f"{contracted[-1]} x {layer.groups} groups")
    elif signature.num_embeddings is not None:
      if (signature.num_embeddings,) != contracted:
        problems.append(f"vocabulary {signature.num_embeddings} != table "
                        f"rows {contracted}")
    elif conv is None and tuple(
        x.shape[a] for a in signature.input_axes) != contracted:
      problems.append(f"input features {tuple(x.shape[a] for a in signature.input_axes)}"
                      f" != kernel in {contracted}")
  output_ndim = 1 if conv is not None else signature.output_ndim
  for g in stats.output_cotangents:
    if g.shape[:stack] != layer.stack_shape or g.shape[
        g.ndim - output_ndim:] != layer.output_shape:
      problems.append(f"output {g.shape} does not end in kernel out "
                      f"{layer.output_shape}")
  if problems:
    raise ValueError(
        f"Layer {name!r}: kfac_stats disagree with the params: "
        f"{'; '.join(problems)}. Pass stats and grads from the same model, or "
        f"add {layers_lib.skip_pattern(name)!r} to skip_layers.")
