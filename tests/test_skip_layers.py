"""Parameters K-FAC leaves alone: unregistered, skipped by ``skip_layers``, or
masked out by the chain (``optax.multi_transform``, ``optax.masked``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import reference
from tests.kfac_problems import (
  DAMPING,
  LEARNING_RATE,
  make_problem,
  update_terms,
)

close = reference.assert_float32_close


def test_unregistered_gradients_pass_through_and_skip_layers():
  class WithNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.LayerNorm()(nn.Dense(6, name="encoder")(x))
      return nn.Dense(3, name="head")(x)

  model = WithNorm()
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(params):
    return jnp.sum(model.apply({"params": params}, x) ** 2)

  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  table = kfac_jax.trace_layers(loss_fn, params)
  for skip, preconditioned, layers in [
    (None, {"encoder", "head"}, None),
    (["^head$"], {"encoder"}, None),
    (["Dense"], set(), None),
    # By class with the table too (init
    # once said the params lacked them).
    (["Dense"], set(), table),
    (["^head$"], {"encoder"}, table),
    # By path: no K-FAC state at all.
    (["encoder|head"], set(), None),
  ]:
    tx = kfac_jax.scale_by_kfac(skip_layers=skip, layers=layers)
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params, kfac_stats=stats)
    for name in ("encoder", "head", "LayerNorm_0"):
      same = all(
        np.array_equal(u, g)
        for u, g in zip(
          jax.tree.leaves(updates[name]), jax.tree.leaves(grads[name])
        )
      )
      assert same == (name not in preconditioned), (skip, layers, name)


class Encoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4)(jnp.tanh(nn.Dense(6)(x))))


class EncoderThenHead(nn.Module):
  """Layers under a parent module (``encoder/Dense_0``, ``encoder/Dense_1``)
  and one at the top (``head``)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="head")(Encoder(name="encoder")(x))


def test_a_skipped_module_leaves_every_layer_under_it():
  # An anchored pattern naming a parent module matches none of its layers'
  # own paths: the modules above each layer are tested too.
  model = EncoderThenHead()
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  _, grads, stats = kfac_jax.value_grad_and_stats(
    lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  )(params)
  tx = kfac_jax.scale_by_kfac(skip_layers=["^encoder$"])
  state = tx.init(params)
  assert sorted(state.factors) == ["head"]
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  jax.tree.map(
    np.testing.assert_array_equal, updates["encoder"], grads["encoder"]
  )
  assert not np.array_equal(updates["head"]["kernel"], grads["head"]["kernel"])


def test_a_table_with_a_parent_module_withheld_by_the_chain():
  """The layer table has encoder/Dense_0 and encoder/Dense_1; Adam gets the
  whole encoder, labelled as one module (one optax.MaskedNode in K-FAC's
  params): not layers the params lack, and the head is preconditioned as
  when K-FAC skips the encoder."""
  model = EncoderThenHead()
  x = jnp.asarray(np.random.default_rng(9).normal(size=(4, 5)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  table = kfac_jax.trace_layers(loss_fn, params)
  assert sorted(table) == ["encoder/Dense_0", "encoder/Dense_1", "head"]
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  kfac = kfac_jax.scale_by_kfac(damping=DAMPING, kl_clip=None, layers=table)
  tx = optax.multi_transform(
    {"kfac": kfac, "adam": optax.adam(1e-3)},
    {"encoder": "adam", "head": "kfac"},
  )
  state = tx.init(params)
  assert list(state.inner_states["kfac"].inner_state.factors) == ["head"]
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  skipping = kfac_jax.scale_by_kfac(
    damping=DAMPING, kl_clip=None, layers=table, skip_layers=["^encoder/"]
  )
  expected, _ = skipping.update(
    grads, skipping.init(params), params, kfac_stats=stats
  )
  # The same step on the same inputs in another program: head's factor
  # sums (4 rows) and eigh (to 5² + 3²), through K-FAC's conditioning.
  tolerance = dict(
    terms=4 + 5**2 + 3**2,
    condition=reference.kfac_condition(
      state.inner_states["kfac"].inner_state.factors, DAMPING
    ),
    scale=reference.largest(jax.tree.leaves(expected["head"])),
  )
  jax.tree.map(
    lambda a, b: close(a, b, **tolerance), updates["head"], expected["head"]
  )


@pytest.mark.parametrize("labels_as", ["leaves", "prefix"])
@pytest.mark.parametrize("wrap", ["multi_transform", "masked"])
def test_layers_masked_out_by_the_chain_are_left_alone(wrap, labels_as):
  """K-FAC on the body, Adam on the head (multi_transform), or K-FAC masked
  to the body: equal to K-FAC skipping the head (init once crashed on
  optax.MaskedNode). Labels per leaf, or per module (a prefix of the params,
  as optax allows: update once raised on the head's stats)."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  label = lambda name: "adam" if name == "Dense_1" else "kfac"
  labels = {
    name: (
      label(name)
      if labels_as == "prefix"
      else jax.tree.map(lambda _, name=name: label(name), leaves)
    )
    for name, leaves in params.items()
  }
  body = kfac_jax.kfac(LEARNING_RATE, damping=DAMPING)
  if wrap == "multi_transform":
    tx = optax.multi_transform({"kfac": body, "adam": optax.adam(1e-3)}, labels)
  else:
    tx = optax.masked(body, jax.tree.map(lambda label: label == "kfac", labels))
  updates, _ = jax.jit(lambda g, s: tx.update(g, s, params, kfac_stats=stats))(
    grads, tx.init(params)
  )
  skipping = kfac_jax.kfac(
    LEARNING_RATE, damping=DAMPING, skip_layers=["^Dense_1$"]
  )
  expected, skipping_state = skipping.update(
    grads, skipping.init(params), params, kfac_stats=stats
  )
  # One jitted, the other not: float32 rounding apart (2.2e-5 relative in
  # one entry with --xla_cpu_multi_thread_eigen=false, a reduction order):
  # one step's, through K-FAC's conditioning, on the layer's update.
  tolerance = dict(
    terms=update_terms("mlp", (6, 7)),
    condition=reference.kfac_condition(
      reference.kfac_state(skipping_state).factors, DAMPING
    ),
    scale=reference.largest(jax.tree.leaves(expected["Dense_0"])),
  )
  jax.tree.map(
    lambda a, b: close(a, b, **tolerance),
    updates["Dense_0"],
    expected["Dense_0"],
  )
  head = (
    optax.adam(1e-3).update(
      grads["Dense_1"], optax.adam(1e-3).init(params["Dense_1"])
    )[0]
    if wrap == "multi_transform"
    else grads["Dense_1"]
  )  # optax.masked passes the rest through
  # Adam's elementwise chain: 10 roundings.
  jax.tree.map(lambda a, b: close(a, b, terms=10), updates["Dense_1"], head)
