"""``kfac_labels``: K-FAC's layers and the rest, for ``optax.partition``."""

from __future__ import annotations

import doctest

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from kfac_jax.transform import labels as labels_lib
from tests import kfac_problems, reference

DAMPING = 0.01


class Model(nn.Module):
  """An embedding, a LayerNorm, a Conv over the embedded sequence
  (A ``[3·4+1]²``), a Dense on its flattened output (A ``[6·5+1]²``) and a
  head (A ``[8+1]²``)."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.LayerNorm()(nn.Embed(11, 4)(tokens))
    x = jnp.tanh(nn.Conv(5, (3,), name="conv")(x))
    x = jnp.tanh(nn.Dense(8, name="wide")(x.reshape(len(x), -1)))
    return nn.Dense(2, name="head")(x)


def _problem():
  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 6), 0, 11)
  y = jax.random.normal(jax.random.PRNGKey(1), (4, 2))
  params = Model().init(jax.random.PRNGKey(2), tokens)["params"]

  def loss_fn(params):
    out = Model().apply({"params": params}, tokens)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))

  return params, loss_fn


def test_labels_follow_the_layers_scale_by_kfac_preconditions():
  params, _ = _problem()
  both = {"kernel": "kfac", "bias": "kfac"}
  other = {"kernel": "other", "bias": "other"}
  norm = {"scale": "other", "bias": "other"}
  embed = {"embedding": "other"}
  # Every layer, then "wide" left out by its A [31, 31], then "head" by name.
  for kwargs, wide, head in [
    ({}, both, both),
    (dict(max_factor_dim=20), other, both),
    (dict(skip_layers=["^head$"]), both, other),
  ]:
    assert kfac_jax.kfac_labels(params, **kwargs) == {
      "Embed_0": embed,
      "LayerNorm_0": norm,
      "conv": both,
      "wide": wide,
      "head": head,
    }, kwargs


def test_a_partitioned_chain_is_kfac_on_its_layers_and_adam_on_the_rest():
  params, loss_fn = _problem()
  settings = dict(kl_clip=None, damping=DAMPING, max_factor_dim=20)
  labels = kfac_jax.kfac_labels(params, **settings)
  tx = optax.partition(
    {"kfac": kfac_jax.kfac(0.1, **settings), "other": optax.adam(1e-3)},
    labels,
  )
  # Second paths: K-FAC alone (its per-layer updates do not depend on the
  # other leaves with kl_clip=None) and Adam alone.
  alone = kfac_jax.kfac(0.1, **settings)
  adam = optax.adam(1e-3)
  state, alone_state = tx.init(params), alone.init(params)
  adam_state = adam.init(params)
  for _ in range(2):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    expected, alone_state = alone.update(
      grads, alone_state, params, kfac_stats=stats
    )
    adam_updates, adam_state = adam.update(grads, adam_state, params)
    kfac_state = reference.kfac_state(alone_state)
    assert sorted(kfac_state.factors) == ["conv", "head"]
    condition = reference.kfac_condition(
      kfac_state.factors, DAMPING, relative=True, method="inverse"
    )
    for name, label in labels.items():
      source = expected if "kfac" in label.values() else adam_updates
      for actual, want in zip(
        jax.tree.leaves(updates[name]), jax.tree.leaves(source[name])
      ):
        # The same float32 operations by two paths: any difference is the
        # order of XLA's sums, over the largest factor pair (A [13, 13] of
        # the conv, G [8, 8] is smaller) and through the damped solve.
        reference.assert_float32_close(
          actual, want, terms=13 + 5, condition=condition, err_msg=name
        )
    params = optax.apply_updates(params, updates)


def test_no_stats_steps_pass_through_the_partition():
  params, loss_fn = _problem()
  settings = dict(factor_update_steps=2, max_factor_dim=20)
  tx = optax.partition(
    {"kfac": kfac_jax.kfac(0.1, **settings), "other": optax.adamw(1e-3)},
    kfac_jax.kfac_labels(params, **settings),
  )

  losses, state = kfac_problems.train_with_no_stats_between(tx, loss_fn, params)
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  assert int(reference.kfac_state(state).skipped_factor_updates) == 0


def test_docstring_example():
  result = doctest.testmod(labels_lib, raise_on_error=False)
  assert result.attempted > 0 and result.failed == 0
