"""KFAC-reduce and KFAC-expand against their definitions (Eschenhagen et al.
2023), in float64 from the captured layer tensors' own formulas.

A layer sharing its weights over ``R`` positions per example (a Dense on
``[B, T, d]``, a convolution's output positions) has, per example ``n``,
inputs ``a_{n,r}`` and output cotangents ``g_{n,r}``. Expand: every position
a row, ``A = cov(a)`` and ``G = cov(g)`` over the ``B·R`` rows. Reduce:
``â_n = mean_r a_{n,r}``, ``ĝ_n = Σ_r g_{n,r}``, ``A = cov(â)``,
``G = cov(ĝ)`` over the ``B`` examples.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax.factors import batch as batch_lib
from tests import reference

close = reference.assert_float32_close
B, T, IN, OUT = 4, 6, 5, 3


class SequenceModel(nn.Module):
  """A Dense applied to every position of ``[B, T, IN]``, then a linear head."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(OUT, name="shared")(x)


def _sequence_problem():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(B, T, IN)), jnp.float32)
  targets = jnp.asarray(rng.normal(size=(B, T, OUT)), jnp.float32)
  model = SequenceModel()
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(params):
    return jnp.mean((model.apply({"params": params}, x) - targets) ** 2)

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  kernel = np.asarray(params["shared"]["kernel"], np.float64)
  bias = np.asarray(params["shared"]["bias"], np.float64)
  x64 = np.asarray(x, np.float64)
  outputs = x64 @ kernel + bias
  # d/dy of mean((y − t)²) over the B·T·OUT entries.
  cotangents = 2 * (outputs - np.asarray(targets, np.float64)) / outputs.size
  inputs = np.concatenate([x64, np.ones((B, T, 1))], axis=-1)
  return stats["shared"], inputs, cotangents


def test_reduce_of_dense_on_sequences_means_inputs_and_sums_cotangents():
  stats, inputs, cotangents = _sequence_problem()
  (a,), (g,) = batch_lib.batch_factors(stats, reduce=True)
  mean_inputs = inputs.mean(axis=1)  # â_n, [B, IN + 1]
  summed_cotangents = cotangents.sum(axis=1)  # ĝ_n, [B, OUT]
  # Roundings: the mean of T positions and A's product of B rows, / B; the
  # cotangent's dot of IN, the bias, the difference, then ĝ's sum of T and
  # G's product of B rows.
  close(a, reference.cov(mean_inputs), terms=T + B + 1)
  close(
    g,
    reference.cov(summed_cotangents),
    terms=IN + 1 + 1 + 1 + T + B + 1,
    scale=np.abs(summed_cotangents).max() ** 2,
  )


def test_expand_of_a_dense_on_sequences_treats_every_position_as_a_row():
  stats, inputs, cotangents = _sequence_problem()
  (a,), (g,) = batch_lib.batch_factors(stats)  # expand, the default
  rows = inputs.reshape(B * T, -1)
  grad_rows = cotangents.reshape(B * T, -1)
  close(a, reference.cov(rows), terms=B * T + 1)
  close(
    g,
    reference.cov(grad_rows),
    terms=IN + 1 + 1 + 1 + B * T + 1,
    scale=np.abs(grad_rows).max() ** 2,
  )


@pytest.mark.parametrize("use_bias", [True, False])
def test_reduce_of_a_convolution_averages_patches_and_sums_cotangents(use_bias):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, 5, 5, 2)), jnp.float32)
  conv = nn.Conv(4, (3, 3), padding=((1, 1), (1, 1)), use_bias=use_bias)
  params = conv.init(jax.random.key(1), x)["params"]
  weights = jnp.asarray(rng.normal(size=(3, 5, 5, 4)), jnp.float32)

  def loss_fn(params):
    return jnp.sum(conv.apply({"params": params}, x) * weights) / 3

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  (a,), (g,) = batch_lib.batch_factors(next(iter(stats.values())), reduce=True)
  patches = reference.im2col(
    np.asarray(x, np.float64), (3, 3), (1, 1), ((1, 1), (1, 1))
  )  # [3, 5, 5, 18]
  mean_patches = patches.reshape(3, 25, -1).mean(axis=1)
  if use_bias:
    mean_patches = np.concatenate([mean_patches, np.ones((3, 1))], axis=1)
  # The loss is linear: its output cotangent is weights / 3, exactly.
  summed = (np.asarray(weights, np.float64) / 3).reshape(3, 25, 4).sum(1)
  close(a, reference.cov(mean_patches), terms=25 + 3 + 1)
  close(
    g,
    reference.cov(summed),
    terms=1 + 25 + 3 + 1,
    scale=np.abs(summed).max() ** 2,
  )


def test_reduce_leaves_a_layer_without_shared_positions_as_expand():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(7, IN)), jnp.float32)
  model = nn.Dense(OUT)
  params = model.init(jax.random.key(2), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  layer = next(iter(stats.values()))
  for reduced, expanded in zip(
    batch_lib.batch_factors(layer, reduce=True), batch_lib.batch_factors(layer)
  ):
    np.testing.assert_array_equal(reduced, expanded)


def test_reduce_gives_scale_by_kfac_the_reduced_factors():
  stats, inputs, cotangents = _sequence_problem()
  params = SequenceModel().init(jax.random.key(0), inputs[..., :IN])["params"]
  grads = jax.tree.map(jnp.ones_like, params)
  tx = kfac_jax.scale_by_kfac(
    weight_sharing="reduce", factor_decay=0.0, kl_clip=None
  )
  _, state = tx.update(
    grads, tx.init(params), params, kfac_stats={"shared": stats}
  )
  factors = state.factors["shared"]
  close(
    factors.activation_factor,
    reference.cov(inputs.mean(axis=1)),
    terms=T + B + 1,
  )
  summed = cotangents.sum(axis=1)
  close(
    factors.gradient_factor,
    reference.cov(summed),
    terms=IN + 1 + 1 + 1 + T + B + 1,
    scale=np.abs(summed).max() ** 2,
  )


def test_weight_sharing_must_be_expand_or_reduce():
  with pytest.raises(ValueError, match="weight_sharing='mean'.*'expand'"):
    kfac_jax.scale_by_kfac(weight_sharing="mean")


def test_a_fractional_factor_batch_size_keeps_that_share_of_the_examples():
  stats, _, _ = _sequence_problem()
  (half,), _ = batch_lib.batch_factors(stats, examples=0.5)
  (two,), _ = batch_lib.batch_factors(stats, examples=2)
  np.testing.assert_array_equal(half, two)  # round(0.5 · 4) = 2 examples
  with pytest.raises(TypeError, match="factor_batch_size.*fraction"):
    kfac_jax.scale_by_kfac(factor_batch_size=1.5)
