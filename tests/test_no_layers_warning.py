"""A capture that finds no layer warns: K-FAC would silently do nothing.

``skip_layers`` that match every layer (an RNN cell's class name), a loss
whose layers the capture does not know, and ``trace_layers`` alike warn
once, at the caller's line; a capture that finds a layer does not warn.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import kfac_jax


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.tanh(nn.Dense(4)(x)))


X = jnp.ones((3, 5))
PARAMS = Mlp().init(jax.random.key(0), X)["params"]


def linen_loss(params, x):
  return jnp.sum(Mlp().apply({"params": params}, x) ** 2)


def nnx_loss(model, x):
  return jnp.sum(model(x) ** 2)


def caught(call):
  """The warnings ``call()`` raises, every one recorded."""
  with warnings.catch_warnings(record=True) as records:
    warnings.simplefilter("always")
    call()
  return [r for r in records if issubclass(r.category, UserWarning)]


def assert_one_no_layer_warning(records, caller, *fragments):
  assert len(records) == 1, [str(r.message) for r in records]
  message = str(records[0].message)
  assert message.startswith(f"{caller} captured no layer"), message
  for fragment in fragments:
    assert fragment in message, message
  assert records[0].filename == __file__  # the caller's line


@pytest.mark.parametrize("skip", [".*", ["Dense"], ["^Dense_0$", "^Dense_1$"]])
def test_skip_layers_matching_every_layer_warn(skip):
  records = caught(
    lambda: kfac_jax.value_grad_and_stats(linen_loss, skip_layers=skip)(
      PARAMS, X
    )
  )
  assert_one_no_layer_warning(
    records, "value_grad_and_stats", "skip_layers", "chained optimizer"
  )
  records = caught(
    lambda: kfac_jax.trace_layers(linen_loss, PARAMS, X, skip_layers=skip)
  )
  assert_one_no_layer_warning(records, "trace_layers", "skip_layers")


def test_a_loss_calling_no_known_layer_warns():
  weights = {"w": jnp.ones((5,))}
  loss = lambda p, x: jnp.sum(x @ p["w"])
  records = caught(lambda: kfac_jax.value_grad_and_stats(loss)(weights, X))
  assert_one_no_layer_warning(records, "value_grad_and_stats")
  assert "skip_layers" not in str(records[0].message)
  records = caught(lambda: kfac_jax.trace_layers(loss, weights, X))
  assert_one_no_layer_warning(records, "trace_layers")


def test_an_nnx_model_with_every_layer_skipped_warns():
  model = nnx.Sequential(
    nnx.Linear(5, 4, rngs=nnx.Rngs(0)),
    jnp.tanh,
    nnx.Linear(4, 2, rngs=nnx.Rngs(1)),
  )
  records = caught(
    lambda: kfac_jax.value_grad_and_stats(nnx_loss, skip_layers=["Linear"])(
      model, X
    )
  )
  assert_one_no_layer_warning(records, "value_grad_and_stats", "'Linear'")
  records = caught(
    lambda: kfac_jax.trace_layers(nnx_loss, model, X, skip_layers=["Linear"])
  )
  assert_one_no_layer_warning(records, "trace_layers")
  # Under jit the warning comes once, when the step is traced.
  records = caught(
    lambda: jax.jit(
      lambda m, x: kfac_jax.value_grad_and_stats(
        nnx_loss, skip_layers=["Linear"]
      )(m, x)[0]
    )(model, X)
  )
  assert len(records) == 1


def test_a_capture_that_finds_a_layer_does_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, _, stats = kfac_jax.value_grad_and_stats(
      linen_loss, skip_layers=["^Dense_1$"]
    )(PARAMS, X)
    table = kfac_jax.trace_layers(linen_loss, PARAMS, X)
  assert sorted(stats) == ["Dense_0"]
  assert sorted(table) == ["Dense_0", "Dense_1"]
