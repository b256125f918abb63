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

  python examples/shakespeare_transformer.py             # defaults, ~15 min on 2 cores
  python examples/shakespeare_transformer.py --steps 20  # smoke run
  python examples/shakespeare_transformer.py --help
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np
import optax

import common  # pylint: disable=g-import-not-at-top
import datasets  # pylint: disable=g-import-not-at-top
import kfac_jax  # pylint: disable=g-import-not-at-top

# Baseline rates from a 60-step sweep on 2 CPU cores (validation loss):
# SGD+momentum lr 0.01/0.03/0.1/0.3/1.0 -> 2.98/2.75/3.06/3.36/NaN; AdamW
# 1e-3/3e-3/1e-2 -> 2.56/2.60/2.81.
# K-FAC keeps the MNIST classifier's settings, untuned here.
DEFAULTS = dict(
    epochs=1,
    batch_size=64,
    kfac_lr=0.1,
    sgd_lr=0.03,
    adam_lr=1e-3,
    compute_method="inverse",
    damping=0.3,
    kl_clip=1e-3,
    inv_update_steps=10,
    factor_decay=0.95,
    optimizers="kfac,sgd,adamw",
    weight_decay=1e-4,
)


class Block(nn.Module):
  """x + attention(LN(x)), then x + MLP(LN(x)); the body of the scan."""

  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    width = x.shape[-1]
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, name="attention")(h, mask=mask)
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(4 * width, name="mlp_in")(h))
    return x + nn.Dense(width, name="mlp_out")(h), None


class CharTransformer(nn.Module):
  """Token + learned position embeddings, scanned blocks, LN, logits."""

  vocab_size: int
  context: int
  width: int = 128
  depth: int = 4
  num_heads: int = 4

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab_size, self.width)(tokens)
    position = self.param("position", nn.initializers.normal(0.02),
                          (self.context, self.width))
    x = x + position[:tokens.shape[1]]
    blocks = nn.scan(Block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.depth)
    x, _ = blocks(self.num_heads, name="blocks")(x, None)
    return nn.Dense(self.vocab_size, name="logits")(nn.LayerNorm()(x))


def sequences(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping windows: inputs ``[n, context]``, next characters ``[n, context]``."""
  n = (len(ids) - 1) // context
  inputs = ids[:n * context].reshape(n, context)
  targets = ids[1:n * context + 1].reshape(n, context)
  return inputs, targets


def load_sequences(context: int) -> tuple[int, tuple[np.ndarray, np.ndarray],
                                          tuple[np.ndarray, np.ndarray]]:
  """Tiny Shakespeare as character ids.

  Returns the vocabulary size, then ``(inputs, targets)`` windows of the
  first 90% of the text (training) and of the last 10% (validation).
  """
  text = datasets.load_shakespeare()
  vocab = sorted(set(text))
  ids = np.searchsorted(np.asarray(vocab), np.asarray(list(text))).astype(
      np.int32)
  split = int(0.9 * len(ids))
  return (len(vocab), sequences(ids[:split], context),
          sequences(ids[split:], context))


def token_losses(model: CharTransformer, params, x: jax.Array,
                 y: jax.Array) -> jax.Array:
  """Next-character cross-entropy of every position: ``[batch, context]``."""
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def main(argv: list[str] | None = None) -> int:
  parser = common.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  parser.add_argument("--context", type=int, default=64,
                      help="characters per training sequence")
  parser.add_argument("--width", type=int, default=128, help="model width")
  parser.add_argument("--depth", type=int, default=4,
                      help="transformer blocks (one nn.scan)")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  args = parser.parse_args(argv)
  common.check_args(args)

  vocab_size, (x_train, y_train), (x_val, y_val) = load_sequences(
      args.context)
  model = CharTransformer(vocab_size, args.context, args.width, args.depth,
                          args.heads)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]

  def loss_fn(params, x, y):
    return token_losses(model, params, x, y).mean()

  @jax.jit
  def per_sequence(params, x, y):
    logits = model.apply({"params": params}, x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return losses.mean(-1), (jnp.argmax(logits, -1) == y).mean(-1)

  example = (x_train[:args.batch_size], y_train[:args.batch_size])
  table = kfac_jax.trace_layers(loss_fn, params, *example)
  optimizers = common.build_optimizers(args, layers=table)
  # The table lists the embedding too, which K-FAC leaves to SGD here
  # (precondition_embeddings=False).
  preconditioned = [layer for layer in table.values()
                    if layer.kernel_key != "embedding"]
  steps = common.num_steps(len(x_train), args.batch_size, args.epochs,
                           args.steps)
  print(f"Tiny Shakespeare, {vocab_size} characters, transformer width "
        f"{args.width} x {args.depth} scanned blocks: {args.epochs} epoch(s) "
        f"capped at {steps} steps of {args.batch_size} x {args.context} "
        f"characters; K-FAC preconditions {len(preconditioned)} layers "
        f"({sum(l.num_blocks for l in preconditioned)} Kronecker blocks; "
        "not the embedding); "
        f"{common.describe_setup()}", flush=True)

  results = common.compare(
      optimizers, loss_fn, params, (x_train, y_train),
      batch_size=args.batch_size, epochs=args.epochs, max_steps=args.steps,
      seed=args.seed, desc="transformer")

  val_eval = common.head((x_val, y_val), args.eval_size)
  for result in results.values():
    evaluate = lambda x, y, p=result.params: per_sequence(p, x, y)
    (result.metrics["val_loss"],
     result.metrics["val_acc"]) = common.batched_means(evaluate, val_eval)
    result.metrics["train_loss"] = float(np.mean(result.losses[-20:]))

  columns = common.standard_columns([
      common.Column("train loss (last 20 steps)",
                    lambda r: r.metrics["train_loss"], "{:.4f}"),
      common.Column("val loss (nats/char)", lambda r: r.metrics["val_loss"],
                    "{:.4f}"),
      common.Column("val acc (%)", lambda r: 100 * r.metrics["val_acc"],
                    "{:.2f}"),
  ])
  common.report(
      results, optimizers, columns, args.out, "shakespeare_transformer",
      header=(f"Tiny Shakespeare, character transformer (width {args.width}, "
              f"{args.depth} scanned blocks, {args.heads} heads, context "
              f"{args.context}), {steps} steps of batch {args.batch_size}, "
              f"seed {args.seed}. Validation over {len(val_eval[0]):,} "
              "held-out sequences (the last 10% of the text); times exclude "
              "compilation."),
      plot_title=f"Tiny Shakespeare transformer, batch {args.batch_size}",
      ylabel="train cross-entropy (nats/char)", log_y=False)
  return 0


if __name__ == "__main__":
  sys.exit(main())
