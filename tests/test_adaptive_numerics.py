"""The adaptive mode under numerical trouble: NaN/Inf gradients, restored
non-finite or out-of-range state, a singular 2×2 system, rejected steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax.transform import quadratic_model
from tests import reference
from tests.adaptive_problems import adaptive_tx, run_steps, sigmoid_problem

close = reference.assert_float32_close


def test_non_finite_gradients_emit_zeros_and_raise_the_damping():
  params, batch, split, loss_fn = sigmoid_problem()
  tx = adaptive_tx(damping=1.0)
  params_1, state_1, _ = run_steps(tx, params, batch, split, loss_fn, 2)

  @jax.jit
  def poisoned_step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
    grads = jax.tree.map(lambda g: g * jnp.nan, grads)
    return tx.update(grads, state, params, kfac_stats=stats, split_loss=split)

  updates, state_2 = poisoned_step(params_1, state_1)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  omega = 0.95**5
  # ω = 0.95⁵ in float32 (5 roundings), then λ/ω.
  close(
    state_2.quadratic_model.damping,
    float(state_1.quadratic_model.damping) / omega,
    terms=5 + 1,
  )
  for before, after in zip(
    jax.tree.leaves(state_1.quadratic_model.previous_update),
    jax.tree.leaves(state_2.quadratic_model.previous_update),
  ):
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
  assert all(
    np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(state_2)
  )
  # Clean steps from the poisoned state train on.
  _, _, history = run_steps(
    tx, params_1, batch, split, loss_fn, 2, initial_state=state_2
  )
  assert all(np.isfinite(h[-1]) for h in history)


def test_a_restored_non_finite_delta_recovers():
  # A rejected step kept a NaN δ: every later update was zero. Now δ
  # restarts at zeros.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = adaptive_tx(damping=1.0)
  params_1, state_1, _ = run_steps(tx, params, batch, split, loss_fn, 2)
  model = state_1.quadratic_model
  model = model._replace(
    previous_update=jax.tree.map(
      lambda x: jnp.full_like(x, jnp.nan), model.previous_update
    )
  )
  state_1 = state_1._replace(quadratic_model=model)
  _, state, history = run_steps(
    tx, params_1, batch, split, loss_fn, 3, initial_state=state_1
  )
  rejected, later = history[0][2], [h[2] for h in history[1:]]
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(rejected))
  assert all(
    np.any(np.asarray(u) != 0) for u in later for u in jax.tree.leaves(u)
  )
  assert all(
    np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(state)
  )
  assert history[-1][-1] < history[0][-1]


@pytest.mark.parametrize("outer_product", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_a_restored_lambda_out_of_range_restarts_clipped_at_once(
  bad, outer_product
):
  # λ entered the step's decompositions and step sizes as restored until the
  # next adaptation step. With the outer product precomputed a NaN λ's
  # decompositions were rejected, the old eigenbasis kept Δ finite and the
  # solve gave α = μ = 0: zero updates, nothing flagged, for every step up
  # to the adaptation. Now every step reads λ clipped, as the rule keeps it.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = kfac_jax.scale_by_kfac(
    damping=1.0,
    kl_clip=None,
    compute_eigenvalue_outer_product=outer_product,
    adaptive=kfac_jax.AdaptiveConfig(),
  )
  params_2, state_2, _ = run_steps(tx, params, batch, split, loss_fn, 2)
  model = state_2.quadratic_model
  config = kfac_jax.AdaptiveConfig()
  clipped = config.max_damping if bad != -1.0 else config.min_damping
  runs = [
    run_steps(
      tx,
      params_2,
      batch,
      split,
      loss_fn,
      3,
      initial_state=state_2._replace(
        quadratic_model=model._replace(damping=jnp.asarray(value, jnp.float32))
      ),
    )
    for value in (bad, clipped)
  ]
  # Counts 2, 3, 4: no adaptation step (interval 5) to clean λ up.
  (_, state, history), (_, reference, reference_history) = runs
  for step, reference_step in zip(history, reference_history):
    for u, r in zip(
      jax.tree.leaves(step[2]), jax.tree.leaves(reference_step[2])
    ):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(r))
      assert np.any(np.asarray(u) != 0)
  assert int(state.rejected_decompositions) == int(
    reference.rejected_decompositions
  )
  assert float(state.quadratic_model.damping) == float(
    reference.quadratic_model.damping
  )


def test_an_injected_initial_damping_is_traced_in_a_jitted_update():
  # Its range check ran on the tracer: TracerBoolConversionError.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = optax.inject_hyperparams(
    kfac_jax.scale_by_kfac, static_args=("accumulation_steps",)
  )(
    damping=0.5,
    kl_clip=None,
    compute_eigenvalue_outer_product=False,
    adaptive=kfac_jax.AdaptiveConfig(),
  )
  _, state, _ = run_steps(tx, params, batch, split, loss_fn, 1)
  _, expected, _ = run_steps(
    adaptive_tx(damping=0.5), params, batch, split, loss_fn, 1
  )
  # λ traced or constant: the same λ·ω (λ's rounding, the product).
  close(
    state.inner_state.quadratic_model.damping,
    expected.quadratic_model.damping,
    terms=2,
  )


@pytest.mark.parametrize(
  "damping, expected",
  [
    (-0.05, kfac_jax.AdaptiveConfig().min_damping),
    (float("nan"), kfac_jax.AdaptiveConfig().max_damping),
  ],
)
def test_an_injected_initial_damping_out_of_range_is_clipped(damping, expected):
  # Traced by a jitted init it could not be range-checked, and a negative λ
  # gave the first decomposition a mixed-sign 1/(outer + λ), kept for
  # inv_update_steps steps. Now kept in range as the rule keeps every λ.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = optax.inject_hyperparams(
    kfac_jax.scale_by_kfac, static_args=("accumulation_steps",)
  )(
    damping=damping,
    kl_clip=None,
    adaptive=kfac_jax.AdaptiveConfig(),
    compute_method="eigen",
  )
  state = jax.jit(tx.init)(params)
  assert float(state.inner_state.quadratic_model.damping) == np.float32(
    expected
  )
  _, state, _ = run_steps(
    tx, params, batch, split, loss_fn, 1, initial_state=state
  )
  eigen = state.inner_state.preconditioners
  assert all(np.all(np.asarray(p.damped_inverse) > 0) for p in eigen.values())


def test_a_nearly_singular_step_size_system_falls_back_to_alpha_alone():
  """δ almost parallel to Δ: det/(Q₀₀Q₁₁) ≈ 2.4e-7 is below the singular
  tolerance, so μ = 0 and α = −g₀/Q₀₀ (closed form) rather than the
  ill-conditioned 2×2 solve's huge pair."""
  eps = float(np.finfo(np.float32).eps) * 2  # 1 + eps is exact in float32
  curvature = jnp.asarray([[1.0, 1.0], [1.0, 1.0 + eps]], jnp.float32)
  coefficients = quadratic_model.solve_step_sizes(
    curvature,
    jnp.zeros((2, 2), jnp.float32),
    jnp.asarray([-1.0, 0.5], jnp.float32),
    jnp.float32(0.0),
    use_momentum=True,
  )
  close(coefficients, [1.0, 0.0], terms=1)  # −g₀/Q₀₀, one division
  # A well-conditioned system still gets the exact 2×2 solution.
  curvature = jnp.asarray([[2.0, 0.5], [0.5, 1.0]], jnp.float32)
  g = np.array([-1.0, 0.5])
  coefficients = quadratic_model.solve_step_sizes(
    curvature,
    jnp.zeros((2, 2), jnp.float32),
    jnp.asarray(g, jnp.float32),
    jnp.float32(0.0),
    use_momentum=True,
  )
  # Cramer's rule (5 roundings of u = ε/2, under 3 of ε) through its
  # conditioning.
  close(
    coefficients,
    -np.linalg.solve(np.asarray(curvature), g),
    terms=3,
    condition=np.linalg.cond(np.asarray(curvature)),
  )


@pytest.mark.parametrize(
  "negated, previous, dtype, coefficients",
  [
    ([-1.0, 2.0], [3.0, -4.0], np.float32, [0.5, 0.25]),  # finite
    ([-1.0, 2.0], [np.nan, 1.0], np.float32, [0.5, 0.0]),  # NaN δ, μ = 0
    ([np.inf, 2.0], [3.0, 1.0], np.float32, [0.0, 0.5]),  # ±Inf Δ, α = 0
    ([-3e38, 0.0], [0.0, 0.0], np.float32, [2.0, 0.0]),  # v past float32
    ([-7e4, 1.0], [0.0, 0.0], np.float16, [1.0, 0.0]),  # v past float16
    ([-6e4, 1.0], [0.0, 0.0], np.float16, [1.0, 0.0]),  # v within it
  ],
)
def test_the_update_check_decides_as_an_elementwise_one(
  negated, previous, dtype, coefficients
):
  """``_update_finite`` decides from ``cᵀPc`` (and float16 leaves' own
  sums) what ``isfinite`` of every entry of ``v = αΔ + μδ``, cast to δ's
  dtype, decides."""
  negated = np.asarray(negated, np.float32)  # −Δ, as the step is given it
  previous = np.asarray(previous, dtype)
  coefficients = np.asarray(coefficients, np.float32)
  vectors = np.stack([-negated, previous.astype(np.float32)])
  with np.errstate(all="ignore"):
    inner = vectors @ vectors.T  # P = [vᵢᵀvⱼ] in float32, as the step's
    expected = np.all(np.isfinite((coefficients @ vectors).astype(dtype)))
  actual = quadratic_model._update_finite(  # pylint: disable=protected-access
    jnp.asarray(coefficients),
    jnp.asarray(inner),
    {"w": jnp.asarray(negated)},
    {"w": jnp.asarray(previous)},
  )
  assert bool(actual) == bool(expected)


def test_a_rejected_step_records_zero_step_sizes():
  """Docstring of ``step``: a non-finite result emits a zero update; the
  state's ``[α, μ]`` are then those of that update, zeros. A restored NaN δ
  leaves α finite (the singular 2×2 system falls back to α alone) while
  the step is rejected: α must not be recorded."""
  params, batch, split, loss_fn = sigmoid_problem()
  tx = kfac_jax.scale_by_kfac(
    damping=1.0, kl_clip=None, adaptive=kfac_jax.AdaptiveConfig()
  )
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  _, state = tx.update(grads, state, params, kfac_stats=stats, split_loss=split)
  assert np.asarray(state.quadratic_model.step_sizes)[0] != 0
  model = state.quadratic_model
  state = state._replace(
    quadratic_model=model._replace(
      previous_update=jax.tree.map(
        lambda x: jnp.full_like(x, jnp.nan), model.previous_update
      )
    )
  )
  updates, state = tx.update(
    grads, state, params, kfac_stats=stats, split_loss=split
  )
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  np.testing.assert_array_equal(
    np.asarray(state.quadratic_model.step_sizes), [0.0, 0.0]
  )
