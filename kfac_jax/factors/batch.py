"""Batch Kronecker factors from captured layer tensors (KAISA's conventions).

With ``cov(x) = sym(xᵀx / N)``, ``sym(C) = (C + Cᵀ) / 2`` and ``N`` the rows of
``x``:

* Dense: ``a = input.reshape(N, in)`` (a ones column appended for a bias),
  ``g = cotangent.reshape(N, out)``; ``A = cov(a)``, ``G = cov(g)``.
* Conv: ``a`` = patches ``[B·S, prod(window)·in]`` in ``(*window, in)`` order,
  ones column appended for a bias, the whole matrix divided by ``S`` (output
  positions); ``g = cotangent.reshape(B·S, out) / S``; ``A = cov(a)``,
  ``G = cov(g)``.

A layer called several times contributes the sum of its calls' factors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from kfac_jax.capture.statistics import LayerSignature, LayerStatistics
from kfac_jax.factors.patches import conv_patches

# Factors are accumulated in float32 whatever the activation dtype.
COMPUTE_DTYPE = jnp.float32


def covariance(rows: jax.Array) -> jax.Array:
  """``sym(rowsᵀ rows / N)`` for ``rows: [N, d]``; returns ``[d, d]`` float32."""
  rows = rows.astype(COMPUTE_DTYPE)
  # On a mesh with Explicit axes and a batch-sharded `rows`, the contraction
  # over the batch must say where the (replicated) result lives.
  replicated = jax.typeof(rows).sharding.update(spec=PartitionSpec())
  product = jnp.matmul(rows.T, rows, precision=lax.Precision.HIGHEST,
                       out_sharding=replicated)
  product = product / rows.shape[0]
  return (product + product.T) / 2


def activation_rows(inputs: jax.Array, signature: LayerSignature) -> jax.Array:
  """The rows ``a`` whose covariance is A: ``[N, activation_dim]``."""
  if signature.conv is None:
    rows = inputs.reshape(-1, inputs.shape[-1])
    scale = 1
  else:
    patches = conv_patches(inputs, signature.conv)
    scale = math.prod(patches.shape[1:-1])
    rows = patches.reshape(-1, patches.shape[-1])
  rows = rows.astype(COMPUTE_DTYPE)
  if signature.has_bias:
    # ones_like keeps the rows' sharding (needed on Explicit mesh axes).
    rows = jnp.concatenate([rows, jnp.ones_like(rows[:, :1])], axis=1)
  return rows / scale if scale != 1 else rows


def gradient_rows(output_cotangents: jax.Array,
                  signature: LayerSignature) -> jax.Array:
  """The rows ``g`` whose covariance is G: ``[N, out]``."""
  rows = output_cotangents.reshape(-1, output_cotangents.shape[-1]).astype(
      COMPUTE_DTYPE)
  if signature.conv is None:
    return rows
  spatial_size = math.prod(output_cotangents.shape[-1 - len(signature.conv.window):-1])
  return rows / spatial_size


def batch_factors(stats: LayerStatistics) -> tuple[jax.Array, jax.Array]:
  """``(A, G)`` of one batch, summed over the layer's calls; float32."""
  activation_factor = sum(
      covariance(activation_rows(x, stats.signature)) for x in stats.inputs)
  gradient_factor = sum(
      covariance(gradient_rows(g, stats.signature))
      for g in stats.output_cotangents)
  return activation_factor, gradient_factor
