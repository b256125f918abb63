"""Finiteness checks: ``finite.all_finite`` / ``leaves_finite`` (exact for
NaN/±Inf entries at any size; a float32 sum overflow counts as non-finite) and
the O(d) checks of PSD matrices from their diagonals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax import finite
from kfac_jax import linalg as batch
from kfac_jax.preconditioning import inverse
from tests import reference


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_element_anywhere_is_caught(bad):
  tree = {"a": jnp.ones((3, 4)), "b": [jnp.zeros(5), jnp.ones((2, 2))]}
  assert bool(finite.all_finite(tree))
  for path in (("a",), ("b", 0), ("b", 1)):
    leaf = tree[path[0]] if len(path) == 1 else tree[path[0]][path[1]]
    poisoned = leaf.reshape(-1).at[-1].set(bad).reshape(leaf.shape)
    broken = jax.tree.map(lambda x: x, tree)
    if len(path) == 1:
      broken[path[0]] = poisoned
    else:
      broken[path[0]][path[1]] = poisoned
    assert not bool(finite.all_finite(broken)), path


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("size", [31, 256, 1001])
def test_large_arrays_are_checked_entry_by_entry_under_jit(bad, size):
  # On XLA:CPU a max/min reduction of a large array drops NaN (YNNPACK); the
  # checks must not. Reference: numpy's elementwise isfinite, leaf by leaf.
  rng = np.random.default_rng(size)
  leaves = [
    rng.standard_normal((size, size)).astype(np.float32),
    np.ones((size,), np.float32),
    np.arange(3),
  ]
  for position in [(0, 0), (size // 2, size // 3), (size - 1, size - 1)]:
    poisoned = [leaf.copy() for leaf in leaves]
    poisoned[0][position] = bad
    expected = [np.isfinite(leaf).all() for leaf in poisoned]
    np.testing.assert_array_equal(
      jax.jit(finite.leaves_finite)(poisoned), expected
    )
    assert not bool(jax.jit(finite.all_finite)(poisoned)), position
  np.testing.assert_array_equal(
    jax.jit(finite.leaves_finite)(leaves), [True, True, True]
  )
  assert bool(jax.jit(finite.all_finite)(leaves))


def test_sum_overflow_is_the_one_false_alarm():
  big = jnp.full((4,), 1e38, jnp.float32)
  assert bool(jax.jit(finite.all_finite)(big[:3]))  # 3e38 < float32 max
  assert bool(finite.all_finite([big[:2], -big[:3]]))  # total -1e38
  assert not bool(jax.jit(finite.all_finite)(big))  # 4e38 overflows
  np.testing.assert_array_equal(
    finite.leaves_finite([big[:3], big]), [True, False]
  )


def test_low_precision_integer_and_empty_trees():
  assert bool(
    finite.all_finite(
      {"half": jnp.full((3,), 6e4, jnp.float16), "ids": jnp.arange(3)}
    )
  )
  assert not bool(finite.all_finite(jnp.array([1.0, jnp.inf], jnp.bfloat16)))
  assert bool(finite.all_finite({"ids": jnp.arange(3)}))
  assert bool(finite.all_finite({}))


def test_complex_leaves_are_checked_in_both_parts():
  z = jnp.ones((3,), jnp.complex64)
  assert bool(finite.all_finite(z))
  assert not bool(finite.all_finite(z.at[1].set(complex(1.0, np.inf))))
  assert not bool(finite.all_finite(z.at[2].set(complex(np.nan, 0.0))))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_psd_check_reads_a_bad_column_off_the_diagonal(bad):
  # One bad entry of x poisons its column's diagonal entry of xᵀx, and the
  # O(d) check agrees with the elementwise one.
  x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
  covariances = [jnp.asarray(x.T @ x / 6), jnp.eye(3)]
  assert bool(batch.psd_all_finite(covariances))
  x[2, 1] = bad
  with np.errstate(invalid="ignore", over="ignore"):
    poisoned = jnp.asarray(x.T @ x / 6)
  assert not bool(finite.all_finite(poisoned))
  assert not bool(batch.psd_all_finite([poisoned, jnp.eye(3)]))
  assert bool(batch.psd_all_finite([]))


def test_diagonal_sums_are_each_matrix_trace_and_keep_a_nan_to_its_own():
  # Sizes below, at and past the 128-entry rows the sums are taken in.
  rng = np.random.default_rng(1)
  matrices = [
    rng.standard_normal((d, d)).astype(np.float32) for d in (3, 128, 300)
  ]
  sums = jax.jit(batch.diagonal_sums)(matrices)
  # A sum of d entries: at most d roundings, of Σ|M_ii| each.
  for result, matrix in zip(np.asarray(sums), matrices):
    reference.assert_float32_close(
      result,
      np.trace(matrix.astype(np.float64)),
      terms=len(matrix),
      scale=np.abs(np.diagonal(matrix)).sum(),
    )
  matrices[1][5, 5] = np.nan
  flags = np.isfinite(np.asarray(jax.jit(batch.diagonal_sums)(matrices)))
  np.testing.assert_array_equal(flags, [True, False, True])
  assert batch.diagonal_sums([]).shape == (0,)


def test_inverse_check_rejects_a_failed_cholesky_and_keeps_a_good_one():
  factor = jnp.asarray([[2.0, 1.0], [1.0, 2.0]])
  (good,) = inverse.damped_inverse(factor, jnp.asarray(0.5))
  # (F + ½I)'s eigenvalues are 1.5 and 3.5: a Cholesky inverse of size 2,
  # conditioning 3.5/1.5, of norm 1/1.5 (reference.assert_float32_close).
  reference.assert_float32_close(
    good,
    np.linalg.inv(np.asarray(factor, np.float64) + 0.5 * np.eye(2)),
    terms=2,
    condition=3.5 / 1.5,
    scale=1 / 1.5,
  )
  pair = inverse.InversePreconditioner(good, good)
  # Indefinite beyond the damping: Cholesky fails and the result is NaN.
  (failed,) = inverse.damped_inverse(-factor, jnp.asarray(0.5))
  # One pass over several layers flags only the failed one.
  np.testing.assert_array_equal(
    inverse.are_finite(
      [pair, inverse.InversePreconditioner(good, failed), pair]
    ),
    [True, False, True],
  )
