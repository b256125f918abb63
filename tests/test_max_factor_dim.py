"""``max_factor_dim``: layers with a factor over the size are left to the
chained optimizer, exactly as ``skip_layers`` naming them would leave them."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from tests import kfac_problems, reference

close = reference.assert_float32_close

DAMPING = 0.01


class WideHead(nn.Module):
  """Conv (A ``[3·3·2+1]²``, G ``[4]²``), then a Dense on the flattened
  ``8·8·4`` features (A ``[257]²``), then a Dense with 40 outputs (G
  ``[40]²``): with ``max_factor_dim=32`` the last two are left out, one by
  its A and one by its G."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Conv(4, (3, 3))(x))
    x = jnp.tanh(nn.Dense(6, name="wide")(x.reshape(len(x), -1)))
    return nn.Dense(40, name="many_outputs")(x)


def _problem():
  model = WideHead()
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(keys[0], (5, 8, 8, 2))
  y = jax.random.normal(keys[1], (5, 40))
  params = model.init(keys[2], x)["params"]

  def loss_fn(params):
    return 0.5 * jnp.mean(
      jnp.sum((model.apply({"params": params}, x) - y) ** 2, -1)
    )

  return params, loss_fn


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("with_table", [False, True])
def test_left_out_layers_match_skip_layers(method, with_table):
  params, loss_fn = _problem()
  table = kfac_jax.trace_layers(loss_fn, params) if with_table else None
  settings = dict(
    damping=DAMPING, kl_clip=None, compute_method=method, layers=table
  )
  by_size = kfac_jax.scale_by_kfac(max_factor_dim=32, **settings)
  by_name = kfac_jax.scale_by_kfac(
    skip_layers=["^wide$", "^many_outputs$"], **settings
  )
  size_state, name_state = by_size.init(params), by_name.init(params)
  assert sorted(size_state.factors) == sorted(name_state.factors) == ["Conv_0"]
  for _ in range(2):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
    size_updates, size_state = by_size.update(
      grads, size_state, params, kfac_stats=stats
    )
    name_updates, name_state = by_name.update(
      grads, name_state, params, kfac_stats=stats
    )
    for name in ("wide", "many_outputs"):
      for update, grad in zip(
        jax.tree.leaves(size_updates[name]), jax.tree.leaves(grads[name])
      ):
        np.testing.assert_array_equal(update, grad)
    # The same operations on the same inputs by two paths of the code: any
    # difference is XLA's order of float32 sums, over the contraction of
    # A [19, 19] and G [4, 4] and through the damped solve's condition.
    condition = reference.kfac_condition(
      name_state.factors, DAMPING, relative=True, method=method
    )
    for actual, expected in zip(
      jax.tree.leaves(size_updates["Conv_0"]),
      jax.tree.leaves(name_updates["Conv_0"]),
    ):
      close(actual, expected, terms=19 + 4, condition=condition)


def test_a_limit_every_layer_fits_changes_nothing():
  params, loss_fn = _problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  unlimited = kfac_jax.scale_by_kfac(damping=DAMPING)
  limited = kfac_jax.scale_by_kfac(damping=DAMPING, max_factor_dim=257)
  expected, _ = unlimited.update(
    grads, unlimited.init(params), params, kfac_stats=stats
  )
  actual, state = limited.update(
    grads, limited.init(params), params, kfac_stats=stats
  )
  assert sorted(state.factors) == ["Conv_0", "many_outputs", "wide"]
  jax.tree.map(np.testing.assert_array_equal, actual, expected)


def test_jitted_chain_with_no_stats_steps_and_partition_specs():
  params, loss_fn = _problem()
  settings = dict(max_factor_dim=32, factor_update_steps=2)
  tx = kfac_jax.kfac(0.1, damping=DAMPING, **settings)
  specs = kfac_jax.get_opt_state_partition_specs(
    params, learning_rate=0.1, damping=DAMPING, **settings
  )
  kfac_specs = reference.kfac_state(specs)
  assert sorted(kfac_specs.factors) == ["Conv_0"]

  losses, state = kfac_problems.train_with_no_stats_between(tx, loss_fn, params)
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  assert int(reference.kfac_state(state).skipped_factor_updates) == 0


@pytest.mark.parametrize(
  ("value", "error"),
  [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)],
)
def test_max_factor_dim_must_be_a_positive_integer(value, error):
  with pytest.raises(error, match="max_factor_dim"):
    kfac_jax.scale_by_kfac(max_factor_dim=value)


def test_a_head_over_the_limit_gets_no_factors():
  # A vocabulary-sized head: its G would be [8193, 8193] (268 MB).
  class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8193, name="head")(jnp.tanh(nn.Dense(4)(x)))

  x = jnp.ones((2, 3))
  params = Head().init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(params):
    return jnp.mean(Head().apply({"params": params}, x) ** 2)

  tx = kfac_jax.scale_by_kfac(max_factor_dim=8192)
  state = tx.init(params)
  assert sorted(state.factors) == ["Dense_0"]
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  jax.tree.map(np.testing.assert_array_equal, updates["head"], grads["head"])
