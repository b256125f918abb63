"""Flax's ``TrainState``, with an ``apply_gradients`` that takes K-FAC's stats.

``flax.training.train_state.TrainState.apply_gradients(grads=..., **kwargs)``
calls ``tx.update(grads, opt_state, params)`` and hands its other keyword
arguments to ``replace``, so the ``kfac_stats`` that ``scale_by_kfac`` needs
cannot reach ``tx.update`` through it. ``TrainState`` here is Flax's class
with that one method extended; ``create``, ``replace``, its fields and
subclassing to add fields (``batch_stats``) are Flax's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.transform.checks import NoStats
from kfac_jax.transform.quadratic_model import SplitLoss


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` for an optimizer with K-FAC.

  Made as Flax's (``TrainState.create(apply_fn=..., params=..., tx=...)``);
  ``apply_gradients`` also takes ``value_grad_and_stats``' stats, and the
  adaptive mode's ``split_loss``, and passes them to ``tx.update``::

    state = kfac_jax.TrainState.create(
        apply_fn=model.apply, params=params, tx=kfac_jax.kfac(0.1))

    @jax.jit
    def train_step(state, x, y):
      loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
          state.params, x, y)
      return state.apply_gradients(grads=grads, kfac_stats=stats), loss

  A subclass adds fields as Flax's does (``batch_stats: Any``), replaced
  by ``apply_gradients``' other keyword arguments.
  """

  def apply_gradients(
    self,
    *,
    grads: Any,
    kfac_stats: (Mapping[str, LayerStatistics] | NoStats | None) = None,
    split_loss: SplitLoss | None = None,
    **kwargs: Any,
  ) -> TrainState:
    """One optimizer step: ``tx.update`` with the stats, then the params.

    Args:
      grads: gradients of the structure of ``params``.
      kfac_stats: the third result of ``kfac_jax.value_grad_and_stats``,
        for ``scale_by_kfac`` in ``tx`` (``kfac_jax.NO_STATS`` on a step
        without statistics); ``None`` passes none (a ``tx`` without K-FAC).
      split_loss: the adaptive mode's ``SplitLoss`` (``scale_by_kfac(
        adaptive=...)``); ``None`` passes none.
      **kwargs: other fields of the state to ``replace`` (a subclass's
        ``batch_stats``).

    Returns:
      The state with ``step`` one higher, ``params`` and ``opt_state``
      updated by ``tx``, and ``kwargs`` replaced.

    Raises:
      TypeError: ``kfac_stats`` or ``split_loss`` given to a ``tx`` that
        takes no extra arguments.
      ValueError: ``grads`` hold Flax's fp8 collection.
    """
    extra = {
      name: value
      for name, value in (
        ("kfac_stats", kfac_stats),
        ("split_loss", split_loss),
      )
      if value is not None
    }
    if extra and not isinstance(self.tx, optax.GradientTransformationExtraArgs):
      raise TypeError(
        f"TrainState.apply_gradients: {' and '.join(extra)} given, but "
        f"tx ({type(self.tx).__name__}) takes no extra arguments to its "
        "update. Build tx with kfac_jax.kfac(...) or optax.chain("
        "kfac_jax.scale_by_kfac(...), ...), which pass them to K-FAC."
      )
    if isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads:
      # Flax's TrainState updates only grads["params"] then; K-FAC's stats
      # name the layers of the loss's params, not of that collection.
      raise ValueError(
        "TrainState.apply_gradients: grads hold Flax's fp8 "
        f"{OVERWRITE_WITH_GRADIENT!r} collection, which kfac_jax's "
        "TrainState does not split off. Keep the 'params' collection "
        "alone in the state (params=variables['params']), or call "
        "tx.update on grads['params'] yourself."
      )
    updates, opt_state = self.tx.update(
      grads, self.opt_state, self.params, **extra
    )
    return self.replace(
      step=self.step + 1,
      params=optax.apply_updates(self.params, updates),
      opt_state=opt_state,
      **kwargs,
    )
