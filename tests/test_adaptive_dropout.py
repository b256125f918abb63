"""The adaptive mode with NNX dropout: the pattern of docs/adaptive.md.

The quadratic model evaluates ``SplitLoss.outputs_fn`` under ``jax.linearize``
and ``lax.cond``, where NNX refuses to advance an ``nnx.Rngs`` made outside.
The documented step draws one key per step outside and builds
``nnx.Rngs(dropout=key)`` inside every evaluation, so the gradient's loss,
the curvature products and the reduction ratio all see one dropout mask.
Checked against a second code path: the same network with that mask given
as an array (no RNG at all) takes the same steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfac_jax
from tests import reference

close = reference.assert_float32_close
B, IN, HIDDEN, OUT = 16, 4, 8, 2
RATE = 0.5  # kept units are scaled by 2, exactly, as the mask below does


class DropoutModel(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
    self.drop = nnx.Dropout(RATE)
    self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs):
    return self.out(self.drop(jnp.tanh(self.hidden(x)), rngs=rngs))


class MaskedModel(nnx.Module):
  """The same network with the dropout mask (0 or 1/keep) given."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

  def __call__(self, x, mask):
    return self.out(jnp.tanh(self.hidden(x)) * mask)


def _data():
  rng = np.random.default_rng(0)
  return (
    jnp.asarray(rng.normal(size=(B, IN)), jnp.float32),
    jnp.asarray(rng.normal(size=(B, OUT)), jnp.float32),
  )


def _optimizer(model):
  tx = kfac_jax.scale_by_kfac(
    damping=1.0,
    kl_clip=None,
    compute_method="inverse",
    adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=1),
  )
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _squared_error(outputs, y):
  return jnp.mean((outputs - y) ** 2)


@nnx.jit
def dropout_step(model, optimizer, rngs, x, y):
  """docs/adaptive.md's step: one key per step, drawn outside the losses."""
  key = rngs.dropout()

  def forward(model):  # the step's mask, the same at every evaluation
    return model(x, rngs=nnx.Rngs(dropout=key))

  loss, grads, stats = kfac_jax.value_grad_and_stats(
    lambda model: _squared_error(forward(model), y)
  )(model)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  split = kfac_jax.SplitLoss(
    lambda params: forward(nnx.merge(graphdef, params, rest, copy=True)),
    lambda outputs: _squared_error(outputs, y),
  )
  optimizer.update(model, grads, kfac_stats=stats, split_loss=split)
  return loss


@nnx.jit
def masked_step(model, optimizer, mask, x, y):
  loss, grads, stats = kfac_jax.value_grad_and_stats(
    lambda model: _squared_error(model(x, mask), y)
  )(model)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  split = kfac_jax.SplitLoss(
    lambda params: nnx.merge(graphdef, params, rest, copy=True)(x, mask),
    lambda outputs: _squared_error(outputs, y),
  )
  optimizer.update(model, grads, kfac_stats=stats, split_loss=split)
  return loss


def test_the_documented_dropout_step_is_the_adaptive_mode_of_its_mask():
  x, y = _data()
  model, masked = DropoutModel(nnx.Rngs(0)), MaskedModel(nnx.Rngs(0))
  optimizer, masked_optimizer = _optimizer(model), _optimizer(masked)
  rngs, keys = nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)  # the same keys
  losses, lambdas = [], []
  for _ in range(4):
    # The mask of this step's key: what Dropout keeps, scaled by 1/keep.
    mask = nnx.Dropout(RATE)(
      jnp.ones((B, HIDDEN)), rngs=nnx.Rngs(dropout=keys.dropout())
    )
    losses.append(
      (
        dropout_step(model, optimizer, rngs, x, y),
        masked_step(masked, masked_optimizer, mask, x, y),
      )
    )
    lambdas.append(
      (
        optimizer.opt_state.quadratic_model.damping[...],
        masked_optimizer.opt_state.quadratic_model.damping[...],
      )
    )
  # The two programs differ by the RNG's operations only: the same float32
  # arithmetic, the masks' scaling by 2 exact. λ moves by ω or 1/ω per step
  # (one rounding each); the losses carry a dot of IN, one of HIDDEN and the
  # mean over B·OUT.
  for (loss, masked_loss), (damping, masked_damping) in zip(losses, lambdas):
    close(loss, masked_loss, terms=IN + HIDDEN + B * OUT + 4)
    close(damping, masked_damping, terms=len(lambdas))
  assert len({float(d) for d, _ in lambdas}) > 1  # λ did adapt
  jax.tree.map(
    lambda a, b: close(a, b, terms=4 * (IN + HIDDEN + B * OUT)),
    nnx.state(model, nnx.Param),
    nnx.state(masked, nnx.Param),
  )


def test_an_outer_rngs_in_the_split_loss_is_refused_naming_the_pattern():
  # The form that failed inside Flax with "Cannot mutate RngCount from a
  # different trace level".
  x, y = _data()
  model = DropoutModel(nnx.Rngs(0))
  optimizer, rngs = _optimizer(model), nnx.Rngs(dropout=1)

  @nnx.jit
  def step(model, optimizer, rngs):
    loss, grads, stats = kfac_jax.value_grad_and_stats(
      lambda model, rngs: _squared_error(model(x, rngs), y)
    )(model, rngs)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    split = kfac_jax.SplitLoss(
      lambda params: nnx.merge(graphdef, params, rest, copy=True)(x, rngs),
      lambda outputs: _squared_error(outputs, y),
    )
    optimizer.update(model, grads, kfac_stats=stats, split_loss=split)
    return loss

  with pytest.raises(
    ValueError,
    match=r"SplitLoss.outputs_fn updates an NNX "
    r"object made outside it.*nnx.Rngs\(dropout=key\)",
  ):
    step(model, optimizer, rngs)
