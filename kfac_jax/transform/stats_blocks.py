"""What ``update`` reads from the captured statistics, block by block.

The batch Kronecker factors (``stats_factors``), EKFAC's batch scaling in
the eigenbases (``stats_scales``), the dense layers' gradients kept as
``aᵀg`` where that form is cheaper (``factored_gradients``), and the
layers whose kernel the params' specs shard (``sharded_kernels``), each
keyed by the state's block names (``LayerInfo.block_names``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from kfac_jax.capture import layers as layers_lib
from kfac_jax.capture.layers import LayerInfo
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.distribution import sharding
from kfac_jax.factors import batch as batch_lib
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import ekfac
from kfac_jax.preconditioning.eigen import EigenPreconditioner
from kfac_jax.preconditioning.gradient_matrix import (
  FactoredGradient,
  factored_is_cheaper,
)
from kfac_jax.transform.config import KFACConfig

Blocks = dict[str, jax.Array]


def row_options(config: KFACConfig) -> dict[str, Any]:
  """How the configuration reads the statistics' rows: Fisher-scaled in
  the adaptive mode, from ``factor_batch_size`` examples, positions
  reduced under KFAC-reduce (``factors.batch``)."""
  return dict(
    fisher_scaled=config.adaptive is not None,
    examples=config.factor_batch_size,
    reduce=config.reduce,
  )


def stats_scales(
  config: KFACConfig,
  stats: Mapping[str, LayerStatistics],
  layers: Mapping[str, LayerInfo],
  active: Sequence[str],
  preconditioners: Mapping[str, EigenPreconditioner],
) -> Blocks:
  """EKFAC's batch ``{block: S_batch}`` of ``active`` in ``preconditioners``'
  eigenbases, from the rows of the batch factors (``factors.batch``)."""
  blocks = {}
  for name in active:
    calls = batch_lib.dense_calls(stats[name], **row_options(config))
    for index, block in enumerate(layers[name].block_names):
      blocks[block] = ekfac.batch_scales(
        [(a[index], g[index], scale) for a, g, scale in calls],
        preconditioners[block],
      )
  return blocks


def stats_factors(
  config: KFACConfig,
  stats: Mapping[str, LayerStatistics],
  layers: Mapping[str, LayerInfo],
  active: Sequence[str],
) -> dict[str, LayerFactors]:
  """The batch factors ``{block: LayerFactors}`` of ``active`` from the
  captured stats (``factors.batch.batch_factors``)."""
  blocks = {}
  for name in active:
    factors = batch_lib.batch_factors(stats[name], **row_options(config))
    blocks.update(
      (block, LayerFactors(a, g))
      for block, a, g in zip(layers[name].block_names, *factors)
    )
  return blocks


def sharded_kernels(
  layers: Mapping[str, LayerInfo], params_specs: Any
) -> dict[str, tuple[str, ...]]:
  """``{layer: mesh axes}`` of the layers whose kernel spec shards it."""
  sharded = {}
  for name, layer in layers.items():
    if layer.num_blocks > 1:
      continue  # its blocks are sliced from the whole gradient.
    spec = layers_lib.get_layer_params(params_specs, layer)[layer.kernel_key]
    axes = tuple(sharding.named_axes(spec or PartitionSpec()))
    if axes:
      sharded[name] = axes
  return sharded


def factored_gradients(
  stats: Mapping[str, LayerStatistics],
  layers: Mapping[str, LayerInfo],
  active: Sequence[str],
  sharded: Mapping[str, tuple[str, ...]],
) -> dict[str, FactoredGradient]:
  """``{block: aᵀg}`` of the dense layers for which that form is cheaper.

  Decided per layer from static shapes (``factored_is_cheaper``); sharded
  kernels keep the dense form, which ``precondition_in_place`` needs.
  """
  factored = {}
  for name in active:
    layer, signature = layers[name], stats[name].signature
    if (
      name in sharded
      or signature.conv is not None
      or signature.num_embeddings is not None
    ):
      continue
    activation, gradient = batch_lib.gradient_rows_of_dense(stats[name])
    if factored_is_cheaper(
      activation.shape[1], layer.activation_dim, layer.gradient_dim
    ):
      factored.update(
        (block, FactoredGradient(a, g))
        for block, a, g in zip(layer.block_names, activation, gradient)
      )
  return factored
