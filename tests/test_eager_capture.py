"""``value_grad_and_stats`` called outside ``jit`` behaves like
``jax.value_and_grad``: what does not depend on the params is concrete, so a
loss may hand it to NumPy or branch on it in Python.

The capture traces the loss for shapes before it differentiates it; that
trace once made every value a tracer, and NumPy on one raised
``TracerArrayConversionError``. Each test runs such a loss eagerly and
compares it with ``jax.value_and_grad`` (value, gradients) and with the
jitted capture of the same loss, its NumPy part computed outside (stats).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kfac_jax
from tests import reference

close = reference.assert_float32_close
B, IN, OUT = 5, 4, 3
# The loss's roundings: the Dense's dot of IN and its bias, the square, the
# sum over B·OUT outputs and the division; the cotangents and the gradient's
# sum over the B rows carry them too.
TERMS = IN + 1 + 1 + B * OUT + 1 + B


def _data():
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.normal(size=(B, IN)), jnp.float32)


def _numpy_scale(x) -> float:
  """A data statistic computed in NumPy, as a user's loss might: it needs
  the concrete value of ``tanh(x)``."""
  return float(np.std(np.asarray(jnp.tanh(x)))) + 1.0


def _check_like_jitted(eager, jitted) -> None:
  (loss, grads, stats), (loss_j, grads_j, stats_j) = eager, jitted
  close(loss, loss_j, terms=TERMS)
  jax.tree.map(lambda a, b: close(a, b, terms=TERMS), grads, grads_j)
  assert sorted(stats) == sorted(stats_j)
  for name in stats:
    for field in ("inputs", "output_cotangents"):
      for value, expected in zip(
        getattr(stats[name], field), getattr(stats_j[name], field)
      ):
        close(value, expected, terms=TERMS, err_msg=f"{name} {field}")


def test_a_linen_loss_using_numpy_runs_eagerly_as_under_value_and_grad():
  model = nn.Dense(OUT)
  x = _data()
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(params, x):
    scale = _numpy_scale(x)
    if scale > 100:  # a Python branch on a concrete value
      scale = 100.0
    return jnp.sum(model.apply({"params": params}, x) ** 2) / scale

  eager = kfac_jax.value_grad_and_stats(loss_fn)(params, x)
  expected_loss, expected_grads = jax.value_and_grad(loss_fn)(params, x)
  close(eager[0], expected_loss, terms=TERMS)
  jax.tree.map(lambda a, b: close(a, b, terms=TERMS), eager[1], expected_grads)
  scale = _numpy_scale(x)
  jitted = jax.jit(
    kfac_jax.value_grad_and_stats(
      lambda params, x: jnp.sum(model.apply({"params": params}, x) ** 2) / scale
    )
  )(params, x)
  _check_like_jitted(eager, jitted)
  # The layer table reads the same loss eagerly too.
  assert list(kfac_jax.trace_layers(loss_fn, params, x)) == [""]


def test_an_nnx_loss_using_numpy_runs_eagerly():
  model = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
  x = _data()

  def loss_fn(model, x):
    return jnp.sum(model(x) ** 2) / _numpy_scale(x)

  eager = kfac_jax.value_grad_and_stats(loss_fn)(model, x)
  scale = _numpy_scale(x)
  jitted = nnx.jit(
    kfac_jax.value_grad_and_stats(
      lambda model, x: jnp.sum(model(x) ** 2) / scale
    )
  )(model, x)
  _check_like_jitted(eager, jitted)


def test_a_loss_with_a_cell_in_a_loop_using_numpy_runs_eagerly():
  # A layer shared over a loop's steps is captured through the loss's
  # jaxpr (capture/loops.py), traced eagerly in the same way.
  model = nn.Dense(IN)
  x = _data()
  params = model.init(jax.random.key(1), x)["params"]

  def looped(scale):
    def loss_fn(params, x):
      step = lambda h, _: (jnp.tanh(model.apply({"params": params}, h)), h)
      return jnp.sum(jax.lax.scan(step, x, length=3)[1] ** 2) / scale(x)

    return loss_fn

  eager = kfac_jax.value_grad_and_stats(looped(_numpy_scale))(params, x)
  scale = _numpy_scale(x)
  jitted = jax.jit(kfac_jax.value_grad_and_stats(looped(lambda _: scale)))(
    params, x
  )
  # Three steps of the layer forward and back.
  assert eager[2][""].inputs[0].shape == (B, 3, IN)
  close(eager[0], jitted[0], terms=3 * TERMS)
  for field in ("inputs", "output_cotangents"):
    close(
      getattr(eager[2][""], field)[0],
      getattr(jitted[2][""], field)[0],
      terms=3 * TERMS,
      err_msg=field,
    )
