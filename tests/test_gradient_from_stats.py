"""``gradient_from_stats``: dense layers preconditioned as ``(a Lᵀ)ᵀ(g R)``.

References: the dense ``L ∇ R`` of ``aᵀg`` in float64 (``sandwich``), and
``scale_by_kfac`` without the option on the same gradients and stats (the
dense path), for Dense (one call and two), ``DenseGeneral``, scanned Dense
and Conv layers, with both methods.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax.factors import batch as batch_lib
from kfac_jax.preconditioning.gradient_matrix import (
  FactoredGradient,
  factored_is_cheaper,
  sandwich,
)
from tests import reference

BATCH = 4


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(24, name="dense")(x)), None


class Mixed(nn.Module):
  """[B, T, C] -> Conv -> DenseGeneral(T, C) -> Dense ×2 (shared) -> scan."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(6, (3,), name="conv")(x))
    h = jnp.tanh(nn.DenseGeneral(24, axis=(-2, -1), name="general")(h))
    shared = nn.Dense(24, name="shared")
    h = jnp.tanh(shared(jnp.tanh(shared(h))))
    scanned = nn.scan(
      Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
    )
    h, _ = scanned(name="layers")(h, None)
    return nn.Dense(2, name="head")(h)


# Rows N and (dA, dG) of each layer at BATCH = 4: which form is cheaper.
#   conv: a convolution, always dense.
#   general: N=4, (8·6+1, 24): 4·(49²+24²+49·24) = 16.6k < 49·24·73 = 85.8k.
#   shared: N=8 (two calls), (25, 24): 8·1801 = 14.4k < 25·24·49 = 29.4k.
#   layers/dense: N=4 per block, (25, 24): 7.2k < 29.4k.
#   head: N=4, (25, 2): 4·679 = 2.7k > 25·2·27 = 1.35k, dense.
FACTORED = {"general", "shared", "layers/dense"}


def _problem():
  rng = np.random.default_rng(0)
  model = Mixed()
  inputs = jnp.asarray(rng.normal(size=(BATCH, 8, 3)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), inputs)["params"]
  targets = jnp.asarray(rng.normal(size=(BATCH, 2)), jnp.float32)

  def loss_fn(params, inputs, targets):
    return jnp.mean((model.apply({"params": params}, inputs) - targets) ** 2)

  layers = kfac_jax.trace_layers(loss_fn, params, inputs, targets)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
    params, inputs, targets
  )
  return params, grads, stats, layers


def test_the_selection_rule_matches_the_flop_counts_above():
  assert factored_is_cheaper(4, 49, 24)
  assert factored_is_cheaper(8, 25, 24)
  assert factored_is_cheaper(4, 25, 24)
  assert not factored_is_cheaper(4, 25, 2)
  # A 1000×1000 layer: factored below N = 1000·1000·2000 / (3·1000²) ≈ 667.
  assert factored_is_cheaper(666, 1000, 1000)
  assert not factored_is_cheaper(667, 1000, 1000)


@pytest.mark.parametrize("left_dim,right_dim", [(7, 5), (5, 7)])
def test_sandwich_of_factors_equals_the_dense_product(left_dim, right_dim):
  rng = np.random.default_rng(1)
  rows = 3
  activation = rng.normal(size=(rows, left_dim))
  gradient = rng.normal(size=(rows, right_dim))
  left = rng.normal(size=(left_dim, left_dim))
  right = rng.normal(size=(right_dim, right_dim))
  expected = left @ (activation.T @ gradient) @ right
  as32 = lambda x: jnp.asarray(x, jnp.float32)
  factored = sandwich(
    as32(left), FactoredGradient(as32(activation), as32(gradient)), as32(right)
  )
  dense = sandwich(as32(left), as32(activation.T @ gradient), as32(right))
  # The inputs' rounding to float32 (4), the sum over the rows and the two
  # products' over left_dim and right_dim, each entry on the magnitude of
  # its terms, |L|·|a|ᵀ|g|·|R| (reference.assert_float32_close).
  magnitudes = (
    np.abs(left) @ (np.abs(activation).T @ np.abs(gradient)) @ (np.abs(right))
  )
  for got in (factored, dense):
    assert got.dtype == jnp.float32
    reference.assert_float32_close(
      got, expected, terms=4 + rows + left_dim + right_dim, scale=magnitudes
    )


def test_captured_rows_multiply_to_the_gradients():
  """``aᵀg`` of each dense layer's stats is the gradient, as captured."""
  params, grads, stats, layers = _problem()
  for name in FACTORED | {"head"}:
    activation, gradient = batch_lib.gradient_rows_of_dense(stats[name])
    product = np.einsum(
      "bna,bng->bag",
      np.asarray(activation, np.float64),
      np.asarray(gradient, np.float64),
    )
    layer = layers[name]
    node = _node(grads, name)
    kernel = np.asarray(node[layer.kernel_key]).reshape(
      product.shape[0], -1, product.shape[2]
    )
    expected = np.concatenate(
      [kernel, np.asarray(node["bias"]).reshape(product.shape[0], 1, -1)],
      axis=1,
    )
    # The gradient sums the same rows' products in float32: each entry
    # within (rows)·ε of the magnitude of its terms, |a|ᵀ|g|.
    magnitudes = np.einsum(
      "bna,bng->bag",
      np.abs(np.asarray(activation, np.float64)),
      np.abs(np.asarray(gradient, np.float64)),
    )
    reference.assert_float32_close(
      product,
      expected,
      terms=activation.shape[1],
      scale=magnitudes,
      err_msg=name,
    )
  with pytest.raises(ValueError, match="Conv layer's gradient"):
    batch_lib.gradient_rows_of_dense(stats["conv"])


def _two_steps(tx, params, grads, stats):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(2):
    updates, state = update(grads, state, params, kfac_stats=stats)
  return updates, state


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [None, 1e-3])
def test_equals_the_dense_path(compute_method, kl_clip):
  params, grads, stats, layers = _problem()
  make = lambda flag: optax.chain(
    kfac_jax.scale_by_kfac(
      learning_rate=0.1,
      damping=1e-2,
      kl_clip=kl_clip,
      compute_method=compute_method,
      layers=layers,
      gradient_from_stats=flag,
    ),
    optax.sgd(0.1, momentum=0.9),
  )
  expected, expected_state = _two_steps(make(False), params, grads, stats)
  got, state = _two_steps(make(True), params, grads, stats)
  # The same preconditioner applied as (a Lᵀ)ᵀ(g R) against L(aᵀg)R: their
  # sums (rows 8, dA 49 and dG 24 at most) round differently, by up to the
  # magnitude |L||∇||R|, which κ of the damped factors bounds by the
  # layer's update; then kl_clip's sum and the two steps' momentum.
  condition = reference.kfac_condition(expected_state[0].factors, 1e-2)
  for path, leaf in jax.tree_util.tree_leaves_with_path(expected):
    layer_scale = reference.largest(jax.tree.leaves(_at(expected, path[:-1])))
    reference.assert_float32_close(
      _at(got, path),
      leaf,
      terms=2 * (8 + 49 + 24 + 1),
      condition=condition,
      scale=layer_scale,
      err_msg=jax.tree_util.keystr(path),
    )
  np.testing.assert_array_equal(
    np.asarray(state[0].count), np.asarray(expected_state[0].count)
  )


def _node(tree, name):
  for key in name.split("/"):
    tree = tree[key]
  return tree


def _at(tree, path):
  for entry in path:
    tree = tree[entry.key]
  return tree


def test_factored_layers_do_not_read_their_dense_gradients():
  """Zeroing every gradient changes only the layers left in the dense form."""
  params, grads, stats, layers = _problem()
  tx = kfac_jax.scale_by_kfac(
    damping=1e-2,
    kl_clip=None,
    layers=layers,
    compute_method="inverse",
    gradient_from_stats=True,
  )
  state = tx.init(params)
  with_grads, _ = tx.update(grads, state, params, kfac_stats=stats)
  zeros, _ = tx.update(
    jax.tree.map(jnp.zeros_like, grads), state, params, kfac_stats=stats
  )
  assert set(layers) == FACTORED | {"conv", "head"}
  for name in layers:
    got, from_zeros = _node(with_grads, name), _node(zeros, name)
    same = all(
      np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(from_zeros))
    )
    assert same == (name in FACTORED), name
    if name not in FACTORED:
      assert all(
        not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(from_zeros)
      ), name


def test_bad_configurations_raise():
  with pytest.raises(
    TypeError, match="gradient_from_stats must be True or False"
  ):
    kfac_jax.scale_by_kfac(gradient_from_stats="yes")
  with pytest.raises(ValueError, match="accumulation_steps=2"):
    kfac_jax.scale_by_kfac(gradient_from_stats=True, accumulation_steps=2)
  with pytest.raises(ValueError, match="mesh_axes"):
    kfac_jax.scale_by_kfac(gradient_from_stats=True, mesh_axes="data")
