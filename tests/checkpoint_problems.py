"""The checkpoint tests' MLP, its data and K-FAC training step, and the
bit-exact comparison of restored states."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax

DAMPING = 3e-3
BATCH = 16


class MLP(nn.Module):
  hidden: int = 8
  head: str = "head"

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(self.hidden, name="hidden")(x))
    return nn.Dense(3, name=self.head)(x)


def loss_fn(model, params, x, y):
  logits = model.apply({"params": params}, x)
  # One-hot labels: on jax >= 0.11, plain jax.grad of the integer-label loss
  # over a batch sharded on an Explicit axis raises a ShardingTypeError (its
  # gather's transpose), with or without K-FAC.
  labels = jax.nn.one_hot(y, logits.shape[-1])
  return optax.softmax_cross_entropy(logits, labels).mean()


def batches(seed=0):
  rng = np.random.default_rng(seed)
  while True:
    yield (
      rng.normal(size=(BATCH, 5)).astype(np.float32),
      rng.integers(0, 3, size=BATCH).astype(np.int32),
    )


# A flax module is a frozen dataclass: the shared default is not mutated.
def make_training(model=MLP(), **kfac_kwargs):  # noqa: B008
  """(params, tx, jitted step) for a K-FAC + SGD-momentum chain."""
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 5)))["params"]
  tx = optax.chain(
    kfac_jax.scale_by_kfac(learning_rate=0.1, damping=DAMPING, **kfac_kwargs),
    optax.sgd(0.1, momentum=0.9),
  )

  @jax.jit
  def step(params, opt_state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p: loss_fn(model, p, x, y)
    )(params)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  return params, tx, step


# Float32 roundings (reference.assert_float32_close's ``terms``). Of a
# preconditioner recomputed from bit-identical factors: the decomposition
# routine gives the same bits, the elementwise work after it (λ shift,
# reciprocal, outer product) may round differently. Of an MLP step: the
# forward and backward contractions (5, 8, 3 and the loss's mean over
# BATCH), the factors' sums over BATCH rows and a decomposition (backward
# stable: the largest factor's dimension, 9).
RECOMPUTE_TERMS = 3
STEP_TERMS = 2 * (5 + 8 + 3 + BATCH) + BATCH + 9


def train(step, params, opt_state, data, steps):
  for _ in range(steps):
    params, opt_state = step(params, opt_state, *next(data))
  return params, opt_state


def assert_bit_exact(actual, expected):
  """Same structure, and every leaf the same shape, dtype and bytes."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert a.tobytes() == b.tobytes()
