"""What the NNX test modules share: a model of every captured NNX layer kind,
its loss, and ``as_pure`` across the supported flax releases."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

# flax 0.12.12 renamed nnx.pure to nnx.as_pure (the old name warns); 0.12.2
# has only nnx.pure.
as_pure = getattr(nnx, "as_pure", None) or nnx.pure


class NnxModel(nnx.Module):
  """Grouped conv, Linear, LinearGeneral, a list of Linears, BatchNorm."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(2, 4, (3,), feature_group_count=2, rngs=rngs)
    self.hidden = nnx.Linear(24, 8, rngs=rngs)
    self.heads = nnx.LinearGeneral(8, (2, 3), rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(2)])
    self.norm = nnx.BatchNorm(
      6, use_running_average=False, use_scale=False, use_bias=False, rngs=rngs
    )

  def __call__(self, x):
    h = jnp.tanh(self.conv(x)).reshape(x.shape[0], -1)
    h = self.heads(jnp.tanh(self.hidden(h))).reshape(x.shape[0], -1)
    for block in self.blocks:
      h = jnp.tanh(block(h))
    return self.norm(h)


def nnx_loss(model, x, target):
  """The mean squared error of ``model(x)``."""
  return jnp.mean((model(x) - target) ** 2)
