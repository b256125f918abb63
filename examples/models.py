"""The Flax models the examples, the benchmarks and the tests share.

* ``MLP``: dense layers with an activation, then a linear head (the MNIST
  classifier's 784-512-256-10; the soak test's bfloat16 MLP; small test MLPs).
* ``Autoencoder``: the MNIST deep autoencoder of Hinton & Salakhutdinov (2006)
  used in the K-FAC papers, 784-1000-500-250-30-250-500-1000-784, tanh hidden
  units, a linear 30-unit code and logits out.
* ``CifarResNet``: a CIFAR ResNet (He et al. 2016, Sec. 4.2) in NHWC. Depth
  ``6n + 2``: a 3x3 stem conv with 16·w channels, three stages of ``n``
  basic blocks (16·w, 32·w, 64·w channels; stride 2 at the start of stages 2
  and 3, 1x1 strided projection shortcuts, "option B"), global average
  pooling and a dense classifier. Convolutions have no bias; each is followed
  by BatchNorm (unless ``batch_norm=False``, in which case convolutions carry
  a bias), whose running statistics are a mutable ``batch_stats`` collection
  threaded through the step.
* ``SmallConvNet``: a plain 3-stage CNN without BatchNorm.
* ``BatchNormCNN``: the CNN of Flax's NNX MNIST example, with BatchNorm
  (whose running statistics are a ``batch_stats`` collection) and without
  its dropout.
* ``CharTransformer``: a character-level transformer with scanned blocks.

This module must not import ``kfac_jax``: ``benchmarks/dm_kfac_step_time.py``
uses it where ``kfac_jax`` is DeepMind's package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

AUTOENCODER_WIDTHS = (1000, 500, 250, 30, 250, 500, 1000)
MNIST_PIXELS = 784


class MLP(nn.Module):
  """Dense layers of ``widths`` with ``activation``, then ``outputs`` logits.

  ``dtype`` and ``param_dtype`` are every layer's computation and parameter
  dtypes (None and float32: Flax's defaults).
  """

  widths: Sequence[int] = (512, 256)
  outputs: int = 10
  activation: Callable[[jax.Array], jax.Array] = nn.relu
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda width: nn.Dense(
      width, dtype=self.dtype, param_dtype=self.param_dtype
    )
    for width in self.widths:
      x = self.activation(dense(width)(x))
    return dense(self.outputs)(x)


class Autoencoder(nn.Module):
  """Dense autoencoder: tanh hidden layers, linear code layer, logits out.

  ``widths`` are the hidden widths; the middle one is the (linear) code.
  """

  widths: Sequence[int] = AUTOENCODER_WIDTHS
  out_features: int = MNIST_PIXELS
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    code = len(self.widths) // 2
    for i, width in enumerate(self.widths):
      x = nn.Dense(width, kernel_init=self.kernel_init)(x)
      if i != code:
        x = jnp.tanh(x)
    return nn.Dense(self.out_features, kernel_init=self.kernel_init)(x)


def autoencoder_losses(logits: jax.Array, x: jax.Array) -> jax.Array:
  """Per-example sigmoid cross-entropy, summed over the pixels: ``[batch]``."""
  return optax.sigmoid_binary_cross_entropy(logits, x).sum(axis=-1)


class BasicBlock(nn.Module):
  features: int
  strides: int
  batch_norm: bool

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = (
      (lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9))
      if self.batch_norm
      else (lambda: lambda y: y)
    )
    conv = lambda f, k, s: nn.Conv(
      f, (k, k), (s, s), padding="SAME", use_bias=not self.batch_norm
    )
    y = nn.relu(norm()(conv(self.features, 3, self.strides)(x)))
    y = norm()(conv(self.features, 3, 1)(y))
    if x.shape[-1] != self.features or self.strides != 1:
      x = norm()(conv(self.features, 1, self.strides)(x))
    return nn.relu(x + y)


class CifarResNet(nn.Module):
  depth: int = 8
  width: int = 1
  num_classes: int = 10
  batch_norm: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    if (self.depth - 2) % 6:
      raise ValueError(f"depth must be 6n + 2, got {self.depth}.")
    blocks = (self.depth - 2) // 6
    x = nn.Conv(
      16 * self.width, (3, 3), padding="SAME", use_bias=not self.batch_norm
    )(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    for stage, channels in enumerate((16, 32, 64)):
      for b in range(blocks):
        strides = 2 if stage > 0 and b == 0 else 1
        x = BasicBlock(channels * self.width, strides, self.batch_norm)(
          x, train
        )
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def resnet_loss_fn(model: CifarResNet):
  """The loss with batch statistics.

  ``loss(variables_params, batch_stats, images, labels)
  -> (loss, new_batch_stats)``.
  """

  def loss_fn(
    params: Any, batch_stats: Any, images: jax.Array, labels: jax.Array
  ):
    variables = {"params": params}
    if model.batch_norm:
      variables["batch_stats"] = batch_stats
      logits, updates = model.apply(
        variables, images, train=True, mutable=["batch_stats"]
      )
      new_stats = updates["batch_stats"]
    else:
      logits = model.apply(variables, images, train=True)
      new_stats = batch_stats
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()
    return loss, new_stats

  return loss_fn


class SmallConvNet(nn.Module):
  """A plain CNN (the convergence benchmark's CIFAR-10 task).

  Three stages of a 3x3 conv (with bias) + ReLU + 2x2 max-pool, with
  16·w, 32·w and 64·w channels, then a dense classifier on the flattened
  ``[H/8, W/8, 64·w]`` features. No BatchNorm, so a train step is a pure
  function of the parameters and the batch.
  """

  width: int = 1
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for channels in (16, 32, 64):
      x = nn.relu(nn.Conv(channels * self.width, (3, 3), padding="SAME")(x))
      x = nn.max_pool(x, (2, 2), (2, 2))
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


class BatchNormCNN(nn.Module):
  """Flax's NNX MNIST example's CNN, in Linen, without dropout.

  A 3x3 conv with 32·w channels, BatchNorm, ReLU and a 2x2 average pool;
  the same with 64·w channels; a dense layer of 256·w units with ReLU on
  the flattened ``[H/4, W/4, 64·w]`` features (3136 of them for MNIST, a
  3137-row K-FAC factor); dense logits. ``x``: ``[N, H, W, C]`` images.
  With ``train``, BatchNorm normalizes by the batch's statistics and
  updates its running ones (``mutable=["batch_stats"]``); without, it
  uses the running ones.
  """

  width: int = 1
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    for channels in (32, 64):
      x = nn.Conv(channels * self.width, (3, 3), padding="SAME")(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(256 * self.width)(x.reshape(x.shape[0], -1)))
    return nn.Dense(self.num_classes)(x)


class TransformerBlock(nn.Module):
  """x + attention(LN(x)), then x + MLP(LN(x)); the body of the scan."""

  num_heads: int

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    width = x.shape[-1]
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads, name="attention"
    )(h, mask=mask)
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
    position = self.param(
      "position", nn.initializers.normal(0.02), (self.context, self.width)
    )
    x = x + position[: tokens.shape[1]]
    blocks = nn.scan(
      TransformerBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=self.depth,
    )
    x, _ = blocks(self.num_heads, name="blocks")(x, None)
    return nn.Dense(self.vocab_size, name="logits")(nn.LayerNorm()(x))
