"""Adaptive step sizes and damping from an exact quadratic model.

After Martens & Grosse (2015).

With ``adaptive=AdaptiveConfig(...)``, ``scale_by_kfac`` turns the K-FAC
direction ``Δ = −(F̂ + λI)⁻¹ ∇`` and the previous update ``δ`` into the update
``α Δ + μ δ`` that minimises the local quadratic model of the loss

  ``M(v) = L(θ) + ∇ᵀv + ½ vᵀ(C + λI)v``

over ``(α, μ)``, where ``C`` is the exact Gauss-Newton matrix of the batch
loss (plus the regularizer's Hessian). With ``K = [Δ, δ]``:

  ``[α, μ]ᵀ = −(Kᵀ(C + λI)K)⁻¹ Kᵀ∇``,

a 2×2 solve whose entries need only the products ``J Δ`` and ``J δ`` of the
network's output Jacobian ``J`` (forward mode) and the loss's Hessian with
respect to the outputs (``SplitLoss``). Every ``interval`` steps the
Levenberg-Marquardt rule compares the achieved reduction with the predicted
one, ``ρ = (L(θ + v) − L(θ)) / (M(v) − L(θ))`` (by default with the
``λ`` term left out of ``M``, as kfac-jax does), and multiplies ``λ`` by
``ω = decay^interval`` when ``ρ > ¾`` or divides it by ``ω`` when ``ρ < ¼``.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import errors as flax_errors

from kfac_jax import finite
from kfac_jax import hyperparameters as hp
from kfac_jax.linalg import tree_inner_products

# Below this determinant (relative to the diagonal's product) the 2×2 system
# is treated as singular: δ is (nearly) parallel to Δ, or δ = 0 at step 0.
_SINGULAR_TOLERANCE = 1e-6


class SplitLoss(NamedTuple):
  """The batch loss, split where the Gauss-Newton matrix needs it.

  ``loss(params) = loss_fn(outputs_fn(params)) + regularizer(params)``, for
  the batch whose gradients and stats are passed to the same ``update``.

  Attributes:
    outputs_fn: ``params -> outputs`` (any pytree, e.g. the logits), the
      network applied to the batch.
    loss_fn: ``outputs -> scalar``, the batch loss from the outputs (targets
      closed over); convex in the outputs (cross-entropies, squared error) so
      that the Gauss-Newton matrix ``Jᵀ ∇²loss_fn J`` is positive
      semi-definite.
    regularizer: optional ``params -> scalar`` added to the loss (e.g.
      ``1e-5 · ½‖θ‖²``); its exact Hessian enters the curvature. The
      gradients passed to ``update`` must include it.
  """

  outputs_fn: Callable[[Any], Any]
  loss_fn: Callable[[Any], jax.Array]
  regularizer: Callable[[Any], jax.Array] | None = None


class AdaptiveConfig(NamedTuple):
  """Settings of the adaptive mode of ``scale_by_kfac`` (DeepMind kfac-jax's).

  Attributes:
    min_damping: lower bound of λ, > 0. kfac-jax's autoencoder example uses
      1e-5; here the default is 1e-4 because with the quadratic model on a
      curvature mini-batch (a quarter of the batch), λ sits at the floor for
      most of training, and at 1e-5 the noisy model's step sizes (|μ| up to
      10) threw the MNIST autoencoder's objective up by ~1.5 after ~760
      steps, where 1e-4 kept it descending (``benchmarks/README.md``,
      *Damping floor*).
    max_damping: upper bound of λ, ≥ ``min_damping``.
    damping_adaptation_decay: per-step factor ``decay`` in (0, 1); λ changes
      by ``ω = decay^damping_adaptation_interval`` at a time.
    damping_adaptation_interval: λ is adapted every that many steps, which
      costs one extra forward pass of ``outputs_fn`` on those steps.
    use_momentum: solve for ``(α, μ)``; ``False`` solves for ``α`` alone.
    include_damping_in_quadratic_change: whether the predicted change that ρ
      divides by includes the ``½λ‖v‖²`` term. Without it (kfac-jax's
      default), ρ measures the Gauss-Newton model alone: a λ much larger
      than the curvature gives short steps the model predicts well (ρ ≈ 1),
      where with the term the same steps read as ρ ≈ 2.
  """

  min_damping: float = 1e-4
  max_damping: float = 1000.0
  damping_adaptation_decay: float = 0.95
  damping_adaptation_interval: int = 5
  use_momentum: bool = True
  include_damping_in_quadratic_change: bool = False

  def check(self) -> AdaptiveConfig:
    """Raises a clear error on an invalid setting; returns ``self``."""
    if not isinstance(self, AdaptiveConfig):
      advice = (
        " (the class itself: pass an instance, AdaptiveConfig())"
        if self is AdaptiveConfig
        else ""
      )
      raise TypeError(
        f"adaptive must be a kfac_jax.AdaptiveConfig; got "
        f"{type(self).__name__}{advice}."
      )
    for name in ("min_damping", "max_damping", "damping_adaptation_decay"):
      value = hp.static_scalar(
        f"AdaptiveConfig.{name}", getattr(self, name), "adaptive"
      )
      if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (numbers.Real, np.floating, np.integer)
      ):
        raise TypeError(
          f"AdaptiveConfig.{name} must be a real number; got "
          f"{getattr(self, name)!r} "
          f"({type(getattr(self, name)).__name__})."
        )
      # NumPy's stubs take its own scalar types, not numbers.Real.
      if not np.isfinite(value):  # pyright: ignore[reportCallIssue, reportArgumentType]
        raise ValueError(
          f"AdaptiveConfig.{name} must be finite; got {value!r}."
        )
    # λ is float32 in the state: a floor that is 0 (or subnormal, which XLA
    # may flush to 0) there would let λ reach 0, from which the rule's λ/ω
    # can never grow back.
    tiny = np.finfo(np.float32).tiny
    if 0 < self.min_damping and not np.float32(self.min_damping) >= tiny:
      raise ValueError(
        f"AdaptiveConfig.min_damping={self.min_damping!r} is below "
        f"float32's smallest normal number, {float(tiny):.3g} (λ is "
        "float32): λ could reach 0 and stay there."
      )
    with np.errstate(over="ignore"):
      max_damping = np.float32(self.max_damping)
    if not np.isfinite(max_damping):
      raise ValueError(
        f"AdaptiveConfig.max_damping={self.max_damping!r} is past float32's "
        f"largest value, {float(np.finfo(np.float32).max):.3g} (λ is "
        "float32): λ could reach inf, where every update is zero and λ/ω "
        "never comes back."
      )
    if not 0 < self.min_damping <= self.max_damping:
      raise ValueError(
        "AdaptiveConfig needs 0 < min_damping <= max_damping; got "
        f"min_damping={self.min_damping!r}, max_damping={self.max_damping!r}."
      )
    if not 0 < self.damping_adaptation_decay < 1:
      raise ValueError(
        "AdaptiveConfig.damping_adaptation_decay must be in "
        f"(0, 1); got {self.damping_adaptation_decay!r}."
      )
    interval = hp.static_positive_integer(
      "AdaptiveConfig.damping_adaptation_interval",
      self.damping_adaptation_interval,
      "adaptive",
    )
    if interval > np.iinfo(np.int32).max:
      raise ValueError(
        "AdaptiveConfig.damping_adaptation_interval must fit in int32 (the "
        f"step count's type); got {interval}."
      )
    # λ is float32: an ω = decay^interval that rounds to 1 there never moves
    # it.
    if np.float32(float(self.damping_adaptation_decay) ** interval) == 1:
      raise ValueError(
        "AdaptiveConfig: ω = damping_adaptation_decay^"
        "damping_adaptation_interval = "
        f"{float(self.damping_adaptation_decay)!r}^{interval} rounds to 1 in "
        "float32 (λ's type), so λ would never change; use a smaller decay."
      )
    for name in ("use_momentum", "include_damping_in_quadratic_change"):
      hp.static_bool(f"AdaptiveConfig.{name}", getattr(self, name), "adaptive")
    return self


class QuadraticModelState(NamedTuple):
  """What the adaptive mode carries between steps.

  Attributes:
    damping: the current λ (float32 scalar).
    previous_update: the last emitted update δ (structure of the params).
    step_sizes: ``[α, μ]`` of the last step (float32 ``[2]``).
    reduction_ratio: ρ at the last damping adaptation (float32 scalar; 1
      before the first one).
  """

  damping: jax.Array
  previous_update: Any
  step_sizes: jax.Array
  reduction_ratio: jax.Array


def init(
  params: Any, damping: float | jax.Array, config: AdaptiveConfig
) -> QuadraticModelState:
  """The state before the first step, λ = ``damping``.

  A constant λ was checked against ``config``'s range when the
  transformation was built; one traced by ``optax.inject_hyperparams`` in a
  jitted ``init`` could not be, so it is kept in range as the rule keeps
  every later λ (``clip_damping``).
  """
  return QuadraticModelState(
    damping=clip_damping(jnp.asarray(damping, jnp.float32), config),
    previous_update=optax.tree.zeros_like(params),
    step_sizes=jnp.zeros([2], jnp.float32),
    reduction_ratio=jnp.ones([], jnp.float32),
  )


def _cross_products(left: Sequence[Any], right: Sequence[Any]) -> jax.Array:
  """``[leftᵢᵀ rightⱼ]`` (``[len(left), len(right)]``) of pytrees, one pass."""
  pairs = [
    (i, len(left) + j) for i in range(len(left)) for j in range(len(right))
  ]
  return tree_inner_products((*left, *right), pairs).reshape(
    len(left), len(right)
  )


def _real_scalar(name: str, value: Any) -> jax.Array:
  """``value``, checked at trace time to be what ``SplitLoss.name`` returns:
  a floating scalar (jax's own error for a vector or an integer names no
  piece of the ``SplitLoss``)."""
  shape, dtype = np.shape(value), jnp.result_type(value)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"SplitLoss.{name} must return a floating scalar (reduce per-example "
      f"values with .mean() or .sum()); got shape {shape}, dtype {dtype}."
    )
  return value


def _outputs(split_loss: SplitLoss, params: Any) -> Any:
  """``split_loss.outputs_fn(params)``; an NNX object it updates but did not
  make raises a ``ValueError`` naming the fix.

  The quadratic model runs ``outputs_fn`` under ``jax.linearize`` and, for
  ρ, under ``lax.cond``: NNX refuses updates there to objects made outside
  (an ``nnx.Rngs`` whose counter dropout advances, a model's BatchNorm
  statistics). Fresh keys per call would also give ``JΔ``, ``Jδ`` and
  ``L(θ + v)`` different networks: one dropout mask per step, the one of
  the gradient's loss, keeps them the model of that loss.
  """
  try:
    return split_loss.outputs_fn(params)
  except flax_errors.TraceContextError as error:
    raise ValueError(
      "SplitLoss.outputs_fn updates an NNX object made outside it (an "
      "nnx.Rngs whose counter dropout advances, a model's BatchNorm "
      "statistics): the adaptive mode evaluates it under jax.linearize "
      "and lax.cond, where NNX refuses such updates. Build what it updates "
      "inside it: a copy of the model (nnx.merge(graphdef, params, rest, "
      "copy=True)) and, for dropout, nnx.Rngs(dropout=key) from one key "
      "drawn outside per step and given to the gradient's loss too, so "
      "that every evaluation uses the gradient's dropout mask "
      "(docs/adaptive.md, 'Dropout and other stochastic layers')."
    ) from error


def loss_value(split_loss: SplitLoss, params: Any) -> jax.Array:
  """``loss_fn(outputs_fn(params)) + regularizer(params)`` (float32)."""
  value = _real_scalar(
    "loss_fn", split_loss.loss_fn(_outputs(split_loss, params))
  )
  if split_loss.regularizer is not None:
    value = value + _real_scalar("regularizer", split_loss.regularizer(params))
  return jnp.asarray(value, jnp.float32)


def curvature_products(
  split_loss: SplitLoss, params: Any, vectors: Sequence[Any]
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The batch loss, ``[vᵢᵀ C vⱼ]`` (``[k, k]``) and ``[∇ᵀvᵢ]`` (``[k]``) of
  the ``SplitLoss`` for the k ``vectors``.

  ``C = Jᵀ H J + ∇²regularizer``: ``J vᵢ`` by forward mode through
  ``outputs_fn`` (one linearisation, k cheap applications), ``H (J vⱼ)`` by
  forward-over-reverse through ``loss_fn`` on the outputs only, whose primal
  output gives ``∇ᵀvᵢ = ∇loss_fn · J vᵢ`` (plus the regularizer's) for free.
  """
  outputs, jacobian_product = jax.linearize(
    lambda p: _outputs(split_loss, p), params
  )
  loss = jnp.asarray(
    _real_scalar("loss_fn", split_loss.loss_fn(outputs)), jnp.float32
  )
  output_tangents = [jacobian_product(v) for v in vectors]
  output_gradient, hessian_product = jax.linearize(
    jax.grad(split_loss.loss_fn), outputs
  )
  curved = [hessian_product(t) for t in output_tangents]
  matrix = _cross_products(output_tangents, curved)
  gradient_products = _cross_products([output_gradient], output_tangents)[0]
  if split_loss.regularizer is not None:
    loss = loss + jnp.asarray(
      _real_scalar("regularizer", split_loss.regularizer(params)), jnp.float32
    )
    regularizer_gradient, regularizer_hessian = jax.linearize(
      jax.grad(split_loss.regularizer), params
    )
    curved_params = [regularizer_hessian(v) for v in vectors]
    matrix = matrix + _cross_products(vectors, curved_params)
    gradient_products = (
      gradient_products + _cross_products([regularizer_gradient], vectors)[0]
    )
  return loss, (matrix + matrix.T) / 2, gradient_products


def solve_step_sizes(
  curvature: jax.Array,
  inner_products: jax.Array,
  gradient_products: jax.Array,
  damping: jax.Array,
  use_momentum: bool,
) -> jax.Array:
  """Minimiser ``c = [α, μ]`` of ``gᵀc + ½ cᵀ(Q + λ P)c``.

  Args:
    curvature: ``Q = [vᵢᵀ C vⱼ]``, ``[2, 2]`` for ``v = (Δ, δ)``.
    inner_products: ``P = [vᵢᵀ vⱼ]``, ``[2, 2]``.
    gradient_products: ``g = [∇ᵀΔ, ∇ᵀδ]``, ``[2]``.
    damping: λ.
    use_momentum: ``False`` fixes ``μ = 0``.

  Returns:
    ``[α, μ]``. When the 2×2 system is singular (``δ = 0`` at the first step,
    or ``δ ∥ Δ``) μ is 0; when even ``ΔᵀQΔ + λΔᵀΔ`` is not positive, both
    are 0.
  """
  system = curvature + damping * inner_products
  alpha_only = jnp.where(
    system[0, 0] > 0,
    -gradient_products[0] / jnp.where(system[0, 0] > 0, system[0, 0], 1.0),
    0.0,
  )
  one_dimensional = jnp.stack([alpha_only, jnp.zeros([], alpha_only.dtype)])
  if not use_momentum:
    return one_dimensional
  # Cramer's rule: a handful of scalar operations where a general solve
  # compiles an LU factorisation loop.
  determinant = system[0, 0] * system[1, 1] - system[0, 1] * system[1, 0]
  regular = determinant > _SINGULAR_TOLERANCE * jnp.abs(
    system[0, 0] * system[1, 1]
  )
  adjugate_products = jnp.stack(
    [
      system[1, 1] * gradient_products[0] - system[0, 1] * gradient_products[1],
      system[0, 0] * gradient_products[1] - system[1, 0] * gradient_products[0],
    ]
  )
  two_dimensional = -adjugate_products / jnp.where(regular, determinant, 1.0)
  return jnp.where(regular, two_dimensional, one_dimensional)


def quadratic_change(
  coefficients: jax.Array, curvature: jax.Array, gradient_products: jax.Array
) -> jax.Array:
  """``gᵀc + ½ cᵀQc``: the model's change of the loss for ``v = Kc``."""
  return (
    gradient_products @ coefficients
    + 0.5 * coefficients @ curvature @ coefficients
  )


def adapt_damping(
  damping: jax.Array, reduction_ratio: jax.Array, config: AdaptiveConfig
) -> jax.Array:
  """Levenberg-Marquardt: ``λ·ω`` if ``ρ > ¾``, ``λ/ω`` if ``ρ < ¼`` or NaN.

  ``ω = decay^interval``; the result is clipped to ``[min, max]``. A NaN λ
  (a corrupted restore: clipping keeps NaN, and every step would be
  rejected) restarts at ``max_damping``, the cautious end.
  """
  omega = config.damping_adaptation_decay**config.damping_adaptation_interval
  new = jnp.where(
    reduction_ratio > 0.75,
    damping * omega,
    jnp.where(reduction_ratio >= 0.25, damping, damping / omega),
  )
  return clip_damping(new, config)


def clip_damping(damping: jax.Array, config: AdaptiveConfig) -> jax.Array:
  """λ clipped to ``[min_damping, max_damping]``; NaN to ``max_damping``."""
  return jnp.where(
    jnp.isnan(damping),
    config.max_damping,
    jnp.clip(damping, config.min_damping, config.max_damping),
  )


def step(
  state: QuadraticModelState,
  preconditioned: Any,
  gradients: Any,
  params: Any,
  split_loss: SplitLoss,
  adapt: jax.Array,
  config: AdaptiveConfig,
) -> tuple[Any, QuadraticModelState]:
  """The update ``α Δ + μ δ`` and the state after it.

  Args:
    state: the state before the step.
    preconditioned: ``(F̂ + λI)⁻¹ ∇ = −Δ``, the K-FAC-preconditioned
      gradient.
    gradients: ``∇`` of the batch loss.
    params: θ.
    split_loss: the batch loss (``SplitLoss``).
    adapt: bool scalar, whether this step adapts λ (costs one more
      ``loss_value`` at ``θ + v``).
    config: the ``AdaptiveConfig``.

  Returns:
    The update ``v = α Δ + μ δ`` (``params``' structure, δ's dtypes) and the
    state after the step (``step_sizes = [α, μ]``).

  A non-finite result (NaN/Inf gradients or outputs) emits a zero update,
  keeps δ and raises λ by ``1/ω``, so the next steps are more cautious.
  """
  previous = state.previous_update
  # The products are taken of −Δ, as given; `signs` turns them into Δ's.
  signs = jnp.asarray([-1.0, 1.0], jnp.float32)
  # Without momentum δ's curvature is not needed: zeros in its place.
  vectors = (
    (preconditioned, previous) if config.use_momentum else (preconditioned,)
  )
  padding = [(0, 2 - len(vectors))]
  loss, curvature, split_gradient_products = curvature_products(
    split_loss, params, vectors
  )
  curvature = jnp.pad(curvature, padding * 2) * jnp.outer(signs, signs)
  split_gradient_products = jnp.pad(split_gradient_products, padding) * signs
  # [∇, −Δ, δ]ᵀ[−Δ, δ]: the first row gives ∇ᵀvⱼ, the rest vᵢᵀvⱼ. δᵀδ even
  # without momentum: it tells whether δ is finite.
  products = _cross_products(
    (gradients, preconditioned, previous), (preconditioned, previous)
  )
  inner_products = products[1:] * jnp.outer(signs, signs)
  gradient_products = products[0] * signs
  coefficients = solve_step_sizes(
    curvature,
    inner_products,
    gradient_products,
    state.damping,
    config.use_momentum,
  )
  predicted = quadratic_change(
    coefficients,
    curvature + state.damping * inner_products
    if config.include_damping_in_quadratic_change
    else curvature,
    gradient_products,
  )
  ok = jnp.isfinite(predicted) & _update_finite(
    coefficients, inner_products, preconditioned, previous
  )
  update = jax.tree.map(
    lambda d, p: jnp.where(
      ok, _combination(coefficients, d, p), jnp.zeros([], p.dtype)
    ),
    preconditioned,
    previous,
  )

  def measured_ratio():
    new_params = jax.tree.map(
      lambda p, u: p + u.astype(p.dtype), params, update
    )
    # The model's linear term is the passed gradients' (the whole batch);
    # the SplitLoss may cover part of it (a curvature mini-batch), whose own
    # change also moves with its own linear term, ∇_splitᵀv ≠ ∇ᵀv. Its
    # change less that term estimates the higher-order change; the whole
    # batch's ∇ᵀv completes it (M&G measure ρ on the gradient's batch).
    # With the SplitLoss on the whole batch the two terms cancel.
    change = (
      loss_value(split_loss, new_params)
      - loss
      + (gradient_products - split_gradient_products) @ coefficients
    )
    # predicted < 0 whenever the solve found a descent step; 0 when it
    # found none, in which case ρ is left NaN and λ grows.
    return change / jnp.where(predicted < 0, predicted, jnp.nan)

  ratio = jax.lax.cond(
    adapt & ok, measured_ratio, lambda: state.reduction_ratio
  )
  damping = jnp.where(
    ok,
    jnp.where(
      adapt, adapt_damping(state.damping, ratio, config), state.damping
    ),
    adapt_damping(state.damping, jnp.asarray(jnp.nan, jnp.float32), config),
  )
  # A rejected step keeps δ, unless δ itself is what is non-finite (a
  # corrupted restore), which would reject every later step: then the
  # rejected step's zeros. One lax.cond for the whole tree: no per-leaf
  # select or zeros to compile.
  new_state = QuadraticModelState(
    damping=damping,
    previous_update=finite.keep(
      ok | ~jnp.isfinite(inner_products[1, 1]), update, previous
    ),
    step_sizes=jnp.where(ok, coefficients, jnp.zeros_like(coefficients)),
    reduction_ratio=ratio,
  )
  return update, new_state


def _combination(
  coefficients: jax.Array, preconditioned: jax.Array, previous: jax.Array
) -> jax.Array:
  """A leaf of ``v = αΔ + μδ = −α(−Δ) + μδ``, in float32, cast to δ's dtype."""
  return (
    -coefficients[0] * preconditioned.astype(jnp.float32)
    + coefficients[1] * previous.astype(jnp.float32)
  ).astype(previous.dtype)


def _update_finite(
  coefficients: jax.Array,
  inner_products: jax.Array,
  preconditioned: Any,
  previous: Any,
) -> jax.Array:
  """Whether ``v = αΔ + μδ`` is finite, from scalars already at hand.

  ``‖v‖² = cᵀPc`` for ``c = [α, μ]``: a NaN or ±Inf in Δ or δ makes ``P``'s
  diagonal non-finite, and so ``cᵀPc`` (even where c's entry is 0), and an
  entry of v past float32's range makes a term of ``cᵀPc`` overflow, since
  ``α²ΔᵀΔ ≥ (αΔᵢ)²``. A finite v whose ``‖v‖²`` overflows counts as
  non-finite, as in ``finite.all_finite``. An entry past the range of a
  dtype whose largest value squared fits float32 (float16) need not
  overflow ``‖v‖²``: leaves of such a dtype are checked themselves.
  """
  norm = jnp.isfinite(coefficients @ inner_products @ coefficients)
  narrow = [
    _combination(coefficients, d, p)
    for d, p in zip(jax.tree.leaves(preconditioned), jax.tree.leaves(previous))
    if jnp.issubdtype(p.dtype, jnp.floating)
    and float(jnp.finfo(p.dtype).max) ** 2 < float(jnp.finfo(jnp.float32).max)
  ]
  return norm & finite.all_finite(narrow) if narrow else norm
