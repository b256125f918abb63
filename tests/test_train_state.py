"""``kfac_jax.TrainState``: Flax's ``TrainState`` whose ``apply_gradients``
passes K-FAC's stats to ``tx.update``.

Its steps are checked against the documented loop it replaces,
``tx.update(grads, opt_state, params, kfac_stats=stats)`` then
``optax.apply_updates`` (the loop the rest of the suite checks against
float64 references); Flax's own ``apply_gradients`` drops the stats.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import kfac_jax

STEPS = 3


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.BatchNorm(
      use_running_average=not train, use_scale=False, use_bias=False
    )(nn.tanh(nn.Dense(8)(x)))
    return nn.Dense(3)(h)


MODEL = Mlp()


def data():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, size=16), jnp.int32)
  return x, y


def loss_fn(params, batch_stats, x, y):
  logits, updates = MODEL.apply(
    {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
  )
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, updates["batch_stats"]


class State(kfac_jax.TrainState):
  """With BatchNorm's statistics, as Flax's guides subclass TrainState."""

  batch_stats: Any


def initial(tx):
  x, _ = data()
  variables = MODEL.init(jax.random.key(0), x)
  return State.create(
    apply_fn=MODEL.apply,
    params=variables["params"],
    tx=tx,
    batch_stats=variables["batch_stats"],
  )


def tx_of():
  return kfac_jax.kfac(0.1, momentum=0.9, damping=0.01, inv_update_steps=2)


@jax.jit
def train_step(state, x, y):
  (loss, batch_stats), grads, stats = kfac_jax.value_grad_and_stats(
    loss_fn, has_aux=True
  )(state.params, state.batch_stats, x, y)
  state = state.apply_gradients(
    grads=grads, kfac_stats=stats, batch_stats=batch_stats
  )
  return state, loss


@jax.jit
def recipe_step(state, x, y):
  """The loop without apply_gradients: ``tx.update`` and ``replace``."""
  (loss, batch_stats), grads, stats = kfac_jax.value_grad_and_stats(
    loss_fn, has_aux=True
  )(state.params, state.batch_stats, x, y)
  updates, opt_state = state.tx.update(
    grads, state.opt_state, state.params, kfac_stats=stats
  )
  state = state.replace(
    step=state.step + 1,
    params=optax.apply_updates(state.params, updates),
    opt_state=opt_state,
    batch_stats=batch_stats,
  )
  return state, loss


def test_apply_gradients_takes_the_stats_as_tx_update_does():
  x, y = data()
  runs = []
  for step in (train_step, recipe_step):
    state = initial(tx_of())
    for _ in range(STEPS):
      state, _ = step(state, x, y)
    runs.append(state)
  state, recipe = runs
  assert int(state.step) == int(recipe.step) == STEPS
  # The same float32 operations on the same arrays each way.
  jax.tree.map(
    np.testing.assert_array_equal,
    (state.params, state.opt_state, state.batch_stats),
    (recipe.params, recipe.opt_state, recipe.batch_stats),
  )
  kfac_state = state.opt_state[0]
  assert sorted(kfac_state.factors) == ["Dense_0", "Dense_1"]
  assert int(kfac_state.count) == STEPS
  # BatchNorm's running statistics moved from their initial values.
  assert not np.allclose(state.batch_stats["BatchNorm_0"]["var"], 1.0)


def test_the_updates_are_preconditioned():
  """One step moves the params by K-FAC's update, not the gradient's."""
  x, y = data()
  state = initial(tx_of())
  stepped, _ = train_step(state, x, y)
  (_, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    state.params, state.batch_stats, x, y
  )
  moved = jax.tree.map(lambda a, b: a - b, stepped.params, state.params)
  sgd = jax.tree.map(lambda g: -0.1 * g, grads)
  assert not np.allclose(
    moved["Dense_0"]["kernel"], sgd["Dense_0"]["kernel"], rtol=0.1
  )


def test_flax_apply_gradients_is_told_to_use_kfac_train_state():
  x, y = data()
  variables = MODEL.init(jax.random.key(0), x)
  state = train_state.TrainState.create(
    apply_fn=MODEL.apply, params=variables["params"], tx=tx_of()
  )
  (_, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
    state.params, variables["batch_stats"], x, y
  )
  with pytest.raises(ValueError, match="kfac_jax.TrainState"):
    state.apply_gradients(grads=grads)


def test_stats_for_a_tx_without_extra_arguments_are_refused():
  x, y = data()
  variables = MODEL.init(jax.random.key(0), x)
  plain = optax.GradientTransformation(
    optax.sgd(0.1).init, optax.sgd(0.1).update
  )
  state = kfac_jax.TrainState.create(
    apply_fn=MODEL.apply, params=variables["params"], tx=plain
  )
  (_, _), grads, stats = kfac_jax.value_grad_and_stats(loss_fn, has_aux=True)(
    state.params, variables["batch_stats"], x, y
  )
  with pytest.raises(TypeError, match=r"kfac_stats given.*kfac_jax.kfac"):
    state.apply_gradients(grads=grads, kfac_stats=stats)
  # Without stats it is Flax's step.
  stepped = state.apply_gradients(grads=grads)
  jax.tree.map(
    lambda new, old, g: np.testing.assert_array_equal(new, old - 0.1 * g),
    stepped.params,
    state.params,
    grads,
  )


def test_flax_fp8_gradients_are_refused():
  x, y = data()
  variables = MODEL.init(jax.random.key(0), x)
  state = kfac_jax.TrainState.create(
    apply_fn=MODEL.apply, params=variables["params"], tx=tx_of()
  )
  grads = {"params": variables["params"], "_overwrite_with_gradient": {}}
  with pytest.raises(ValueError, match="_overwrite_with_gradient"):
    state.apply_gradients(grads=grads, kfac_stats={})


def test_adaptive_mode_takes_the_split_loss():
  x, y = data()
  variables = MODEL.init(jax.random.key(0), x)
  tx = kfac_jax.scale_by_kfac(
    kl_clip=None, damping=1.0, adaptive=kfac_jax.AdaptiveConfig()
  )
  state = kfac_jax.TrainState.create(
    apply_fn=MODEL.apply, params=variables["params"], tx=tx
  )
  batch_stats = variables["batch_stats"]

  def outputs_fn(params):
    return MODEL.apply(
      {"params": params, "batch_stats": batch_stats}, x, train=False
    )

  def split_step(state, use_apply_gradients):
    _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p: optax.softmax_cross_entropy_with_integer_labels(
        outputs_fn(p), y
      ).mean()
    )(state.params)
    split = kfac_jax.SplitLoss(
      outputs_fn,
      lambda logits: optax.softmax_cross_entropy_with_integer_labels(
        logits, y
      ).mean(),
    )
    if use_apply_gradients:
      return state.apply_gradients(
        grads=grads, kfac_stats=stats, split_loss=split
      )
    updates, opt_state = state.tx.update(
      grads, state.opt_state, state.params, kfac_stats=stats, split_loss=split
    )
    return state.replace(
      step=state.step + 1,
      params=optax.apply_updates(state.params, updates),
      opt_state=opt_state,
    )

  got = jax.jit(split_step, static_argnums=1)(state, True)
  want = jax.jit(split_step, static_argnums=1)(state, False)
  jax.tree.map(
    np.testing.assert_array_equal,
    (got.params, got.opt_state),
    (want.params, want.opt_state),
  )
