"""A layer's gradient as the block matrices K-FAC preconditions, and back.

A kernel ``[*stack, *contracted, *output]`` with ``g`` groups splits into
``prod(stack) * g`` blocks ``[activation_dim, gradient_dim]``: block
``s * g + j`` holds slice ``s`` of the stack and the output channels
``[j * o, (j + 1) * o)`` (``o = gradient_dim``), its rows the flattened
contracted axes followed by the bias (see ``capture.layers``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from kfac_jax.capture.layers import BIAS, LayerInfo


def to_matrix(layer_grads: Mapping[str, jax.Array], layer: LayerInfo,
              dtype: jnp.dtype) -> jax.Array:
  """``[num_blocks, activation_dim, gradient_dim]`` blocks of a layer's gradient."""
  stack = layer.num_blocks // layer.groups
  rows = layer.activation_dim - int(layer.has_bias)

  def blocks(array: jax.Array, array_rows: int) -> jax.Array:
    # [stack, rows, groups, o] -> [stack, groups, rows, o] -> [blocks, rows, o].
    array = array.reshape(stack, array_rows, layer.groups, layer.gradient_dim)
    return jnp.swapaxes(array, 1, 2).reshape(
        layer.num_blocks, array_rows, layer.gradient_dim).astype(dtype)

  matrix = blocks(layer_grads[layer.kernel_key], rows)
  if layer.has_bias:
    matrix = jnp.concatenate([matrix, blocks(layer_grads[BIAS], 1)], axis=1)
  return matrix


def from_matrix(matrix: jax.Array, layer: LayerInfo,
                like: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Inverse of ``to_matrix``; dtypes follow ``like`` (the incoming grads)."""
  stack = layer.num_blocks // layer.groups
  rows = layer.activation_dim - int(layer.has_bias)

  def unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    blocks = blocks.reshape(stack, layer.groups, -1, layer.gradient_dim)
    return jnp.swapaxes(blocks, 1, 2).reshape(shape)

  key = layer.kernel_key
  out = {key: unblock(matrix[:, :rows], layer.kernel_shape).astype(
      like[key].dtype)}
  if layer.has_bias:
    out[BIAS] = unblock(matrix[:, rows:], like[BIAS].shape).astype(
        like[BIAS].dtype)
  return out
