"""``kfac``: scale_by_kfac chained with SGD, as optax's aliases are."""

from __future__ import annotations

import numbers
from typing import Any

import optax

from kfac_jax.hyperparameters import (
  ScalarOrSchedule,
  hyperparameter,
  non_negative,
  static_bool,
  static_positive_integer,
)
from kfac_jax.transform.scale_by_kfac import DEFAULT_DAMPING, scale_by_kfac


def kfac(
  learning_rate: ScalarOrSchedule,
  momentum: float | None = 0.9,
  weight_decay: float = 0.0,
  nesterov: bool = False,
  damping: ScalarOrSchedule = DEFAULT_DAMPING,
  **kfac_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC preconditioning followed by SGD with momentum (KAISA's setup).

  ``optax.chain(scale_by_kfac(learning_rate, damping, **kfac_kwargs),
  add_decayed_weights(weight_decay), sgd(learning_rate, momentum, nesterov))``.
  As in KAISA (PyTorch SGD after K-FAC), weight decay is added after
  preconditioning. With ``accumulation_steps=k`` the SGD part is wrapped in
  ``optax.MultiSteps(every_k_schedule=k, use_grad_mean=False)`` so it steps
  once per optimizer step.

  Args:
    learning_rate: constant or schedule, shared by KL clipping and SGD.
    momentum: SGD momentum in [0, 1) (``None`` or 0 for none).
    weight_decay: decoupled-from-preconditioning L2 coefficient, ≥ 0.
    nesterov: Nesterov momentum.
    damping: ``scale_by_kfac``'s λ; named here so that
      ``optax.inject_hyperparams`` can change it between steps.
    **kfac_kwargs: any other ``scale_by_kfac`` argument.
  """
  # optax.inject_hyperparams binds **kfac_kwargs as one argument of that
  # name; its entries then stay static, as they must (accumulation_steps).
  kfac_kwargs = {**kfac_kwargs.pop("kfac_kwargs", {}), **kfac_kwargs}
  if kfac_kwargs.get("adaptive") is not None:
    # Its output is the final update; SGD's -lr would flip and shrink it.
    raise ValueError(
      "kfac(adaptive=...): the adaptive mode's output is the final "
      "parameter update, which this alias's SGD would rescale by "
      "-learning_rate. Use kfac_jax.scale_by_kfac(adaptive=..., "
      "kl_clip=None) alone and apply its updates."
    )
  for name, value in (("weight_decay", weight_decay), ("momentum", momentum)):
    if callable(value):
      raise TypeError(f"{name} must be a number, not a schedule.")
  if weight_decay is not None:
    non_negative("weight_decay", weight_decay)
  if momentum is not None:
    # From 1 on the momentum buffer grows geometrically: the run diverges.
    hyperparameter(
      "momentum", momentum, lambda v: (0 <= v) & (v < 1), "in [0, 1)"
    )
  # Only a Python zero drops a stage: under optax.inject_hyperparams the
  # values are arrays (traced in a jitted update), and init and update must
  # build the same chain.
  is_zero = lambda value: (
    value is None or (isinstance(value, numbers.Real) and value == 0)
  )
  nesterov = static_bool("nesterov", nesterov)
  if nesterov and is_zero(momentum):
    # optax.sgd drops Nesterov without momentum: the setting would be lost.
    raise ValueError(
      f"nesterov=True needs momentum > 0; got momentum={momentum!r}."
    )
  # Built first: it validates kfac_kwargs (accumulation_steps included).
  preconditioner = scale_by_kfac(
    learning_rate=learning_rate,
    damping=damping,
    momentum=momentum,
    **kfac_kwargs,
  )
  first_order = optax.chain(
    optax.identity()
    if is_zero(weight_decay)
    else optax.add_decayed_weights(weight_decay),
    optax.sgd(
      # optax types a schedule as a callable of any ArrayLike; ours take the
      # step count, which is what optax calls them with.
      learning_rate,  # pyright: ignore[reportArgumentType]
      momentum=None if is_zero(momentum) else momentum,
      nesterov=nesterov,
    ),
  )
  # NumPy integers count as in scale_by_kfac (else SGD would step on every
  # micro-batch while K-FAC holds).
  accumulation_steps = static_positive_integer(
    "accumulation_steps", kfac_kwargs.get("accumulation_steps", 1)
  )
  if accumulation_steps > 1:
    first_order = optax.MultiSteps(
      first_order, every_k_schedule=accumulation_steps, use_grad_mean=False
    ).gradient_transformation()
  return optax.chain(preconditioner, first_order)
