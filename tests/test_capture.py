"""value_grad_and_stats: each call's gradients, inputs and output cotangents."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax.factors.batch import batch_factors
from tests import reference

close = reference.assert_float32_close


class SharedLayer(nn.Module):
  """One Dense called twice, inside a named sub-module."""

  @nn.compact
  def __call__(self, x1, x2):
    dense = nn.Dense(3, name="shared")
    return dense(x1) + 2.0 * dense(x2)


class Outer(nn.Module):
  @nn.compact
  def __call__(self, x1, x2):
    return SharedLayer(name="block")(x1, x2)


def test_each_call_is_captured_with_its_cotangent():
  model = Outer()
  rng = np.random.default_rng(0)
  x1 = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
  x2 = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x1, x2)["params"]

  def loss_fn(params):
    y = model.apply({"params": params}, x1, x2)
    return jnp.sum(y**2), y

  (loss, y), grads, stats = kfac_jax.value_grad_and_stats(
    loss_fn, has_aux=True
  )(params)
  (expected_loss, _), expected_grads = jax.value_and_grad(
    loss_fn, has_aux=True
  )(params)
  # The dot of 5, the bias, out₁ + 2·out₂, the sum over 4 × 3 outputs
  # (reference.assert_float32_close's ``terms``); the gradients, backward
  # and the kernel's sums over 2 × 4 rows.
  close(loss, expected_loss, terms=5 + 1 + 2 + 12)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
    close(a, b, terms=2 * (5 + 1 + 2 + 12) + 8)

  assert list(stats) == ["block/shared"]
  layer = stats["block/shared"]
  assert layer.signature.module_type == "Dense" and layer.signature.has_bias
  np.testing.assert_array_equal(layer.inputs[0], x1)
  np.testing.assert_array_equal(layer.inputs[1], x2)
  # dL/d(out_1) = 2y and dL/d(out_2) = 2 * 2y, from
  # L = sum((out_1 + 2 out_2)^2).
  # 2y and 4y are exact of the backward pass's y, which XLA may compute again:
  # the dot of 5, the bias, the sum.
  close(layer.output_cotangents[0], 2 * y, terms=5 + 1 + 2)
  close(layer.output_cotangents[1], 4 * y, terms=5 + 1 + 2)

  # The layer's batch factors are the sum of its calls' factors.
  (a,), (g,) = batch_factors(layer)  # one Kronecker block
  ones = np.ones((4, 1))
  a1 = np.concatenate([np.asarray(x1, np.float64), ones], 1)
  a2 = np.concatenate([np.asarray(x2, np.float64), ones], 1)
  y64 = np.asarray(y, np.float64)
  # Each call's 4 rows' products summed, / 4, the two calls added.
  close(a, reference.cov(a1) + reference.cov(a2), terms=4 + 1 + 1)
  close(g, reference.cov(2 * y64) + reference.cov(4 * y64), terms=4 + 1 + 1)


class TargetWithSameLayers(nn.Module):
  """A Dense and an Embed each called twice, the second call's output under
  ``stop_gradient`` (a target computed with the same layers)."""

  @nn.compact
  def __call__(self, ids, x, target_ids, target_x):
    dense, embed = nn.Dense(3, name="dense"), nn.Embed(6, 3, name="embed")
    online = dense(x) + embed(ids)
    target = jax.lax.stop_gradient(dense(target_x) + embed(target_ids))
    return online, target


def test_a_call_whose_output_does_not_reach_the_loss_adds_nothing():
  # Its inputs came out zeros (reveal_input's backward pass never runs), so
  # its bias column entered A (A[bias, bias] = 2) and the Embed's A counted
  # token 0 for each of its rows.
  model = TargetWithSameLayers()
  rng = np.random.default_rng(4)
  x, target_x = (
    jnp.asarray(rng.normal(size=(5, 4)), jnp.float32) for _ in range(2)
  )
  ids, target_ids = jnp.array([1, 2, 2, 3, 5]), jnp.array([0, 0, 4, 4, 1])
  params = model.init(jax.random.PRNGKey(0), ids, x, target_ids, target_x)[
    "params"
  ]

  def loss_fn(params):
    online, target = model.apply(
      {"params": params}, ids, x, target_ids, target_x
    )
    return jnp.sum((online - target) ** 2)

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  online, target = model.apply({"params": params}, ids, x, target_ids, target_x)
  online_cotangent = 2 * np.asarray(online - target, np.float64)
  (a,), (g,) = batch_factors(stats["dense"])
  online_rows = np.concatenate([np.asarray(x, np.float64), np.ones((5, 1))], 1)
  close(a, reference.cov(online_rows), terms=5 + 1)  # 5 rows' products, / 5
  # The cotangent 2(online − target) cancels: its rounding (the dot of 4, the
  # bias, the embedding's add, for each side) is of 2(|online| + |target|),
  # and G's of that squared; then G's 5 rows' products, / 5.
  magnitude = 2 * float(np.max(np.abs(online) + np.abs(target)))
  close(
    g,
    reference.cov(online_cotangent),
    terms=2 * (4 + 1 + 1) + 5 + 1,
    scale=magnitude**2,
  )
  (a,), _ = batch_factors(stats["embed"])
  # Counts of one-hot rows, exact, / 5.
  close(np.diag(a), np.bincount(ids, minlength=6) / 5, terms=1)


def test_extra_arguments_and_jit():
  model = nn.Dense(2)
  x = jnp.ones((3, 4))
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(params, x, scale):
    return scale * jnp.sum(model.apply({"params": params}, x))

  fn = jax.jit(kfac_jax.value_grad_and_stats(loss_fn))
  loss, grads, stats = fn(params, x, 3.0)
  # Root module: its path is empty, as is the params path of its kernel.
  assert list(stats) == [""]
  np.testing.assert_allclose(grads["bias"], 3.0 * 3 * np.ones(2))
  np.testing.assert_allclose(
    stats[""].output_cotangents[0], 3.0 * np.ones((3, 2))
  )


def test_non_scalar_loss_is_rejected():
  model = nn.Dense(2)
  x = jnp.ones((3, 4))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  with pytest.raises(ValueError, match="scalar loss"):
    kfac_jax.value_grad_and_stats(lambda p: model.apply({"params": p}, x))(
      params
    )


def test_has_aux_requires_a_pair():
  model = nn.Dense(2)
  x = jnp.ones((3, 4))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  with pytest.raises(ValueError, match=r"\(loss, aux\)"):
    kfac_jax.value_grad_and_stats(
      lambda p: jnp.sum(model.apply({"params": p}, x)), has_aux=True
    )(params)


class ScaledDense(nn.Dense):
  """A Dense subclass that overrides ``__call__`` around the base call."""

  @nn.compact
  def __call__(self, x):
    return 2.0 * super().__call__(x) + 1.0


def test_a_subclass_overriding_call_is_captured_at_the_base_call():
  # Linen intercepts both calls; only the inner, linear one is the layer.
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return ScaledDense(3, name="scaled")(x)

  model = Model()
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 4))
  y = rng.normal(size=(5, 3))
  params = model.init(jax.random.PRNGKey(0), jnp.asarray(x, jnp.float32))[
    "params"
  ]

  def loss_fn(params):
    out = model.apply({"params": params}, jnp.asarray(x, jnp.float32))
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  assert len(stats["scaled"].inputs) == 1
  kernel = np.asarray(params["scaled"]["kernel"], np.float64)
  bias = np.asarray(params["scaled"]["bias"], np.float64)
  out = 2.0 * (x @ kernel + bias) + 1.0
  # d loss / d (the base call's output): through the override's factor 2.
  cotangent = 2.0 * (out - y) / len(x)
  close(stats["scaled"].inputs[0], x, terms=1)  # x rounded to float32
  # The dot of 4, the bias, ·2, +1, −y, ·2/5: 9 roundings.
  close(stats["scaled"].output_cotangents[0], cotangent, terms=9)


def test_calls_that_contract_different_axes_are_refused():
  # axis=1 is the features of the rank-3 input and of the rank-2 one, -2 and
  # -1 counted from the end: one factor layout cannot hold both.
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x3, x2):
      layer = nn.DenseGeneral(3, axis=1, name="general")
      return jnp.sum(layer(x3)) + jnp.sum(layer(x2) ** 2)

  model = Model()
  x3, x2 = jnp.ones((5, 4, 2)), jnp.ones((5, 4))
  params = model.init(jax.random.PRNGKey(0), x3, x2)["params"]
  with pytest.raises(
    ValueError, match="'general' is called with two signatures"
  ):
    kfac_jax.value_grad_and_stats(
      lambda params: model.apply({"params": params}, x3, x2)
    )(params)


@pytest.mark.parametrize("batch_dims", [0, (0,)])
def test_dense_general_with_batch_dims_is_left_out(batch_dims):
  # Its kernel [batch, in, out] is no Kronecker layer. The int form (Flax's
  # shorthand for one axis) was read as none: kernel (6, 3, 2) as in (6,),
  # out (3, 2), then a bias-shape error at init.
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.DenseGeneral(2, batch_dims=batch_dims, name="batched")(x)
      return nn.Dense(1, name="head")(h)

  model = Model()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5, 3)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  assert params["batched"]["kernel"].shape == (6, 3, 2)
  loss_fn = lambda params: jnp.mean(model.apply({"params": params}, x) ** 2)
  table = kfac_jax.trace_layers(loss_fn, params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  assert list(table) == list(stats) == ["head"]
  tx = kfac_jax.scale_by_kfac(layers=table, skip_layers=["^batched$"])
  updates, _ = tx.update(grads, tx.init(params), kfac_stats=stats)
  jax.tree.map(
    np.testing.assert_array_equal, updates["batched"], grads["batched"]
  )
