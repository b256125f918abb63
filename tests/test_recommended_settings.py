"""The README's settings, and the second-moment recipes of the docs' table,
train a BatchNorm CNN without diverging.

The README's chain is run as the README writes it (its program is executed
and its ``tx`` taken), then trains a small BatchNorm CNN on MNIST: the train
loss at the end must not be above the loss at step 50. KAISA's absolute
damping with those numbers drove the kernels' norms up a hundredfold and the
loss back up from step ~50 on (issue 49's NNX MNIST run).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from examples import datasets
from tests import test_readme_snippets

BATCH, STEPS = 64, 200


class BatchNormCNN(nn.Module):
  """Two 3x3 conv + BatchNorm + ReLU + 2x2 average-pool stages, then a
  64-unit ReLU layer and the logits (the shape of Flax's MNIST CNN)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    for features in (8, 16):
      x = nn.Conv(features, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10)(x)


def readme_transformation() -> optax.GradientTransformationExtraArgs:
  """The ``tx`` the README's example builds, from running that program."""
  namespace = {"__name__": "__main__"}
  for line, code in test_readme_snippets.PROGRAMS[0].parts:
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["tx"]


def train_losses(
  make_tx: Callable[[dict], optax.GradientTransformationExtraArgs],
) -> np.ndarray:
  """Per-step train losses of ``make_tx(params)`` on the BatchNorm CNN."""
  mnist = datasets.load_mnist()
  images = mnist.x_train[: BATCH * STEPS].reshape(-1, 28, 28, 1)
  labels = mnist.y_train[: BATCH * STEPS]
  model = BatchNormCNN()
  variables = model.init(jax.random.key(0), jnp.asarray(images[:BATCH]))
  params, batch_stats = variables["params"], variables["batch_stats"]
  tx = make_tx(params)

  def loss_fn(params, batch_stats, x, y):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]

  @jax.jit
  def step(params, batch_stats, opt_state, x, y):
    (loss, batch_stats), grads, stats = kfac_jax.value_grad_and_stats(
      loss_fn, has_aux=True
    )(params, batch_stats, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), batch_stats, opt_state, loss

  opt_state, losses = tx.init(params), []
  for i in range(STEPS):
    x = jnp.asarray(images[i * BATCH : (i + 1) * BATCH])
    y = jnp.asarray(labels[i * BATCH : (i + 1) * BATCH])
    params, batch_stats, opt_state, loss = step(
      params, batch_stats, opt_state, x, y
    )
    losses.append(float(loss))
  return np.array(losses)


# The recommended-settings table's faster recipe for CNNs and transformers
# (docs/configuration.md): the README's settings with the gradient's second
# moment in K-FAC's eigenbasis, at the README's rate (κ = 10·lr²).
SECOND_MOMENT_RECIPE = dict(
  learning_rate=0.1,
  damping=0.01,
  kl_clip=0.1,
  inv_update_steps=10,
  compute_method="eigen",
  second_moment_decay=0.95,
)


def recipe_transformation(
  recipe: str, params: dict
) -> optax.GradientTransformationExtraArgs:
  """The README's chain, the second-moment recipe, or that recipe on
  K-FAC's layers with the other params (here BatchNorm's scales and
  biases) to AdamW at 0.01 × its rate (the table's transformer recipe)."""
  if recipe == "readme":
    return readme_transformation()
  tx = kfac_jax.kfac(**SECOND_MOMENT_RECIPE)
  if recipe == "second_moment":
    return tx
  settings = dict(SECOND_MOMENT_RECIPE)
  rate = settings.pop("learning_rate")
  return optax.partition(
    {"kfac": tx, "other": optax.adamw(0.01 * rate)},
    kfac_jax.kfac_labels(params, **settings),
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "recipe", ["readme", "second_moment", "second_moment_adamw"]
)
def test_the_documented_settings_train_a_batch_norm_cnn_without_diverging(
  recipe,
):
  losses = train_losses(lambda params: recipe_transformation(recipe, params))
  assert np.all(np.isfinite(losses))
  # Means of 10 steps: one batch's loss varies by ~±30 % around its trend.
  at_50, at_end = losses[45:55].mean(), losses[-10:].mean()
  assert at_end <= at_50, (
    f"the loss rose from {at_50:.3f} at step 50 to {at_end:.3f} at step "
    f"{STEPS}: {np.round(losses[::10], 3)}"
  )
