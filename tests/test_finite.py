"""``finite.all_finite``: exact, including sums that overflow float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax import finite


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


def test_finite_values_whose_sum_overflows_are_finite():
  big = jnp.full((4,), 3e38, jnp.float32)
  assert not np.isfinite(np.float32(big.sum()))  # the fast path's sum overflows
  assert bool(finite.all_finite([big, -big[:1]]))
  assert bool(jax.jit(finite.all_finite)(big))
  assert not bool(jax.jit(finite.all_finite)(big.at[0].set(jnp.nan)))


def test_low_precision_integer_and_empty_trees():
  assert bool(finite.all_finite({"half": jnp.full((3,), 6e4, jnp.float16),
                                 "ids": jnp.arange(3)}))
  assert not bool(finite.all_finite(jnp.array([1.0, jnp.inf], jnp.bfloat16)))
  assert bool(finite.all_finite({"ids": jnp.arange(3)}))
  assert bool(finite.all_finite({}))
