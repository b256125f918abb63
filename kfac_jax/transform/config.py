"""``KFACConfig``: the arguments of ``scale_by_kfac``, validated once.

The keyword-only arguments of ``scale_by_kfac`` are the fields of
``KFACConfig``, with the same names, order, annotations and defaults
(``tests/test_validation.py`` checks it), and their documentation is
``KFACConfig``'s (``with_config_args_doc``). Building one checks every
argument and normalizes it (hyper-parameters as ``Hyperparameter`` callables
of the step count, enums parsed, skip patterns compiled, the preconditioners'
``Placement`` made), so that ``scale_by_kfac``,
``get_opt_state_partition_specs`` and ``checkpoint.recompute_preconditioners``
read one frozen value built from the same keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax.numpy as jnp

from kfac_jax import hyperparameters as hp
from kfac_jax.capture import layers as layers_lib
from kfac_jax.capture.layers import LayerInfo, LayerTable
from kfac_jax.distribution import placement as placement_lib
from kfac_jax.distribution import strategy
from kfac_jax.distribution.strategy import (
  AssignmentStrategy,
  DistributedStrategy,
)
from kfac_jax.hyperparameters import (
  ComputeMethod,
  DampingMode,
  ScalarOrSchedule,
  WeightSharing,
)
from kfac_jax.preconditioning.methods import make_method
from kfac_jax.preconditioning.subspace import SubspaceSolver
from kfac_jax.transform import arguments, nnx_variables
from kfac_jax.transform.quadratic_model import AdaptiveConfig

# scale_by_kfac's λ (relative) and κ unless given (the kfac alias's too).
DEFAULT_DAMPING = 0.01
DEFAULT_KL_CLIP = 0.1
# The dtype of the preconditioners unless given: a dtype instance, not the
# callable jnp.float32 (see inv_dtype).
DEFAULT_INV_DTYPE = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class KFACConfig:
  """The configuration of ``scale_by_kfac``, checked and normalized.

  Built from ``scale_by_kfac``'s arguments (the fields below, by the same
  names); afterwards each field holds its normalized value: hyper-parameters
  as ``hyperparameters.Hyperparameter`` (``kl_clip`` may be ``None``),
  ``compute_method`` a ``ComputeMethod``, ``skip_layers`` the compiled
  patterns, dtypes resolved, flags and sizes Python values,
  ``params_partition_specs`` without NNX Variables; ``placement`` is where
  the preconditioners are computed and kept.

  Args:
    learning_rate: the learning rate of the chained optimizer; only KL clipping
      uses it (``vg = lr² Σ P ⊙ ∇``). Constant or schedule, ≥ 0 (at 0, as
      a warmup from 0 starts, nothing is clipped: ν = 1).
    damping: λ in ``(A ⊗ G + λI)⁻¹``. Constant or schedule, > 0. With
      ``damping_mode="relative"`` a fraction of each layer's mean
      curvature (the same setting serves every layer, batch size and
      input scale); with ``"absolute"`` in the units of the factors.
    damping_mode: ``"relative"`` (the default) normalizes each layer's
      factors to mean eigenvalue 1 before damping them,
      ``Â = A / (tr A / dA)``, ``Ĝ = G / (tr G / dG)``: the eigen method
      gives ``(Â ⊗ Ĝ + λI)⁻¹ vec(∇)``, the inverse method
      ``(Â + √λI)⁻¹ ∇ (Ĝ + √λI)⁻¹`` (Martens & Grosse's π-adjusted damping,
      λ relative), so ``P`` keeps the gradient's scale and the chained
      optimizer's learning rate means what it means for SGD.
      ``"absolute"``: KAISA's ``(A ⊗ G + λI)⁻¹`` and
      ``(A + λI)⁻¹ ∇ (G + λI)⁻¹`` on the factors as they are (``G`` of the
      mean loss scales as 1/batch², a convolution's ``A`` as
      1/positions²). ``None``: relative, or with ``adaptive`` absolute
      (the only one it takes: its λ is adapted on the Fisher's scale).
    factor_decay: d in ``F ← d·F + (1 − d)·F_batch``. Constant or schedule,
      in [0, 1]: 0 replaces F by ``F_batch``, 1 keeps F.
      ``kfac_jax.schedules.exp_decay_factor_averaging()`` is KAISA's
      ``min(1 − 1/max(step, 1), 0.95)``.
    kl_clip: KL-clipping bound κ. Constant or schedule, > 0; ``None``
      turns clipping off.
    momentum: the chained optimizer's heavy-ball momentum μ in [0, 1)
      (constant or schedule; ``None``: 0), read only by KL clipping: the step
      actually taken settles at ``lr·ν·P / (1 − μ)`` while ``P`` keeps its
      direction, so the clip measures ``vg = (lr / (1 − μ))² Σ P ⊙ ∇`` and κ
      bounds that step. ``kfac_jax.kfac`` passes its own.
    factor_update_steps: factors update when ``step % factor_update_steps ==
      0``. Positive integer or schedule.
    inv_update_steps: eigendecompositions (or inverses) are recomputed when
      ``step % inv_update_steps == 0``. Positive integer or schedule.
    compute_method: ``"eigen"`` or ``"inverse"``. ``None``: ``"inverse"``
      (a Cholesky inverse costs a fraction of an ``eigh`` of the same
      factor, and it preconditions with one pair of products instead of
      two), or ``"eigen"`` where another argument needs eigenbases
      (``eigenvalue_correction``, ``eigen_solver="subspace"``, bfloat16
      ``factor_dtype``).
    compute_eigenvalue_outer_product: eigen method only: store
      ``1/(outer(d_A, d_G) + λ)`` at each decomposition (λ then stays fixed
      until the next one) instead of forming it every step.
    accumulation_steps: k > 1 accumulates k micro-batches per optimizer step:
      gradients and batch factors are averaged over them (G also divided by
      k²: each micro-batch's loss is its own mean), as for one step on the
      concatenated batch, and the preconditioned update is emitted on the
      k-th call (zeros before). Wrap the rest of the chain in
      ``optax.MultiSteps(..., every_k_schedule=k, use_grad_mean=False)`` so
      it steps once per k calls (``kfac`` does).
    skip_layers: regexes (``re.search``) matched against each layer's module
      path (joined with ``/``) and its Flax class name; matched layers and all
      modules under them are left to the chained optimizer. Class-name matches
      are known from the layer table or once stats arrive, so without a
      table such layers still get (unused) state, and the capture given the
      same pattern leaves them without stats, which ``update`` refuses: skip
      by path there.
    max_factor_dim: layers with a Kronecker factor larger than this on a
      side (A's ``prod(contracted) + 1`` with a bias, G's outputs per group)
      are left to the chained optimizer, as ``skip_layers`` leaves them:
      their ``O(d³)`` decomposition and ``O(d²·out)`` preconditioning
      outweigh what they give (a 3136→256 Dense head: A is ``[3137,
      3137]``). Their stats, if the capture computes them, are unused (and
      left out of a jitted step). Positive integer; ``None``: no limit.
    factor_dtype: storage dtype of A and G; default float32 (the kernel's
      dtype if wider). A bfloat16 running average stalls once
      ``(1 − d)·|F_batch − F|`` is below half a bfloat16 step of ``F``, so
      bfloat16 is an explicit choice.
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
      mini-batch). A float f in (0, 1): ``max(1, round(f·B))`` examples.
      The gradients still use the whole batch. ``None``, or k ≥ B: every
      example.
    weight_sharing: the rows of a layer that shares its weights over
      positions (a ``Dense`` on ``[B, T, d]``, a convolution's output
      positions; ``factors.batch``). ``"expand"``: every position is a row
      (``B·T`` rows). ``"reduce"`` (KFAC-reduce, Eschenhagen et al. 2023):
      one row per example, its inputs averaged and its output cotangents
      summed over the positions, so the factor products cost ``1/T`` of
      expand's. Embeddings keep their rows. EKFAC's scales use the same rows.
    gradient_from_stats: precondition each dense layer's gradient in the
      factored form its ``kfac_stats`` give, ``∇ = aᵀg`` (``a [N, dA]`` the
      inputs, with the bias's ones column; ``g [N, dG]`` the output
      cotangents; ``N`` the rows of all calls), wherever that is cheaper:
      ``L ∇ R = (a Lᵀ)ᵀ(g R)`` costs ``2·N·(dA² + dG² + dA·dG)`` FLOPs
      instead of ``2·dA·dG·(dA + dG)`` (``gradient_matrix.sandwich``; the
      inverse method's one pair of products, the eigen method's first). The
      result is the same, *provided* the incoming gradients of those layers
      are exactly the gradient of the loss the stats were captured from: the
      stats of ``value_grad_and_stats`` of the training loss (not
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
      (``inverse.factored_damping_scaled``) instead of adding it to each.
      The updates are then the final parameter updates (apply them with
      ``optax.apply_updates``; chain nothing that rescales them), and
      ``update`` also needs ``params`` and ``split_loss=SplitLoss(...)``.
      Needs ``kl_clip=None`` and ``accumulation_steps=1``; ``learning_rate``
      is unused.
    eigen_solver: eigen method: how each decomposition step refreshes the
      eigenbases. ``"eigh"``: a full ``eigh`` of every factor.
      ``"subspace"`` (``SubspaceSolver()``) or a ``SubspaceSolver(steps,
      drift_threshold)``: ``steps`` steps of warm-started subspace
      iteration from the stored basis, ``Q ← qr(F·Q)`` with its columns
      sorted by decreasing Rayleigh quotient ``diag(Qᵀ F Q)``, which give
      the eigenvalues (``preconditioning.subspace``): two ``[d, d]``
      products and a QR per step instead of an ``eigh``. A factor's first
      decomposition (its basis still the identity), and a refresh that
      drifted, ``‖F − Q diag(d) Qᵀ‖_F > drift_threshold·‖F‖_F``, use
      ``eigh``; the state counts the drifted ones (``eigh_fallbacks``).
    eigenvalue_correction: eigen method: EKFAC (George et al. 2018). The
      scaling ``outer(d_A, d_G)`` is replaced by running second moments of
      the gradient rows in the Kronecker eigenbasis,
      ``S ← d·S + (1 − d)·mean_n((Q_Aᵀ a_n)² (Q_Gᵀ g_n)²ᵀ)`` on factor
      steps, and ``P = Q_A [(Q_Aᵀ ∇ Q_G) / (S + λ)] Q_Gᵀ``
      (``preconditioning.ekfac``, which gives the costs). Dense and
      ``DenseGeneral`` layers only: a registered convolution or embedding
      is refused by name. With ``mesh_axes`` the decompositions are spread
      as the strategy says; ``S`` is replicated, and every device reads
      every active basis each step (one all-gather unless every device
      keeps them all, ``grad_worker_fraction=1``) and preconditions every
      layer itself.
    second_moment_decay: eigen method: β of a running second moment of the
      gradient in the Kronecker eigenbasis, ``v ← β·v + (1 − β)·R²`` with
      ``R = Q_Aᵀ ∇ Q_G``, updated every step (statistics or not), which
      replaces ``outer(d_A, d_G)``: ``P = Q_A [R / (√v̂ + λ)] Q_Gᵀ``, ``v̂``
      bias-corrected, ``√v̂`` divided by its mean under relative damping
      (``preconditioning.second_moment``): Adam in K-FAC's eigenbasis, as
      SOAP runs it in Shampoo's. Constant or schedule in [0, 1); ``None``:
      off. Not with ``eigenvalue_correction`` (the other estimate of the
      same scaling), the adaptive mode (its λ is on the Fisher's scale),
      ``precondition_embeddings`` or ``gradient_from_stats``. ``v`` is
      replicated as EKFAC's ``S`` is.

  Raises:
    ValueError, TypeError: an argument out of range or of the wrong kind,
      or two that do not work together; the message names them.
  """

  # The fields are the arguments, as scale_by_kfac's signature repeats them;
  # for those whose normalized value has another type, the type checker
  # reads the declarations under TYPE_CHECKING (what __post_init__ stores),
  # and the constructor's arguments are checked at run time.
  if TYPE_CHECKING:
    learning_rate: hp.Hyperparameter
    damping: hp.Hyperparameter
    damping_mode: DampingMode
    factor_decay: hp.Hyperparameter
    kl_clip: hp.Hyperparameter | None
    second_moment_decay: hp.Hyperparameter | None
    momentum: hp.Hyperparameter
    factor_update_steps: hp.Hyperparameter
    inv_update_steps: hp.Hyperparameter
    compute_method: ComputeMethod
    skip_layers: tuple[re.Pattern[str], ...]
    weight_sharing: WeightSharing

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...

  if not TYPE_CHECKING:
    learning_rate: ScalarOrSchedule = 0.1
    damping: ScalarOrSchedule = DEFAULT_DAMPING
    damping_mode: DampingMode | str | None = None
    factor_decay: ScalarOrSchedule = 0.95
    kl_clip: ScalarOrSchedule | None = DEFAULT_KL_CLIP
    momentum: ScalarOrSchedule | None = 0.0
    factor_update_steps: ScalarOrSchedule = 1
    inv_update_steps: ScalarOrSchedule = 1
    compute_method: ComputeMethod | str | None = None
  compute_eigenvalue_outer_product: bool = True
  accumulation_steps: int = 1
  if not TYPE_CHECKING:
    skip_layers: Sequence[str] | str | None = None
  max_factor_dim: int | None = None
  factor_dtype: jnp.dtype | None = None
  inv_dtype: jnp.dtype = DEFAULT_INV_DTYPE
  mesh_axes: str | Sequence[str] | None = None
  grad_worker_fraction: DistributedStrategy | float = (
    DistributedStrategy.COMM_OPT
  )
  assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE
  params_partition_specs: Any = None
  layers: LayerTable | None = None
  precondition_embeddings: bool = False
  decomposition_batch_size: int | None = None
  factor_batch_size: int | float | None = None
  if not TYPE_CHECKING:
    weight_sharing: WeightSharing | str = WeightSharing.EXPAND
  gradient_from_stats: bool = False
  adaptive: AdaptiveConfig | None = None
  eigen_solver: str | SubspaceSolver = "eigh"
  eigenvalue_correction: bool = False
  if not TYPE_CHECKING:
    second_moment_decay: ScalarOrSchedule | None = None
  placement: placement_lib.Placement = dataclasses.field(init=False)

  def __post_init__(self) -> None:
    set_ = functools.partial(object.__setattr__, self)
    # Until set_ stores a field's normalized value it holds the argument as
    # given, of the type the dataclass field declares.
    given: Any = self
    for name, value in arguments.hyperparameters(self).items():
      set_(name, value)
    set_("compute_method", arguments.compute_method(self))
    set_(
      "damping_mode", arguments.damping_mode(self.damping_mode, self.adaptive)
    )
    set_(
      "accumulation_steps",
      hp.static_positive_integer("accumulation_steps", self.accumulation_steps),
    )
    set_("skip_layers", layers_lib.compile_patterns(given.skip_layers))
    if self.max_factor_dim is not None:
      set_(
        "max_factor_dim",
        hp.static_positive_integer("max_factor_dim", self.max_factor_dim),
      )
    arguments.check_layer_table(self.layers)
    if self.adaptive is not None:
      arguments.check_adaptive(self, self.adaptive)
    set_(
      "precondition_embeddings",
      hp.static_bool("precondition_embeddings", self.precondition_embeddings),
    )
    if self.precondition_embeddings and self.layers is None:
      raise ValueError(
        "precondition_embeddings=True needs the layer table: "
        "scale_by_kfac(..., layers=kfac_jax.trace_layers(loss_fn, params, "
        "*batch))."
      )
    set_(
      "factor_dtype",
      arguments.factor_dtype(self.factor_dtype, self.compute_method),
    )
    set_("inv_dtype", hp.preconditioner_dtype("inv_dtype", self.inv_dtype))
    if self.decomposition_batch_size is not None:
      set_(
        "decomposition_batch_size",
        hp.static_positive_integer(
          "decomposition_batch_size", self.decomposition_batch_size
        ),
      )
    set_(
      "factor_batch_size", arguments.factor_batch_size(self.factor_batch_size)
    )
    set_("weight_sharing", WeightSharing.parse(self.weight_sharing))
    set_(
      "gradient_from_stats",
      hp.static_bool("gradient_from_stats", self.gradient_from_stats),
    )
    arguments.check_gradient_from_stats(self)
    set_(
      "eigenvalue_correction",
      hp.static_bool("eigenvalue_correction", self.eigenvalue_correction),
    )
    set_("eigen_solver", arguments.eigen_solver(self.eigen_solver))
    arguments.check_eigen_options(self)
    arguments.check_second_moment(self)
    set_(
      "placement",
      make_placement(
        self.compute_method,
        self.compute_eigenvalue_outer_product,
        self.inv_dtype,
        self.mesh_axes,
        self.grad_worker_fraction,
        self.assignment_strategy,
        self.decomposition_batch_size,
        self.subspace_solver,
        self.relative_damping,
      ),
    )
    set_(
      "compute_eigenvalue_outer_product",
      bool(self.compute_eigenvalue_outer_product),
    )
    # Specs made by jax.tree.map over an nnx.State sit in its Variables.
    set_(
      "params_partition_specs",
      nnx_variables.values(self.params_partition_specs),
    )

  @property
  def factored_damping(self) -> bool:
    """Whether λ is split between the factors (π-damping).

    The adaptive mode's λ is on the Fisher's scale: the inverse method then
    splits it between the factors instead of adding λ to each.
    """
    return (
      self.adaptive is not None and self.compute_method is ComputeMethod.INVERSE
    )

  @property
  def reduce(self) -> bool:
    """Whether weight-sharing layers' factors use KFAC-reduce's rows."""
    return self.weight_sharing is WeightSharing.REDUCE

  @property
  def keeps_eigenvalue_scales(self) -> bool:
    """Whether the state keeps a scaling in the eigenbasis
    (``eigenvalue_scales``): EKFAC's ``S`` or the gradient's ``v``."""
    return self.eigenvalue_correction or self.second_moment_decay is not None

  @property
  def relative_damping(self) -> bool:
    """Whether λ is relative to each layer's mean curvature."""
    return self.damping_mode is DampingMode.RELATIVE

  @property
  def subspace_solver(self) -> SubspaceSolver | None:
    """The subspace solver's settings, or ``None`` for ``eigh``."""
    return (
      self.eigen_solver
      if isinstance(self.eigen_solver, SubspaceSolver)
      else None
    )

  def find_layers(
    self, params: Any, warn_untraced: bool = False
  ) -> tuple[dict[str, LayerInfo], frozenset[str]]:
    """The layers of ``params`` to precondition, and the names of those
    ``max_factor_dim`` leaves out (``layers_lib.find_layers`` with this
    configuration's skips and table, then ``within_factor_size``)."""
    layers = layers_lib.find_layers(
      params,
      skip=self.skip_layers,
      table=self.layers,
      warn_untraced=warn_untraced,
      include_embeddings=self.precondition_embeddings,
    )
    return layers_lib.within_factor_size(layers, self.max_factor_dim)


def make_placement(
  compute_method: ComputeMethod | str,
  compute_eigenvalue_outer_product: bool,
  inv_dtype: jnp.dtype,
  mesh_axes: str | Sequence[str] | None,
  grad_worker_fraction: DistributedStrategy | float,
  assignment_strategy: AssignmentStrategy | str,
  decomposition_batch_size: int | None = None,
  solver: SubspaceSolver | None = None,
  relative_damping: bool = False,
) -> placement_lib.Placement:
  """Where ``scale_by_kfac``'s preconditioners are computed and kept."""
  method = make_method(
    use_eigen=ComputeMethod.parse(compute_method) is ComputeMethod.EIGEN,
    dtype=hp.preconditioner_dtype("inv_dtype", inv_dtype),
    precompute_damped_inverse=hp.static_bool(
      "compute_eigenvalue_outer_product", compute_eigenvalue_outer_product
    ),
    decomposition_batch_size=decomposition_batch_size,
    solver=solver,
    relative_damping=relative_damping,
  )
  distribution = strategy.make_config(
    mesh_axes, grad_worker_fraction, assignment_strategy
  )
  if distribution is None:
    return placement_lib.local_placement(method)
  return placement_lib.mesh_placement(method, distribution)


F = TypeVar("F", bound=Callable[..., Any])


def with_config_args_doc(fn: F) -> F:
  """Puts ``KFACConfig``'s ``Args`` in place of the line
  ``Args: KFACConfig's.`` of ``fn``'s docstring (``fn`` declares
  ``KFACConfig``'s fields as its keyword-only arguments)."""
  args = re.search(r"\n  Args:\n.*?\n\n", KFACConfig.__doc__ or "", re.S)
  if args is None or fn.__doc__ is None:
    raise AssertionError("KFACConfig and fn must have docstrings.")
  fn.__doc__ = fn.__doc__.replace("\n  Args: KFACConfig's.\n\n", args.group(0))
  return fn
