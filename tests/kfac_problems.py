"""The small MLP and CNN problems of the ``scale_by_kfac`` tests, their float32
rounding budgets (``reference.assert_float32_close``'s ``terms``) and
settings."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from tests import reference

CONV_STRIDES = (2, 1)
CONV_PADDING = ((1, 1), (0, 1))
DAMPING = 0.003
LEARNING_RATE = 0.1
# reference.assert_float32_close's ``terms`` for make_problem's models. The
# rounding a layer's rows carry: the forward's contractions, the softmax's
# few and the backward's (MLP: 5, 7, 4, 4, 7; CNN: the conv's 3·3·2, the
# dense 36, 4, 4, 36); twice in a factor, which also sums ROWS rows.
CHAIN = {"mlp": 5 + 7 + 4 + 4 + 7, "cnn": 18 + 36 + 4 + 4 + 36}
ROWS = {"mlp": 16, "cnn": 16 * 12}
# KL clipping's sum over the params.
PARAMS = {"mlp": 6 * 7 + 8 * 4, "cnn": 19 * 3 + 37 * 4}


def factor_terms(kind: str, micro_batches: int = 1, mixes: int = 1) -> int:
  """A running factor's: its batch factor's (2·CHAIN + ROWS, summed over
  ``micro_batches``) and each mix's 3."""
  return 2 * CHAIN[kind] + ROWS[kind] + micro_batches + 3 * mixes


def update_terms(kind: str, shape: tuple[int, int], **factor_kwargs) -> int:
  """A preconditioned gradient's ``[dA, dG]``: the factors', the
  gradient's (CHAIN + ROWS), the eigh's (dA² + dG², test_batched), the
  products' and KL clipping's; through K-FAC's conditioning."""
  return (
    factor_terms(kind, **factor_kwargs)
    + CHAIN[kind]
    + ROWS[kind]
    + shape[0] ** 2
    + shape[1] ** 2
    + shape[0]
    + shape[1]
    + PARAMS[kind]
  )


class MLP(nn.Module):
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(7, use_bias=self.use_bias)(x))
    return nn.Dense(4, use_bias=self.use_bias)(x)


class CNN(nn.Module):
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(
      3,
      (3, 3),
      strides=CONV_STRIDES,
      padding=CONV_PADDING,
      use_bias=self.use_bias,
    )(x)
    x = jax.nn.relu(x).reshape(x.shape[0], -1)
    return nn.Dense(4, use_bias=self.use_bias)(x)


def make_problem(kind: str, use_bias: bool, batch: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  if kind == "mlp":
    model = MLP(use_bias)
    shape = (batch, 5)
  else:
    model = CNN(use_bias)
    shape = (batch, 6, 5, 2)
  x0 = jnp.asarray(rng.normal(size=shape), jnp.float32)
  params = model.init(jax.random.PRNGKey(seed), x0)["params"]
  # Non-zero biases so the bias rows matter.
  params = jax.tree.map(
    lambda p: p + 0.1 * jnp.asarray(rng.normal(size=p.shape), p.dtype), params
  )

  def batches():
    while True:
      yield (
        jnp.asarray(rng.normal(size=shape), jnp.float32),
        jnp.asarray(rng.integers(0, 4, size=shape[0]), jnp.int32),
      )

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def reference_tensors(params, x, y):
    numpy_params = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    x, y = np.asarray(x, np.float64), np.asarray(y)
    if kind == "mlp":
      return reference.mlp_forward_backward(numpy_params, x, y, use_bias)
    return reference.cnn_forward_backward(
      numpy_params, x, y, use_bias, CONV_STRIDES, CONV_PADDING
    )

  return params, batches(), loss_fn, reference_tensors


def as_matrix(layer_tree) -> np.ndarray:
  """A Dense/Conv layer's params as the ``[in+1, out]`` (or ``[in, out]``)
  gradient matrix K-FAC preconditions, float64."""
  kernel = np.asarray(layer_tree["kernel"], np.float64)
  matrix = kernel.reshape(-1, kernel.shape[-1])
  if "bias" in layer_tree:
    matrix = np.concatenate([matrix, np.asarray(layer_tree["bias"])[None]])
  return matrix


def train_with_no_stats_between(tx, loss_fn, params, steps: int = 6):
  """``steps`` jitted steps of ``tx`` on ``loss_fn(params)``, with stats on
  even steps and ``NO_STATS`` on odd ones (``factor_update_steps=2``).

  Returns:
    The losses ``[steps]`` and the final optimizer state.
  """

  def step(params, state, with_stats):
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
    stats = stats if with_stats else kfac_jax.NO_STATS
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  step = jax.jit(step, static_argnums=2)
  state = tx.init(params)
  losses = []
  for i in range(steps):
    params, state, loss = step(params, state, i % 2 == 0)
    losses.append(float(loss))
  return np.asarray(losses), state
