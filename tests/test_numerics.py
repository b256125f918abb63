"""Non-finite safety: NaN/Inf batches, gradients, factors: a usable state."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import reference


class Regressor(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(8)(x))
    return nn.Dense(2)(x)


def _problem(seed=0, batch=32):
  rng = np.random.default_rng(seed)
  true_w = rng.normal(size=(4, 2))
  model = Regressor()
  x = rng.normal(size=(batch, 4)).astype(np.float32)
  params = model.init(jax.random.PRNGKey(seed), x)["params"]

  def sample():
    x = rng.normal(size=(batch, 4)).astype(np.float32)
    return x, np.tanh(x @ true_w).astype(np.float32)

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  return params, sample, loss_fn


def _all_finite(tree):
  return all(
    bool(jnp.all(jnp.isfinite(x)))
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  )


def _kfac_state(opt_state):
  return opt_state.inner_state[0]


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("poison", ["inputs", "labels", "gradients"])
def test_poisoned_batches_are_skipped_and_training_recovers(
  compute_method, poison
):
  params, sample, loss_fn = _problem()
  kfac = kfac_jax.scale_by_kfac(
    damping=1e-2, inv_update_steps=2, compute_method=compute_method
  )
  # The whole chain under apply_if_finite skips the parameter update too (and
  # keeps its inner state, K-FAC's included, as it was).
  tx = optax.apply_if_finite(
    optax.chain(kfac, optax.sgd(0.1, momentum=0.9)), max_consecutive_errors=100
  )
  opt_state, bare_state = tx.init(params), kfac.init(params)

  @jax.jit
  def step(params, opt_state, bare_state, x, y, grad_poison):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    grads = jax.tree.map(lambda g: g + grad_poison, grads)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    # The bare transformation on the same inputs: it must protect itself.
    _, bare_state = kfac.update(grads, bare_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state, bare_state

  poisoned_steps = {3, 4, 7}
  eval_x, eval_y = sample()
  first_loss = float(loss_fn(params, eval_x, eval_y))
  steps = 40
  for t in range(steps):
    x, y = sample()
    grad_poison = 0.0
    if t in poisoned_steps:
      if poison == "inputs":
        x[0, 0] = np.nan
      elif poison == "labels":
        y[1, 1] = np.inf
      else:
        grad_poison = np.nan
    bare_before = bare_state
    params, opt_state, bare_state = step(
      params, opt_state, bare_state, x, y, grad_poison
    )
    assert _all_finite(params), t
    assert _all_finite(_kfac_state(opt_state)) and _all_finite(bare_state), t
    if t in poisoned_steps and poison != "gradients":
      for a, b in zip(
        jax.tree.leaves(bare_before.factors),
        jax.tree.leaves(bare_state.factors),
      ):
        np.testing.assert_array_equal(a, b)
  # Poisoned gradients do not touch the statistics the factors come from, so
  # those factor updates go ahead.
  skipped = 0 if poison == "gradients" else len(poisoned_steps)
  assert int(bare_state.skipped_factor_updates) == skipped
  assert int(bare_state.count) == steps
  assert int(opt_state.total_notfinite) == len(poisoned_steps)
  assert int(_kfac_state(opt_state).count) == steps - len(poisoned_steps)
  assert float(loss_fn(params, eval_x, eval_y)) < 0.5 * first_loss


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_corrupted_factors_restart(compute_method):
  params, sample, loss_fn = _problem()
  tx = kfac_jax.scale_by_kfac(damping=1e-2, compute_method=compute_method)

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)

  _, state = step(params, tx.init(params), *sample())
  corrupted = dict(state.factors)
  corrupted["Dense_0"] = corrupted["Dense_0"]._replace(
    activation_factor=corrupted["Dense_0"]
    .activation_factor.at[0, 0]
    .set(jnp.nan)
  )
  # The corrupted factor restarts from the identity at the next
  # decomposition (every step here): the decomposition, the update and the
  # state stay finite.
  x, y = sample()
  updates, state = step(params, state._replace(factors=corrupted), x, y)
  assert _all_finite(updates) and _all_finite(state)
  assert int(state.rejected_decompositions) == 0
  # Restarted, then averaged with this batch: 0.95·I + 0.05·E[a aᵀ], a = [x; 1]
  # (Dense_0's input is the data).
  inputs = np.concatenate([x, np.ones((len(x), 1))], axis=1).astype(np.float64)
  expected = 0.95 * np.eye(5) + 0.05 * inputs.T @ inputs / len(x)
  # float32: the sum over 32 rows, / 32, the mix; each entry on its parts'
  # magnitudes (reference.assert_float32_close).
  reference.assert_float32_close(
    state.factors["Dense_0"].activation_factor,
    expected,
    terms=32 + 1 + 2,
    scale=reference.running_factor_scale(expected, 0.95),
  )
  # Its uncorrupted partner G averages on as before.
  assert not np.allclose(
    state.factors["Dense_0"].gradient_factor, 0.95 * np.eye(8), atol=1e-3
  )


def test_bad_batches_off_factor_steps_are_not_counted_as_skipped():
  # Only a factor step's batch enters the factors: a bad one elsewhere skips
  # nothing, so skipped_factor_updates counts factor steps alone.
  params, sample, loss_fn = _problem()
  tx = kfac_jax.scale_by_kfac(damping=1e-2, factor_update_steps=2)

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)[1]

  state = tx.init(params)
  for t, poisoned in enumerate([False, True, False, True, True]):
    x, y = sample()
    if poisoned:
      x[0, 0] = np.nan
    if t == 3:  # A corrupted factor makes step 3 restart it off a factor step.
      factors = dict(state.factors)
      factors["Dense_1"] = factors["Dense_1"]._replace(
        gradient_factor=factors["Dense_1"].gradient_factor.at[0, 0].set(np.inf)
      )
      state = state._replace(factors=factors)
    state = step(params, state, x, y)
  # Steps 1 and 3 are off factor steps; step 4 is a factor step.
  assert int(state.skipped_factor_updates) == 1
  assert _all_finite(state)


class WideRegressor(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden = jnp.tanh(nn.Dense(300)(x))
    return nn.Dense(2)(hidden)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_one_bad_entry_of_a_wide_factor_restarts_it(compute_method, bad):
  # A [301, 301] factor: on XLA:CPU a max/min reduction of an array this large
  # drops NaN, so a check built on one would miss this entry and the factor
  # would poison every later decomposition.
  rng = np.random.default_rng(0)
  model = WideRegressor()
  x = rng.normal(size=(16, 4)).astype(np.float32)
  y = rng.normal(size=(16, 2)).astype(np.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  tx = kfac_jax.scale_by_kfac(
    damping=1e-2, compute_method=compute_method, factor_decay=0.9
  )

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  @jax.jit
  def step(state):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)

  _, state = step(tx.init(params))
  _, clean = step(state)
  factors = dict(state.factors)
  factors["Dense_1"] = factors["Dense_1"]._replace(
    activation_factor=factors["Dense_1"].activation_factor.at[5, 200].set(bad)
  )
  updates, restarted = step(state._replace(factors=factors))
  assert _all_finite(updates) and _all_finite(restarted)
  assert int(restarted.rejected_decompositions) == 0
  # Restarted from the identity, then averaged with the same batch: 0.9·I +
  # 0.1·A_batch, where the clean run has 0.9·A + 0.1·A_batch.
  batch_part = (
    clean.factors["Dense_1"].activation_factor
    - 0.9 * state.factors["Dense_1"].activation_factor
  )
  # The same program computes the same batch factor in both; the roundings
  # of the two mixes (0.9·F and the sum, in each) are of the factors'
  # magnitude.
  reference.assert_float32_close(
    restarted.factors["Dense_1"].activation_factor,
    0.9 * np.eye(301) + batch_part,
    terms=3,
    scale=reference.largest(
      [
        clean.factors["Dense_1"].activation_factor,
        state.factors["Dense_1"].activation_factor,
      ]
    ),
  )
  # The other factors: the same program on the same values, bit for bit.
  for a, b in zip(
    clean.factors["Dense_1"][1:] + tuple(clean.factors["Dense_0"]),
    restarted.factors["Dense_1"][1:] + tuple(restarted.factors["Dense_0"]),
  ):
    np.testing.assert_array_equal(a, b)


def test_corrupted_factor_restarts_at_the_next_decomposition_step():
  params, sample, loss_fn = _problem()
  # Factor steps at 0, 3, ...; decompositions at 0, 2, ...
  tx = kfac_jax.scale_by_kfac(
    damping=1e-2,
    compute_method="inverse",
    factor_update_steps=3,
    inv_update_steps=2,
  )

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)

  _, state = step(params, tx.init(params), *sample())
  previous = state.preconditioners
  corrupted = dict(state.factors)
  corrupted["Dense_0"] = corrupted["Dense_0"]._replace(
    gradient_factor=corrupted["Dense_0"].gradient_factor.at[1, 0].set(jnp.inf)
  )
  # Step 1 neither updates factors nor decomposes: the last decomposition
  # stays in use and the update is finite.
  updates, state = step(params, state._replace(factors=corrupted), *sample())
  assert _all_finite(updates)
  for a, b in zip(
    jax.tree.leaves(previous), jax.tree.leaves(state.preconditioners)
  ):
    np.testing.assert_array_equal(a, b)
  # Step 2 decomposes (no factor update is due): the corrupted factor
  # restarts as the identity, the others are untouched.
  before = state.factors
  updates, state = step(params, state, *sample())
  np.testing.assert_array_equal(
    state.factors["Dense_0"].gradient_factor,
    np.eye(before["Dense_0"].gradient_factor.shape[0]),
  )
  np.testing.assert_array_equal(
    state.factors["Dense_0"].activation_factor,
    before["Dense_0"].activation_factor,
  )
  for name in before:
    if name != "Dense_0":
      for a, b in zip(before[name], state.factors[name]):
        np.testing.assert_array_equal(a, b)
  assert _all_finite(updates) and _all_finite(state)
  assert int(state.rejected_decompositions) == 0
  assert int(state.skipped_factor_updates) == 0


def test_non_finite_decomposition_keeps_the_previous_one():
  params, sample, loss_fn = _problem()
  # Inverse method with a factor whose damped Cholesky must fail: inject -inf
  # scale via an overflowing batch at step 1 but finite gradients.
  tx = kfac_jax.scale_by_kfac(
    damping=1e-2, compute_method="inverse", kl_clip=None
  )
  state = tx.init(params)
  x, y = sample()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  _, state = tx.update(grads, state, params, kfac_stats=stats)
  previous = state.preconditioners["Dense_0"]
  # Make A indefinite beyond the damping: Cholesky yields NaN.
  broken = dict(state.factors)
  broken["Dense_0"] = broken["Dense_0"]._replace(
    activation_factor=-1e3 * jnp.eye(5, dtype=jnp.float32)
  )
  state = state._replace(factors=broken)
  tx_no_factor_update = kfac_jax.scale_by_kfac(
    damping=1e-2,
    compute_method="inverse",
    kl_clip=None,
    factor_update_steps=1000,
  )
  state = state._replace(count=jnp.ones([], jnp.int32))
  updates, state = tx_no_factor_update.update(
    grads, state, params, kfac_stats=stats
  )
  assert int(state.rejected_decompositions) == 1
  for a, b in zip(previous, state.preconditioners["Dense_0"]):
    np.testing.assert_array_equal(a, b)
  assert _all_finite(updates)


@pytest.mark.parametrize("scale", [1e-18, 1e-6, 1e6, 1e15])
@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_extreme_scales_and_batch_of_one_stay_finite(scale, compute_method):
  params, sample, loss_fn = _problem(batch=1)
  tx = kfac_jax.scale_by_kfac(damping=1e-6, compute_method=compute_method)
  state = tx.init(params)
  for _ in range(3):
    x, y = sample()
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
      params, x * scale, y
    )
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    assert _all_finite(updates) and _all_finite(state)
