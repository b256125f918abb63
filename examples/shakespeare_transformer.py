"""Tiny Shakespeare character transformer: K-FAC vs SGD with momentum vs AdamW.

A decoder-only transformer (pre-LayerNorm, causal multi-head attention, GELU
MLP) whose blocks are one ``nn.scan`` over stacked parameters is trained on
next-character prediction by each optimizer from the same initialization on
the same mini-batches. K-FAC preconditions, per scanned layer slice, the
attention's query/key/value/out projections (``DenseGeneral`` kernels
``[d, heads, head_dim]`` and ``[heads, head_dim, d]``), both MLP layers and
the output layer; embeddings and LayerNorms pass through to the SGD that
follows. Its layer table comes from ``kfac_jax.trace_layers``.

The script prints a table (validation loss in nats per character, final
training loss, time) and writes the loss curves to
``<out>/shakespeare_transformer.png``.

Run from the repository root::

  python -m examples.shakespeare_transformer  # defaults, ~15 min on 2 cores
  python -m examples.shakespeare_transformer --steps 20  # smoke run
  python -m examples.shakespeare_transformer --help
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from examples import (
  datasets,
  flags,
  mnist_classifier,
  models,
  reporting,
  training,
)

# Baseline rates from a 60-step sweep on 2 CPU cores (validation loss):
# SGD+momentum lr 0.01/0.03/0.1/0.3/1.0 -> 2.98/2.75/3.06/3.36/NaN; AdamW
# 1e-3/3e-3/1e-2 -> 2.56/2.60/2.81.
# K-FAC: the transformer recipe of the configuration guide (kl_clip 0.1).
DEFAULTS = dict(
  mnist_classifier.DEFAULTS,
  epochs=1,
  batch_size=64,
  sgd_lr=0.03,
  kl_clip=0.1,
  optimizers="kfac,sgd,adamw",
  weight_decay=1e-4,
)


def sequences(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping windows: inputs, next characters, ``[n, context]`` each."""
  n = (len(ids) - 1) // context
  inputs = ids[: n * context].reshape(n, context)
  targets = ids[1 : n * context + 1].reshape(n, context)
  return inputs, targets


def load_sequences(
  context: int,
) -> tuple[int, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """Tiny Shakespeare as character ids.

  Returns the vocabulary size, then ``(inputs, targets)`` windows of the
  first 90% of the text (training) and of the last 10% (validation).
  """
  text = datasets.load_shakespeare()
  vocab = sorted(set(text))
  ids = np.searchsorted(np.asarray(vocab), np.asarray(list(text))).astype(
    np.int32
  )
  split = int(0.9 * len(ids))
  return (
    len(vocab),
    sequences(ids[:split], context),
    sequences(ids[split:], context),
  )


def token_losses(
  model: models.CharTransformer, params, x: jax.Array, y: jax.Array
) -> jax.Array:
  """Next-character cross-entropy of every position: ``[batch, context]``."""
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def main(argv: list[str] | None = None) -> int:
  parser = flags.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  parser.add_argument(
    "--context", type=int, default=64, help="characters per training sequence"
  )
  parser.add_argument("--width", type=int, default=128, help="model width")
  parser.add_argument(
    "--depth", type=int, default=4, help="transformer blocks (one nn.scan)"
  )
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  args = parser.parse_args(argv)
  flags.check_args(args)

  vocab_size, (x_train, y_train), (x_val, y_val) = load_sequences(args.context)
  model = models.CharTransformer(
    vocab_size, args.context, args.width, args.depth, args.heads
  )
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]

  def loss_fn(params, x, y):
    return token_losses(model, params, x, y).mean()

  @jax.jit
  def per_sequence(params, x, y):
    logits = model.apply({"params": params}, x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return losses.mean(-1), (jnp.argmax(logits, -1) == y).mean(-1)

  example = (x_train[: args.batch_size], y_train[: args.batch_size])
  table = kfac_jax.trace_layers(loss_fn, params, *example)
  optimizers = flags.build_optimizers(args, layers=table)
  # The table lists the embedding too, which K-FAC leaves to SGD here
  # (precondition_embeddings=False).
  preconditioned = [
    layer for layer in table.values() if layer.kernel_key != "embedding"
  ]
  steps = training.num_steps(
    len(x_train), args.batch_size, args.epochs, args.steps
  )
  print(
    f"Tiny Shakespeare, {vocab_size} characters, transformer width "
    f"{args.width} x {args.depth} scanned blocks: {args.epochs} epoch(s) "
    f"capped at {steps} steps of {args.batch_size} x {args.context} "
    f"characters; K-FAC preconditions {len(preconditioned)} layers "
    f"({sum(layer.num_blocks for layer in preconditioned)} Kronecker "
    "blocks; "
    "not the embedding); "
    f"{flags.describe_setup()}",
    flush=True,
  )

  results = training.compare(
    optimizers,
    lambda opt: training.make_train_step(loss_fn, opt),
    params,
    (x_train, y_train),
    batch_size=args.batch_size,
    epochs=args.epochs,
    max_steps=args.steps,
    seed=args.seed,
    desc="transformer",
  )

  val_eval = flags.head((x_val, y_val), args.eval_size)
  for result in results.values():
    evaluate = lambda x, y, p=result.params: per_sequence(p, x, y)
    (result.metrics["val_loss"], result.metrics["val_acc"]) = (
      reporting.batched_means(evaluate, val_eval)
    )
    result.metrics["train_loss"] = float(np.mean(result.losses[-20:]))

  columns = reporting.standard_columns(
    [
      reporting.Column(
        "train loss (last 20 steps)",
        lambda r: r.metrics["train_loss"],
        "{:.4f}",
      ),
      reporting.Column(
        "val loss (nats/char)", lambda r: r.metrics["val_loss"], "{:.4f}"
      ),
      reporting.Column(
        "val acc (%)", lambda r: 100 * r.metrics["val_acc"], "{:.2f}"
      ),
    ]
  )
  reporting.report(
    results,
    optimizers,
    columns,
    args.out,
    "shakespeare_transformer",
    header=(
      f"Tiny Shakespeare, character transformer (width {args.width}, "
      f"{args.depth} scanned blocks, {args.heads} heads, context "
      f"{args.context}), {steps} steps of batch {args.batch_size}, "
      f"seed {args.seed}. Validation over {len(val_eval[0]):,} "
      "held-out sequences (the last 10% of the text); times exclude "
      "compilation."
    ),
    plot_title=f"Tiny Shakespeare transformer, batch {args.batch_size}",
    ylabel="train cross-entropy (nats/char)",
    log_y=False,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
