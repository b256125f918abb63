"""A layer's gradient as the matrix K-FAC preconditions, and back."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from kfac_jax.capture.layers import BIAS, KERNEL, LayerInfo


def to_matrix(layer_grads: Mapping[str, jax.Array], layer: LayerInfo,
              dtype: jnp.dtype) -> jax.Array:
  """``[kernel.reshape(prod(window)*in, out); bias]``: ``[activation_dim, gradient_dim]``."""
  matrix = layer_grads[KERNEL].reshape(-1, layer.gradient_dim).astype(dtype)
  if layer.has_bias:
    matrix = jnp.concatenate([matrix, layer_grads[BIAS][None, :].astype(dtype)])
  return matrix


def from_matrix(matrix: jax.Array, layer: LayerInfo,
                like: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Inverse of ``to_matrix``; dtypes follow ``like`` (the incoming grads)."""
  kernel_rows = matrix.shape[0] - int(layer.has_bias)
  out = {KERNEL: matrix[:kernel_rows].reshape(layer.kernel_shape).astype(
      like[KERNEL].dtype)}
  if layer.has_bias:
    out[BIAS] = matrix[kernel_rows].astype(like[BIAS].dtype)
  return out
