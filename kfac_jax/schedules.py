"""Schedules of ``scale_by_kfac``'s hyper-parameters: callables of the step.

A schedule is called with ``ScaleByKFACState.count``, the number of optimizer
steps taken before the current one (0 at the first ``update``), which is the
``steps`` counter KAISA's ``kfac_pytorch`` passes its schedules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax import hyperparameters as hp


def exp_decay_factor_averaging(min_value: float = 0.95) -> hp.Schedule:
  r"""KAISA's factor-averaging schedule: a running mean, then an average.

  The ``factor_decay`` at step ``t`` is

  .. math::

    d(t) = \min\left(1 - \frac{1}{\max(t, 1)},\ \text{min\_value}\right),

  so ``d = 0`` at steps 0 and 1 (``F ← F_batch``: the identity the factors
  start from is forgotten at once), and from step 1 on, while
  ``1 − 1/t < min_value``, ``F`` is the plain mean of the batch factors of
  steps 1 … t (``F_t = (1 − 1/t)·F_{t−1} + F_batch,t / t``). From then on it
  is the exponential average of weight ``min_value``. Steps that do not
  update the factors (``factor_update_steps`` > 1) still count, as in KAISA.

  Args:
    min_value: the largest weight, reached from step ``1/(1 − min_value)``
      (KAISA's name: the bound the schedule is the minimum with), in [0, 1].

  Returns:
    A schedule ``count -> d`` (float32) for ``scale_by_kfac(factor_decay=...)``.

  Raises:
    ValueError: ``min_value`` is outside [0, 1].
    TypeError: ``min_value`` is not a real number.

  Examples:
    >>> import kfac_jax
    >>> schedule = kfac_jax.schedules.exp_decay_factor_averaging(0.95)
    >>> [round(float(schedule(t)), 4) for t in (0, 1, 2, 3, 19, 20, 100)]
    [0.0, 0.0, 0.5, 0.6667, 0.9474, 0.95, 0.95]
    >>> tx = kfac_jax.scale_by_kfac(factor_decay=schedule)

  References:
    Martens & Grosse, `Optimizing Neural Networks with Kronecker-factored
    Approximate Curvature <https://arxiv.org/abs/1503.05671>`_, 2015 (§5).

    Pauloski et al., `KAISA: An Adaptive Second-Order Optimizer Framework
    for Deep Neural Networks <https://arxiv.org/abs/2107.01739>`_, 2021
    (``kfac.hyperparams.exp_decay_factor_averaging``).
  """
  if callable(min_value):
    raise TypeError(
      "exp_decay_factor_averaging: min_value must be a number in [0, 1], "
      f"not a schedule; got {min_value!r}."
    )
  hp.decay("exp_decay_factor_averaging: min_value", min_value)

  def schedule(count: jax.Array) -> jax.Array:
    return jnp.minimum(1.0 - 1.0 / jnp.maximum(count, 1), min_value)

  return schedule
