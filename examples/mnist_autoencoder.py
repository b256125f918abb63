"""MNIST deep autoencoder, the classic K-FAC benchmark: K-FAC vs SGD vs Adam.

The autoencoder of Hinton & Salakhutdinov (2006), used by Martens (2010) and
Martens & Grosse (2015): 784-1000-500-250-30-250-500-1000-784, tanh hidden
units, a linear 30-dimensional code and sigmoid outputs. The loss is the
sigmoid cross-entropy between the output logits and the pixel intensities,
summed over the 784 pixels and averaged over the batch. K-FAC runs twice:
with KAISA's recipe (``kfac_jax.kfac``: learning rate, damping, KL clip) and
in the adaptive mode (``scale_by_kfac(adaptive=...)``: learning rate,
momentum and damping from the quadratic model of the loss, which the script
splits into network and loss with ``kfac_jax.SplitLoss``; its factors sample
the Gauss-Newton matrix with ``kfac_jax.sampled_curvature``). All optimizers
start from the same initialization and see the same mini-batches. The script
prints a table (final training reconstruction loss over the full training set,
test loss, training time, time per step) and writes the loss curves (vs step
and vs seconds) to ``<out>/mnist_autoencoder.png``.

Run from the repository root::

  python -m examples.mnist_autoencoder             # defaults, minutes (2 cores)
  python -m examples.mnist_autoencoder --steps 20  # smoke run
  python -m examples.mnist_autoencoder --help

See ``DEFAULTS`` for the hyper-parameters and why they were chosen.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import kfac_jax
from examples import datasets, flags, models, reporting, training

# Defaults: batch 1000 (the benchmark's), 2 epochs (120 steps); SGD lr 3e-3
# with momentum 0.9 and Adam lr 1e-3 (the best of 3e-4..1e-2 after 60
# steps); K-FAC the configuration guide's recipe for this autoencoder (lr 0.3,
# relative damping 0.01, kl_clip 1, inverses every 10 steps).
DEFAULTS = dict(
  epochs=2,
  batch_size=1000,
  kfac_lr=0.3,
  sgd_lr=3e-3,
  adam_lr=1e-3,
  compute_method="inverse",
  damping=0.01,
  kl_clip=1.0,
  inv_update_steps=10,
  factor_decay=0.95,
  optimizers="kfac,kfac-adaptive,sgd,adam",
)


def main(argv: list[str] | None = None) -> int:
  parser = flags.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  args = parser.parse_args(argv)
  flags.check_args(args)

  mnist = datasets.load_mnist()
  model = models.Autoencoder()
  params = model.init(jax.random.key(args.seed), mnist.x_train[:1])["params"]

  def loss_fn(params, x):
    return models.autoencoder_losses(
      model.apply({"params": params}, x), x
    ).mean()

  @jax.jit
  def per_example(params, x):
    logits = model.apply({"params": params}, x)
    squared_error = jnp.sum((jax.nn.sigmoid(logits) - x) ** 2, axis=-1)
    return models.autoencoder_losses(logits, x), squared_error

  optimizers = flags.build_optimizers(args, adaptive=True)
  steps = training.num_steps(
    len(mnist.x_train), args.batch_size, args.epochs, args.steps
  )
  print(
    f"MNIST autoencoder 784-1000-500-250-30-250-500-1000-784: "
    f"{args.epochs} epoch(s) capped at {steps} steps of batch "
    f"{args.batch_size}; {flags.describe_setup()}",
    flush=True,
  )

  def split_loss(x):
    return kfac_jax.SplitLoss(
      outputs_fn=lambda params: model.apply({"params": params}, x),
      loss_fn=lambda logits: models.autoencoder_losses(logits, x).mean(),
    )

  def curvature_fn(params, key, x):
    return kfac_jax.sampled_curvature.sigmoid_cross_entropy(
      model.apply({"params": params}, x), key
    )

  results = training.compare(
    optimizers,
    lambda opt: training.make_train_step(
      loss_fn, opt, split_loss=split_loss, curvature_fn=curvature_fn
    ),
    params,
    (mnist.x_train,),
    batch_size=args.batch_size,
    epochs=args.epochs,
    max_steps=args.steps,
    seed=args.seed,
    desc="MNIST autoencoder",
  )

  train_eval = flags.head((mnist.x_train,), args.eval_size)
  test_eval = flags.head((mnist.x_test,), args.eval_size)
  for result in results.values():
    evaluate = lambda x, p=result.params: per_example(p, x)
    (result.metrics["train_loss"], result.metrics["train_sq"]) = (
      reporting.batched_means(evaluate, train_eval)
    )
    result.metrics["test_loss"] = reporting.batched_means(evaluate, test_eval)[
      0
    ]

  columns = reporting.standard_columns(
    [
      reporting.Column(
        "final train loss", lambda r: r.metrics["train_loss"], "{:.2f}"
      ),
      reporting.Column(
        "train sq. error", lambda r: r.metrics["train_sq"], "{:.2f}"
      ),
      reporting.Column("test loss", lambda r: r.metrics["test_loss"], "{:.2f}"),
    ]
  )
  reporting.report(
    results,
    optimizers,
    columns,
    args.out,
    "mnist_autoencoder",
    header=(
      f"MNIST autoencoder (784-1000-500-250-30-250-500-1000-784), "
      f"{steps} steps of batch {args.batch_size}, seed {args.seed}. "
      "Losses: sigmoid cross-entropy summed over the 784 pixels, "
      f"averaged over {len(train_eval[0]):,} training (or "
      f"{len(test_eval[0]):,} test) images after the last step; "
      "squared error likewise, of the sigmoid outputs; times exclude "
      "compilation."
    ),
    plot_title=(f"MNIST deep autoencoder, batch {args.batch_size}"),
    ylabel="train reconstruction loss",
    log_y=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
