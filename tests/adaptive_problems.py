"""The adaptive mode's test problem and steps, shared by its test modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import kfac_jax
from examples import models

# The regularizer's weight: 1e-3 · ½‖θ‖².
L2 = 1e-3
# reference.assert_float32_close's ``terms`` for sigmoid_problem: its loss
# (the dots of 4 and 6, the sigmoid cross-entropy's 3 roundings, the sums
# over 3 outputs and 32 examples, the L2 term's over 51 params); an adaptive
# step (the contractions forward and back, the sums over 32 rows, the eigh
# of the largest factors, 7² + 6², test_batched, and the quadratic model's
# inner products over the 51 params).
SIGMOID_LOSS_TERMS = 4 + 6 + 3 + 3 + 32 + 51
SIGMOID_STEP_TERMS = 2 * (4 + 6 + 3) + 32 + 7**2 + 6**2 + 51


def sigmoid_problem(batch: int = 32, seed: int = 0):
  """A small MLP with a summed sigmoid cross-entropy, its split and its loss."""
  rng = np.random.default_rng(seed)
  model = models.MLP((6,), 3, jnp.tanh)
  x = jnp.asarray(rng.normal(size=(batch, 4)), jnp.float32)
  y = jnp.asarray(np.asarray(x)[:, :3] > 0, jnp.float32)  # learnable
  params = model.init(jax.random.PRNGKey(seed), x)["params"]

  def outputs_fn(p):
    return model.apply({"params": p}, x)

  def data_loss(logits):
    return optax.sigmoid_binary_cross_entropy(logits, y).sum(-1).mean()

  def regularizer(p):
    return L2 * 0.5 * sum(jnp.vdot(v, v) for v in jax.tree.leaves(p))

  split = kfac_jax.SplitLoss(outputs_fn, data_loss, regularizer)

  def loss_fn(p, x_batch, y_batch):
    logits = model.apply({"params": p}, x_batch)
    return optax.sigmoid_binary_cross_entropy(logits, y_batch).sum(
      -1
    ).mean() + regularizer(p)

  return params, (x, y), split, loss_fn


def flat64(tree) -> np.ndarray:
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def adaptive_tx(damping=1.0, compute_method="eigen", **config):
  return kfac_jax.scale_by_kfac(
    damping=damping,
    kl_clip=None,
    compute_eigenvalue_outer_product=False,
    compute_method=compute_method,
    adaptive=kfac_jax.AdaptiveConfig(**config),
  )


def run_steps(tx, params, batch, split, loss_fn, steps, initial_state=None):
  state = tx.init(params) if initial_state is None else initial_state
  history = []

  @jax.jit
  def step(params, state):
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
    updates, new_state = tx.update(
      grads, state, params, kfac_stats=stats, split_loss=split
    )
    return updates, new_state, loss, grads

  for _ in range(steps):
    updates, new_state, loss, grads = step(params, state)
    history.append((params, state, updates, grads, float(loss)))
    params = optax.apply_updates(params, updates)
    state = new_state
  return params, state, history
