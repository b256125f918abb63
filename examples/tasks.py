"""The convergence race's training problems (``benchmarks/convergence.py``).

A ``Task`` bundles a data set, a model's init and training objective, the
objective split for ``scale_by_kfac(adaptive=...)``, its sampled Gauss-Newton
surrogate and the metric the race reads: the MNIST autoencoder, a small CNN
on CIFAR-10 (or scikit-learn's digits) and a character transformer on Tiny
Shakespeare. ``benchmarks/dm_kfac_race.py`` runs DeepMind's kfac-jax on the
autoencoder task.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from examples import datasets
from examples import flags
from examples import models
from examples import reporting
from examples import shakespeare_transformer

# The autoencoder objective's L2 coefficient (the 1e-5·½‖θ‖²).
AUTOENCODER_WEIGHT_DECAY = 1e-5


def l2_penalty(params: Any) -> jax.Array:
  """½‖θ‖² over every parameter."""
  return 0.5 * sum(jnp.vdot(p, p) for p in jax.tree.leaves(params))


@dataclasses.dataclass
class Task:
  """One race track.

  Attributes:
    name: ``autoencoder``, ``cifar`` or ``shakespeare``.
    description: one line for the report.
    metric: the metric's name (table header and plot label).
    higher_is_better: direction of the metric.
    data: training arrays with a leading example axis.
    batch_size: examples per step.
    init: ``seed -> params``.
    loss_fn: ``loss_fn(params, *batch) -> scalar`` (the training objective).
    evaluate: ``params -> metric`` on the task's evaluation set.
    layers: K-FAC's layer table (``kfac_jax.trace_layers``), or None when
      ``init`` alone describes the layers.
    split_loss: ``split_loss(*batch) -> kfac_jax.SplitLoss``, the objective
      split into network and loss (for ``kfac_adaptive``).
    gauss_newton_fn: ``gauss_newton_fn(params, key, *batch)``, the
      ``kfac_jax.sampled_curvature`` surrogate of the objective's data term
      (for ``kfac_adaptive --curvature gauss-newton``).
  """

  name: str
  description: str
  metric: str
  higher_is_better: bool
  data: tuple[np.ndarray, ...]
  batch_size: int
  init: Callable[[int], Any]
  loss_fn: Callable[..., jax.Array]
  evaluate: Callable[[Any], float]
  layers: Any = None
  split_loss: Callable[..., kfac_jax.SplitLoss] | None = None
  gauss_newton_fn: Callable[..., jax.Array] | None = None

  def better(self, a: float, b: float) -> bool:
    """Whether metric ``a`` is strictly better than ``b`` (NaN never is)."""
    if not math.isfinite(a):
      return False
    if not math.isfinite(b):
      return True
    return a > b if self.higher_is_better else a < b

  def reaches(self, value: float, target: float) -> bool:
    if not math.isfinite(value):
      return False
    return value >= target if self.higher_is_better else value <= target


def chunked_mean(fn: Callable[..., jax.Array], arrays: Sequence[np.ndarray],
                 chunk: int) -> float:
  """Mean over examples of ``fn(*chunk_arrays) -> [n]``, in chunks."""
  return reporting.batched_means(lambda *a: (fn(*a),), arrays, chunk)[0]


def truncated_fan_in_normal(key, shape, dtype=jnp.float32):
  """Normal truncated to ±2σ with σ = 1/√fan_in (``shape[0]`` for Dense)."""
  return (jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) /
          math.sqrt(shape[0]))


def softmax_gauss_newton(model: Any) -> Callable[..., jax.Array]:
  """``gauss_newton_fn(params, key, x, y)`` of a classifier's softmax
  cross-entropy: it samples the model's own predictions, so ``y`` is unused."""

  def gauss_newton_fn(params, key, x, y):
    del y
    return kfac_jax.sampled_curvature.softmax_cross_entropy(
        model.apply({"params": params}, x), key)

  return gauss_newton_fn


def autoencoder_task(eval_examples: int | None, batch_size: int) -> Task:
  mnist = datasets.load_mnist()
  model = models.Autoencoder(kernel_init=truncated_fan_in_normal)
  weight_decay = AUTOENCODER_WEIGHT_DECAY

  def loss_fn(params, x):
    logits = model.apply({"params": params}, x)
    return (models.autoencoder_losses(logits, x).mean() +
            weight_decay * l2_penalty(params))

  def split_loss(x):
    return kfac_jax.SplitLoss(
        outputs_fn=lambda params: model.apply({"params": params}, x),
        loss_fn=lambda logits: models.autoencoder_losses(
            logits, x).mean(),
        regularizer=lambda params: weight_decay * l2_penalty(params))

  def gauss_newton_fn(params, key, x):
    return kfac_jax.sampled_curvature.sigmoid_cross_entropy(
        model.apply({"params": params}, x), key)

  @jax.jit
  def per_example(params, x):
    return models.autoencoder_losses(
        model.apply({"params": params}, x), x)

  eval_x = flags.head((mnist.x_train,), eval_examples)

  def evaluate(params) -> float:
    data_term = chunked_mean(lambda x: per_example(params, x), eval_x, 5000)
    return data_term + weight_decay * float(l2_penalty(params))

  return Task(
      name="autoencoder",
      description=(
          "MNIST autoencoder 784-1000-500-250-30-250-500-1000-784, batch "
          f"{batch_size}; objective = summed sigmoid cross-entropy + "
          f"1e-5·½‖θ‖² over {len(eval_x[0]):,} training images"),
      metric="train objective",
      higher_is_better=False,
      data=(mnist.x_train,),
      batch_size=batch_size,
      init=lambda seed: model.init(jax.random.key(seed),
                                   mnist.x_train[:1])["params"],
      loss_fn=loss_fn,
      evaluate=evaluate,
      split_loss=split_loss,
      gauss_newton_fn=gauss_newton_fn)


def cifar_task(eval_examples: int | None, batch_size: int) -> Task:
  images = datasets.load_image_classification()
  model = models.SmallConvNet(num_classes=images.num_classes)
  weight_decay = 1e-4

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            + weight_decay * l2_penalty(params))

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
        outputs_fn=lambda params: model.apply({"params": params}, x),
        loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean(),
        regularizer=lambda params: weight_decay * l2_penalty(params))

  @jax.jit
  def correct(params, x, y):
    return jnp.argmax(model.apply({"params": params}, x), -1) == y

  test = flags.head((images.x_test, images.y_test), eval_examples)
  return Task(
      name="cifar",
      description=(f"{images.name}, 3-stage CNN, batch {batch_size}; test "
                   f"accuracy over {len(test[0]):,} test images"),
      metric="test accuracy (%)",
      higher_is_better=True,
      data=(images.x_train, images.y_train),
      batch_size=batch_size,
      init=lambda seed: model.init(jax.random.key(seed),
                                   images.x_train[:1])["params"],
      loss_fn=loss_fn,
      evaluate=lambda params: 100 * chunked_mean(
          lambda x, y: correct(params, x, y), test, 1000),
      split_loss=split_loss,
      gauss_newton_fn=softmax_gauss_newton(model))


def shakespeare_task(eval_examples: int | None, batch_size: int) -> Task:
  context = 64
  vocab_size, (x_train, y_train), val = shakespeare_transformer.load_sequences(
      context)
  val = flags.head(val, eval_examples)
  model = models.CharTransformer(
      vocab_size, context, width=64, depth=2, num_heads=4)

  def loss_fn(params, x, y):
    return shakespeare_transformer.token_losses(model, params, x, y).mean()

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
        outputs_fn=lambda params: model.apply({"params": params}, x),
        loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean())

  @jax.jit
  def per_sequence(params, x, y):
    return shakespeare_transformer.token_losses(model, params, x, y).mean(-1)

  init = lambda seed: model.init(jax.random.key(seed), x_train[:1])["params"]
  example = (x_train[:batch_size], y_train[:batch_size])
  return Task(
      name="shakespeare",
      description=(f"Tiny Shakespeare, character transformer width 64 × 2 "
                   f"scanned blocks, batch {batch_size} × {context}; "
                   f"validation loss over {len(val[0]):,} sequences"),
      metric="validation loss (nats/char)",
      higher_is_better=False,
      data=(x_train, y_train),
      batch_size=batch_size,
      init=init,
      loss_fn=loss_fn,
      evaluate=lambda params: chunked_mean(
          lambda x, y: per_sequence(params, x, y), val, 512),
      layers=kfac_jax.trace_layers(loss_fn, init(0), *example),
      split_loss=split_loss,
      gauss_newton_fn=softmax_gauss_newton(model))


TASK_BUILDERS = {"autoencoder": (autoencoder_task, 1000),
                 "cifar": (cifar_task, 128),
                 "shakespeare": (shakespeare_task, 64)}
