"""Convolution patches (im2col) by XLA's own patch op, in Flax kernel order."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.capture.layers import ConvGeometry


def _pre_pad(
  inputs: jax.Array, geometry: ConvGeometry
) -> tuple[jax.Array, str | tuple[tuple[int, int], ...]]:
  """Applies the paddings lax cannot express, exactly as ``flax.linen.Conv``."""
  padding = geometry.padding
  if padding in ("CIRCULAR", "REFLECT"):
    dilated = [
      (k - 1) * d + 1 for k, d in zip(geometry.window, geometry.kernel_dilation)
    ]
    pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
    mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
    return jnp.pad(inputs, pads, mode=mode), "VALID"
  if padding == "CAUSAL":
    left = geometry.kernel_dilation[0] * (geometry.window[0] - 1)
    return jnp.pad(inputs, [(0, 0), (left, 0), (0, 0)]), "VALID"
  return inputs, padding


def conv_patches(inputs: jax.Array, geometry: ConvGeometry) -> jax.Array:
  """Extracts the patches a convolution multiplies with its kernel.

  Args:
    inputs: ``[*batch, *spatial, in]`` (channels last, any number of batch
      dimensions, including none).
    geometry: the layer's window, strides, padding and dilations.

  Returns:
    ``[B, *out_spatial, prod(window) * in]`` with the feature axis ordered
    ``(*window, in)``, i.e. matching ``kernel.reshape(-1, out)`` of a Flax
    kernel ``[*window, in, out]``. ``B`` is the product of the batch dimensions.
  """
  rank = len(geometry.window)
  spatial_and_features = inputs.shape[inputs.ndim - rank - 1 :]
  inputs = inputs.reshape((-1,) + spatial_and_features)
  inputs, padding = _pre_pad(inputs, geometry)
  in_features = inputs.shape[-1]
  channels_last = (0, rank + 1) + tuple(range(1, rank + 1))
  dimension_numbers = lax.ConvDimensionNumbers(
    lhs_spec=channels_last,
    rhs_spec=(rank + 1, rank) + tuple(range(rank)),
    out_spec=channels_last,
  )
  patches = lax.conv_general_dilated_patches(
    inputs,
    filter_shape=geometry.window,
    window_strides=geometry.strides,
    padding=padding,
    lhs_dilation=geometry.input_dilation,
    rhs_dilation=geometry.kernel_dilation,
    dimension_numbers=dimension_numbers,
    precision=lax.Precision.HIGHEST,
  )
  # lax orders patch features (in, *window); Flax kernels are (*window, in).
  window_size = math.prod(geometry.window)
  patches = patches.reshape(patches.shape[:-1] + (in_features, window_size))
  patches = jnp.swapaxes(patches, -1, -2)
  return patches.reshape(patches.shape[:-2] + (window_size * in_features,))
