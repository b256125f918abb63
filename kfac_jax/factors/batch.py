"""Batch Kronecker factors from captured layer tensors (KAISA's conventions).

With ``cov(x) = xᵀx / N`` and ``N`` the rows of ``x``, per Kronecker block
(``capture.layers``):

* Dense / DenseGeneral: ``a`` = the input with its contracted axes flattened
  last, ``[N, prod(contracted)]`` (a ones column appended for a bias),
  ``g = cotangent.reshape(N, prod(output))``; ``A = cov(a)``, ``G = cov(g)``.
* Conv: ``a`` = patches ``[B·S, prod(window)·in/g]`` in ``(*window, in/g)``
  order of one group's input channels, ones column appended for a bias, the
  whole matrix divided by ``S`` (output positions); ``g`` = that group's
  output channels of the cotangent, ``[B·S, out/g] / S``.
* Embed: the lookup is a dense layer on one-hot token ids, so
  ``A = diag(counts) / N`` (token frequencies; kept dense ``[vocab, vocab]``)
  and ``G`` as for a dense layer.
* Scanned layers: the same for each slice of the leading stack axes.

Weight sharing (``reduce``): a dense layer applied to ``[B, T..., in]`` (the
positions of a sequence) or a convolution (its output positions) shares its
weights over ``R`` positions per example. The rows above treat every
position as an example (KFAC-expand). KFAC-reduce (Eschenhagen et al.
2023) gives each example one row instead, ``â_n = (1/R) Σ_r a_{n,r}`` and
``ĝ_n = Σ_r g_{n,r}`` (inputs averaged, cotangents summed; a convolution's
without KAISA's ``1/S``), so ``A = cov(â)`` and ``G = cov(ĝ)`` over the
``B`` examples: ``R`` times fewer rows in the factor products. Embeddings
keep their rows.

A layer called several times contributes the sum of its calls' factors;
of those calls, one whose output does not reach the loss (all its
cotangents zero) contributes none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.capture.layers import LayerSignature
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.factors.patches import conv_patches
from kfac_jax.linalg import COMPUTE_DTYPE, contract_rows


def covariance(rows: jax.Array) -> jax.Array:
  """``rowsᵀ rows / N`` for ``rows: [..., N, d]``: ``[..., d, d]``, float32.

  Not symmetrized here: that is a pass over every factor on every factor
  step, comparable to the product itself when d ≈ N; ``eigh`` and the inverse
  method's Cholesky read one triangle, and the subspace solver symmetrizes
  what it refines.
  """
  rows = rows.astype(COMPUTE_DTYPE)
  return contract_rows(rows, rows) / rows.shape[-2]


def _shared_axes(tensor: jax.Array, trailing: int) -> tuple[int, ...]:
  """The weight-sharing axes of a slice ``[B, R..., *features]`` whose last
  ``trailing`` axes are features: those between the example axis and them."""
  return tuple(range(1, tensor.ndim - trailing))


def activation_rows(
  inputs: jax.Array, signature: LayerSignature, reduce: bool = False
) -> jax.Array:
  """Rows ``a`` of each group of a layer slice: ``[groups, N, activation_dim]``.

  ``reduce``: one row per example, the mean over its shared positions
  (KFAC-reduce, module docstring).
  """
  if signature.conv is None:
    contracted = tuple(range(-len(signature.input_axes), 0))
    rows = jnp.moveaxis(inputs, signature.input_axes, contracted)
    if reduce:
      rows = jnp.mean(
        rows.astype(COMPUTE_DTYPE), axis=_shared_axes(rows, len(contracted))
      )
    rows = rows.reshape(
      1, -1, math.prod(rows.shape[rows.ndim - len(contracted) :])
    )
    scale = 1
  else:
    groups = signature.conv.feature_group_count
    # [..., in] -> [groups, ..., in / groups]: lax splits channels contiguously.
    split = inputs.reshape(inputs.shape[:-1] + (groups, -1))
    patches = jax.vmap(conv_patches, in_axes=(-2, None))(split, signature.conv)
    scale = math.prod(patches.shape[2:-1])
    if reduce:
      patches = jnp.mean(
        patches.astype(COMPUTE_DTYPE), axis=tuple(range(2, patches.ndim - 1))
      )
      scale = 1
    rows = patches.reshape(groups, -1, patches.shape[-1])
  rows = rows.astype(COMPUTE_DTYPE)
  if signature.has_bias:
    # ones_like keeps the rows' sharding (needed on Explicit mesh axes).
    rows = jnp.concatenate([rows, jnp.ones_like(rows[..., :1])], axis=-1)
  return rows / scale if scale != 1 else rows


def token_frequencies(
  token_ids: jax.Array, signature: LayerSignature
) -> jax.Array:
  """``A = cov(one_hot(ids)) = diag(counts / N)`` of a slice: ``[1, V, V]``."""
  ids = token_ids.reshape(-1).astype(jnp.int32)
  counts = jnp.zeros((signature.num_embeddings,), COMPUTE_DTYPE).at[ids].add(1)
  return jnp.diag(counts / ids.shape[0])[None]


def gradient_rows(
  output_cotangents: jax.Array, signature: LayerSignature, reduce: bool = False
) -> jax.Array:
  """Rows ``g`` of each group of a layer slice: ``[groups, N, gradient_dim]``.

  ``reduce``: one row per example, the sum over its shared positions
  (KFAC-reduce, module docstring).
  """
  conv = signature.conv
  if reduce:
    # A convolution's features are its channels; its positions are shared.
    trailing = signature.output_ndim if conv is None else 1
    output_cotangents = jnp.sum(
      output_cotangents.astype(COMPUTE_DTYPE),
      axis=_shared_axes(output_cotangents, trailing),
    )
  if conv is None:
    features = math.prod(output_cotangents.shape[-signature.output_ndim :])
    return output_cotangents.reshape(1, -1, features).astype(COMPUTE_DTYPE)
  groups = conv.feature_group_count
  spatial_size = (
    1
    if reduce
    else math.prod(output_cotangents.shape[-1 - len(conv.window) : -1])
  )
  # Merge, then split: sharding rules allow one kind of change per reshape.
  rows = output_cotangents.reshape(-1, output_cotangents.shape[-1])
  rows = rows.reshape(rows.shape[0], groups, -1)
  return jnp.swapaxes(rows, 0, 1).astype(COMPUTE_DTYPE) / spatial_size


def _per_block(
  rows_fn: Callable[[jax.Array, LayerSignature], jax.Array],
  tensor: jax.Array,
  signature: LayerSignature,
) -> jax.Array:
  """``rows_fn`` over each stack slice: ``[prod(stack) * groups, N, d]``."""
  if signature.stack_ndim == 0:
    return rows_fn(tensor, signature)
  slices = tensor.reshape((-1,) + tensor.shape[signature.stack_ndim :])
  rows = jax.vmap(rows_fn, in_axes=(0, None))(slices, signature)
  return rows.reshape((-1,) + rows.shape[2:])


def fisher_scales(
  output_cotangent: jax.Array, signature: LayerSignature, reduce: bool = False
) -> tuple[float, float]:
  """``(A scale, G scale)`` that bring one call's factors to the Fisher's.

  The captured cotangents are those of a loss averaged over the ``N`` rows
  (examples, or tokens), ``c = ∇ℓ / N``, so for a dense layer ``A ⊗ N²G``
  is K-FAC's estimate of that loss's Fisher ``(1/N) Σ ∇ℓ ∇ℓᵀ``: ``(1, N²)``.
  A convolution with ``T`` output positions (``N = B·T`` rows) has both of
  KAISA's factors divided by ``T`` (``A = Ω/T²``, ``G = Γ/(B²T²)`` with
  ``Ω``, ``Γ`` the per-position covariances of inputs and of ``∇ℓ``), while
  KFC's estimate is ``Ω ⊗ TΓ``: ``(T², N²T)``. KFAC-reduce's rows
  (``reduce``) of ``B`` examples: ``(1, B²)``.
  """
  stack = signature.stack_ndim
  if reduce:
    # ∇ℓ_n = Σ_r a_r (B·c_r)ᵀ ≈ â_n (B·ĝ_n)ᵀ for the n-th of B examples.
    trailing = (
      signature.output_ndim
      if signature.conv is None
      else (len(signature.conv.window) + 1)
    )
    examples = (
      output_cotangent.shape[stack]
      if output_cotangent.ndim > stack + trailing
      else 1
    )
    return 1.0, float(examples) ** 2
  if signature.conv is None:
    rows = math.prod(
      output_cotangent.shape[
        stack : output_cotangent.ndim - signature.output_ndim
      ]
    )
    return 1.0, float(rows) ** 2
  positions = math.prod(
    output_cotangent.shape[-1 - len(signature.conv.window) : -1]
  )
  rows = math.prod(output_cotangent.shape[stack:-1])
  return float(positions) ** 2, float(rows) ** 2 * positions


def example_subset(
  tensor: jax.Array, axis: int | None, examples: int | float | None
) -> jax.Array:
  """``examples`` evenly spaced entries of ``tensor`` along its ``axis``.

  Entries ``0, s, 2s, …`` with stride ``s = ⌊B / examples⌋`` are kept, rather
  than the first ``examples``: on a batch-sharded array, each device then
  keeps an equal share of its own rows and nothing moves between devices.
  A float ``examples`` in (0, 1) is a fraction: ``max(1, round(f·B))``.
  ``examples`` None or ``≥ B``, or ``axis`` None: unchanged.
  """
  if examples is None or axis is None:
    return tensor
  if isinstance(examples, float):
    examples = max(1, round(examples * tensor.shape[axis]))
  if examples >= tensor.shape[axis]:
    return tensor
  stride = tensor.shape[axis] // examples
  return lax.slice_in_dim(
    tensor, 0, stride * (examples - 1) + 1, stride=stride, axis=axis
  )


def _example_axis(
  tensor: jax.Array, signature: LayerSignature, is_input: bool
) -> int | None:
  """The example axis of a captured tensor (the first after the stack axes).

  None when that axis is a feature axis (a ``DenseGeneral`` contracting it,
  or a tensor without batch axes).
  """
  axis = signature.stack_ndim
  if is_input and signature.conv is None:
    # Token ids have no feature axis; DenseGeneral's may be anywhere.
    features = (
      {a % tensor.ndim for a in signature.input_axes}
      if signature.num_embeddings is None
      else set()
    )
  else:
    trailing = (
      signature.output_ndim
      if signature.conv is None
      else len(signature.conv.window) + 1
    )  # [*spatial, channels]
    features = set(range(tensor.ndim - trailing, tensor.ndim))
  return None if axis >= tensor.ndim or axis in features else axis


def _calls(
  stats: LayerStatistics,
  fisher_scaled: bool,
  examples: int | float | None,
  reduce: bool,
) -> tuple[list[jax.Array], list[jax.Array], list[tuple[float, float]]]:
  """Per call: the inputs and cotangents ``batch_factors`` reads (their
  ``example_subset``) and the ``(A, G)`` scales it gives them."""
  signature = stats.signature
  scales = [
    fisher_scales(g, signature, reduce) if fisher_scaled else (1.0, 1.0)
    for g in stats.output_cotangents
  ]
  inputs = [
    example_subset(x, _example_axis(x, signature, True), examples)
    for x in stats.inputs
  ]
  cotangents = [
    example_subset(g, _example_axis(g, signature, False), examples)
    for g in stats.output_cotangents
  ]
  return inputs, cotangents, scales


def dense_calls(
  stats: LayerStatistics,
  fisher_scaled: bool = False,
  examples: int | float | None = None,
  reduce: bool = False,
) -> list[tuple[jax.Array, jax.Array, float]]:
  """Per call of a dense layer, the rows of ``batch_factors``' A and G.

  Returns:
    ``[(a [blocks, N, dA], g [blocks, N, dG], scale)]``, one entry per call,
    with ``A = Σ_calls s_A·aᵀa/N``, ``G = Σ_calls s_G·gᵀg/N`` and
    ``scale = s_A·s_G``.
  """
  signature = stats.signature
  inputs, cotangents, scales = _calls(stats, fisher_scaled, examples, reduce)
  rows_of = _rows_functions(signature, reduce)
  return [
    (
      _per_block(rows_of[0], x, signature),
      _per_block(rows_of[1], g, signature),
      a_scale * g_scale,
    )
    for x, g, (a_scale, g_scale) in zip(inputs, cotangents, scales)
  ]


def _rows_functions(signature: LayerSignature, reduce: bool):
  """``(activation_rows, gradient_rows)``, reduced for a weight-sharing layer
  under KFAC-reduce (embeddings keep their rows)."""
  if not reduce or signature.num_embeddings is not None:
    return activation_rows, gradient_rows
  return (
    functools.partial(activation_rows, reduce=True),
    functools.partial(gradient_rows, reduce=True),
  )


def batch_factors(
  stats: LayerStatistics,
  fisher_scaled: bool = False,
  examples: int | float | None = None,
  reduce: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """``(A [blocks, dA, dA], G [blocks, dG, dG])`` of a batch, summed over calls.

  ``fisher_scaled`` scales each call's factors by ``fisher_scales``, so that
  ``A ⊗ G`` estimates the Fisher of the mean loss rather than KAISA's
  ``1/N²`` of it (whose damping values assume the latter).

  ``examples``: the factors of ``examples`` of the batch's ``B`` examples
  (``example_subset``), e.g. Martens & Grosse's curvature mini-batch: the
  factor products cost ``examples / B`` of the whole batch's. Each
  covariance divides by its own rows, and the Fisher scales are those of the
  whole batch's loss, so the factors estimate the same ``A`` and ``G``.

  ``reduce``: KFAC-reduce's rows for weight-sharing layers (module
  docstring); else KFAC-expand's.
  """
  signature = stats.signature
  inputs, cotangents, scales = _calls(stats, fisher_scaled, examples, reduce)
  activation_rows_of, gradient_rows_of = _rows_functions(signature, reduce)
  rows = [_per_block(gradient_rows_of, g, signature) for g in cotangents]
  gradient_factor = sum(
    covariance(g) * scale for g, (_, scale) in zip(rows, scales)
  )
  if signature.num_embeddings is not None:
    activations = [
      _per_block(token_frequencies, ids, signature) for ids in inputs
    ]
  else:
    activations = [
      covariance(_per_block(activation_rows_of, x, signature)) * scale
      for x, (scale, _) in zip(inputs, scales)
    ]
  if len(rows) > 1:
    # A call whose output does not reach the loss (stop_gradient, a target
    # computed with the layer) gets zero cotangents, and its inputs come out
    # zeros (``probes.reveal_input``'s backward pass never runs): its bias
    # column, or token 0, would still enter A. Such a call adds nothing.
    # Judged on all its rows: a subset can hold only zero-cotangent rows
    # (padding) of a call that reaches the loss.
    reached = (
      rows
      if examples is None
      else [
        _per_block(gradient_rows_of, g, signature)
        for g in stats.output_cotangents
      ]
    )
    activations = [
      factor * jnp.any(g != 0, axis=(1, 2))[:, None, None].astype(factor.dtype)
      for factor, g in zip(activations, reached)
    ]
  # A captured layer has calls: sum's start 0 meets arrays.
  return cast(jax.Array, sum(activations)), cast(jax.Array, gradient_factor)


def gradient_rows_of_dense(
  stats: LayerStatistics,
) -> tuple[jax.Array, jax.Array]:
  """``(a [blocks, N, dA], g [blocks, N, dG])`` with ``∇_b = a_bᵀ g_b``.

  For a dense layer (``Dense``, ``DenseGeneral``, scanned or not) the rows of
  ``A`` and ``G`` (``activation_rows``, ``gradient_rows``, unscaled) are also
  the factors of the gradient of the loss the stats were captured from:
  ``∇ = Σ_n a_n g_nᵀ``. The calls' rows are concatenated (``N`` = all of
  them), as their gradients add up.
  """
  signature = stats.signature
  if signature.conv is not None or signature.num_embeddings is not None:
    raise ValueError(
      f"gradient_rows_of_dense: a {signature.module_type} layer's gradient "
      "is not the product of its captured rows; only dense layers' is."
    )
  activation = [_per_block(activation_rows, x, signature) for x in stats.inputs]
  gradient = [
    _per_block(gradient_rows, g, signature) for g in stats.output_cotangents
  ]
  return (
    jnp.concatenate(activation, axis=1),
    jnp.concatenate(gradient, axis=1),
  )
