"""``batch.inner_products`` / ``tree_inner_products`` (one pass for many pairs)
against float64 numpy, and the adaptive mode's products through them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax import linalg as batch
from tests import reference


def _reference(arrays, pairs):
  flat = [np.asarray(a, np.float64).ravel() for a in arrays]
  return np.array([flat[i] @ flat[j] for i, j in pairs])


@pytest.mark.parametrize(
  "pairs", [[(2, 1)], [(0, 0), (0, 1), (1, 2), (2, 0), (2, 2)]]
)
@pytest.mark.parametrize("shape", [(), (7,), (31, 5), (3, 4, 6), (1001, 784)])
def test_every_pair_matches_float64_under_jit(shape, pairs):
  rng = np.random.default_rng(len(shape))
  arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
  got = jax.jit(lambda arrays: batch.inner_products(arrays, pairs))(arrays)
  want = _reference(arrays, pairs)
  assert got.shape == (len(pairs),) and got.dtype == jnp.float32
  # float32 summation of n products: relative to Σ|products|, the error
  # grows with n (3.7e-4 measured at n = 784,784).
  magnitude = _reference([np.abs(a) for a in arrays], pairs)
  tolerance = 1e-6 + 2e-3 * np.sqrt(max(np.prod(shape), 1) / 784784)
  np.testing.assert_allclose(
    np.asarray(got), want, rtol=0, atol=tolerance * magnitude.max()
  )


@pytest.mark.parametrize("pairs", [[(0, 1)], [(0, 1), (1, 1)]])
def test_low_precision_inputs_are_multiplied_in_float32(pairs):
  # (1 + 2⁻⁷)² = 1 + 2⁻⁶ + 2⁻¹⁴ is exact in float32 (as is the sum of four),
  # not in bfloat16, which rounds it to 1 + 2⁻⁶. One pair and several take
  # different paths.
  value = 1 + 2.0**-7
  arrays = [
    jnp.full((2, 2), value, jnp.bfloat16),
    jnp.full((2, 2), value, jnp.float32),
  ]
  got = batch.inner_products(arrays, pairs)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), [4 * value**2] * len(pairs))


def test_tree_sums_over_leaves_of_mixed_shapes():
  rng = np.random.default_rng(0)

  def tree():
    return {
      "dense": {
        "kernel": rng.standard_normal((5, 3)),
        "bias": rng.standard_normal(3),
      },
      "scale": [rng.standard_normal(()), rng.standard_normal((2, 2, 2))],
    }

  trees = [
    jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree())
    for _ in range(3)
  ]
  pairs = [(0, 1), (1, 1), (2, 0)]
  got = batch.tree_inner_products(trees, pairs)
  flat = [[np.asarray(x) for x in jax.tree.leaves(t)] for t in trees]
  want = sum(_reference(leaves, pairs) for leaves in zip(*flat))
  # Sums of 15 + 3 + 1 + 8 products, each of the magnitude of its terms.
  magnitude = sum(
    _reference([np.abs(x) for x in leaves], pairs) for leaves in zip(*flat)
  )
  reference.assert_float32_close(got, want, terms=27, scale=magnitude.max())


def test_trees_with_different_leaf_counts_are_refused():
  x = jnp.ones(3)
  with pytest.raises(ValueError):
    batch.tree_inner_products([{"a": x}, {"a": x, "b": x}], [(0, 1)])


def test_several_pairs_over_millions_of_terms_sum_rows_first():
  # One running float32 sum over the 2.8M products of a 2000 × 1400 kernel
  # drifted by 6.5e-4 relative (n·ε over the few accumulators XLA keeps);
  # the row sums and then their sum stay within ~1e-6.
  rng = np.random.default_rng(5)
  arrays = [
    rng.uniform(0.5, 1.5, (2000, 1400)).astype(np.float32) for _ in range(2)
  ]
  pairs = [(0, 0), (0, 1)]
  got = jax.jit(lambda arrays: batch.inner_products(arrays, pairs))(arrays)
  # Positive products (no cancellation): sums of 1400 and then of 2000,
  # counted as random rounding (√n each; the worst case, 3400·ε = 4e-4,
  # would not tell them from the running sum).
  want = _reference(arrays, pairs)
  reference.assert_float32_close(got, want, terms=np.sqrt(1400) + np.sqrt(2000))
