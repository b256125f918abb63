"""Time to target on real data: K-FAC against first-order optimizers.

Each optimizer trains each task for a fixed budget of *training* seconds
(compilation and evaluation excluded; the clock stops while the objective is
evaluated). The race has two phases:

1. **Sweep.** Every optimizer tries the same three-point grid of its one
   swept setting, ``center × (1/3, 1, 3)`` around its customary value
   (``CENTERS``), with seed 0 and the sweep budget; when an edge of the grid
   wins, the grid grows past it by factors of 3 (``--max-extensions``). The
   value with the best final metric wins. The swept setting is the learning
   rate, except for ``kfac_adaptive``, which has none: its initial damping
   λ₀ (``lr`` in the JSON and tables holds it).
2. **Final.** Each optimizer's winning value runs with every seed and the full
   budget.

The target of a task is the best first-order optimizer's final metric (median
over seeds). For every optimizer and seed the script reports the steps and
training seconds at the first evaluation that reaches it.

Tasks:

* ``autoencoder``: the MNIST deep autoencoder 784-1000-500-250-30-250-500-
  1000-784 (tanh, linear code). The objective is the sigmoid cross-entropy,
  summed over the 784 pixels and averaged over the training images, plus
  ``1e-5 · ½‖θ‖²`` over all weights and biases. Batch 1000, reshuffled each
  epoch. Weights are drawn from a normal truncated to ±2σ, σ = 1/√fan_in;
  biases start at 0. Metric: that objective over the first ``--eval-examples``
  training images (default all 60,000). Lower is better.
* ``cifar``: a 3-stage CNN (``models.SmallConvNet``) on the shared CIFAR-10
  subset (10k train / 1k test), or on scikit-learn's digits when CIFAR-10 is
  absent. Softmax cross-entropy plus ``1e-4 · ½‖θ‖²``, batch 128. Metric: test
  accuracy (%). Higher is better.
* ``shakespeare``: the character transformer of
  ``examples/shakespeare_transformer.py`` (width 64, 2 scanned blocks,
  context 64) on Tiny Shakespeare, batch 64. Metric: validation loss
  (nats/char) over the first ``--eval-examples`` held-out sequences (default
  all). Lower is better.

Optimizers (``--optimizers``): ``sgd`` (optax.sgd, Nesterov momentum 0.9),
``adam`` (optax.adam), ``muon`` (optax.contrib.muon; its Adam part for
non-matrix parameters keeps lr 1e-3), ``kron`` (PSGD Kron from the
``distributed-kron`` package, if installed), ``kfac`` (kfac_jax.kfac:
scale_by_kfac + SGD momentum 0.9, with the task's settings in
``KFAC_SETTINGS``, which come from the examples and are not tuned here) and
``kfac_adaptive`` (``scale_by_kfac(adaptive=...)``: learning rate, momentum
and damping from the exact quadratic model, with DeepMind kfac-jax's
autoencoder-example settings, ``KFAC_ADAPTIVE_SETTINGS``, except for λ's
floor: the library's ``AdaptiveConfig`` default, 1e-4, where the example has
1e-5, ``--min-damping``; each run records λ, α, μ and ρ per step). Having no learning
rate, ``kfac_adaptive`` is swept over its initial damping λ₀ (the example's
150 the center): λ then moves by at most a factor 0.95⁵ every 5 steps, so λ₀
sets the step sizes of the first ~100 steps. Its quadratic model is computed on the
first ``--curvature-examples`` of each batch (default 250: a quarter of the
autoencoder's batch, all of the others'), Martens' curvature mini-batch. Its
Kronecker factors come from as many evenly spaced examples of the whole
batch's capture (``--curvature subset``, the default:
``scale_by_kfac(factor_batch_size=...)``, the empirical Fisher, no extra
pass), from all of it (``batch``), from the loss on the curvature examples
(``empirical``) or from a ``kfac_jax.sampled_curvature`` surrogate on them
(``gauss-newton``, kfac-jax's default estimator); with these two the
gradient's loss is split at the curvature examples
(``curvature_shared_loss``) so that their forward pass runs once.
``subset`` is the default
because it costs no extra pass on any task; on the autoencoder
``gauss-newton`` reaches the targets in fewer steps at the same step time
(``benchmarks/README.md``, *Gauss-Newton factors at the 1e-4 floor*).
``--inv-dtype bfloat16`` gives both K-FAC contestants ``inv_dtype=bfloat16``:
their inverses stored and applied in bfloat16 (float32 accumulation), the
products at twice float32's rate on CPUs with AVX512-BF16.

Outputs in ``--out``: ``convergence_<stamp>.json`` (every run's curve,
settings and versions, rewritten after each run; ``--resume FILE`` continues
an interrupted race), ``convergence_<stamp>.md`` (tables) and
``convergence_<stamp>_<task>.png`` (metric vs steps and vs seconds).

Run from the repository root::

  python benchmarks/convergence.py --help
  python benchmarks/convergence.py --smoke --out /tmp/x    # CI check, tiny
  python benchmarks/convergence.py --tasks autoencoder     # the full race
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "examples"))

import flax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position
from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top,wrong-import-position

import common  # pylint: disable=g-import-not-at-top,wrong-import-position
import datasets  # pylint: disable=g-import-not-at-top,wrong-import-position
import kfac_jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import mnist_autoencoder  # pylint: disable=g-import-not-at-top,wrong-import-position
import models  # pylint: disable=g-import-not-at-top,wrong-import-position
import shakespeare_transformer  # pylint: disable=g-import-not-at-top,wrong-import-position

OPTIMIZERS = ("sgd", "adam", "muon", "kron", "kfac", "kfac_adaptive")
FIRST_ORDER = ("sgd", "adam", "muon", "kron")
KFAC_OPTIMIZERS = ("kfac", "kfac_adaptive")
# The optimizer without a learning rate: its sweep is over λ₀.
SWEPT_DAMPING = "kfac_adaptive"
# Each optimizer's customary learning rate (kfac_adaptive: λ₀, that of
# KFAC_ADAPTIVE_SETTINGS, below); the sweep is center × LR_GRID.
CENTERS = {"sgd": 1e-2, "adam": 1e-3, "muon": 1e-2, "kron": 3e-4,
           "kfac": 0.1, "kfac_adaptive": 150.0}
LR_GRID = (1 / 3, 1.0, 3.0)
EXTENSION_FACTOR = 3.0  # beyond a winning edge of the grid
MUON_ADAM_LR = 1e-3

# K-FAC's settings per task: those of the matching example (chosen there by
# short sweeps; the Shakespeare ones were not tuned at all). Only the
# learning rate is swept here, as for every other optimizer.
KFAC_SETTINGS = {
    "autoencoder": dict(compute_method="inverse", damping=0.1, kl_clip=1e-2,
                        factor_decay=0.95, factor_update_steps=1,
                        inv_update_steps=10),
    # examples/cifar10_resnet.py's. (The autoencoder's damping 0.1 and
    # kl_clip 1e-2 reach 40% and then collapse to chance on this CNN.)
    "cifar": dict(compute_method="inverse", damping=0.3, kl_clip=1e-3,
                  factor_decay=0.95, factor_update_steps=10,
                  inv_update_steps=10),
    "shakespeare": dict(compute_method="inverse", damping=0.3, kl_clip=1e-3,
                        factor_decay=0.95, factor_update_steps=1,
                        inv_update_steps=10),
}
# DeepMind kfac-jax's examples/autoencoder_mnist settings (damping adapted
# every 5 steps by 0.95^5 within [1e-5, 1000], inverses every 5 steps, factor
# decay 0.95), used for every task; its initial damping, 150, is the center
# of kfac_adaptive's sweep (CENTERS). The inverse method (with π-split
# damping in this mode) costs less per step than the eigen method.
KFAC_ADAPTIVE_SETTINGS = dict(
    compute_method="inverse", factor_decay=0.95, factor_update_steps=1,
    inv_update_steps=5, kl_clip=None)
BUDGETS = {"autoencoder": 420.0, "cifar": 300.0, "shakespeare": 300.0}
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
  return common.batched_means(lambda *a: (fn(*a),), arrays, chunk)[0]


def truncated_fan_in_normal(key, shape, dtype=jnp.float32):
  """Normal truncated to ±2σ with σ = 1/√fan_in (``shape[0]`` for Dense)."""
  return (jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) /
          math.sqrt(shape[0]))


def autoencoder_task(eval_examples: int | None, batch_size: int) -> Task:
  mnist = datasets.load_mnist()
  model = mnist_autoencoder.Autoencoder(kernel_init=truncated_fan_in_normal)
  weight_decay = AUTOENCODER_WEIGHT_DECAY

  def loss_fn(params, x):
    logits = model.apply({"params": params}, x)
    return (mnist_autoencoder.reconstruction_losses(logits, x).mean() +
            weight_decay * l2_penalty(params))

  def split_loss(x):
    return kfac_jax.SplitLoss(
        outputs_fn=lambda params: model.apply({"params": params}, x),
        loss_fn=lambda logits: mnist_autoencoder.reconstruction_losses(
            logits, x).mean(),
        regularizer=lambda params: weight_decay * l2_penalty(params))

  def gauss_newton_fn(params, key, x):
    return kfac_jax.sampled_curvature.sigmoid_cross_entropy(
        model.apply({"params": params}, x), key)

  @jax.jit
  def per_example(params, x):
    return mnist_autoencoder.reconstruction_losses(
        model.apply({"params": params}, x), x)

  eval_x = common.head((mnist.x_train,), eval_examples)

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

  def gauss_newton_fn(params, key, x, y):
    del y  # the curvature samples the model's own predictions
    return kfac_jax.sampled_curvature.softmax_cross_entropy(
        model.apply({"params": params}, x), key)

  @jax.jit
  def correct(params, x, y):
    return jnp.argmax(model.apply({"params": params}, x), -1) == y

  test = common.head((images.x_test, images.y_test), eval_examples)
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
      gauss_newton_fn=gauss_newton_fn)


def shakespeare_task(eval_examples: int | None, batch_size: int) -> Task:
  context = 64
  vocab_size, (x_train, y_train), val = shakespeare_transformer.load_sequences(
      context)
  val = common.head(val, eval_examples)
  model = shakespeare_transformer.CharTransformer(
      vocab_size, context, width=64, depth=2, num_heads=4)

  def loss_fn(params, x, y):
    return shakespeare_transformer.token_losses(model, params, x, y).mean()

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
        outputs_fn=lambda params: model.apply({"params": params}, x),
        loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean())

  def gauss_newton_fn(params, key, x, y):
    del y  # the curvature samples the model's own predictions
    return kfac_jax.sampled_curvature.softmax_cross_entropy(
        model.apply({"params": params}, x), key)

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
      gauss_newton_fn=gauss_newton_fn)


TASK_BUILDERS = {"autoencoder": (autoencoder_task, 1000),
                 "cifar": (cifar_task, 128),
                 "shakespeare": (shakespeare_task, 64)}


def import_kron():
  """``distributed_kron.kron``, or None when the package is missing.

  distributed-kron 2.0.0 annotates an argument as ``PartitionSpec[str, str]``,
  which fails at import with the jax versions kfac_jax supports
  (``PartitionSpec`` is not generic there). A no-op ``__class_getitem__``
  lets the annotation evaluate; nothing else of jax is touched.
  """
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top
  if not hasattr(PartitionSpec, "__class_getitem__"):
    PartitionSpec.__class_getitem__ = classmethod(lambda cls, _: cls)
  try:
    import distributed_kron  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return distributed_kron.kron


def adaptive_config(min_damping: float | None) -> kfac_jax.AdaptiveConfig:
  """``kfac_adaptive``'s settings: the library's, with λ's floor if given."""
  if min_damping is None:
    return kfac_jax.AdaptiveConfig()
  return kfac_jax.AdaptiveConfig(min_damping=min_damping)


def kfac_dtypes(inv_dtype: str) -> dict[str, Any]:
  """The K-FAC contestants' ``inv_dtype`` setting (none for the default)."""
  if inv_dtype == "float32":
    return {}
  return dict(inv_dtype=jnp.dtype(inv_dtype))


def build_optimizer(name: str, lr: float, task: Task,
                    curvature: str = "batch",
                    curvature_examples: int | None = None,
                    min_damping: float | None = None,
                    inv_dtype: str = "float32") -> common.Optimizer:
  """One contestant at its swept value ``lr``: the learning rate, or
  ``kfac_adaptive``'s initial damping λ₀.

  ``curvature``: ``kfac_adaptive``'s factor statistics (``--curvature``);
  with ``"subset"``, from ``curvature_examples`` of each batch.
  ``min_damping``: ``kfac_adaptive``'s floor of λ (None: the library's).
  ``inv_dtype``: both K-FAC contestants' ``inv_dtype`` (``--inv-dtype``).
  """
  if name == "sgd":
    return common.Optimizer(
        "sgd", optax.sgd(lr, momentum=0.9, nesterov=True),
        description=f"optax.sgd(lr={lr:g}, momentum=0.9, nesterov=True)")
  if name == "adam":
    return common.Optimizer("adam", optax.adam(lr),
                            description=f"optax.adam(lr={lr:g})")
  if name == "muon":
    return common.Optimizer(
        "muon", optax.contrib.muon(lr, adam_learning_rate=MUON_ADAM_LR),
        description=(f"optax.contrib.muon(lr={lr:g}, "
                     f"adam_learning_rate={MUON_ADAM_LR:g})"))
  if name == "kron":
    kron = import_kron()
    if kron is None:
      raise SystemExit("--optimizers kron needs the distributed-kron package: "
                       "pip install distributed-kron (or leave kron out).")
    return common.Optimizer("kron", kron(lr, b1=0.9),
                            description=f"distributed_kron.kron(lr={lr:g}, "
                            "b1=0.9)")
  if name == "kfac":
    settings = dict(KFAC_SETTINGS[task.name], **kfac_dtypes(inv_dtype))
    return common.Optimizer(
        "kfac",
        kfac_jax.kfac(learning_rate=lr, momentum=0.9, layers=task.layers,
                      **settings),
        uses_kfac=True,
        description=f"kfac_jax.kfac(lr={lr:g}, momentum=0.9, " + ", ".join(
            f"{k}={v!r}" for k, v in settings.items()) + ")")
  if name == SWEPT_DAMPING:
    settings = dict(KFAC_ADAPTIVE_SETTINGS, damping=lr,
                    **kfac_dtypes(inv_dtype))
    if curvature == "subset":
      settings["factor_batch_size"] = curvature_examples
    adaptive = adaptive_config(min_damping)
    return common.Optimizer(
        "kfac_adaptive",
        kfac_jax.scale_by_kfac(layers=task.layers, adaptive=adaptive,
                               **settings),
        uses_kfac=True, needs_split_loss=True,
        separate_curvature=curvature in ("empirical", "gauss-newton"),
        description=f"kfac_jax.scale_by_kfac(adaptive={adaptive}, " +
        ", ".join(f"{k}={v!r}" for k, v in settings.items()) +
        f"), curvature {curvature!r}")
  raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}.")


def curvature_batch(batch: Sequence[Any], examples: int) -> tuple[Any, ...]:
  """The first ``examples`` of a batch (all of a smaller one).

  Martens' curvature mini-batch (Hessian-free optimisation, 2010): the
  Kronecker factors' statistics and the quadratic model's curvature products
  and reduction ratio use part of a large batch, the gradient all of it. On a
  small batch the model of a few examples is too noisy: on CIFAR-10 at batch
  128, 32 examples drove the damping to ~5e-5 and training diverged after
  380 steps, where all 128 did not.
  """
  return tuple(a[:examples] for a in batch)


def curvature_shared_loss(loss_fn: Callable[..., jax.Array],
                          examples: int) -> Callable[..., jax.Array]:
  """``loss_fn`` on a batch of ``N`` as ``(M/N)·loss(head) + (1 − M/N)·loss(rest)``.

  The same objective for a ``loss_fn`` that is a mean over the batch's
  examples plus terms that do not depend on the batch (every task's is), with
  the head the ``M = examples`` of ``curvature_batch`` (a batch of at most
  ``M`` is passed whole). Computed so, the gradient's forward pass over the
  head is the one the curvature capture and the quadratic model run on the
  same parameters and examples, and XLA's common-subexpression elimination
  runs it once: one forward pass over ``M`` examples less a step
  (``race_flops.py``, *all, the gradient split*).
  """

  def loss(params, *batch):
    size = batch[0].shape[0]
    if examples >= size:
      return loss_fn(params, *batch)
    head_weight = examples / size
    return (head_weight * loss_fn(params, *curvature_batch(batch, examples)) +
            (1 - head_weight) * loss_fn(params,
                                        *(a[examples:] for a in batch)))

  return loss


def train_run(task: Task, optimizer: common.Optimizer, seed: int,
              budget: float, eval_every: float, max_steps: int | None,
              progress: bool, label: str,
              curvature_examples: int | None = None,
              curvature: str = "batch") -> dict[str, Any]:
  """Trains for ``budget`` training seconds; returns the run's record.

  ``curvature_examples``: see ``curvature_batch`` (None: the whole batch).
  ``curvature``: where a ``separate_curvature`` optimizer's stats come from
  on the curvature batch, ``"empirical"`` (the loss) or ``"gauss-newton"``
  (the task's ``gauss_newton_fn``). The clock and the evaluations are
  ``timed_training``'s.
  """
  params = task.init(seed)
  opt_state = optimizer.tx.init(params)
  example = tuple(a[:task.batch_size] for a in task.data)
  examples = curvature_examples or task.batch_size
  split_loss = None
  if task.split_loss is not None:
    split_loss = lambda *b: task.split_loss(*curvature_batch(b, examples))
  if curvature == "gauss-newton":
    curvature_fn = lambda p, key, *b: task.gauss_newton_fn(
        p, key, *curvature_batch(b, examples))
  elif curvature == "empirical":
    curvature_fn = lambda p, key, *b: task.loss_fn(
        p, *curvature_batch(b, examples))
  else:
    curvature_fn = None
  # The gradient's forward pass over the curvature examples is shared with
  # the curvature pass (the whole-batch capture of the other settings is
  # not: its layers would be captured twice).
  loss_fn = (curvature_shared_loss(task.loss_fn, examples)
             if optimizer.separate_curvature else task.loss_fn)
  start = time.perf_counter()
  compiled = common.make_train_step(
      loss_fn, optimizer, split_loss=split_loss,
      curvature_fn=curvature_fn).lower(
          params, opt_state, None, jax.random.key(seed), *example).compile()
  compile_seconds = time.perf_counter() - start

  def step(params, opt_state, key, *batch):
    params, opt_state, _, loss = compiled(params, opt_state, None, key, *batch)
    return params, opt_state, loss

  record = timed_training(
      task, step, params, opt_state, seed, budget, eval_every, max_steps,
      progress, label,
      trace=adaptive_trace if optimizer.needs_split_loss else None)
  return dict(task=task.name, optimizer=optimizer.name,
              description=optimizer.description, seed=seed, budget=budget,
              compile_seconds=compile_seconds, **record)


def adaptive_trace(opt_state: kfac_jax.ScaleByKFACState) -> dict[str, float]:
  """λ, ``[α, μ]`` and the last ρ after a ``kfac_adaptive`` step."""
  model = opt_state.quadratic_model
  alpha, mu = np.asarray(model.step_sizes).tolist()
  return dict(damping=float(model.damping), alpha=alpha, mu=mu,
              rho=float(model.reduction_ratio))


def timed_training(task: Task, step: Callable[..., tuple[Any, Any, Any]],
                   params: Any, opt_state: Any, seed: int, budget: float,
                   eval_every: float, max_steps: int | None, progress: bool,
                   label: str,
                   trace: Callable[[Any], dict[str, float]] | None = None
                   ) -> dict[str, Any]:
  """Runs ``step(params, opt_state, key, *batch) -> (params, opt_state,
  loss)`` on the task's shuffled batches for ``budget`` training seconds,
  with a fresh PRNG key each step.

  Each step is timed alone (``jax.block_until_ready``). The metric is
  evaluated at the start, every ``eval_every`` training seconds and at the
  end, with the training clock stopped. A non-finite mini-batch loss ends the
  run (``diverged``), its last metric recorded as NaN. ``trace(opt_state)``,
  if given, is read after every step, off the clock, and recorded per step
  (``trace``: ``{name: [value per step]}``).
  """
  curve = [(0, 0.0, task.evaluate(params))]
  batches = common.epoch_batches(len(task.data[0]), task.batch_size,
                                 epochs=10**9, seed=seed)
  trained, steps, diverged = 0.0, 0, False
  traced: dict[str, list[float]] = {}
  next_eval = eval_every
  bar = tqdm(total=round(budget), desc=label, unit="s", disable=not progress,
             dynamic_ncols=True, leave=False)
  while trained < budget and (max_steps is None or steps < max_steps):
    idx = next(batches)
    batch = jax.device_put(tuple(a[idx] for a in task.data))
    key = jax.random.fold_in(jax.random.key(seed), steps)
    start = time.perf_counter()
    params, opt_state, loss = jax.block_until_ready(
        step(params, opt_state, key, *batch))
    elapsed = time.perf_counter() - start
    trained += elapsed
    steps += 1
    bar.update(min(elapsed, budget - bar.n))
    if trace is not None:
      for name, value in trace(opt_state).items():
        traced.setdefault(name, []).append(value)
    if not math.isfinite(float(loss)):
      diverged = True
      curve.append((steps, trained, float("nan")))
      break
    done = trained >= budget or steps == max_steps
    if trained >= next_eval or done:
      curve.append((steps, trained, task.evaluate(params)))
      bar.set_postfix(metric=f"{curve[-1][2]:.4g}", refresh=False)
      while next_eval <= trained:
        next_eval += eval_every
  bar.close()
  record = dict(steps=steps, train_seconds=trained,
                ms_per_step=1000 * trained / max(steps, 1), diverged=diverged,
                final=curve[-1][2],
                curve=[dict(step=s, seconds=t, metric=m) for s, t, m in curve])
  if trace is not None:
    record.update(trace=traced)
  return record


def first_reach(task: Task, run: dict[str, Any],
                target: float) -> tuple[int, float] | None:
  """(steps, seconds) at the run's first evaluation meeting ``target``."""
  for point in run["curve"]:
    if task.reaches(point["metric"], target):
      return point["step"], point["seconds"]
  return None


def crossing(task: Task, run: dict[str, Any],
             target: float) -> tuple[float, float] | None:
  """(steps, seconds) where the curve first meets ``target``, read off the
  straight line between the evaluations on either side of it."""
  previous = None
  for point in run["curve"]:
    if task.reaches(point["metric"], target):
      if previous is None or point["metric"] == previous["metric"]:
        return float(point["step"]), float(point["seconds"])
      fraction = ((target - previous["metric"]) /
                  (point["metric"] - previous["metric"]))
      return tuple(float(previous[k] + fraction * (point[k] - previous[k]))
                   for k in ("step", "seconds"))
    previous = point
  return None


def metric_at(run: dict[str, Any], seconds: float) -> float | None:
  """The metric of the last evaluation at or before ``seconds`` of training
  (``None`` before the first)."""
  values = [p["metric"] for p in run["curve"] if p["seconds"] <= seconds]
  return values[-1] if values else None


def readouts(task: Task, run: dict[str, Any], targets: Sequence[float],
             at_seconds: Sequence[float]) -> dict[str, Any]:
  """Per target: the first evaluation meeting it and the interpolated
  crossing; per time: the metric then."""
  reached = {}
  for target in targets:
    hit, line = first_reach(task, run, target), crossing(task, run, target)
    reached[f"{target:g}"] = None if hit is None else dict(
        step=hit[0], seconds=hit[1], crossing_step=line[0],
        crossing_seconds=line[1])
  return dict(reached=reached,
              at={f"{s:g}": metric_at(run, s) for s in at_seconds})


def readouts_table(task: Task, runs: Sequence[tuple[str, dict[str, Any]]],
                   targets: Sequence[float],
                   at_seconds: Sequence[float]) -> str:
  """Markdown: per run, ``readouts`` (``--targets``, ``--at-seconds``)."""
  header = ["run"]
  for target in targets:
    header += [f"s to {target:g} (steps)", f"crossing {target:g}: steps, s"]
  header += [f"at {s:g} s" for s in at_seconds] + ["final", "steps",
                                                    "ms/step"]
  lines = ["| " + " | ".join(header) + " |",
           "|---" + "|---:" * (len(header) - 1) + "|"]
  for label, run in runs:
    values = readouts(task, run, targets, at_seconds)
    cells = [label]
    for target in targets:
      hit = values["reached"][f"{target:g}"]
      cells += (["never", "—"] if hit is None else [
          f"{hit['seconds']:.0f} ({hit['step']})",
          f"{hit['crossing_step']:.0f}, {hit['crossing_seconds']:.1f}"])
    cells += ["—" if v is None else f"{v:.4g}"
              for v in values["at"].values()]
    cells += [f"{run['final']:.4g}", str(run["steps"]),
              f"{run['ms_per_step']:.0f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


# --------------------------------------------------------------------------
# The race: sweep, final runs, summary.


def run_key(run: dict[str, Any]) -> tuple:
  """What a run depends on beyond the code. A run recorded without one of
  these (an older JSON) matches no new run, so it is run again."""
  curvature = run.get("curvature")
  return (run["phase"], run["task"], run["optimizer"], run["lr"], run["seed"],
          run["budget"], None if curvature is None else tuple(curvature),
          run.get("min_damping"), run.get("inv_dtype", "float32"),
          run.get("eval_examples", "unrecorded"), run.get("eval_every"),
          run.get("max_steps", "unrecorded"))


class Race:
  """Runs (or takes from a resumed JSON) every run; rewrites the JSON after each."""

  def __init__(self, args: argparse.Namespace, path: pathlib.Path,
               meta: dict[str, Any]):
    self.args = args
    self.path = path
    self.meta = meta
    self.runs: list[dict[str, Any]] = []
    self.done: dict[tuple, dict[str, Any]] = {}
    if args.resume is not None:
      previous = json.loads(args.resume.read_text())
      for run in previous["runs"]:
        self.done[run_key(run)] = run
      if previous.get("git_commit") != meta.get("git_commit") or previous.get(
          "git_dirty") or meta.get("git_dirty"):
        tqdm.write(
            f"Resuming runs recorded at commit {previous.get('git_commit')} "
            f"(dirty: {previous.get('git_dirty')}) under commit "
            f"{meta.get('git_commit')} (dirty: {meta.get('git_dirty')}): "
            "their optimizer settings (KFAC_SETTINGS, the sweep centres) "
            "are the code's of then; say so where the results are quoted.")

  def run(self, phase: str, task: Task, name: str, lr: float, seed: int,
          budget: float) -> dict[str, Any]:
    # kfac_adaptive's runs also depend on where its curvature comes from
    # and on λ's floor (the value in effect: a run recorded before the
    # floor was recorded, or under another default, is not reused), both
    # K-FAC contestants' on inv_dtype (runs recorded without it: float32).
    adaptive = name == "kfac_adaptive"
    inv_dtype = self.args.inv_dtype if name in KFAC_OPTIMIZERS else "float32"
    curvature = ((self.args.curvature, self.args.curvature_examples)
                 if adaptive else None)
    min_damping = (adaptive_config(self.args.min_damping).min_damping
                   if adaptive else None)
    evaluation = dict(eval_examples=self.args.eval_examples,
                      eval_every=self.args.eval_every,
                      max_steps=self.args.max_steps)
    key = run_key(dict(phase=phase, task=task.name, optimizer=name, lr=lr,
                       seed=seed, budget=budget, curvature=curvature,
                       min_damping=min_damping, inv_dtype=inv_dtype,
                       **evaluation))
    if key in self.done:
      record = self.done[key]
    else:
      optimizer = build_optimizer(name, lr, task, self.args.curvature,
                                  self.args.curvature_examples,
                                  self.args.min_damping, inv_dtype)
      label = f"{task.name} {phase} {name} {format_lr(name, lr)} seed={seed}"
      record = train_run(task, optimizer, seed, budget, self.args.eval_every,
                         self.args.max_steps, not self.args.no_progress, label,
                         self.args.curvature_examples, self.args.curvature)
      record.update(phase=phase, lr=lr, **evaluation)
      if adaptive:
        record.update(curvature=list(curvature), min_damping=min_damping)
      if name in KFAC_OPTIMIZERS:
        record.update(inv_dtype=inv_dtype)
      tqdm.write(f"{label}: {task.metric} {record['final']:.4g} after "
                 f"{record['steps']} steps ({record['ms_per_step']:.0f} "
                 f"ms/step, compile {record['compile_seconds']:.1f} s)"
                 + (" DIVERGED" if record["diverged"] else ""))
    self.runs.append(record)
    self.path.write_text(json.dumps(dict(self.meta, runs=self.runs),
                                    indent=1))
    return record


def format_lr(name: str, lr: float) -> str:
  """``name``'s swept value as the tables and labels show it."""
  return f"λ₀={lr:.3g}" if name == SWEPT_DAMPING else f"lr={lr:.3g}"


def rounded(lr: float) -> float:
  return float(f"{lr:.3g}")


def sweep(task: Task, name: str, args: argparse.Namespace, race: Race,
          budget: float) -> tuple[float, dict[float, float]]:
  """The best value of ``center × LR_GRID`` (``name``'s learning rate, or
  λ₀), and every value's final metric.

  When the best rate is at an edge of the rates tried, the grid grows by one
  more factor of 3 past that edge, up to ``args.max_extensions`` times, so
  that no optimizer is left at the edge of its sweep.
  """
  center = args.center.get(name, CENTERS[name])
  finals: dict[float, float] = {}

  def best() -> float:
    rates = sorted(finals)
    winner = rates[0]
    for lr in rates[1:]:
      if task.better(finals[lr], finals[winner]):
        winner = lr
    return winner

  low, high = swept_range(name, args)

  def run(lr: float) -> bool:
    """Runs ``lr``; False (nothing run) outside the optimizer's range."""
    if not low <= lr <= high:
      return False
    finals[lr] = race.run("sweep", task, name, lr, 0, budget)["final"]
    return True

  for multiple in LR_GRID:
    run(rounded(center * multiple))
  for _ in range(args.max_extensions):
    winner = best()
    if winner == min(finals):
      grew = run(rounded(winner / EXTENSION_FACTOR))
    elif winner == max(finals):
      grew = run(rounded(winner * EXTENSION_FACTOR))
    else:
      break
    if not grew:
      break  # the winning edge is the end of the range
  return best(), dict(sorted(finals.items()))


def swept_range(name: str, args: argparse.Namespace) -> tuple[float, float]:
  """The values ``name``'s sweep may try: λ₀ within kfac_adaptive's
  [min_damping, max_damping] (``scale_by_kfac`` refuses others), any
  positive learning rate."""
  if name == SWEPT_DAMPING:
    config = adaptive_config(args.min_damping)
    return config.min_damping, config.max_damping
  return 0.0, math.inf


def race_task(task: Task, args: argparse.Namespace, race: Race
              ) -> dict[str, Any]:
  """Sweep, final runs and the time-to-target summary of one task."""
  budget = args.budget if args.budget is not None else BUDGETS[task.name]
  sweep_budget = (args.sweep_budget if args.sweep_budget is not None else
                  budget)
  best_lr, sweeps = {}, {}
  for name in args.optimizers:
    if args.no_sweep:
      best_lr[name] = args.center.get(name, CENTERS[name])
      continue
    best_lr[name], sweeps[name] = sweep(task, name, args, race, sweep_budget)

  finals = {name: [race.run("final", task, name, best_lr[name], seed, budget)
                   for seed in args.seeds] for name in args.optimizers}
  baselines = [n for n in args.optimizers if n in FIRST_ORDER]
  medians = {n: float(np.median([r["final"] for r in runs]))
             for n, runs in finals.items()}
  target_name = None
  for name in baselines:
    if target_name is None or task.better(medians[name], medians[target_name]):
      target_name = name
  target = medians[target_name] if target_name else None
  return dict(task=task, budget=budget, sweep_budget=sweep_budget,
              best_lr=best_lr, sweep=sweeps, finals=finals, medians=medians,
              target_name=target_name, target=target)


def median_reach(hits: Sequence[tuple[int, float] | None],
                 index: int) -> float | None:
  """Median steps (``index`` 0) or seconds (1) to the target over all seeds,
  a seed that never reached it counting as infinitely late; ``None`` when
  that median is a miss. (Over the seeds that reached it alone, one lucky
  seed of three would stand for the optimizer.)"""
  value = float(np.median([h[index] if h is not None else np.inf
                           for h in hits]))
  return value if np.isfinite(value) else None


def summary_table(result: dict[str, Any]) -> str:
  """Markdown: per optimizer, best rate, final metric, time to target."""
  task, target = result["task"], result["target"]
  reach = {}
  for name, runs in result["finals"].items():
    reach[name] = [first_reach(task, r, target) if target is not None
                   else None for r in runs]
  base_seconds = None
  if result["target_name"] is not None:
    base_seconds = median_reach(reach[result["target_name"]], 1)
  header = ("| optimizer | lr or λ₀ | final " + task.metric +
            " (median; min–max) | reached target | steps to target (median) "
            "| seconds to target (median) | × best baseline's seconds | "
            "ms/step | compile s |")
  lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, runs in result["finals"].items():
    values = [r["final"] for r in runs]
    hits = [h for h in reach[name] if h is not None]
    median_steps = median_reach(reach[name], 0)
    steps = "—" if median_steps is None else f"{median_steps:.0f}"
    seconds = median_reach(reach[name], 1)
    ratio = (f"{seconds / base_seconds:.2f}" if seconds is not None and
             base_seconds else "—")
    spread = (f" ({min(values):.4g}–{max(values):.4g})" if len(values) > 1
              else "")
    lines.append(
        f"| {name} | {format_lr(name, result['best_lr'][name])} | "
        f"{np.median(values):.4g}{spread} | {len(hits)}/{len(runs)} | {steps} "
        f"| {'—' if seconds is None else f'{seconds:.0f}'} | {ratio} | "
        f"{np.median([r['ms_per_step'] for r in runs]):.0f} | "
        f"{np.median([r['compile_seconds'] for r in runs]):.1f} |")
  return "\n".join(lines)


def sweep_table(result: dict[str, Any]) -> str:
  if not result["sweep"]:
    return "(no sweep)"
  lines = ["| optimizer | learning rate (kfac_adaptive: λ₀): final metric "
           "| best |",
           "|---|---|---:|"]
  for name, finals in result["sweep"].items():
    cells = ", ".join(f"{lr:g}: {value:.4g}" for lr, value in finals.items())
    lines.append(f"| {name} | {cells} | {result['best_lr'][name]:g} |")
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Metric vs steps and vs training seconds; one colour per optimizer."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  task = result["task"]
  fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, (name, runs) in enumerate(result["finals"].items()):
    color = f"C{i}"
    for j, run in enumerate(runs):
      points = [p for p in run["curve"] if math.isfinite(p["metric"])]
      label = (f"{name} ({format_lr(name, result['best_lr'][name])})"
               if j == 0 else None)
      for ax, x in ((ax_step, "step"), (ax_time, "seconds")):
        ax.plot([p[x] for p in points], [p["metric"] for p in points],
                color=color, lw=1.4, alpha=1.0 if j == 0 else 0.45,
                label=label)
  for ax in (ax_step, ax_time):
    if result["target"] is not None:
      ax.axhline(result["target"], color="k", ls="--", lw=0.8,
                 label=f"target ({result['target_name']}'s final "
                 f"{result['target']:.4g})")
    ax.set_ylabel(task.metric)
    ax.grid(True, alpha=0.3)
    if not task.higher_is_better:
      ax.set_yscale("log")  # losses fall by orders of magnitude at first
    ax.legend(fontsize=8)
  ax_step.set_xlabel("step")
  ax_time.set_xlabel("training seconds (compilation and evaluation excluded)")
  fig.suptitle(task.description, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# --------------------------------------------------------------------------
# Command line.


def parse_centers(values: Sequence[str]) -> dict[str, float]:
  centers = {}
  for value in values:
    name, _, lr = value.partition("=")
    if name not in CENTERS or not lr:
      raise SystemExit(f"--center {value!r}: use NAME=VALUE (the learning "
                       f"rate, kfac_adaptive's λ₀) with NAME in "
                       f"{tuple(CENTERS)}.")
    try:
      centers[name] = float(lr)
    except ValueError:
      raise SystemExit(f"--center {value!r}: {lr!r} is not a "
                       "number.") from None
  return centers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="Protocol and outputs: see the module docstring and "
      "benchmarks/README.md.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--tasks", nargs="+", default=list(TASK_BUILDERS),
                      choices=list(TASK_BUILDERS))
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                      choices=OPTIMIZERS)
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                      help="seeds of the final runs (init and shuffling)")
  parser.add_argument("--budget", type=float, default=None,
                      help="training seconds per final run (default per "
                      f"task: {BUDGETS})")
  parser.add_argument("--sweep-budget", type=float, default=None,
                      help="training seconds per sweep run (default: the "
                      "budget)")
  parser.add_argument("--no-sweep", action="store_true",
                      help="skip the sweep: every optimizer runs at its "
                      "center (learning rate, or kfac_adaptive's λ₀)")
  parser.add_argument("--max-extensions", type=int, default=2,
                      help="times the sweep may grow past a winning edge of "
                      "its grid")
  parser.add_argument("--center", nargs="*", default=[],
                      help="override sweep centers, e.g. kfac=0.3 adam=1e-3 "
                      "kfac_adaptive=15 (its λ₀)")
  parser.add_argument("--eval-every", type=float, default=10.0,
                      help="training seconds between evaluations")
  parser.add_argument("--targets", nargs="*", type=float, default=[],
                      help="also report, per final run, when the metric "
                      "first met each of these values (first evaluation, "
                      "and the crossing interpolated between evaluations)")
  parser.add_argument("--at-seconds", nargs="*", type=float, default=[],
                      help="also report, per final run, the metric at the "
                      "last evaluation by each of these training seconds")
  parser.add_argument("--eval-examples", type=int, default=None,
                      help="evaluate on the first N examples of the task's "
                      "evaluation set (default: all)")
  parser.add_argument("--curvature-examples", type=int, default=250,
                      help="kfac_adaptive: the quadratic model's curvature "
                      "and reduction ratio use the first N examples of each "
                      "batch (all of a smaller batch), the factors' "
                      "statistics N examples (see --curvature); Martens' "
                      "curvature mini-batch")
  parser.add_argument("--curvature",
                      choices=("batch", "subset", "empirical",
                               "gauss-newton"),
                      default="subset",
                      help="kfac_adaptive's factor statistics, from the "
                      "capture of the whole batch's loss (the empirical "
                      "Fisher): on its whole batch, or on "
                      "--curvature-examples evenly spaced examples "
                      "(factor_batch_size); or from the loss on the "
                      "curvature examples, or from the task's "
                      "kfac_jax.sampled_curvature surrogate (Gauss-Newton) "
                      "on them")
  parser.add_argument("--min-damping", type=float, default=None,
                      help="kfac_adaptive: AdaptiveConfig.min_damping, the "
                      "floor of λ (default: the library's, "
                      f"{kfac_jax.AdaptiveConfig().min_damping:g})")
  parser.add_argument("--inv-dtype", choices=("float32", "bfloat16"),
                      default="float32",
                      help="kfac and kfac_adaptive: scale_by_kfac's "
                      "inv_dtype, in which the inverses are stored and "
                      "applied")
  parser.add_argument("--max-steps", type=int, default=None,
                      help="also stop every run after this many steps")
  parser.add_argument("--out", type=pathlib.Path,
                      default=REPO / "results")
  parser.add_argument("--resume", type=pathlib.Path, default=None,
                      help="a previous run's JSON: runs recorded there are "
                      "not repeated")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--smoke", action="store_true",
                      help="CI check: every task and optimizer, one seed, "
                      "2-step runs on small evaluation sets, no sweep")
  args = parser.parse_args(argv)
  args.center = parse_centers(args.center)
  if args.smoke:
    args.seeds, args.no_sweep = [0], True
    args.budget, args.max_steps = 60.0, 2
    args.eval_examples, args.eval_every = 64, 1e9
  for flag in ("budget", "sweep_budget", "eval_every"):
    value = getattr(args, flag)
    if value is not None and not value > 0:
      raise SystemExit(f"--{flag.replace('_', '-')} must be > 0.")
  if args.min_damping is not None and not args.min_damping > 0:
    raise SystemExit("--min-damping must be > 0.")
  for name, center in args.center.items():
    low, high = swept_range(name, args)
    if not (center > 0 and low <= center <= high):
      raise SystemExit(f"--center {name}={center:g}: must be > 0"
                       + (f" and within [{low:g}, {high:g}], the range of λ"
                          if name == SWEPT_DAMPING else "") + ".")
  if args.resume is not None and not args.resume.is_file():
    raise SystemExit(f"--resume {args.resume}: no such file.")
  if args.curvature_examples < 1:
    raise SystemExit("--curvature-examples must be >= 1.")
  if args.max_extensions < 0:
    raise SystemExit("--max-extensions must be >= 0.")
  for flag in ("eval_examples", "max_steps"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  if "kron" in args.optimizers and import_kron() is None:
    tqdm.write("distributed-kron is not installed: leaving kron out.")
    args.optimizers = [n for n in args.optimizers if n != "kron"]
  return args


def metadata(args: argparse.Namespace) -> dict[str, Any]:
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                            capture_output=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(
        ["git", "status", "--porcelain", "kfac_jax", "benchmarks", "examples"],
        cwd=REPO, text=True, capture_output=True, check=True).stdout.strip())
  except (OSError, subprocess.CalledProcessError):
    commit, dirty = None, None
  return dict(
      command=" ".join([sys.executable.rsplit("/", 1)[-1],
                        *map(str, sys.argv)]),
      args={k: (str(v) if isinstance(v, pathlib.Path) else v)
            for k, v in vars(args).items()},
      centers=CENTERS, lr_grid=LR_GRID, kfac_settings=KFAC_SETTINGS,
      kfac_adaptive_settings=KFAC_ADAPTIVE_SETTINGS,
      git_commit=commit, git_dirty=dirty, jax=jax.__version__,
      optax=optax.__version__, flax=flax.__version__,
      machine=platform.machine(),
      cpus=os.cpu_count(),
      blas_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
      started=datetime.datetime.now().isoformat(timespec="seconds"))


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  stem = args.out / f"convergence_{stamp}"
  race = Race(args, stem.with_suffix(".json"), metadata(args))
  report = [f"`{race.meta['command']}`", ""]
  for name in args.tasks:
    builder, batch_size = TASK_BUILDERS[name]
    task = builder(args.eval_examples, batch_size)
    result = race_task(task, args, race)
    png = pathlib.Path(f"{stem}_{name}.png")
    plot(result, png)
    target = ("no first-order optimizer ran" if result["target"] is None else
              f"{result['target_name']}'s median final {task.metric}, "
              f"{result['target']:.4g}")
    report += [
        f"## {name}: {task.description}", "",
        f"Budget {result['budget']:g} training seconds per run, seeds "
        f"{args.seeds}; sweep {result['sweep_budget']:g} s, seed 0. Target: "
        f"{target}.", "", summary_table(result), "", "Sweep (final metric):",
        "", sweep_table(result), "", f"Plot: `{png.name}`", ""]
    if args.targets or args.at_seconds:
      runs = [(f"{optimizer}, seed {run['seed']}", run)
              for optimizer, seeds in result["finals"].items()
              for run in seeds]
      report += ["Readouts (`--targets`, `--at-seconds`):", "",
                 readouts_table(task, runs, args.targets, args.at_seconds),
                 ""]
    print("\n".join(report[-16:]), flush=True)
  pathlib.Path(f"{stem}.md").write_text("\n".join(report))
  print(f"Wrote {stem}.json, {stem}.md and the plots.", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
