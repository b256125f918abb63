"""Model B: a CIFAR ResNet (He et al. 2016, Sec. 4.2) in Flax, NHWC.

Depth ``6n + 2``: a 3x3 stem conv with 16·w channels, three stages of ``n``
basic blocks (16·w, 32·w, 64·w channels; stride 2 at the start of stages 2 and
3, 1x1 strided projection shortcuts, "option B"), global average pooling and a
dense classifier. Convolutions have no bias; each is followed by BatchNorm
(unless ``batch_norm=False``, in which case convolutions carry a bias).

K-FAC preconditions the Conv and Dense layers; BatchNorm scale/bias gradients
pass through to the chained optimizer. BatchNorm's running statistics are a
mutable ``batch_stats`` collection threaded through the step.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class BasicBlock(nn.Module):
  features: int
  strides: int
  batch_norm: bool

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = (lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
            ) if self.batch_norm else (lambda: (lambda y: y))
    conv = lambda f, k, s: nn.Conv(f, (k, k), (s, s), padding="SAME",
                                   use_bias=not self.batch_norm)
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
    x = nn.Conv(16 * self.width, (3, 3), padding="SAME",
                use_bias=not self.batch_norm)(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    for stage, channels in enumerate((16, 32, 64)):
      for b in range(blocks):
        strides = 2 if stage > 0 and b == 0 else 1
        x = BasicBlock(channels * self.width, strides, self.batch_norm)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def resnet_loss_fn(model: CifarResNet):
  """``loss(variables_params, batch_stats, images, labels) -> (loss, new_batch_stats)``."""

  def loss_fn(params: Any, batch_stats: Any, images: jax.Array,
              labels: jax.Array):
    variables = {"params": params}
    if model.batch_norm:
      variables["batch_stats"] = batch_stats
      logits, updates = model.apply(variables, images, train=True,
                                    mutable=["batch_stats"])
      new_stats = updates["batch_stats"]
    else:
      logits = model.apply(variables, images, train=True)
      new_stats = batch_stats
    loss = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           labels).mean()
    return loss, new_stats

  return loss_fn


class SmallConvNet(nn.Module):
  """A plain CNN for the convergence benchmark's CIFAR-10 task.

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
