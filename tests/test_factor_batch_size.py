"""``factor_batch_size``: batch factors from evenly spaced examples.

The reference is a second capture: the same model's loss on the sub-batch
alone (its own mean), whose factors must equal the subset's factors of the
whole batch's capture, for dense, convolution, ``DenseGeneral``, scanned and
embedding layers.
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

BATCH = 8
EXAMPLES = 3
STRIDE = BATCH // EXAMPLES  # examples 0, 2, 4
# A factor of the subset against one of the sub-batch's own capture
# (reference.assert_float32_close's ``terms``): a layer's inputs carry the
# forward contractions before it, its cotangents those and the backward
# ones (here at most the layers' contraction lengths, conv 3·2, general
# 6·4, dense 5; or the three scanned layers' 4), squared in the factor;
# then the sum over EXAMPLES rows of up to 6 positions.
CHAIN = {"conv_dense": 3 * 2 + 6 * 4 + 5, "scanned_on_embeddings": 3 * 4}
FACTOR_TERMS = {
  name: 2 * 2 * chain + EXAMPLES * 6 for name, chain in CHAIN.items()
}


class ConvDense(nn.Module):
  """Conv over [B, T, C], then DenseGeneral over (T, C), then Dense."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(4, (3,), name="conv")(x))
    h = jnp.tanh(nn.DenseGeneral(5, axis=(-2, -1), name="general")(h))
    return nn.Dense(3, name="dense")(h)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(4, name="dense")(x)), None


class ScannedOnEmbeddings(nn.Module):
  """Embed [B, T] tokens, then three scanned Dense layers (stack axis first)."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(7, 4, name="embed")(tokens)
    scanned = nn.scan(
      Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, _ = scanned(name="layers")(x, None)
    return x


def _problem(name):
  rng = np.random.default_rng(0)
  if name == "conv_dense":
    model = ConvDense()
    inputs = jnp.asarray(rng.normal(size=(BATCH, 6, 2)), jnp.float32)
  else:
    model = ScannedOnEmbeddings()
    inputs = jnp.asarray(rng.integers(0, 7, size=(BATCH, 5)), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), inputs)["params"]
  outputs = model.apply({"params": params}, inputs)
  targets = jnp.asarray(rng.normal(size=outputs.shape), jnp.float32)

  def loss_fn(params, inputs, targets):
    # A mean over the examples (and positions): the capture's convention.
    return jnp.mean((model.apply({"params": params}, inputs) - targets) ** 2)

  return params, loss_fn, inputs, targets


@pytest.mark.parametrize("name", ["conv_dense", "scanned_on_embeddings"])
def test_subset_factors_equal_the_sub_batch_loss_factors(name):
  params, loss_fn, inputs, targets = _problem(name)
  _, _, whole = kfac_jax.value_grad_and_stats(loss_fn)(params, inputs, targets)
  subset = slice(0, STRIDE * (EXAMPLES - 1) + 1, STRIDE)
  _, _, alone = kfac_jax.value_grad_and_stats(loss_fn)(
    params, inputs[subset], targets[subset]
  )
  assert set(whole) == set(alone) and len(whole) >= 2
  for layer in whole:
    # Fisher-scaled: both estimate (1/k) Σ ∇ℓᵢ ∇ℓᵢᵀ over the same examples,
    # whichever batch mean their cotangents came from.
    subset_factors = batch_lib.batch_factors(
      whole[layer], fisher_scaled=True, examples=EXAMPLES
    )
    alone_factors = batch_lib.batch_factors(alone[layer], fisher_scaled=True)
    for got, expected in zip(subset_factors, alone_factors):
      assert got.shape == expected.shape
      reference.assert_float32_close(
        got, expected, terms=FACTOR_TERMS[name], err_msg=layer
      )
    whole_factors = batch_lib.batch_factors(whole[layer], fisher_scaled=True)
    assert not np.allclose(
      np.asarray(whole_factors[1]), np.asarray(subset_factors[1])
    ), layer


def test_scale_by_kfac_takes_its_factors_from_the_subset():
  """KAISA's scale: A as the sub-batch's, G (k/B)² of it (cotangents ∇ℓ/B)."""
  params, loss_fn, inputs, targets = _problem("conv_dense")
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
    params, inputs, targets
  )
  decay = 0.5
  run = lambda size: jax.jit(
    kfac_jax.scale_by_kfac(
      factor_decay=decay, kl_clip=None, factor_batch_size=size
    ).update
  )(grads, kfac_jax.scale_by_kfac().init(params), params, kfac_stats=stats)
  updates, state = run(EXAMPLES)
  subset = slice(0, STRIDE * (EXAMPLES - 1) + 1, STRIDE)
  _, _, alone = kfac_jax.value_grad_and_stats(loss_fn)(
    params, inputs[subset], targets[subset]
  )
  for layer in ("conv", "dense"):
    activation, gradient = (f[0] for f in batch_lib.batch_factors(alone[layer]))
    factors = state.factors[layer]
    identity = lambda f: np.eye(f.shape[0])
    # The two captures' factors (FACTOR_TERMS), the decay's mix (2) and G's
    # scale (k/B)² (2), each entry on its two parts' magnitudes.
    terms = FACTOR_TERMS["conv_dense"] + 2 + 2
    for got, batch_part in (
      (factors.activation_factor, (1 - decay) * np.asarray(activation)),
      (
        factors.gradient_factor,
        (1 - decay) * (EXAMPLES / BATCH) ** 2 * np.asarray(gradient),
      ),
    ):
      expected = decay * identity(batch_part) + batch_part
      reference.assert_float32_close(
        got,
        expected,
        terms=terms,
        scale=reference.running_factor_scale(expected, decay),
      )
  # A size of at least the batch is every example: the default, exactly.
  default = run(None)
  for x, y in zip(jax.tree.leaves(run(2 * BATCH)), jax.tree.leaves(default)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.allclose(
    np.asarray(updates["dense"]["kernel"]),
    np.asarray(default[0]["dense"]["kernel"]),
  )


@pytest.mark.parametrize(
  "value, error",
  [(0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError)],
)
def test_bad_factor_batch_size_is_refused(value, error):
  with pytest.raises(error, match="factor_batch_size"):
    kfac_jax.scale_by_kfac(factor_batch_size=value)


def test_a_shared_layers_call_with_zero_cotangents_in_the_subset_still_counts():
  """A layer called twice whose second call's subset rows are padding (loss
  weight 0) but which reaches the loss through its other rows: its A is
  the sum of both calls' subset covariances (the subset's zero cotangents
  were read as a call that never reaches the loss, and its A was dropped)."""

  class Shared(nn.Module):
    @nn.compact
    def __call__(self, first, second):
      dense = nn.Dense(3, name="shared")
      return dense(first), dense(second)

  rng = np.random.default_rng(0)
  first, second = (
    jnp.asarray(rng.normal(size=(4, 5)), jnp.float32) for _ in range(2)
  )
  target = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  padding = jnp.array([0.0, 1.0, 0.0, 1.0])  # the subset is rows 0 and 2
  model = Shared()
  params = model.init(jax.random.PRNGKey(0), first, second)["params"]

  def loss_fn(p):
    a, b = model.apply({"params": p}, first, second)
    return jnp.mean(
      jnp.sum((a - target) ** 2, -1) + padding * jnp.sum((b - target) ** 2, -1)
    )

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  activation_factor, _ = batch_lib.batch_factors(stats["shared"], examples=2)
  with_bias = lambda x: np.concatenate(
    [np.asarray(x, np.float64)[[0, 2]], np.ones((2, 1))], 1
  )
  expected = sum(with_bias(x).T @ with_bias(x) / 2 for x in (first, second))
  # Each call's 2 rows' products summed, / 2, the two calls added.
  reference.assert_float32_close(
    activation_factor[0], expected, terms=2 + 1 + 1
  )
