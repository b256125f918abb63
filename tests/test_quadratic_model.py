"""The adaptive mode (``transform.quadratic_model``) against dense references."""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from examples import models
from kfac_jax.capture.statistics import ConvGeometry, LayerSignature
from kfac_jax.factors import batch as batch_lib
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import inverse as inverse_lib
from kfac_jax.transform import quadratic_model
from tests import reference

L2 = 1e-3
close = reference.assert_float32_close
# reference.assert_float32_close's ``terms`` for sigmoid_problem: its loss
# (the dots of 4 and 6, the sigmoid cross-entropy's 3 roundings, the sums
# over 3 outputs and 32 examples, the L2 term's over 51 params); an adaptive
# step (the contractions forward and back, the sums over 32 rows, the eigh
# of the largest factors, 7² + 6², test_batched, and the quadratic model's
# inner products over the 51 params).
SIGMOID_LOSS_TERMS = 4 + 6 + 3 + 3 + 32 + 51
SIGMOID_STEP_TERMS = 2 * (4 + 6 + 3) + 32 + 7**2 + 6**2 + 51


def sigmoid_problem(batch: int = 32, seed: int = 0):
  """A small MLP with a summed sigmoid cross-entropy, its split and its loss."""
  rng = np.random.default_rng(seed)
  model = models.MLP((6,), 3, jnp.tanh)
  x = jnp.asarray(rng.normal(size=(batch, 4)), jnp.float32)
  y = jnp.asarray(np.asarray(x)[:, :3] > 0, jnp.float32)  # learnable
  params = model.init(jax.random.PRNGKey(seed), x)["params"]

  def outputs_fn(p):
    return model.apply({"params": p}, x)

  def data_loss(logits):
    return optax.sigmoid_binary_cross_entropy(logits, y).sum(-1).mean()

  def regularizer(p):
    return L2 * 0.5 * sum(jnp.vdot(v, v) for v in jax.tree.leaves(p))

  split = kfac_jax.SplitLoss(outputs_fn, data_loss, regularizer)

  def loss_fn(p, x_batch, y_batch):
    logits = model.apply({"params": p}, x_batch)
    return (optax.sigmoid_binary_cross_entropy(logits, y_batch).sum(-1).mean()
            + regularizer(p))

  return params, (x, y), split, loss_fn


def dense_gauss_newton(split: kfac_jax.SplitLoss, params) -> np.ndarray:
  """``Jᵀ H J + L2·I`` as a dense float64 matrix, with the closed-form H.

  For ``mean_b Σ_k sigmoid_ce(z_bk)``, ``H = diag(σ(z)(1 − σ(z))) / B``.
  """
  flat, unravel = ravel_pytree(params)
  logits = np.asarray(split.outputs_fn(params), np.float64)
  jacobian = np.asarray(
      jax.jacobian(lambda f: split.outputs_fn(unravel(f)))(flat),
      np.float64).reshape(logits.size, flat.size)
  s = 1 / (1 + np.exp(-logits))
  hessian = np.diag((s * (1 - s)).reshape(-1)) / logits.shape[0]
  return jacobian.T @ hessian @ jacobian + L2 * np.eye(flat.size)


def random_like(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


def flat64(tree) -> np.ndarray:
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def test_curvature_products_match_the_dense_gauss_newton_matrix():
  params, _, split, _ = sigmoid_problem()
  vectors = [random_like(params, 1), random_like(params, 2)]
  loss, matrix, gradient_products = quadratic_model.curvature_products(
      split, params, vectors)
  dense = dense_gauss_newton(split, params)
  flat = np.stack([flat64(v) for v in vectors])
  # vᵢᵀ(JᵀHJ + L2)vⱼ in float32: the tangents Jv through the dots of 4 and
  # 6, the bias and tanh (each way: 2·12), H's sigmoid, the sums over the
  # 96 outputs and the 51 params; each on the magnitude of its terms.
  close(matrix, flat @ dense @ flat.T, terms=2 * 12 + 3 + 96 + 51,
        scale=np.abs(flat) @ np.abs(dense) @ np.abs(flat).T)
  close(loss, quadratic_model.loss_value(split, params),
        terms=SIGMOID_LOSS_TERMS)
  gradient = flat64(jax.grad(lambda p: quadratic_model.loss_value(split, p))(
      params))
  # vᵀ∇ over 51 params of two float32 gradients (backward as much again as
  # the loss), each on |v|ᵀ|∇|.
  close(gradient_products, flat @ gradient,
        terms=2 * SIGMOID_LOSS_TERMS + 51,
        scale=(np.abs(flat) @ np.abs(gradient)).max())


def test_a_curvature_mini_batch_measures_rho_on_the_whole_batchs_gradient():
  # With the SplitLoss on part of the batch, ρ divided the part's loss
  # change by the model of the whole batch's gradient: for a tiny step
  # ρ → ∇_partᵀv / ∇ᵀv (anything, even negative), not 1, and λ moved on
  # that alone.
  params, (x, y), _, loss_fn = sigmoid_problem()
  model = models.MLP((6,), 3, jnp.tanh)
  part = kfac_jax.SplitLoss(
      lambda p: model.apply({"params": p}, x[:4]),
      lambda logits: optax.sigmoid_binary_cross_entropy(
          logits, y[:4]).sum(-1).mean(),
      lambda p: L2 * 0.5 * sum(jnp.vdot(v, v) for v in jax.tree.leaves(p)))
  # A large λ: a tiny step, which the quadratic model predicts closely.
  tx = adaptive_tx(damping=500.0)
  _, state, history = run_steps(tx, params, (x, y), part, loss_fn, 1)
  update, grads = history[0][2], history[0][3]
  part_gradient = jax.grad(lambda p: quadratic_model.loss_value(part, p))(
      params)
  old_ratio = float(optax.tree.vdot(part_gradient, update) /
                    optax.tree.vdot(grads, update))
  assert abs(old_ratio - 1) > 0.1, old_ratio  # the test tells them apart
  np.testing.assert_allclose(float(state.quadratic_model.reduction_ratio), 1.0,
                             atol=0.02)


def test_step_sizes_minimise_the_two_dimensional_model():
  rng = np.random.default_rng(0)
  basis = rng.normal(size=(2, 2))
  curvature = basis @ basis.T + 0.1 * np.eye(2)
  vectors = rng.normal(size=(2, 5))
  inner = vectors @ vectors.T
  gradient_products = rng.normal(size=2)
  damping = 0.3
  coefficients = quadratic_model.solve_step_sizes(
      jnp.asarray(curvature, jnp.float32), jnp.asarray(inner, jnp.float32),
      jnp.asarray(gradient_products, jnp.float32), jnp.float32(damping), True)
  system = curvature + damping * inner
  expected = -np.linalg.solve(system, gradient_products)
  # The inputs' rounding to float32 and λ's product and sum (3); Cramer's
  # rule's products and difference in a numerator and in the determinant,
  # and the division (5 of u = ε/2, under 3 of ε): through the system's
  # conditioning.
  close(coefficients, expected, terms=3 + 3,
        condition=np.linalg.cond(system))
  alpha_only = quadratic_model.solve_step_sizes(
      jnp.asarray(curvature, jnp.float32), jnp.asarray(inner, jnp.float32),
      jnp.asarray(gradient_products, jnp.float32), jnp.float32(damping), False)
  # The inputs' rounding (3), λ's product and sum, the division: 6, on
  # positive terms.
  close(alpha_only,
        [-gradient_products[0] / (curvature[0, 0] + damping * inner[0, 0]), 0],
        terms=6)


def test_zero_previous_update_falls_back_to_the_learning_rate_alone():
  curvature = jnp.asarray([[2.0, 0.0], [0.0, 0.0]])
  inner = jnp.asarray([[1.0, 0.0], [0.0, 0.0]])
  coefficients = quadratic_model.solve_step_sizes(
      curvature, inner, jnp.asarray([-3.0, 0.0]), jnp.float32(1.0), True)
  np.testing.assert_allclose(np.asarray(coefficients), [1.0, 0.0])


# Martens & Grosse: λω when ρ > ¾, λ/ω when ρ < ¼; the bounds keep λ.
@pytest.mark.parametrize("ratio, factor", [(0.9, 0.5), (0.5, 1.0), (0.1, 2.0),
                                           (0.75, 1.0), (0.25, 1.0),
                                           (np.nan, 2.0)])
def test_levenberg_marquardt_rule(ratio, factor):
  config = kfac_jax.AdaptiveConfig(damping_adaptation_decay=0.5**0.5,
                                   damping_adaptation_interval=2)
  new = quadratic_model.adapt_damping(jnp.float32(1.0), jnp.float32(ratio),
                                      config)
  close(new, factor, terms=2)  # ω = decay², then λ·ω (or λ/ω)
  clipped = quadratic_model.adapt_damping(
      jnp.float32(config.max_damping), jnp.float32(ratio), config)
  assert float(clipped) <= config.max_damping


def adaptive_tx(damping=1.0, compute_method="eigen", **config):
  return kfac_jax.scale_by_kfac(
      damping=damping, kl_clip=None, compute_eigenvalue_outer_product=False,
      compute_method=compute_method,
      adaptive=kfac_jax.AdaptiveConfig(**config))


def run_steps(tx, params, batch, split, loss_fn, steps, initial_state=None):
  state = tx.init(params) if initial_state is None else initial_state
  history = []

  @jax.jit
  def step(params, state):
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
    updates, new_state = tx.update(grads, state, params, kfac_stats=stats,
                                   split_loss=split)
    return updates, new_state, loss, grads

  for _ in range(steps):
    updates, new_state, loss, grads = step(params, state)
    history.append((params, state, updates, grads, float(loss)))
    params = optax.apply_updates(params, updates)
    state = new_state
  return params, state, history


def model_gradient(split, step) -> tuple[np.ndarray, np.ndarray]:
  """``(v, ∇ + (C + λI) v)`` of one recorded step, with the dense C.

  The model's gradient is orthogonal to every direction the step was
  optimised along.
  """
  params_t, state_t, updates, grads, _ = step
  update = flat64(updates)
  dense = dense_gauss_newton(split, params_t)
  damping = float(state_t.quadratic_model.damping)
  return update, flat64(grads) + (dense + damping * np.eye(len(update))) @ update


def assert_orthogonal(direction, residual, grads):
  assert abs(direction @ residual) < 1e-4 * np.linalg.norm(
      flat64(grads)) * np.linalg.norm(direction)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_update_is_optimal_along_the_previous_update(compute_method):
  """``δᵀ(∇ + (C + λI) v) = 0``: μ minimises the dense model along δ."""
  params, batch, split, loss_fn = sigmoid_problem()
  _, _, history = run_steps(adaptive_tx(compute_method=compute_method),
                            params, batch, split, loss_fn, 3)
  for step in history[1:]:
    previous = flat64(step[1].quadratic_model.previous_update)
    update, residual = model_gradient(split, step)
    assert np.linalg.norm(previous) > 0
    assert_orthogonal(previous, residual, step[3])
    # And v is not a multiple of δ: the K-FAC direction contributes.
    cosine = update @ previous / np.linalg.norm(update) / np.linalg.norm(
        previous)
    assert abs(cosine) < 0.999
  # At the first step (δ = 0) the update is α·Δ, optimal along itself.
  update, residual = model_gradient(split, history[0])
  assert_orthogonal(update, residual, history[0][3])


def test_quadratic_loss_gives_reduction_ratio_one_and_lowers_damping():
  """Linear model + squared error: the model is exact, so ρ = 1 (λ excluded)."""
  rng = np.random.default_rng(0)
  model = nn.Dense(3)
  x = jnp.asarray(rng.normal(size=(64, 5)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(64, 3)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(p, x, y):
    return 0.5 * jnp.mean(jnp.sum((model.apply({"params": p}, x) - y)**2, -1))

  split = kfac_jax.SplitLoss(
      lambda p: model.apply({"params": p}, x),
      lambda out: 0.5 * jnp.mean(jnp.sum((out - y)**2, -1)))
  tx = adaptive_tx(damping=1.0, damping_adaptation_interval=2,
                   damping_adaptation_decay=0.5)
  _, state, history = run_steps(tx, params, (x, y), split, loss_fn, 5)
  np.testing.assert_allclose(float(state.quadratic_model.reduction_ratio), 1.0,
                             atol=2e-3)
  # Adapted at steps 0, 2 and 4 (ρ > ¾ each time): λ·(0.5²)³.
  close(state.quadratic_model.damping, 0.25**3, terms=3)  # three λ·ω
  losses = [h[-1] for h in history]
  assert all(b < a for a, b in zip(losses, losses[1:]))


def test_fisher_scaled_gradient_factor_is_the_per_example_covariance():
  """Dense: ``G = (1/N) Σ ∇ℓᵢ ∇ℓᵢᵀ`` of the output layer, in closed form."""
  params, batch, _, loss_fn = sigmoid_problem()
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  _, gradient_factor = batch_lib.batch_factors(stats["Dense_1"],
                                               fisher_scaled=True)
  x, y = batch
  hidden = np.tanh(np.asarray(x, np.float64) @ np.asarray(
      params["Dense_0"]["kernel"], np.float64) + np.asarray(
          params["Dense_0"]["bias"], np.float64))
  logits = hidden @ np.asarray(params["Dense_1"]["kernel"],
                               np.float64) + np.asarray(
                                   params["Dense_1"]["bias"], np.float64)
  per_example = 1 / (1 + np.exp(-logits)) - np.asarray(y, np.float64)
  # The residuals σ(z) − y carry the dots of 4 and 6, the bias, tanh and
  # the sigmoid (14 roundings), twice in each product; the sum over 32, / 32.
  close(gradient_factor[0], per_example.T @ per_example / len(per_example),
        terms=2 * 14 + 32 + 1)


def test_fisher_scales_of_a_convolution():
  conv = LayerSignature("Conv", True, conv=ConvGeometry(
      (3, 3), (1, 1), "SAME", (1, 1), (1, 1)))
  # B = 2 examples, T = 4·5 output positions: (T², N²·T) with N = B·T.
  assert batch_lib.fisher_scales(jnp.zeros((2, 4, 5, 7)), conv) == (
      20.0**2, 40.0**2 * 20)


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
  close(state_2.quadratic_model.damping,
        float(state_1.quadratic_model.damping) / omega, terms=5 + 1)
  for before, after in zip(
      jax.tree.leaves(state_1.quadratic_model.previous_update),
      jax.tree.leaves(state_2.quadratic_model.previous_update)):
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
  assert all(np.all(np.isfinite(np.asarray(leaf)))
             for leaf in jax.tree.leaves(state_2))
  # Clean steps from the poisoned state train on.
  _, _, history = run_steps(tx, params_1, batch, split, loss_fn, 2,
                            initial_state=state_2)
  assert all(np.isfinite(h[-1]) for h in history)


def test_a_restored_non_finite_delta_recovers():
  # A rejected step kept a NaN δ: every later update was zero. Now δ
  # restarts at zeros.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = adaptive_tx(damping=1.0)
  params_1, state_1, _ = run_steps(tx, params, batch, split, loss_fn, 2)
  model = state_1.quadratic_model
  model = model._replace(previous_update=jax.tree.map(
      lambda x: jnp.full_like(x, jnp.nan), model.previous_update))
  state_1 = state_1._replace(quadratic_model=model)
  _, state, history = run_steps(tx, params_1, batch, split, loss_fn, 3,
                                initial_state=state_1)
  rejected, later = history[0][2], [h[2] for h in history[1:]]
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(rejected))
  assert all(np.any(np.asarray(u) != 0) for u in later
             for u in jax.tree.leaves(u))
  assert all(np.all(np.isfinite(np.asarray(leaf)))
             for leaf in jax.tree.leaves(state))
  assert history[-1][-1] < history[0][-1]


@pytest.mark.parametrize("outer_product", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_a_restored_lambda_out_of_range_restarts_clipped_at_once(
    bad, outer_product):
  # λ entered the step's decompositions and step sizes as restored until the
  # next adaptation step. With the outer product precomputed a NaN λ's
  # decompositions were rejected, the old eigenbasis kept Δ finite and the
  # solve gave α = μ = 0: zero updates, nothing flagged, for every step up
  # to the adaptation. Now every step reads λ clipped, as the rule keeps it.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = kfac_jax.scale_by_kfac(
      damping=1.0, kl_clip=None, compute_eigenvalue_outer_product=outer_product,
      adaptive=kfac_jax.AdaptiveConfig())
  params_2, state_2, _ = run_steps(tx, params, batch, split, loss_fn, 2)
  model = state_2.quadratic_model
  config = kfac_jax.AdaptiveConfig()
  clipped = config.max_damping if bad != -1.0 else config.min_damping
  runs = [
      run_steps(tx, params_2, batch, split, loss_fn, 3,
                initial_state=state_2._replace(quadratic_model=model._replace(
                    damping=jnp.asarray(value, jnp.float32))))
      for value in (bad, clipped)
  ]
  # Counts 2, 3, 4: no adaptation step (interval 5) to clean λ up.
  (_, state, history), (_, reference, reference_history) = runs
  for step, reference_step in zip(history, reference_history):
    for u, r in zip(jax.tree.leaves(step[2]),
                    jax.tree.leaves(reference_step[2])):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(r))
      assert np.any(np.asarray(u) != 0)
  assert int(state.rejected_decompositions) == int(
      reference.rejected_decompositions)
  assert float(state.quadratic_model.damping) == float(
      reference.quadratic_model.damping)


def test_an_injected_initial_damping_is_traced_in_a_jitted_update():
  # Its range check ran on the tracer: TracerBoolConversionError.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = optax.inject_hyperparams(kfac_jax.scale_by_kfac,
                                static_args=("accumulation_steps",))(
      damping=0.5, kl_clip=None, compute_eigenvalue_outer_product=False,
      adaptive=kfac_jax.AdaptiveConfig())
  _, state, _ = run_steps(tx, params, batch, split, loss_fn, 1)
  _, expected, _ = run_steps(adaptive_tx(damping=0.5), params, batch, split,
                             loss_fn, 1)
  # λ traced or constant: the same λ·ω (λ's rounding, the product).
  close(state.inner_state.quadratic_model.damping,
        expected.quadratic_model.damping, terms=2)


@pytest.mark.parametrize("damping, expected", [
    (-0.05, kfac_jax.AdaptiveConfig().min_damping),
    (float("nan"), kfac_jax.AdaptiveConfig().max_damping)])
def test_an_injected_initial_damping_out_of_range_is_clipped(damping,
                                                             expected):
  # Traced by a jitted init it could not be range-checked, and a negative λ
  # gave the first decomposition a mixed-sign 1/(outer + λ), kept for
  # inv_update_steps steps. Now kept in range as the rule keeps every λ.
  params, batch, split, loss_fn = sigmoid_problem()
  tx = optax.inject_hyperparams(kfac_jax.scale_by_kfac,
                                static_args=("accumulation_steps",))(
      damping=damping, kl_clip=None, adaptive=kfac_jax.AdaptiveConfig())
  state = jax.jit(tx.init)(params)
  assert float(state.inner_state.quadratic_model.damping) == np.float32(
      expected)
  _, state, _ = run_steps(tx, params, batch, split, loss_fn, 1,
                          initial_state=state)
  eigen = state.inner_state.preconditioners
  assert all(np.all(np.asarray(p.damped_inverse) > 0) for p in eigen.values())


def test_adaptive_kfac_fits_a_learnable_problem():
  """Sanity: the loss falls steadily and λ moves down from its start."""
  params, batch, split, loss_fn = sigmoid_problem(batch=64)
  _, state, history = run_steps(adaptive_tx(damping=10.0), params, batch,
                                split, loss_fn, 25)
  losses = [h[-1] for h in history]
  assert losses[-1] < 0.7 * losses[0]
  assert float(state.quadratic_model.damping) < 10.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kl_clip=0.01), ValueError, "kl_clip=None"),
    (dict(kl_clip=None, accumulation_steps=2), ValueError,
     "accumulation_steps"),
    (dict(kl_clip=None, damping=optax.constant_schedule(1.0)), TypeError,
     "initial"),
    (dict(kl_clip=None, damping=5000.0), ValueError,
     r"damping=5000.0.*\[min_damping=0.0001, max_damping=1000.0\]"),
    (dict(kl_clip=None, damping=1e-5), ValueError, "min_damping"),
])
def test_incompatible_settings_are_rejected(kwargs, error, match):
  with pytest.raises(error, match=match):
    kfac_jax.scale_by_kfac(adaptive=kfac_jax.AdaptiveConfig(), **kwargs)


@pytest.mark.parametrize("config, match", [
    (dict(min_damping=0.0), "min_damping"),
    (dict(min_damping=2.0, max_damping=1.0), "max_damping"),
    (dict(damping_adaptation_decay=1.0), "decay"),
    (dict(damping_adaptation_interval=0), "interval"),
    # 0 in float32: λ then reached 0 and updates stayed 0.
    (dict(min_damping=1e-50), "min_damping=1e-50 is below float32"),
    # inf in float32: λ reached it and every later update was zero.
    (dict(max_damping=1e39), "max_damping=1e\\+39 is past float32"),
    (dict(max_damping=float("nan")), "max_damping must be finite"),
    # ω = decay^interval was 1 in float32: λ never moved.
    (dict(damping_adaptation_decay=1 - 1e-9), "rounds to 1 in float32"),
    # Failed in the first jitted update, naming no field.
    (dict(damping_adaptation_interval=2**40), "interval must fit in int32"),
])
def test_invalid_adaptive_config(config, match):
  with pytest.raises(ValueError, match=match):
    kfac_jax.scale_by_kfac(kl_clip=None,
                           adaptive=kfac_jax.AdaptiveConfig(**config))


@pytest.mark.parametrize("config", [dict(min_damping="1e-4"),
                                    dict(max_damping=None),
                                    dict(damping_adaptation_decay=None)])
def test_adaptive_config_of_the_wrong_type_names_the_field(config):
  (name,) = config
  with pytest.raises(TypeError, match=f"AdaptiveConfig.{name} must be a real"):
    kfac_jax.scale_by_kfac(kl_clip=None,
                           adaptive=kfac_jax.AdaptiveConfig(**config))


def test_adaptive_config_class_instead_of_an_instance_says_so():
  with pytest.raises(TypeError, match=r"pass an instance, AdaptiveConfig\(\)"):
    kfac_jax.scale_by_kfac(kl_clip=None, adaptive=kfac_jax.AdaptiveConfig)


def test_adaptive_config_of_numpy_and_jax_scalars_trains_as_python_numbers():
  # 0-d arrays were refused ("must be a real number", "positive integer").
  params, batch, split, loss_fn = sigmoid_problem()
  python = dict(min_damping=1e-3, max_damping=100.0,
                damping_adaptation_decay=0.5, damping_adaptation_interval=2,
                use_momentum=True)
  arrays = dict(min_damping=jnp.asarray(1e-3), max_damping=np.asarray(100.0),
                damping_adaptation_decay=np.float32(0.5),
                damping_adaptation_interval=np.asarray(2),
                use_momentum=jnp.asarray(True))
  runs = [run_steps(adaptive_tx(**config), params, batch, split, loss_fn, 4)
          for config in (python, arrays)]
  for (_, state, history), (_, other_state, other_history) in zip(
      runs[:1], runs[1:]):
    assert float(state.quadratic_model.damping) != 1.0  # it adapted
    # At most one λ·ω a step over 4 steps, ω = decay² each time (2).
    close(other_state.quadratic_model.damping, state.quadratic_model.damping,
          terms=4 * 3)
    # Each step's rounding (SIGMOID_STEP_TERMS) through K-FAC's conditioning
    # at the smallest λ (the configs' min_damping), carried by the next.
    condition = reference.kfac_condition(state.factors, 1e-3)
    for k, (step, other_step) in enumerate(zip(history, other_history)):
      scale = reference.largest(jax.tree.leaves(step[2]))
      for a, b in zip(jax.tree.leaves(step[2]), jax.tree.leaves(other_step[2])):
        close(a, b, terms=(k + 1) * SIGMOID_STEP_TERMS, condition=condition,
              scale=scale)


def test_state_of_another_configuration_is_refused():
  params, batch, split, loss_fn = sigmoid_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  plain = kfac_jax.scale_by_kfac(kl_clip=None)
  adaptive, accumulating = adaptive_tx(), kfac_jax.scale_by_kfac(
      accumulation_steps=4)
  for tx, state, match in (
      (adaptive, plain.init(params), "lacks the quadratic_model"),
      (plain, adaptive.init(params), "has the quadratic_model"),
      (accumulating, plain.init(params), "lacks the accumulator"),
      (plain, accumulating.init(params), "has the accumulator")):
    extra = dict(split_loss=split) if tx is adaptive else {}
    with pytest.raises(ValueError, match=match):
      tx.update(grads, state, params, kfac_stats=stats, **extra)


def test_split_loss_given_to_a_transformation_built_without_adaptive():
  # It was silently ignored: the user likely meant the adaptive mode.
  params, batch, split, loss_fn = sigmoid_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  tx = kfac_jax.scale_by_kfac(kl_clip=None)
  with pytest.raises(ValueError, match="split_loss.*without adaptive"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats,
              split_loss=split)


def test_update_without_split_loss_says_what_to_pass():
  params, batch, split, loss_fn = sigmoid_problem()
  tx = adaptive_tx()
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  with pytest.raises(ValueError, match="split_loss"):
    tx.update(grads, state, params, kfac_stats=stats)
  with pytest.raises(TypeError, match="SplitLoss"):
    tx.update(grads, state, params, kfac_stats=stats,
              split_loss=(split.outputs_fn, split.loss_fn))


def test_factored_damping_splits_lambda_by_the_trace_ratio():
  """``(A/(π√λ) + I)⁻¹ ∇ (Gπ/√λ + I)⁻¹ = λ (A + π√λI)⁻¹ ∇ (G + √λ/π I)⁻¹``."""
  rng = np.random.default_rng(0)
  a_root, g_root = rng.normal(size=(5, 5)), rng.normal(size=(3, 3))
  activation, gradient = a_root @ a_root.T, 40.0 * g_root @ g_root.T
  grad = rng.normal(size=(5, 3))
  damping = 0.7
  scaled = inverse_lib.factored_damping_scaled(
      LayerFactors(jnp.asarray(activation, jnp.float32),
                   jnp.asarray(gradient, jnp.float32)), jnp.float32(damping))
  result = (np.linalg.inv(np.asarray(scaled.activation_factor) + np.eye(5)) @
            grad @ np.linalg.inv(np.asarray(scaled.gradient_factor) +
                                 np.eye(3)))
  pi = np.sqrt((np.trace(activation) / 5) / (np.trace(gradient) / 3))
  expected = damping * (
      np.linalg.inv(activation + pi * np.sqrt(damping) * np.eye(5)) @ grad @
      np.linalg.inv(gradient + np.sqrt(damping) / pi * np.eye(3)))
  # The factors' rounding to float32 and π's (traces over 5 and 3, their
  # ratio, the square root; √λ, the division): 13, each factor's through
  # its conditioning, of ‖(A/(π√λ) + I)⁻¹‖‖∇‖‖(Gπ/√λ + I)⁻¹‖.
  a_shifted = np.asarray(scaled.activation_factor, np.float64) + np.eye(5)
  g_shifted = np.asarray(scaled.gradient_factor, np.float64) + np.eye(3)
  close(result, expected, terms=13,
        condition=np.linalg.cond(a_shifted) + np.linalg.cond(g_shifted),
        scale=damping * np.linalg.norm(np.linalg.inv(a_shifted), 2) *
        np.linalg.norm(grad) * np.linalg.norm(np.linalg.inv(g_shifted), 2))


def test_inverse_direction_keeps_its_scale_against_unregistered_params():
  """Adaptive inverse method: the direction is ``(A + π√λI)⁻¹ ∇ (G +
  √λ/π I)⁻¹`` on a registered layer beside the raw ``∇`` of a skipped one,
  so ``v = αΔ`` is one multiple of both. Without the ``/λ`` that undoes
  ``factored_damping_scaled``'s factor the registered part came out λ times
  too large (invisible when every parameter is registered: α absorbs it)."""
  params, batch, split, loss_fn = sigmoid_problem()
  damping = 10.0
  tx = kfac_jax.scale_by_kfac(
      damping=damping, kl_clip=None, compute_method="inverse",
      skip_layers="Dense_1",
      adaptive=kfac_jax.AdaptiveConfig(use_momentum=False))
  _, _, history = run_steps(tx, params, batch, split, loss_fn, 2)
  _, _, updates, grads, _ = history[0]
  factors = history[1][1].factors["Dense_0"]
  activation = np.asarray(factors.activation_factor, np.float64)
  gradient = np.asarray(factors.gradient_factor, np.float64)
  pi = np.sqrt((np.trace(activation) / len(activation)) /
               (np.trace(gradient) / len(gradient)))
  root = np.sqrt(damping)
  layer_gradient = np.concatenate(
      [grads["Dense_0"]["kernel"], grads["Dense_0"]["bias"][None]])
  layer_direction = (
      np.linalg.inv(activation + pi * root * np.eye(len(activation))) @
      layer_gradient @
      np.linalg.inv(gradient + root / pi * np.eye(len(gradient))))
  direction = np.concatenate([layer_direction.ravel(), flat64(
      grads["Dense_1"])])
  update = np.concatenate([np.concatenate(
      [updates["Dense_0"]["kernel"], updates["Dense_0"]["bias"][None]]
  ).ravel(), flat64(updates["Dense_1"])])
  alpha = (update @ direction) / (direction @ direction)
  assert alpha < 0
  # The float32 direction: the Cholesky inverses (3·(5 + 1), 3·(6 + 1),
  # reference.assert_damped_inverse) through their conditioning, the
  # product with ∇ (5 + 6); α's scale is fitted away.
  condition = (
      np.linalg.cond(activation + pi * root * np.eye(len(activation))) +
      np.linalg.cond(gradient + root / pi * np.eye(len(gradient))))
  close(update, alpha * direction, terms=3 * (5 + 1) + 3 * (6 + 1) + 5 + 6,
        condition=condition)


def test_factored_damping_of_far_apart_traces_does_not_overflow():
  # tr A/dA ÷ tr G/dG = 1e40 overflowed float32 (π = 1e20 does not): π = ∞
  # zeroed A's side and G's inverse, and the layer stopped moving.
  scaled = inverse_lib.factored_damping_scaled(
      LayerFactors(1e20 * jnp.eye(3), 1e-20 * jnp.eye(2)), jnp.float32(1.0))
  # π from the traces (3 and 2 terms), their ratio, its root, √λ, the
  # division: 8 roundings.
  close(scaled.activation_factor, np.eye(3), terms=8)
  close(scaled.gradient_factor, np.eye(2), terms=8)


def test_partition_specs_cover_the_quadratic_model_state():
  params, _, _, _ = sigmoid_problem()
  kwargs = dict(kl_clip=None, adaptive=kfac_jax.AdaptiveConfig())
  specs = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
  state = kfac_jax.scale_by_kfac(**kwargs).init(params)
  assert jax.tree.structure(specs) == jax.tree.structure(
      jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state))
  model = specs.quadratic_model
  assert model.damping == jax.sharding.PartitionSpec()
  assert jax.tree.structure(model.previous_update) == jax.tree.structure(
      params)
  assert all(spec == jax.sharding.PartitionSpec()
             for spec in jax.tree.leaves(model.previous_update))


def test_without_momentum_the_update_is_alpha_times_the_direction():
  """``use_momentum=False``: ``v = αΔ`` with α optimal along v itself."""
  params, batch, split, loss_fn = sigmoid_problem()
  _, _, history = run_steps(adaptive_tx(use_momentum=False), params, batch,
                            split, loss_fn, 3)
  for step in history:
    update, residual = model_gradient(split, step)
    assert_orthogonal(update, residual, step[3])
  assert float(history[-1][1].quadratic_model.step_sizes[1]) == 0.0


def fill_masked(params, full_params):
  """``params`` with the ``optax.MaskedNode`` leaves of another group taken
  from ``full_params`` (the README's recipe for ``optax.multi_transform``)."""
  return jax.tree.map(
      lambda mine, whole: whole if isinstance(mine, optax.MaskedNode) else mine,
      params, full_params, is_leaf=lambda n: isinstance(n, optax.MaskedNode))


def test_adaptive_mode_in_multi_transform_with_the_masked_params_filled():
  # The README advises multi_transform for parameters outside the blocks;
  # outputs_fn then received optax.MaskedNode leaves and Flax raised
  # ScopeParamNotFoundError. Filled from the full params, the K-FAC group
  # moves as a lone adaptive K-FAC whose other layer gets zero gradients.
  params, batch, split, loss_fn = sigmoid_problem()
  labels = {"Dense_0": "kfac", "Dense_1": "frozen"}
  multi = optax.multi_transform(
      {"kfac": adaptive_tx(), "frozen": optax.set_to_zero()}, labels)
  alone = kfac_jax.scale_by_kfac(
      damping=1.0, kl_clip=None, compute_eigenvalue_outer_product=False,
      adaptive=kfac_jax.AdaptiveConfig(), skip_layers=["^Dense_1$"])

  @jax.jit
  def multi_step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
    filled = kfac_jax.SplitLoss(
        lambda p: split.outputs_fn(fill_masked(p, params)), split.loss_fn,
        lambda p: split.regularizer(fill_masked(p, params)))
    return multi.update(grads, state, params, kfac_stats=stats,
                        split_loss=filled)

  @jax.jit
  def alone_step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(
        loss_fn, skip_layers=["^Dense_1$"])(params, *batch)
    grads["Dense_1"] = jax.tree.map(jnp.zeros_like, grads["Dense_1"])
    return alone.update(grads, state, params, kfac_stats=stats,
                        split_loss=split)

  multi_params, multi_state = params, multi.init(params)
  alone_params, alone_state = params, alone.init(params)
  steps = 0
  for _ in range(3):  # the second step on uses the previous update too
    multi_updates, multi_state = multi_step(multi_params, multi_state)
    alone_updates, alone_state = alone_step(alone_params, alone_state)
    assert not any(np.any(u) for u in jax.tree.leaves(
        alone_updates["Dense_1"]))
    # The same steps in two programs: each step's rounding through K-FAC's
    # conditioning (λ = 1 adapted a little), carried by the next ones.
    steps += 1
    tolerance = dict(
        terms=steps * SIGMOID_STEP_TERMS,
        condition=reference.kfac_condition(
            alone_state.factors, float(alone_state.quadratic_model.damping)),
        scale=reference.largest(jax.tree.leaves(alone_updates)))
    jax.tree.map(lambda a, b: close(a, b, **tolerance), multi_updates,
                 alone_updates)
    multi_params = optax.apply_updates(multi_params, multi_updates)
    alone_params = optax.apply_updates(alone_params, alone_updates)


@pytest.mark.parametrize("piece, malformed", [
    ("loss_fn", lambda split: split._replace(
        loss_fn=lambda o: jnp.sum(o, axis=-1))),  # per example
    ("loss_fn", lambda split: split._replace(
        loss_fn=lambda o: split.loss_fn(o)[None])),  # shape (1,)
    ("loss_fn", lambda split: split._replace(
        loss_fn=lambda o: jnp.sum(o > 0))),  # integer
    ("regularizer", lambda split: split._replace(
        regularizer=lambda p: jnp.ones(3))),
])
def test_a_malformed_split_loss_is_named(piece, malformed):
  # jax's own error ("Gradient only defined for scalar-output functions")
  # named no piece of the SplitLoss.
  params, batch, split, loss_fn = sigmoid_problem()
  with pytest.raises(ValueError,
                     match=f"SplitLoss.{piece} must return a floating scalar"):
    run_steps(adaptive_tx(), params, batch, malformed(split), loss_fn, 1)


def _numpy_forward(params, x, y):
  """``sigmoid_problem``'s model in float64 numpy: (x, hidden, logits, y)."""
  f64 = lambda a: np.asarray(a, np.float64)
  x, y = f64(x), f64(y)
  pre = x @ f64(params["Dense_0"]["kernel"]) + f64(params["Dense_0"]["bias"])
  hidden = np.tanh(pre)
  logits = (hidden @ f64(params["Dense_1"]["kernel"]) +
            f64(params["Dense_1"]["bias"]))
  return x, hidden, logits, y


def test_adaptive_running_gradient_factor_is_on_the_fishers_scale():
  """Through ``scale_by_kfac(adaptive=...)``: after one step the output
  layer's running ``G = d·I + (1 − d)·(1/N) Σ ∇ℓᵢ∇ℓᵢᵀ`` (closed form, the
  per-example sigmoid residuals), not KAISA's ``1/N²`` of it; ``A`` is the
  plain covariance of ``[hidden, 1]``."""
  params, batch, split, loss_fn = sigmoid_problem()
  decay = 0.5
  tx = kfac_jax.scale_by_kfac(damping=1e-2, kl_clip=None, factor_decay=decay,
                              adaptive=kfac_jax.AdaptiveConfig())
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  _, state = tx.update(grads, state, params, kfac_stats=stats,
                       split_loss=split)
  x, hidden, logits, y = _numpy_forward(params, *batch)
  n = len(x)
  residual = 1 / (1 + np.exp(-logits)) - y  # ∇ℓᵢ w.r.t. the logits
  g_expected = decay * np.eye(3) + (1 - decay) * residual.T @ residual / n
  a_rows = np.concatenate([hidden, np.ones((n, 1))], axis=1)
  a_expected = decay * np.eye(7) + (1 - decay) * a_rows.T @ a_rows / n
  factors = state.factors["Dense_1"]
  # The residuals carry 14 roundings (the dots of 4 and 6, the bias, tanh,
  # the sigmoid), the hidden rows 6, twice in each product; the sum over
  # 32, / 32, the mix. Each entry on its two parts' magnitudes.
  for got, expected, terms in (
      (factors.gradient_factor, g_expected, 2 * 14 + 32 + 3),
      (factors.activation_factor, a_expected, 2 * 6 + 32 + 3)):
    close(got, expected, terms=terms,
          scale=reference.running_factor_scale(expected, decay))


def test_factored_damping_of_a_zero_gradient_factor_uses_pi_one():
  """Documented: a zero factor gets π = 1 (not 0 or ∞), so with G = 0 the
  result is ``(A/√λ, 0)`` whatever A's trace (closed form)."""
  activation = np.diag([2.0, 6.0])  # mean diagonal 4: π would be 2 with G's 1
  for g_zero, a_zero in ((True, False), (False, True)):
    a = np.zeros((2, 2)) if a_zero else activation
    g = np.zeros((3, 3)) if g_zero else 5 * np.eye(3)
    scaled = inverse_lib.factored_damping_scaled(
        LayerFactors(jnp.asarray(a, jnp.float32), jnp.asarray(g, jnp.float32)),
        jnp.float32(9.0))
    # √9 = 3 exactly, one division.
    close(scaled.activation_factor, a / 3, terms=1)
    close(scaled.gradient_factor, g / 3, terms=1)


def test_a_nearly_singular_step_size_system_falls_back_to_alpha_alone():
  """δ almost parallel to Δ: det/(Q₀₀Q₁₁) ≈ 2.4e-7 is below the singular
  tolerance, so μ = 0 and α = −g₀/Q₀₀ (closed form) rather than the
  ill-conditioned 2×2 solve's huge pair."""
  eps = float(np.finfo(np.float32).eps) * 2  # 1 + eps is exact in float32
  curvature = jnp.asarray([[1.0, 1.0], [1.0, 1.0 + eps]], jnp.float32)
  coefficients = quadratic_model.solve_step_sizes(
      curvature, jnp.zeros((2, 2), jnp.float32),
      jnp.asarray([-1.0, 0.5], jnp.float32), jnp.float32(0.0),
      use_momentum=True)
  close(coefficients, [1.0, 0.0], terms=1)  # −g₀/Q₀₀, one division
  # A well-conditioned system still gets the exact 2×2 solution.
  curvature = jnp.asarray([[2.0, 0.5], [0.5, 1.0]], jnp.float32)
  g = np.array([-1.0, 0.5])
  coefficients = quadratic_model.solve_step_sizes(
      curvature, jnp.zeros((2, 2), jnp.float32), jnp.asarray(g, jnp.float32),
      jnp.float32(0.0), use_momentum=True)
  # Cramer's rule (5 roundings of u = ε/2, under 3 of ε) through its
  # conditioning.
  close(coefficients, -np.linalg.solve(np.asarray(curvature), g), terms=3,
        condition=np.linalg.cond(np.asarray(curvature)))


@pytest.mark.parametrize("negated, previous, dtype, coefficients", [
    ([-1.0, 2.0], [3.0, -4.0], np.float32, [0.5, 0.25]),   # finite
    ([-1.0, 2.0], [np.nan, 1.0], np.float32, [0.5, 0.0]),  # NaN δ, μ = 0
    ([np.inf, 2.0], [3.0, 1.0], np.float32, [0.0, 0.5]),   # ±Inf Δ, α = 0
    ([-3e38, 0.0], [0.0, 0.0], np.float32, [2.0, 0.0]),    # v past float32
    ([-7e4, 1.0], [0.0, 0.0], np.float16, [1.0, 0.0]),     # v past float16
    ([-6e4, 1.0], [0.0, 0.0], np.float16, [1.0, 0.0]),     # v within it
])
def test_the_update_check_decides_as_an_elementwise_one(
    negated, previous, dtype, coefficients):
  """``_update_finite`` decides from ``cᵀPc`` (and float16 leaves' own
  sums) what ``isfinite`` of every entry of ``v = αΔ + μδ``, cast to δ's
  dtype, decides."""
  negated = np.asarray(negated, np.float32)  # −Δ, as the step is given it
  previous = np.asarray(previous, dtype)
  coefficients = np.asarray(coefficients, np.float32)
  vectors = np.stack([-negated, previous.astype(np.float32)])
  with np.errstate(all="ignore"):
    inner = vectors @ vectors.T  # P = [vᵢᵀvⱼ] in float32, as the step's
    expected = np.all(np.isfinite(
        (coefficients @ vectors).astype(dtype)))
  actual = quadratic_model._update_finite(  # pylint: disable=protected-access
      jnp.asarray(coefficients), jnp.asarray(inner), {"w": jnp.asarray(negated)},
      {"w": jnp.asarray(previous)})
  assert bool(actual) == bool(expected)


def test_a_rejected_step_records_zero_step_sizes():
  """Docstring of ``step``: a non-finite result emits a zero update; the
  state's ``[α, μ]`` are then those of that update, zeros. A restored NaN δ
  leaves α finite (the singular 2×2 system falls back to α alone) while
  the step is rejected: α must not be recorded."""
  params, batch, split, loss_fn = sigmoid_problem()
  tx = kfac_jax.scale_by_kfac(damping=1.0, kl_clip=None,
                              adaptive=kfac_jax.AdaptiveConfig())
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  _, state = tx.update(grads, state, params, kfac_stats=stats,
                       split_loss=split)
  assert np.asarray(state.quadratic_model.step_sizes)[0] != 0
  model = state.quadratic_model
  state = state._replace(quadratic_model=model._replace(
      previous_update=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan),
                                   model.previous_update)))
  updates, state = tx.update(grads, state, params, kfac_stats=stats,
                             split_loss=split)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  np.testing.assert_array_equal(np.asarray(state.quadratic_model.step_sizes),
                                [0.0, 0.0])
