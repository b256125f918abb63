"""The checks and normalizations of ``KFACConfig``'s arguments.

One function an argument, or a group of arguments that constrain each
other: each takes the argument as the user gave it (or the configuration
being built, whose earlier fields are already normalized) and returns its
normalized value, or raises ``TypeError``/``ValueError`` naming the
argument and the fix. ``KFACConfig.__post_init__`` calls them in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.core
import jax.numpy as jnp

from kfac_jax import hyperparameters as hp
from kfac_jax.capture.layers import LayerInfo
from kfac_jax.hyperparameters import ComputeMethod, DampingMode
from kfac_jax.preconditioning.subspace import SubspaceSolver
from kfac_jax.transform.quadratic_model import AdaptiveConfig

if TYPE_CHECKING:
  from kfac_jax.transform.config import KFACConfig


def hyperparameters(config: KFACConfig) -> dict[str, Any]:
  """The constant-or-schedule arguments, checked (``hyperparameters``)."""
  if config.kl_clip is False:
    raise TypeError("kl_clip=False: pass kl_clip=None to turn KL clipping off.")
  return dict(
    # 0 allowed: a warmup schedule starts there, and KL clipping's ν is 1.
    learning_rate=hp.non_negative("learning_rate", config.learning_rate),
    damping=hp.positive("damping", config.damping),
    factor_decay=hp.decay("factor_decay", config.factor_decay),
    kl_clip=(
      None if config.kl_clip is None else hp.positive("kl_clip", config.kl_clip)
    ),
    # 1 would keep v at 0, whose bias correction is then 0/0.
    second_moment_decay=(
      None
      if config.second_moment_decay is None
      else hp.hyperparameter(
        "second_moment_decay",
        config.second_moment_decay,
        lambda v: (0 <= v) & (v < 1),
        "in [0, 1)",
      )
    ),
    # From 1 on the chained momentum buffer grows geometrically.
    momentum=hp.hyperparameter(
      "momentum",
      0.0 if config.momentum is None else config.momentum,
      lambda v: (0 <= v) & (v < 1),
      "in [0, 1)",
    ),
    factor_update_steps=hp.positive_integer(
      "factor_update_steps", config.factor_update_steps
    ),
    inv_update_steps=hp.positive_integer(
      "inv_update_steps", config.inv_update_steps
    ),
  )


def compute_method(config: KFACConfig) -> ComputeMethod:
  """``compute_method`` parsed; ``None``: the inverse method, unless an
  option needs eigenbases."""
  if config.compute_method is not None:
    return ComputeMethod.parse(config.compute_method)
  needs_eigen = (
    hp.static_bool("eigenvalue_correction", config.eigenvalue_correction)
    or config.second_moment_decay is not None
    or not (
      isinstance(config.eigen_solver, str) and config.eigen_solver == "eigh"
    )
    or hp.factor_dtype("factor_dtype", config.factor_dtype) == jnp.bfloat16
  )
  return ComputeMethod.EIGEN if needs_eigen else ComputeMethod.INVERSE


def damping_mode(mode: Any, adaptive: AdaptiveConfig | None) -> DampingMode:
  """``mode`` parsed; ``None``: relative, or the adaptive mode's absolute λ."""
  if mode is None:
    return DampingMode.RELATIVE if adaptive is None else DampingMode.ABSOLUTE
  mode = DampingMode.parse(mode)
  if adaptive is not None and mode is DampingMode.RELATIVE:
    raise ValueError(
      "scale_by_kfac(adaptive=...) adapts an absolute λ on the Fisher's "
      "scale, which its quadratic model adds as it is; pass "
      "damping_mode=None or 'absolute' (got 'relative')."
    )
  return mode


def factor_batch_size(size: Any) -> int | float | None:
  """A positive integer (examples), a fraction in (0, 1), or None."""
  if isinstance(size, float) and not size.is_integer():
    if not 0 < size < 1:
      raise TypeError(
        "factor_batch_size must be a positive integer (examples) or a "
        f"fraction of the batch in (0, 1); got {size!r}."
      )
    return size
  return (
    None
    if size is None
    else hp.static_positive_integer("factor_batch_size", size)
  )


def check_layer_table(layers: Any) -> None:
  if layers is not None and not (
    isinstance(layers, Mapping)
    and all(isinstance(layer, LayerInfo) for layer in layers.values())
  ):
    raise TypeError(
      "layers must be the table from kfac_jax.trace_layers(loss_fn, params, "
      f"*batch) or None; got {type(layers).__name__}."
    )


def check_adaptive(config: KFACConfig, adaptive: AdaptiveConfig) -> None:
  """The adaptive mode's constraints on the other arguments."""
  AdaptiveConfig.check(adaptive)
  if config.kl_clip is not None:
    raise ValueError(
      "scale_by_kfac(adaptive=...) chooses the step size from the "
      "quadratic model; pass kl_clip=None (got kl_clip="
      f"{config.kl_clip.value!r})."
    )
  if config.accumulation_steps != 1:
    raise ValueError(
      "scale_by_kfac(adaptive=...) evaluates the quadratic model on the "
      "batch of the step; it does not support accumulation_steps="
      f"{config.accumulation_steps} (use accumulation_steps=1 and a larger "
      "batch)."
    )
  damping = config.damping.value
  if callable(damping):
    raise TypeError(
      "scale_by_kfac(adaptive=...): damping is the initial λ, which the "
      "Levenberg-Marquardt rule then adapts; pass a number, not a "
      "schedule."
    )
  # Under optax.inject_hyperparams the value is traced in update (it is
  # only read at init, where it is concrete and checked).
  if not isinstance(damping, jax.core.Tracer) and not (
    adaptive.min_damping <= damping <= adaptive.max_damping
  ):
    raise ValueError(
      f"scale_by_kfac(adaptive=...): the initial damping={damping!r} "
      "lies outside the range the rule keeps λ in, AdaptiveConfig's "
      f"[min_damping={adaptive.min_damping!r}, "
      f"max_damping={adaptive.max_damping!r}]."
    )


def factor_dtype(dtype: Any, method: ComputeMethod) -> jnp.dtype | None:
  dtype = hp.factor_dtype("factor_dtype", dtype)
  if dtype == jnp.bfloat16 and method is ComputeMethod.INVERSE:
    raise ValueError(
      "factor_dtype=bfloat16 does not work with compute_method='inverse': "
      "rounding a running factor to bfloat16 moves each entry by up to "
      "2⁻⁹ of its size, which makes a rank-deficient factor (a batch "
      "smaller than the layer's width, correlated inputs) indefinite, so "
      "F + λI has no Cholesky factor unless λ outweighs the rounding; "
      "those decompositions are rejected and the layer goes "
      "unpreconditioned. Use compute_method='eigen' (it clamps the "
      "negative eigenvalues at 0) or float32 factors (the default)."
    )
  return dtype


def check_gradient_from_stats(config: KFACConfig) -> None:
  if config.gradient_from_stats and config.accumulation_steps != 1:
    raise ValueError(
      "scale_by_kfac(gradient_from_stats=True) reads each step's gradient "
      "from that step's kfac_stats, which hold one micro-batch; it does not "
      f"support accumulation_steps={config.accumulation_steps}."
    )
  if config.gradient_from_stats and config.mesh_axes is not None:
    raise ValueError(
      "scale_by_kfac(gradient_from_stats=True) preconditions where the "
      "program runs; it does not support mesh_axes (got "
      f"{config.mesh_axes!r}). Drop one of the two."
    )


def eigen_solver(solver: Any) -> str | SubspaceSolver:
  """``"eigh"``, or the ``SubspaceSolver`` of ``"subspace"`` or of one given."""
  if isinstance(solver, str) and solver in ("eigh", "subspace"):
    return "eigh" if solver == "eigh" else SubspaceSolver()
  if not isinstance(solver, SubspaceSolver):
    raise ValueError(
      "eigen_solver must be 'eigh', 'subspace' or a "
      f"kfac_jax.SubspaceSolver(steps, drift_threshold); got {solver!r}."
    )
  steps = hp.static_integer("SubspaceSolver.steps", solver.steps, 0)
  threshold = solver.drift_threshold
  if (
    isinstance(threshold, bool)
    or not isinstance(threshold, (int, float))
    or not 0 < threshold <= 1
  ):
    raise ValueError(
      "SubspaceSolver.drift_threshold must be a number in (0, 1] (a "
      f"relative Frobenius error); got {threshold!r}."
    )
  return SubspaceSolver(steps, float(threshold))


def check_eigen_options(config: KFACConfig) -> None:
  """The subspace solver and EKFAC need the eigen method."""
  for name, on in (
    ("eigen_solver='subspace'", config.subspace_solver is not None),
    ("eigenvalue_correction=True", config.eigenvalue_correction),
    ("second_moment_decay", config.second_moment_decay is not None),
  ):
    if on and config.compute_method is not ComputeMethod.EIGEN:
      raise ValueError(
        f"{name} works on eigenbases: it needs compute_method='eigen' (got "
        f"{config.compute_method.value!r})."
      )


def check_second_moment(config: KFACConfig) -> None:
  """``second_moment_decay`` against the settings it does not work with."""
  if config.second_moment_decay is None:
    return
  for other, on, why in (
    (
      "eigenvalue_correction=True",
      config.eigenvalue_correction,
      "EKFAC's S from the gradient rows is the other estimate of the same "
      "scaling",
    ),
    (
      "adaptive=AdaptiveConfig(...)",
      config.adaptive is not None,
      "the adaptive mode's λ is on the Fisher's scale, √v on the gradient's",
    ),
    (
      "precondition_embeddings=True",
      config.precondition_embeddings,
      "an embedding's A is kept diagonal, without an eigenbasis",
    ),
    (
      "gradient_from_stats=True",
      config.gradient_from_stats,
      "v is read from the dense gradient every step",
    ),
  ):
    if on:
      raise ValueError(
        f"scale_by_kfac(second_moment_decay=...) does not work with {other}: "
        f"{why}. Drop one of the two."
      )
