"""``inverse.damped_inverse``: the blocked Cholesky inverse against float64
numpy, across block boundaries, under ``jit`` and ``vmap``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax.preconditioning import inverse
from tests import reference

DAMPING = 0.1
BLOCK = inverse.INVERSE_BLOCK_SIZE


def _spd(size: int, seed: int = 0) -> np.ndarray:
  x = np.random.default_rng(seed).standard_normal((2 * size, size))
  return (x.T @ x / (2 * size)).astype(np.float32)


# One block; two blocks, one a row longer; three uneven blocks; four (the
# autoencoder's 1001 rows at the default block size).
@pytest.mark.parametrize(
  "size", [1, 7, BLOCK, 2 * BLOCK + 1, 3 * BLOCK - 49, 4 * BLOCK + 1]
)
def test_matches_float64_numpy_across_block_boundaries(size):
  factor = _spd(size)
  (result,) = jax.jit(inverse.damped_inverse)(factor, jnp.float32(DAMPING))
  reference.assert_damped_inverse(result, factor, DAMPING)


def test_stacked_factors_under_vmap():
  factors = np.stack([_spd(2 * BLOCK + 3, seed) for seed in range(3)])
  (results,) = jax.jit(jax.vmap(inverse.damped_inverse, in_axes=(0, None)))(
    factors, jnp.float32(DAMPING)
  )
  for factor, result in zip(factors, results):
    reference.assert_damped_inverse(result, factor, DAMPING)


def test_a_factor_that_is_not_positive_definite_gives_nan_in_every_block():
  # are_finite reads only the diagonal, so every block's diagonal must be NaN.
  factor = -np.eye(2 * BLOCK + 1, dtype=np.float32)
  (result,) = jax.jit(inverse.damped_inverse)(factor, jnp.float32(DAMPING))
  assert np.isnan(np.diagonal(result)).all()
  assert not inverse.are_finite(
    [inverse.InversePreconditioner(result, result)]
  )[0]
