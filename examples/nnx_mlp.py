"""Flax NNX end to end: an ``nnx.Module`` MLP on MNIST, trained through
``nnx.Optimizer`` by K-FAC, SGD with momentum and AdamW.

The NNX path: ``kfac_jax.value_grad_and_stats(loss_fn)(model, x, y)`` is used
as ``nnx.value_and_grad`` would be (the gradients are an ``nnx.State``), and
``optimizer.update(model, grads, kfac_stats=stats)`` hands the statistics to
``scale_by_kfac``, which ``nnx.Optimizer`` forwards to ``tx.update``. Each
optimizer trains its own copy of the same initial model on the same
mini-batches; the script prints a table (test accuracy, training loss, time)
and writes the loss curves to ``<out>/nnx_mlp.png``.

Run from the repository root::

  python -m examples.nnx_mlp             # defaults, a few minutes on 2 cores
  python -m examples.nnx_mlp --steps 20  # smoke run
  python -m examples.nnx_mlp --help
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import kfac_jax
from examples import datasets, flags, mnist_classifier, reporting, training

# The MNIST classifier's settings (see mnist_classifier.py), 2 epochs.
DEFAULTS = dict(
  mnist_classifier.DEFAULTS, epochs=2, optimizers="kfac,sgd,adamw"
)


class MLP(nnx.Module):
  """784-512-256-10 with ReLU, as NNX modules."""

  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.List(
      [
        nnx.Linear(784, 512, rngs=rngs),
        nnx.Linear(512, 256, rngs=rngs),
        nnx.Linear(256, 10, rngs=rngs),
      ]
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def kfac_step(model, optimizer, x, y):
  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model, x, y)
  optimizer.update(model, grads, kfac_stats=stats)
  return loss


@nnx.jit
def first_order_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def per_example(model, x, y):
  logits = model(x)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return losses, (jnp.argmax(logits, -1) == y).astype(jnp.float32)


def main(argv: list[str] | None = None) -> int:
  parser = flags.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  args = parser.parse_args(argv)
  flags.check_args(args)
  mnist = datasets.load_mnist()
  optimizers = flags.build_optimizers(args)
  steps = training.num_steps(
    len(mnist.x_train), args.batch_size, args.epochs, args.steps
  )
  print(
    f"MNIST, NNX MLP 784-512-256-10 through nnx.Optimizer: {steps} steps "
    f"of batch {args.batch_size}; {flags.describe_setup()}",
    flush=True,
  )

  initial = MLP(nnx.Rngs(args.seed))
  runs, compile_seconds = {}, {}
  example = jax.device_put(
    (mnist.x_train[: args.batch_size], mnist.y_train[: args.batch_size])
  )
  for opt in optimizers:
    model = nnx.clone(initial)
    optimizer = nnx.Optimizer(model, opt.tx, wrt=nnx.Param)
    step = kfac_step if opt.uses_kfac else first_order_step
    # Compile on throw-away copies (same graph, so the cache hits later).
    start = time.perf_counter()
    jax.block_until_ready(
      step(nnx.clone(model), nnx.clone(optimizer), *example)
    )
    compile_seconds[opt.name] = time.perf_counter() - start
    runs[opt.name] = (model, optimizer, step)
  losses = {name: np.zeros(steps) for name in runs}
  seconds = {name: np.zeros(steps) for name in runs}
  batches = training.epoch_batches(
    len(mnist.x_train), args.batch_size, args.epochs, args.seed
  )
  with tqdm(total=steps, desc="NNX MLP", unit="step") as bar:
    for i in range(steps):
      idx = next(batches)
      x, y = jax.device_put((mnist.x_train[idx], mnist.y_train[idx]))
      for name, (model, optimizer, step) in runs.items():
        start = time.perf_counter()
        losses[name][i] = jax.block_until_ready(step(model, optimizer, x, y))
        seconds[name][i] = (seconds[name][i - 1] if i else 0.0) + (
          time.perf_counter() - start
        )
      bar.set_postfix({n: f"{losses[n][i]:.4g}" for n in runs}, refresh=False)
      bar.update(1)

  test = flags.head((mnist.x_test, mnist.y_test), args.eval_size)
  train = flags.head((mnist.x_train, mnist.y_train), args.eval_size)
  # RunResult.params holds the trained model itself.
  results = {
    name: training.RunResult(
      name, losses[name], seconds[name], compile_seconds[name], params=model
    )
    for name, (model, _, _) in runs.items()
  }
  columns = reporting.classification_columns(
    results, lambda r, x, y: per_example(r.params, x, y), train, test
  )
  reporting.report(
    results,
    optimizers,
    columns,
    args.out,
    "nnx_mlp",
    header=(
      f"MNIST, NNX MLP 784-512-256-10 through nnx.Optimizer, {steps} "
      f"steps of batch {args.batch_size}, seed {args.seed}. Train "
      f"loss and accuracy over {len(train[0]):,} training images, "
      "test accuracy "
      f"over {len(test[0]):,} test images; 'compile' is a first call "
      "on copies of the model and optimizer (compilation and one "
      "step), not counted in the train time."
    ),
    plot_title=f"MNIST NNX MLP, batch {args.batch_size}",
    ylabel="train cross-entropy",
    log_y=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
