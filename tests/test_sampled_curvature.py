"""``capture.sampled_curvature`` against the losses' Hessians, a dense GGN."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax.factors import batch as batch_lib
from tests import reference

KEYS = 20_000
RNG = np.random.default_rng(0)
LOGITS = jnp.asarray(RNG.normal(size=(3, 4)) * 1.5, jnp.float32)
SOFT_TARGETS = jax.nn.softmax(jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32))

# (sampled surrogate, the per-example loss whose Hessian it samples)
CASES = {
  "sigmoid": (
    kfac_jax.sampled_curvature.sigmoid_cross_entropy,
    lambda f, y: optax.sigmoid_binary_cross_entropy(f, y).sum(),
  ),
  "softmax": (
    kfac_jax.sampled_curvature.softmax_cross_entropy,
    optax.softmax_cross_entropy,
  ),
  "squared": (
    kfac_jax.sampled_curvature.squared_error,
    lambda f, y: 0.5 * jnp.sum((f - y) ** 2),
  ),
}


def sampled_cotangents(surrogate, logits: jax.Array) -> jax.Array:
  """``u`` of ``KEYS`` keys, ``[keys, examples, outputs]``: surrogate's N·∇."""
  keys = jax.random.split(jax.random.key(1), KEYS)
  gradient = jax.vmap(jax.grad(surrogate), in_axes=(None, 0))(logits, keys)
  return gradient * logits.shape[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_cotangent_covariance_is_the_per_example_hessian(name):
  surrogate, per_example_loss = CASES[name]
  u = np.asarray(sampled_cotangents(surrogate, LOGITS), np.float64)
  covariance = np.einsum("kni,knj->nij", u, u) / KEYS
  hessians = jax.vmap(jax.hessian(per_example_loss))(LOGITS, SOFT_TARGETS)
  # Monte Carlo: entries of u are bounded by 1, so the standard error of
  # each mean is below 1/√KEYS ≈ 0.007.
  np.testing.assert_allclose(covariance, np.asarray(hessians), atol=0.03)


def test_sequence_outputs_average_over_every_leading_axis():
  # Outputs [batch, time, vocab] are batch·time examples, as a loss that
  # means over both axes counts them: each Rademacher cotangent is ±1/(B·T).
  gradient = jax.grad(kfac_jax.sampled_curvature.squared_error)(
    jnp.zeros((2, 3, 4), jnp.float32), jax.random.key(0)
  )
  # ±1, / 6: one rounding (reference.assert_float32_close).
  reference.assert_float32_close(
    np.abs(np.asarray(gradient)), np.full(gradient.shape, 1 / 6), terms=1
  )


def test_sigmoid_curvature_propagation_diagonal_is_exact():
  u = sampled_cotangents(CASES["sigmoid"][0], LOGITS)[:50]
  p = jax.nn.sigmoid(LOGITS)
  # Both sides in float32: the sigmoid (3 roundings), 1 − p and the product
  # (2), the square root squared again (2) and the scale by N (1).
  reference.assert_float32_close(
    u**2, jnp.broadcast_to(p * (1 - p), u.shape), terms=2 * (3 + 2) + 2 + 1
  )


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden = jnp.tanh(nn.Dense(5, name="hidden")(x))
    return nn.Dense(3, name="output")(hidden)


def test_stats_sample_the_gauss_newton_factors_of_every_layer():
  """E[N²·cov(g)] = (1/N) Σᵢ Jᵢᵀ Hᵢ Jᵢ per layer.

  J = ∂logits/∂(layer output).
  """
  model = MLP()
  x = jnp.asarray(RNG.normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def curvature_fn(p, key):
    logits = model.apply({"params": p}, x)
    return kfac_jax.sampled_curvature.sigmoid_cross_entropy(logits, key)

  def gradient_factors(key):
    _, _, stats = kfac_jax.value_grad_and_stats(curvature_fn)(params, key)
    return {
      name: batch_lib.batch_factors(s, fisher_scaled=True)[1][0]
      for name, s in stats.items()
    }

  keys = jax.random.split(jax.random.key(2), 8_000)
  sampled = jax.tree.map(
    lambda g: np.asarray(g.mean(0)), jax.jit(jax.vmap(gradient_factors))(keys)
  )

  f64 = lambda a: np.asarray(a, np.float64)
  w0, b0 = f64(params["hidden"]["kernel"]), f64(params["hidden"]["bias"])
  w1, b1 = f64(params["output"]["kernel"]), f64(params["output"]["bias"])
  hidden = np.tanh(f64(x) @ w0 + b0)
  p = 1 / (1 + np.exp(-(hidden @ w1 + b1)))
  hessians = [np.diag(h) for h in p * (1 - p)]  # [N] of [3, 3]
  # Jacobians of the logits w.r.t. each layer's output (pre-activation).
  jacobians = {
    "output": [np.eye(3)] * len(x),
    "hidden": [w1.T * (1 - h**2) for h in hidden],
  }
  for name, per_example in jacobians.items():
    expected = np.mean(
      [j.T @ h @ j for j, h in zip(per_example, hessians)], axis=0
    )
    np.testing.assert_allclose(
      sampled[name], expected, atol=0.03 * np.abs(expected).max()
    )


def test_activation_factors_do_not_depend_on_the_surrogate():
  model = MLP()
  x = jnp.asarray(RNG.normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  _, _, probe_stats = kfac_jax.value_grad_and_stats(
    lambda p: kfac_jax.sampled_curvature.softmax_cross_entropy(
      model.apply({"params": p}, x), jax.random.key(0)
    )
  )(params)
  targets = jax.nn.softmax(jnp.asarray(RNG.normal(size=(6, 3)), jnp.float32))
  _, _, loss_stats = kfac_jax.value_grad_and_stats(
    lambda p: optax.softmax_cross_entropy(
      model.apply({"params": p}, x), targets
    ).mean()
  )(params)
  for name in loss_stats:
    np.testing.assert_array_equal(
      batch_lib.batch_factors(probe_stats[name])[0],
      batch_lib.batch_factors(loss_stats[name])[0],
    )


def test_outputs_without_an_output_axis_are_rejected():
  with pytest.raises(ValueError, match="output axis"):
    kfac_jax.sampled_curvature.squared_error(jnp.zeros([]), jax.random.key(0))


@pytest.mark.parametrize(
  "fn", ["sigmoid_cross_entropy", "softmax_cross_entropy", "squared_error"]
)
def test_integer_outputs_and_a_key_that_is_not_one_are_named(fn):
  # Integer logits gave a surrogate of 0 (no statistics); an int seed or a
  # batch of keys failed inside jax.random, naming no argument.
  curvature = getattr(kfac_jax.sampled_curvature, fn)
  key = jax.random.key(0)
  with pytest.raises(TypeError, match=f"{fn}: the outputs must be floating"):
    curvature(jnp.ones((4, 3), jnp.int32), key)
  for bad_key in (0, None, jax.random.split(key, 4)):
    with pytest.raises(TypeError, match=f"{fn}: key must be one JAX PRNG key"):
      curvature(jnp.ones((4, 3)), bad_key)
  # Raw uint32 keys (jax.random.PRNGKey) are keys too, [4] ones for rbg.
  assert np.isfinite(float(curvature(jnp.ones((4, 3)), jax.random.PRNGKey(0))))
  with jax.default_prng_impl("unsafe_rbg"):
    assert np.isfinite(
      float(curvature(jnp.ones((4, 3)), jax.random.PRNGKey(0)))
    )
