"""``preconditioning.batched``: every factor's decomposition, one by one or
stacked by size as each platform and method calls for, against float64 numpy
on each factor."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax.distribution import placement
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import batched, eigen, inverse, methods
from tests import reference

DAMPING = 0.1


def _spd_factors(
  sizes: dict[str, tuple[int, int]], seed: int
) -> dict[str, LayerFactors]:
  """``{layer: LayerFactors}`` of random SPD factors of the given sizes."""
  rng = np.random.default_rng(seed)

  def spd(d):
    x = rng.standard_normal((2 * d, d)).astype(np.float32)
    return jnp.asarray(x.T @ x / (2 * d))

  return {name: LayerFactors(spd(a), spd(g)) for name, (a, g) in sizes.items()}


def _factors() -> dict[str, LayerFactors]:
  # Two layers share the size 5 (one stack of three), one has a 7.
  return _spd_factors({"a": (5, 7), "b": (5, 5)}, seed=0)


LAYOUTS = {
  "dispatched": lambda fs, fn: batched.decompose_layers(fs, fn, DAMPING),
  "each": lambda fs, fn: batched.decompose_each(fs, fn, DAMPING),
  "stacked": lambda fs, fn: batched.decompose_stacked(fs, fn, DAMPING),
  "stacked in batches of 2": lambda fs, fn: batched.decompose_layers(
    fs, fn, DAMPING, batch_size=2
  ),
}


def _results(layout: str, factor_fn) -> list[tuple[jax.Array, tuple]]:
  """``(factor, factor_fn's results for it)`` for every A and G."""
  factors = _factors()
  decomposed = jax.jit(lambda fs: LAYOUTS[layout](fs, factor_fn))(factors)
  return [
    (factor, result)
    for name, pair in factors.items()
    for factor, result in zip(pair, decomposed[name])
  ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inverses_match_float64_numpy(layout):
  for factor, (result,) in _results(layout, inverse.damped_inverse):
    reference.assert_damped_inverse(result, factor, DAMPING)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eigenbases_rebuild_each_factor(layout):
  for factor, (values, vectors) in _results(layout, eigen.eigh_factor):
    # eigh is backward stable: the exact eigenbasis of F + E, with ‖E‖ up
    # to n²·ε·‖F‖ (Householder tridiagonalisation's bound), which moves the
    # eigenvalues by as much (Weyl) and the rebuilt factor by that and Q's
    # departure from orthogonality (as much again).
    n2 = len(factor) ** 2
    expected = np.linalg.eigvalsh(np.asarray(factor, np.float64))
    reference.assert_float32_close(values, expected, terms=n2)
    vectors = np.asarray(vectors, np.float64)
    rebuilt = (vectors * np.asarray(values)) @ vectors.T
    reference.assert_float32_close(
      rebuilt, factor, terms=2 * n2, scale=expected[-1]
    )


def _choleskies(decompose) -> list[str]:
  """Batch shapes of the compiled program's Cholesky calls on this device."""
  text = (
    jax.jit(lambda fs: decompose(fs, inverse.damped_inverse))
    .lower(_factors())
    .compile()
    .as_text()
  )
  return re.findall(
    r"= \(f32\[([\d,]+)\][^ ]* \S+ custom-call\([^\n]*potrf", text
  )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering")
def test_on_cpu_each_factor_is_its_own_call_and_stacks_group_by_size():
  # One call per factor runs concurrently on XLA:CPU's threads; a stacked
  # call would loop over its stack on one.
  assert sorted(_choleskies(LAYOUTS["dispatched"])) == [
    "5,5",
    "5,5",
    "5,5",
    "7,7",
  ]
  assert sorted(_choleskies(LAYOUTS["stacked"])) == ["1,7,7", "3,5,5"]


def _decomposition_batch_ranks(use_eigen: bool, platform: str) -> set[int]:
  """Stack ranks of the solver calls in a decomposition lowered on ``platform``.

  ``0``: one call per factor; ``1``: factors stacked by size. Lowering for
  a platform needs no device of it, so every platform is checked here.
  """
  method = methods.make_method(
    use_eigen, jnp.float32, precompute_damped_inverse=False
  )
  factors = _factors()
  previous = {
    name: method.init(
      pair.activation_factor.shape[0], pair.gradient_factor.shape[0]
    )
    for name, pair in factors.items()
  }
  text = (
    jax.jit(
      lambda fs, ps: placement.decompose_checked(
        method, fs, ps, jnp.float32(DAMPING)
      )
    )
    .trace(factors, previous)
    .lower(lowering_platforms=(platform,))
    .as_text()
  )
  operands = re.findall(r"custom_call @\w+\(.*?: \(tensor<([\dx]+)x", text)
  assert operands, text
  return {len(shape.split("x")) - 2 for shape in operands}


@pytest.mark.parametrize(
  "use_eigen, platform, batch_rank",
  [
    (True, "cpu", 0),
    (True, "cuda", 0),
    (True, "rocm", 1),
    (True, "tpu", 1),
    (False, "cpu", 0),
    (False, "cuda", 1),
    (False, "rocm", 1),
  ],
)
def test_each_platform_decomposes_one_by_one_or_stacked_by_method(
  use_eigen, platform, batch_rank
):
  # One by one where it is faster: LAPACK on CPU for both methods, and
  # cuSOLVER's eigh (3.9x faster than stacked on an H100); cuSOLVER's
  # Cholesky is faster stacked (benchmarks/README.md, NVIDIA H100).
  assert _decomposition_batch_ranks(use_eigen, platform) == {batch_rank}


def test_padded_sizes_pad_by_one_row_at_most():
  assert batched.padded_sizes([30, 31, 32, 7, 1000, 1001]) == {
    31: 32,
    1000: 1001,
  }
  assert batched.padded_sizes([5, 7]) == {}


def _chained_factors() -> dict[str, LayerFactors]:
  # Sizes 4, 5 and 6: 5 is padded to 6, 4 is left alone.
  return _spd_factors({"a": (5, 4), "b": (6, 5)}, seed=1)


@pytest.mark.parametrize("layout", ["dispatched", "each", "stacked"])
def test_inverses_of_padded_factors_match_float64_numpy(layout):
  decompose = {
    "dispatched": batched.decompose_layers,
    "each": batched.decompose_each,
    "stacked": batched.decompose_stacked,
  }[layout]
  factors = _chained_factors()
  decomposed = jax.jit(
    lambda fs: decompose(fs, inverse.damped_inverse, DAMPING, crop=inverse.crop)
  )(factors)
  for name, pair in factors.items():
    for factor, (result,) in zip(pair, decomposed[name]):
      assert result.shape == factor.shape
      reference.assert_damped_inverse(result, factor, DAMPING)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering")
def test_padded_factors_share_their_decompositions_size():
  text = (
    jax.jit(
      lambda fs: batched.decompose_layers(
        fs, inverse.damped_inverse, DAMPING, crop=inverse.crop
      )
    )
    .lower(_chained_factors())
    .compile()
    .as_text()
  )
  choleskies = re.findall(
    r"= \(f32\[([\d,]+)\][^ ]* \S+ custom-call\([^\n]*potrf", text
  )
  assert sorted(choleskies) == ["4,4", "6,6", "6,6", "6,6"]
