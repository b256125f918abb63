"""``LayerSignature``s of Flax layer calls, for Linen and NNX modules alike.

Linen's ``Dense``/``Conv``/``DenseGeneral`` and NNX's ``Linear``/``Conv``/
``LinearGeneral`` keep the same hyper-parameters under (nearly) the same
attribute names, so one reader serves both capture front ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax.linen import linear as flax_linear

from kfac_jax.capture import probes as probes_lib
from kfac_jax.capture.layers import ConvGeometry, LayerSignature


def _broadcast(
  value: int | tuple[int, ...] | None, rank: int
) -> tuple[int, ...]:
  if value is None:
    return (1,) * rank
  if isinstance(value, int):
    return (value,) * rank
  return tuple(int(v) for v in value)


def as_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
  return (
    (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
  )


def conv_signature(
  module_type: str, module: Any, name: str, stack_ndim: int = 0
) -> LayerSignature:
  """A convolution's call, layer ``name``: its geometry as Flax applies it.

  Raises:
    ValueError: the conv has a ``mask``, which the factors cannot express.
  """
  if getattr(module, "mask", None) is not None:
    # Its masked kernel entries have no gradient, but A covers their input
    # rows: the update moved them, and the live entries got the Schur
    # complement of A, not the K-FAC of the layer as applied.
    raise ValueError(
      f"value_grad_and_stats: layer {name!r} ({module_type}) has a mask, "
      "which K-FAC's Kronecker factors do not express (the update would "
      "move the masked kernel entries); "
      f"{probes_lib.skip_advice(name)}."
    )
  window = as_tuple(module.kernel_size)
  rank = len(window)
  padding = flax_linear.canonicalize_padding(module.padding, rank)
  if not isinstance(padding, str):
    padding = tuple((int(lo), int(hi)) for lo, hi in padding)
  geometry = ConvGeometry(
    window=window,
    strides=_broadcast(module.strides, rank),
    padding=padding,
    input_dilation=_broadcast(module.input_dilation, rank),
    kernel_dilation=_broadcast(module.kernel_dilation, rank),
    feature_group_count=int(module.feature_group_count),
  )
  return LayerSignature(
    module_type, bool(module.use_bias), geometry, stack_ndim=stack_ndim
  )


def embed_signature(
  module_type: str, num_embeddings: int, stack_ndim: int = 0
) -> LayerSignature:
  """An embedding lookup: a dense layer on one-hot token ids."""
  return LayerSignature(
    module_type,
    False,
    input_axes=(),
    stack_ndim=stack_ndim,
    num_embeddings=int(num_embeddings),
  )


def dense_signature(
  module_type: str,
  use_bias: bool,
  inputs: jax.Array,
  axis: int | Sequence[int] = -1,
  features: int | Sequence[int] = 1,
  stack_ndim: int = 0,
) -> LayerSignature:
  """A dense call contracting the input's ``axis`` into ``features``."""
  axes = sorted(a % inputs.ndim for a in as_tuple(axis))
  return LayerSignature(
    module_type,
    bool(use_bias),
    input_axes=tuple(a - inputs.ndim for a in axes),
    output_ndim=len(as_tuple(features)),
    stack_ndim=stack_ndim,
  )
