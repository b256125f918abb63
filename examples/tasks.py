"""The convergence race's training problems (``benchmarks/convergence.py``).

A ``Task`` bundles a data set, a model's init and training objective (with
its model state, BatchNorm's running statistics, where it has one), the
objective split for ``scale_by_kfac(adaptive=...)``, its sampled
Gauss-Newton surrogate and the metric the race reads: the MNIST
autoencoder, a small CNN and a ResNet-20 on CIFAR-10 (or scikit-learn's
digits), a BatchNorm CNN on MNIST and two character transformers on Tiny
Shakespeare. ``benchmarks/dm_kfac_race.py`` runs DeepMind's kfac-jax on the
autoencoder task.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from examples import datasets, flags, models, reporting, shakespeare_transformer

# The autoencoder objective's L2 coefficient (the 1e-5·½‖θ‖²).
AUTOENCODER_WEIGHT_DECAY = 1e-5


def l2_penalty(params: Any) -> jax.Array:
  """½‖θ‖² over every parameter."""
  return 0.5 * sum(jnp.vdot(p, p) for p in jax.tree.leaves(params))


@dataclasses.dataclass
class Task:
  """One race track.

  A task without model state (``init_model_state`` None) has
  ``loss_fn(params, *batch) -> loss`` and ``evaluate(params)``; one with
  (BatchNorm's ``batch_stats``) has ``loss_fn(params, model_state, *batch)
  -> (loss, new_model_state)`` and ``evaluate(params, model_state)``, as
  ``examples.training.make_train_step(stateful=True)`` takes them.
  ``initial`` and ``measure`` call either kind.

  Attributes:
    name: a key of ``TASK_BUILDERS``.
    description: one line for the report.
    metric: the metric's name (table header and plot label).
    higher_is_better: direction of the metric.
    data: training arrays with a leading example axis.
    batch_size: examples per step.
    init: ``seed -> params``.
    loss_fn: the training objective (above).
    evaluate: the metric on the task's evaluation set (above).
    layers: K-FAC's layer table (``kfac_jax.trace_layers``), or None when
      ``init`` alone describes the layers. The race's Muon orthogonalizes
      the kernels it lists (``benchmarks/race_optimizers.py``).
    split_loss: ``split_loss(*batch) -> kfac_jax.SplitLoss``, the objective
      split into network and loss (for ``kfac_adaptive``).
    gauss_newton_fn: ``gauss_newton_fn(params, key, *batch)``, the
      ``kfac_jax.sampled_curvature`` surrogate of the objective's data term
      (for ``kfac_adaptive --curvature gauss-newton``).
    init_model_state: ``seed -> model state`` (the same seed's as
      ``init``), or None for a task without one.
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
  init_model_state: Callable[[int], Any] | None = None

  @property
  def stateful(self) -> bool:
    """Whether ``loss_fn`` and ``evaluate`` take and give model state."""
    return self.init_model_state is not None

  def initial(self, seed: int) -> tuple[Any, Any]:
    """``(params, model_state)`` for ``seed`` (model state None if none)."""
    state = (
      None if self.init_model_state is None else self.init_model_state(seed)
    )
    return self.init(seed), state

  def measure(self, params: Any, model_state: Any) -> float:
    """The metric of ``params`` (with ``model_state`` if the task has one)."""
    if self.stateful:
      return self.evaluate(params, model_state)
    return self.evaluate(params)

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


def chunked_mean(
  fn: Callable[..., jax.Array], arrays: Sequence[np.ndarray], chunk: int
) -> float:
  """Mean over examples of ``fn(*chunk_arrays) -> [n]``, in chunks."""
  return reporting.batched_means(lambda *a: (fn(*a),), arrays, chunk)[0]


def truncated_fan_in_normal(key, shape, dtype=jnp.float32):
  """Normal truncated to ±2σ with σ = 1/√fan_in (``shape[0]`` for Dense)."""
  return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) / math.sqrt(
    shape[0]
  )


def softmax_gauss_newton(model: Any) -> Callable[..., jax.Array]:
  """``gauss_newton_fn(params, key, x, y)`` of a classifier's softmax
  cross-entropy: it samples the model's own predictions, so ``y`` is unused."""

  def gauss_newton_fn(params, key, x, y):
    del y
    return kfac_jax.sampled_curvature.softmax_cross_entropy(
      model.apply({"params": params}, x), key
    )

  return gauss_newton_fn


def autoencoder_task(eval_examples: int | None, batch_size: int) -> Task:
  mnist = datasets.load_mnist()
  model = models.Autoencoder(kernel_init=truncated_fan_in_normal)
  weight_decay = AUTOENCODER_WEIGHT_DECAY

  def loss_fn(params, x):
    logits = model.apply({"params": params}, x)
    return models.autoencoder_losses(
      logits, x
    ).mean() + weight_decay * l2_penalty(params)

  def split_loss(x):
    return kfac_jax.SplitLoss(
      outputs_fn=lambda params: model.apply({"params": params}, x),
      loss_fn=lambda logits: models.autoencoder_losses(logits, x).mean(),
      regularizer=lambda params: weight_decay * l2_penalty(params),
    )

  def gauss_newton_fn(params, key, x):
    return kfac_jax.sampled_curvature.sigmoid_cross_entropy(
      model.apply({"params": params}, x), key
    )

  @jax.jit
  def per_example(params, x):
    return models.autoencoder_losses(model.apply({"params": params}, x), x)

  eval_x = flags.head((mnist.x_train,), eval_examples)
  init = lambda seed: model.init(jax.random.key(seed), mnist.x_train[:1])[
    "params"
  ]

  def evaluate(params) -> float:
    data_term = chunked_mean(lambda x: per_example(params, x), eval_x, 5000)
    return data_term + weight_decay * float(l2_penalty(params))

  return Task(
    name="autoencoder",
    description=(
      "MNIST autoencoder 784-1000-500-250-30-250-500-1000-784, batch "
      f"{batch_size}; objective = summed sigmoid cross-entropy + "
      f"1e-5·½‖θ‖² over {len(eval_x[0]):,} training images"
    ),
    metric="train objective",
    higher_is_better=False,
    data=(mnist.x_train,),
    batch_size=batch_size,
    init=init,
    loss_fn=loss_fn,
    evaluate=evaluate,
    # No layer table: Dense layers only, which the params describe, and
    # benchmarks/dm_kfac_race.py builds this task where kfac_jax is
    # DeepMind's package (no trace_layers).
    split_loss=split_loss,
    gauss_newton_fn=gauss_newton_fn,
  )


def cifar_task(eval_examples: int | None, batch_size: int) -> Task:
  images = datasets.load_image_classification()
  model = models.SmallConvNet(num_classes=images.num_classes)
  weight_decay = 1e-4

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, y
    ).mean() + weight_decay * l2_penalty(params)

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
      outputs_fn=lambda params: model.apply({"params": params}, x),
      loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
        logits, y
      ).mean(),
      regularizer=lambda params: weight_decay * l2_penalty(params),
    )

  @jax.jit
  def correct(params, x, y):
    return jnp.argmax(model.apply({"params": params}, x), -1) == y

  test = flags.head((images.x_test, images.y_test), eval_examples)
  init = lambda seed: model.init(jax.random.key(seed), images.x_train[:1])[
    "params"
  ]
  example = (images.x_train[:batch_size], images.y_train[:batch_size])
  return Task(
    name="cifar",
    description=(
      f"{images.name}, 3-stage CNN, batch {batch_size}; test "
      f"accuracy over {len(test[0]):,} test images"
    ),
    metric="test accuracy (%)",
    higher_is_better=True,
    data=(images.x_train, images.y_train),
    batch_size=batch_size,
    init=init,
    loss_fn=loss_fn,
    evaluate=lambda params: (
      100 * chunked_mean(lambda x, y: correct(params, x, y), test, 1000)
    ),
    layers=kfac_jax.trace_layers(loss_fn, init(0), *example),
    split_loss=split_loss,
    gauss_newton_fn=softmax_gauss_newton(model),
  )


def shakespeare_task(
  eval_examples: int | None,
  batch_size: int,
  name: str = "shakespeare",
  width: int = 64,
  depth: int = 2,
  num_heads: int = 4,
  context: int = 64,
) -> Task:
  """A character transformer (``models.CharTransformer``) on Tiny
  Shakespeare: next-character cross-entropy, validation loss as metric."""
  vocab_size, (x_train, y_train), val = shakespeare_transformer.load_sequences(
    context
  )
  val = flags.head(val, eval_examples)
  model = models.CharTransformer(
    vocab_size, context, width=width, depth=depth, num_heads=num_heads
  )

  def loss_fn(params, x, y):
    return shakespeare_transformer.token_losses(model, params, x, y).mean()

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
      outputs_fn=lambda params: model.apply({"params": params}, x),
      loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
        logits, y
      ).mean(),
    )

  @jax.jit
  def per_sequence(params, x, y):
    return shakespeare_transformer.token_losses(model, params, x, y).mean(-1)

  init = lambda seed: model.init(jax.random.key(seed), x_train[:1])["params"]
  example = (x_train[:batch_size], y_train[:batch_size])
  return Task(
    name=name,
    description=(
      f"Tiny Shakespeare, character transformer width {width} × "
      f"{depth} scanned blocks, {num_heads} heads, batch "
      f"{batch_size} × {context}; validation loss over "
      f"{len(val[0]):,} sequences"
    ),
    metric="validation loss (nats/char)",
    higher_is_better=False,
    data=(x_train, y_train),
    batch_size=batch_size,
    init=init,
    loss_fn=loss_fn,
    evaluate=lambda params: chunked_mean(
      lambda x, y: per_sequence(params, x, y), val, 512
    ),
    layers=kfac_jax.trace_layers(loss_fn, init(0), *example),
    split_loss=split_loss,
    gauss_newton_fn=softmax_gauss_newton(model),
  )


def batch_norm_classifier(
  name: str,
  description: str,
  model: Any,
  images: datasets.ImageData,
  eval_examples: int | None,
  batch_size: int,
  weight_decay: float,
) -> Task:
  """A classifier with BatchNorm: softmax cross-entropy (plus
  ``weight_decay · ½‖θ‖²``) on the batch's statistics, whose running
  averages (``batch_stats``) are the model state; test accuracy (%) with
  the running averages as metric."""

  def variables(seed):
    return model.init(jax.random.key(seed), images.x_train[:1], train=False)

  def loss_fn(params, batch_stats, x, y):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      x,
      train=True,
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, y
    ).mean() + weight_decay * l2_penalty(params)
    return loss, updates["batch_stats"]

  @jax.jit
  def correct(params, batch_stats, x, y):
    logits = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, train=False
    )
    return jnp.argmax(logits, -1) == y

  test = flags.head((images.x_test, images.y_test), eval_examples)
  init = lambda seed: variables(seed)["params"]
  init_model_state = lambda seed: variables(seed)["batch_stats"]
  example = (images.x_train[:batch_size], images.y_train[:batch_size])
  return Task(
    name=name,
    description=(
      f"{description}, batch {batch_size}; test accuracy over "
      f"{len(test[0]):,} test images"
    ),
    metric="test accuracy (%)",
    higher_is_better=True,
    data=(images.x_train, images.y_train),
    batch_size=batch_size,
    init=init,
    loss_fn=loss_fn,
    evaluate=lambda params, batch_stats: (
      100
      * chunked_mean(
        lambda x, y: correct(params, batch_stats, x, y), test, 1000
      )
    ),
    layers=kfac_jax.trace_layers(
      loss_fn, init(0), init_model_state(0), *example
    ),
    init_model_state=init_model_state,
  )


def resnet20_task(eval_examples: int | None, batch_size: int) -> Task:
  """ResNet-20 (``models.CifarResNet(depth=20)``, BatchNorm) on CIFAR-10,
  with the CIFAR task's ``1e-4 · ½‖θ‖²``."""
  images = datasets.load_image_classification()
  model = models.CifarResNet(depth=20, num_classes=images.num_classes)
  return batch_norm_classifier(
    "resnet20",
    f"{images.name}, ResNet-20 (BatchNorm)",
    model,
    images,
    eval_examples,
    batch_size,
    weight_decay=1e-4,
  )


def mnist_batch_norm_task(eval_examples: int | None, batch_size: int) -> Task:
  """Flax's NNX MNIST CNN with BatchNorm (``models.BatchNormCNN``), no
  weight decay, as that example trains it."""
  mnist = datasets.load_mnist()
  images = datasets.ImageData(
    "MNIST",
    mnist.x_train.reshape(-1, 28, 28, 1),
    mnist.y_train,
    mnist.x_test.reshape(-1, 28, 28, 1),
    mnist.y_test,
    10,
  )
  return batch_norm_classifier(
    "mnist_bn",
    "MNIST, Flax's NNX example CNN with BatchNorm (conv 32, "
    "conv 64, dense 3136→256→10)",
    models.BatchNormCNN(),
    images,
    eval_examples,
    batch_size,
    weight_decay=0.0,
  )


# {name: (builder(eval_examples, batch_size) -> Task, the race's batch)}.
TASK_BUILDERS = {
  "autoencoder": (autoencoder_task, 1000),
  "cifar": (cifar_task, 128),
  "shakespeare": (shakespeare_task, 64),
  # Twice as wide and twice the context, the same characters per step.
  "shakespeare_wide": (
    functools.partial(
      shakespeare_task, name="shakespeare_wide", width=128, context=128
    ),
    32,
  ),
  "resnet20": (resnet20_task, 128),
  "mnist_bn": (mnist_batch_norm_task, 128),
}
