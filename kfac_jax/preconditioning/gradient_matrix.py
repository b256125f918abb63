"""A layer's gradient as the block matrices K-FAC preconditions, and back.

A kernel ``[*stack, *contracted, *output]`` with ``g`` groups splits into
``prod(stack) * g`` blocks ``[activation_dim, gradient_dim]``: block
``s * g + j`` holds slice ``s`` of the stack and the output channels
``[j * o, (j + 1) * o)`` (``o = gradient_dim``), its rows the flattened
contracted axes followed by the bias (see ``capture.layers``).

A dense layer's gradient is also the product of what the capture holds,
``∇ = aᵀ g`` (``a [N, dA]``: the inputs with the ones column of the bias;
``g [N, dG]``: the output cotangents; ``N`` rows); ``FactoredGradient`` keeps
it in that form, and ``sandwich`` applies a preconditioner's two products to
either form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.capture.layers import BIAS, LayerInfo
from kfac_jax.linalg import contract_rows

# ``(x [dA, dG], axis) -> x``: called on a gradient-shaped operand before a
# product that contracts ``axis`` (0: Q_Aᵀ·x or A⁻¹·x; 1: x·Q_G or x·G⁻¹),
# and on that product's result with the same ``axis`` (where it was
# computed). With a sharded kernel it moves the sharding off that axis, so
# the products stay local and no device holds the whole gradient.
Reshard = Callable[[jax.Array, int], jax.Array]


def no_reshard(x: jax.Array, axis: int) -> jax.Array:
  del axis
  return x


class FactoredGradient(NamedTuple):
  """One block's gradient ``∇ = activation_rowsᵀ gradient_rows``, unmultiplied.

  Attributes:
    activation_rows: ``a``, ``[N, activation_dim]``.
    gradient_rows: ``g``, ``[N, gradient_dim]``.
  """

  activation_rows: jax.Array
  gradient_rows: jax.Array


def divided(
  gradient: jax.Array | FactoredGradient, divisor: jax.Array
) -> jax.Array | FactoredGradient:
  """``∇ / divisor`` in ``gradient``'s form (a factored one: its ``g``)."""
  if isinstance(gradient, FactoredGradient):
    return gradient._replace(gradient_rows=gradient.gradient_rows / divisor)
  return gradient / divisor


def factored_is_cheaper(
  rows: int, activation_dim: int, gradient_dim: int
) -> bool:
  """Whether ``sandwich`` costs fewer FLOPs on ``aᵀg`` than on ``∇``.

  ``L ∇ R`` with ``L [dA, dA]``, ``R [dG, dG]``: ``2·dA·dG·(dA + dG)``
  FLOPs; ``(a Lᵀ)ᵀ (g R)``: ``2·N·(dA² + dG² + dA·dG)``. E.g. a 1000×1000
  layer at ``N = 256``: 1.5 against 4 GFLOP.
  """
  dense = activation_dim * gradient_dim * (activation_dim + gradient_dim)
  factored = rows * (
    activation_dim**2 + gradient_dim**2 + activation_dim * gradient_dim
  )
  return factored < dense


def product_dtype(left: jnp.dtype, right: jnp.dtype) -> jnp.dtype:
  """The operand dtype of ``sandwich``'s products for these stored operands.

  A preconditioner stored in bfloat16 (``inv_dtype``) is applied in it,
  every operand rounded to it and every product accumulated in float32, as
  KAISA preconditions in its ``inv_dtype``: the products then run at the
  hardware's bfloat16 rate (TPU, GPU tensor cores, AVX512-BF16: twice
  float32's on the CI machine's CPU), at the price of a relative rounding
  of ``2⁻⁸`` per operand. Anything else multiplies in float32.
  """
  dtype = jnp.result_type(left, right)
  return dtype if dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


def sandwich(
  left: jax.Array,
  gradient: jax.Array | FactoredGradient,
  right: jax.Array,
  reshard: Reshard = no_reshard,
) -> jax.Array:
  """``left ∇ right``, float32: ``[dA', dA] · [dA, dG] · [dG, dG']``.

  Each product's operands are cast to ``product_dtype(left, right)`` and
  accumulated in float32. A ``FactoredGradient`` is multiplied as
  ``(a leftᵀ)ᵀ (g right)``, never forming ``∇`` (``factored_is_cheaper``
  says when that pays). ``reshard`` (dense ``∇`` only) is applied to each
  ``[dA, dG]`` operand before a product contracting its ``axis``, and to
  the product after it with the same ``axis`` (see ``Reshard``).
  """
  dtype = product_dtype(left.dtype, right.dtype)
  cast = lambda x: x.astype(dtype)
  # Operands are cast before ``reshard``, which then moves the narrow ones.
  matmul = lambda x, y: jnp.matmul(
    cast(x),
    cast(y),
    precision=lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  if isinstance(gradient, FactoredGradient):
    activation_side = lax.dot_general(
      cast(gradient.activation_rows),
      cast(left),
      (((1,), (1,)), ((), ())),
      precision=lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
    )
    gradient_side = matmul(gradient.gradient_rows, right)
    return contract_rows(cast(activation_side), cast(gradient_side))
  # Each product is pinned where it was computed (sharded as the operand it
  # came from) before ``reshard`` moves it: unpinned, XLA computes the
  # product from a gathered gradient instead, to come out as the next
  # product wants it.
  left_product = reshard(matmul(left, reshard(cast(gradient), 0)), 0)
  return reshard(matmul(reshard(cast(left_product), 1), right), 1)


def to_matrix(
  layer_grads: Mapping[str, jax.Array], layer: LayerInfo, dtype: jnp.dtype
) -> jax.Array:
  """A layer's gradient as ``[num_blocks, activation_dim, gradient_dim]``."""
  stack = layer.num_blocks // layer.groups
  rows = layer.activation_dim - int(layer.has_bias)

  def blocks(array: jax.Array, array_rows: int) -> jax.Array:
    # [stack, rows, groups, o] -> [stack, groups, rows, o] -> [blocks, rows, o].
    array = array.reshape(stack, array_rows, layer.groups, layer.gradient_dim)
    return (
      jnp.swapaxes(array, 1, 2)
      .reshape(layer.num_blocks, array_rows, layer.gradient_dim)
      .astype(dtype)
    )

  matrix = blocks(layer_grads[layer.kernel_key], rows)
  if layer.has_bias:
    matrix = jnp.concatenate([matrix, blocks(layer_grads[BIAS], 1)], axis=1)
  return matrix


def from_matrix(
  matrix: jax.Array, layer: LayerInfo, like: Mapping[str, jax.Array]
) -> dict[str, jax.Array]:
  """Inverse of ``to_matrix``; dtypes follow ``like`` (the incoming grads)."""
  stack = layer.num_blocks // layer.groups
  rows = layer.activation_dim - int(layer.has_bias)

  def unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    blocks = blocks.reshape(stack, layer.groups, -1, layer.gradient_dim)
    return jnp.swapaxes(blocks, 1, 2).reshape(shape)

  key = layer.kernel_key
  out = {
    key: unblock(matrix[:, :rows], layer.kernel_shape).astype(like[key].dtype)
  }
  if layer.has_bias:
    out[BIAS] = unblock(matrix[:, rows:], like[BIAS].shape).astype(
      like[BIAS].dtype
    )
  return out
