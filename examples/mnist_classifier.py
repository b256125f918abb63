"""MNIST classification: K-FAC vs SGD with momentum vs Adam.

An MLP 784-512-256-10 (ReLU, ``flax.linen.Dense``) is trained by the three
optimizers from the same initialization on the same mini-batches. The script
prints a table (final training loss over the full training set, test accuracy,
training time, time per step) and writes the loss curves (vs step and vs
seconds) to ``<out>/mnist_classifier.png``.

Run from the repository root::

  python -m examples.mnist_classifier             # defaults, minutes (2 cores)
  python -m examples.mnist_classifier --steps 20  # smoke run
  python -m examples.mnist_classifier --help

K-FAC here is ``kfac_jax.kfac``: ``scale_by_kfac`` (factors updated every
step, inverses recomputed every ``--inv-update-steps`` steps, KL clipping)
chained with SGD with momentum 0.9. Its train step (``train_step``, below)
differs from the others in one call: ``kfac_jax.value_grad_and_stats``
returns the layer statistics with the gradient, and ``tx.update`` takes them
as ``kfac_stats``. See ``DEFAULTS`` for the hyper-parameters and why they were
chosen.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax

import kfac_jax
from examples import datasets, flags, models, reporting, training

# Defaults: SGD lr 0.1 with momentum 0.9 and Adam lr 1e-3, the usual good
# settings for this MLP; K-FAC the dense-network recipe of the configuration
# guide's *Recommended settings* (lr 0.3, relative damping 0.01, kl_clip 0.3,
# inverses every 10 steps).
DEFAULTS = dict(
  epochs=5,
  batch_size=256,
  kfac_lr=0.3,
  sgd_lr=0.1,
  adam_lr=1e-3,
  compute_method="inverse",
  damping=0.01,
  kl_clip=0.3,
  inv_update_steps=10,
  factor_decay=0.95,
)


def main(argv: list[str] | None = None) -> int:
  parser = flags.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  args = parser.parse_args(argv)
  flags.check_args(args)

  mnist = datasets.load_mnist()
  model = models.MLP(widths=(512, 256), outputs=10)
  params = model.init(jax.random.key(args.seed), mnist.x_train[:1])["params"]

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def train_step(optimizer: training.Optimizer) -> training.StepFn:
    """One optimizer's step; K-FAC's also captures the layer statistics."""
    tx = optimizer.tx

    def step(params, opt_state, x, y):
      if optimizer.uses_kfac:
        loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
          params, x, y
        )
        updates, opt_state = tx.update(
          grads, opt_state, params, kfac_stats=stats
        )
      else:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return training.stateless(step)  # jitted

  @jax.jit
  def per_example(params, x, y):
    logits = model.apply({"params": params}, x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return losses, (jnp.argmax(logits, -1) == y).astype(jnp.float32)

  optimizers = flags.build_optimizers(args)
  steps = training.num_steps(
    len(mnist.x_train), args.batch_size, args.epochs, args.steps
  )
  print(
    f"MNIST classifier, MLP 784-512-256-10: {args.epochs} epoch(s) "
    f"capped at {steps} steps of batch {args.batch_size}; "
    f"{flags.describe_setup()}",
    flush=True,
  )

  results = training.compare(
    optimizers,
    train_step,
    params,
    (mnist.x_train, mnist.y_train),
    batch_size=args.batch_size,
    epochs=args.epochs,
    max_steps=args.steps,
    seed=args.seed,
    desc="MNIST classifier",
  )

  train_eval = flags.head((mnist.x_train, mnist.y_train), args.eval_size)
  test_eval = flags.head((mnist.x_test, mnist.y_test), args.eval_size)
  columns = reporting.classification_columns(
    results, lambda r, x, y: per_example(r.params, x, y), train_eval, test_eval
  )
  reporting.report(
    results,
    optimizers,
    columns,
    args.out,
    "mnist_classifier",
    header=(
      f"MNIST classifier (MLP 784-512-256-10), {steps} steps of batch "
      f"{args.batch_size}, seed {args.seed}. Train loss and accuracy "
      f"over {len(train_eval[0]):,} training images after the last "
      f"step; test accuracy over {len(test_eval[0]):,} test images; "
      "times exclude compilation."
    ),
    plot_title=(f"MNIST MLP 784-512-256-10, batch {args.batch_size}"),
    ylabel="train cross-entropy",
    log_y=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
