"""The adaptive mode (``transform.quadratic_model``) against dense ones."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax
from examples import models
from kfac_jax.transform import quadratic_model
from tests import reference
from tests.adaptive_problems import (
  L2,
  SIGMOID_LOSS_TERMS,
  SIGMOID_STEP_TERMS,
  adaptive_tx,
  flat64,
  run_steps,
  sigmoid_problem,
)

close = reference.assert_float32_close


def dense_gauss_newton(split: kfac_jax.SplitLoss, params) -> np.ndarray:
  """``Jᵀ H J + L2·I`` as a dense float64 matrix, with the closed-form H.

  For ``mean_b Σ_k sigmoid_ce(z_bk)``, ``H = diag(σ(z)(1 − σ(z))) / B``.
  """
  flat, unravel = ravel_pytree(params)
  logits = np.asarray(split.outputs_fn(params), np.float64)
  jacobian = np.asarray(
    jax.jacobian(lambda f: split.outputs_fn(unravel(f)))(flat), np.float64
  ).reshape(logits.size, flat.size)
  s = 1 / (1 + np.exp(-logits))
  hessian = np.diag((s * (1 - s)).reshape(-1)) / logits.shape[0]
  return jacobian.T @ hessian @ jacobian + L2 * np.eye(flat.size)


def random_like(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params
  )


def test_curvature_products_match_the_dense_gauss_newton_matrix():
  params, _, split, _ = sigmoid_problem()
  vectors = [random_like(params, 1), random_like(params, 2)]
  loss, matrix, gradient_products = quadratic_model.curvature_products(
    split, params, vectors
  )
  dense = dense_gauss_newton(split, params)
  flat = np.stack([flat64(v) for v in vectors])
  # vᵢᵀ(JᵀHJ + L2)vⱼ in float32: the tangents Jv through the dots of 4 and
  # 6, the bias and tanh (each way: 2·12), H's sigmoid, the sums over the
  # 96 outputs and the 51 params; each on the magnitude of its terms.
  close(
    matrix,
    flat @ dense @ flat.T,
    terms=2 * 12 + 3 + 96 + 51,
    scale=np.abs(flat) @ np.abs(dense) @ np.abs(flat).T,
  )
  close(
    loss, quadratic_model.loss_value(split, params), terms=SIGMOID_LOSS_TERMS
  )
  gradient = flat64(
    jax.grad(lambda p: quadratic_model.loss_value(split, p))(params)
  )
  # vᵀ∇ over 51 params of two float32 gradients (backward as much again as
  # the loss), each on |v|ᵀ|∇|.
  close(
    gradient_products,
    flat @ gradient,
    terms=2 * SIGMOID_LOSS_TERMS + 51,
    scale=(np.abs(flat) @ np.abs(gradient)).max(),
  )


def test_a_curvature_mini_batch_measures_rho_on_the_whole_batchs_gradient():
  # With the SplitLoss on part of the batch, ρ divided the part's loss
  # change by the model of the whole batch's gradient: for a tiny step
  # ρ → ∇_partᵀv / ∇ᵀv (anything, even negative), not 1, and λ moved on
  # that alone.
  params, (x, y), _, loss_fn = sigmoid_problem()
  model = models.MLP((6,), 3, jnp.tanh)
  part = kfac_jax.SplitLoss(
    lambda p: model.apply({"params": p}, x[:4]),
    lambda logits: (
      optax.sigmoid_binary_cross_entropy(logits, y[:4]).sum(-1).mean()
    ),
    lambda p: L2 * 0.5 * sum(jnp.vdot(v, v) for v in jax.tree.leaves(p)),
  )
  # A large λ: a tiny step, which the quadratic model predicts closely.
  tx = adaptive_tx(damping=500.0)
  _, state, history = run_steps(tx, params, (x, y), part, loss_fn, 1)
  update, grads = history[0][2], history[0][3]
  part_gradient = jax.grad(lambda p: quadratic_model.loss_value(part, p))(
    params
  )
  old_ratio = float(
    optax.tree.vdot(part_gradient, update) / optax.tree.vdot(grads, update)
  )
  assert abs(old_ratio - 1) > 0.1, old_ratio  # the test tells them apart
  np.testing.assert_allclose(
    float(state.quadratic_model.reduction_ratio), 1.0, atol=0.02
  )


def test_step_sizes_minimise_the_two_dimensional_model():
  rng = np.random.default_rng(0)
  basis = rng.normal(size=(2, 2))
  curvature = basis @ basis.T + 0.1 * np.eye(2)
  vectors = rng.normal(size=(2, 5))
  inner = vectors @ vectors.T
  gradient_products = rng.normal(size=2)
  damping = 0.3
  coefficients = quadratic_model.solve_step_sizes(
    jnp.asarray(curvature, jnp.float32),
    jnp.asarray(inner, jnp.float32),
    jnp.asarray(gradient_products, jnp.float32),
    jnp.float32(damping),
    True,
  )
  system = curvature + damping * inner
  expected = -np.linalg.solve(system, gradient_products)
  # The inputs' rounding to float32 and λ's product and sum (3); Cramer's
  # rule's products and difference in a numerator and in the determinant,
  # and the division (5 of u = ε/2, under 3 of ε): through the system's
  # conditioning.
  close(coefficients, expected, terms=3 + 3, condition=np.linalg.cond(system))
  alpha_only = quadratic_model.solve_step_sizes(
    jnp.asarray(curvature, jnp.float32),
    jnp.asarray(inner, jnp.float32),
    jnp.asarray(gradient_products, jnp.float32),
    jnp.float32(damping),
    False,
  )
  # The inputs' rounding (3), λ's product and sum, the division: 6, on
  # positive terms.
  close(
    alpha_only,
    [-gradient_products[0] / (curvature[0, 0] + damping * inner[0, 0]), 0],
    terms=6,
  )


def test_zero_previous_update_falls_back_to_the_learning_rate_alone():
  curvature = jnp.asarray([[2.0, 0.0], [0.0, 0.0]])
  inner = jnp.asarray([[1.0, 0.0], [0.0, 0.0]])
  coefficients = quadratic_model.solve_step_sizes(
    curvature, inner, jnp.asarray([-3.0, 0.0]), jnp.float32(1.0), True
  )
  np.testing.assert_allclose(np.asarray(coefficients), [1.0, 0.0])


# Martens & Grosse: λω when ρ > ¾, λ/ω when ρ < ¼; the bounds keep λ.
@pytest.mark.parametrize(
  "ratio, factor",
  [(0.9, 0.5), (0.5, 1.0), (0.1, 2.0), (0.75, 1.0), (0.25, 1.0), (np.nan, 2.0)],
)
def test_levenberg_marquardt_rule(ratio, factor):
  config = kfac_jax.AdaptiveConfig(
    damping_adaptation_decay=0.5**0.5, damping_adaptation_interval=2
  )
  new = quadratic_model.adapt_damping(
    jnp.float32(1.0), jnp.float32(ratio), config
  )
  close(new, factor, terms=2)  # ω = decay², then λ·ω (or λ/ω)
  clipped = quadratic_model.adapt_damping(
    jnp.float32(config.max_damping), jnp.float32(ratio), config
  )
  assert float(clipped) <= config.max_damping


def model_gradient(split, step) -> tuple[np.ndarray, np.ndarray]:
  """``(v, ∇ + (C + λI) v)`` of one recorded step, with the dense C.

  The model's gradient is orthogonal to every direction the step was
  optimised along.
  """
  params_t, state_t, updates, grads, _ = step
  update = flat64(updates)
  dense = dense_gauss_newton(split, params_t)
  damping = float(state_t.quadratic_model.damping)
  return update, flat64(grads) + (
    dense + damping * np.eye(len(update))
  ) @ update


def assert_orthogonal(direction, residual, grads):
  assert abs(direction @ residual) < 1e-4 * np.linalg.norm(
    flat64(grads)
  ) * np.linalg.norm(direction)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_update_is_optimal_along_the_previous_update(compute_method):
  """``δᵀ(∇ + (C + λI) v) = 0``: μ minimises the dense model along δ."""
  params, batch, split, loss_fn = sigmoid_problem()
  _, _, history = run_steps(
    adaptive_tx(compute_method=compute_method), params, batch, split, loss_fn, 3
  )
  for step in history[1:]:
    previous = flat64(step[1].quadratic_model.previous_update)
    update, residual = model_gradient(split, step)
    assert np.linalg.norm(previous) > 0
    assert_orthogonal(previous, residual, step[3])
    # And v is not a multiple of δ: the K-FAC direction contributes.
    cosine = (
      update @ previous / np.linalg.norm(update) / np.linalg.norm(previous)
    )
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
    return 0.5 * jnp.mean(jnp.sum((model.apply({"params": p}, x) - y) ** 2, -1))

  split = kfac_jax.SplitLoss(
    lambda p: model.apply({"params": p}, x),
    lambda out: 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1)),
  )
  tx = adaptive_tx(
    damping=1.0, damping_adaptation_interval=2, damping_adaptation_decay=0.5
  )
  _, state, history = run_steps(tx, params, (x, y), split, loss_fn, 5)
  np.testing.assert_allclose(
    float(state.quadratic_model.reduction_ratio), 1.0, atol=2e-3
  )
  # Adapted at steps 0, 2 and 4 (ρ > ¾ each time): λ·(0.5²)³.
  close(state.quadratic_model.damping, 0.25**3, terms=3)  # three λ·ω
  losses = [h[-1] for h in history]
  assert all(b < a for a, b in zip(losses, losses[1:]))


def test_adaptive_kfac_fits_a_learnable_problem():
  """Sanity: the loss falls steadily and λ moves down from its start."""
  params, batch, split, loss_fn = sigmoid_problem(batch=64)
  _, state, history = run_steps(
    adaptive_tx(damping=10.0), params, batch, split, loss_fn, 25
  )
  losses = [h[-1] for h in history]
  assert losses[-1] < 0.7 * losses[0]
  assert float(state.quadratic_model.damping) < 10.0


def test_partition_specs_cover_the_quadratic_model_state():
  params, _, _, _ = sigmoid_problem()
  kwargs = dict(kl_clip=None, adaptive=kfac_jax.AdaptiveConfig())
  specs = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
  state = kfac_jax.scale_by_kfac(**kwargs).init(params)
  assert jax.tree.structure(specs) == jax.tree.structure(
    jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)
  )
  model = specs.quadratic_model
  assert model.damping == jax.sharding.PartitionSpec()
  assert jax.tree.structure(model.previous_update) == jax.tree.structure(params)
  assert all(
    spec == jax.sharding.PartitionSpec()
    for spec in jax.tree.leaves(model.previous_update)
  )


def test_without_momentum_the_update_is_alpha_times_the_direction():
  """``use_momentum=False``: ``v = αΔ`` with α optimal along v itself."""
  params, batch, split, loss_fn = sigmoid_problem()
  _, _, history = run_steps(
    adaptive_tx(use_momentum=False), params, batch, split, loss_fn, 3
  )
  for step in history:
    update, residual = model_gradient(split, step)
    assert_orthogonal(update, residual, step[3])
  assert float(history[-1][1].quadratic_model.step_sizes[1]) == 0.0


def fill_masked(params, full_params):
  """``params`` with the ``optax.MaskedNode`` leaves of another group taken
  from ``full_params`` (the README's recipe for ``optax.multi_transform``)."""
  return jax.tree.map(
    lambda mine, whole: whole if isinstance(mine, optax.MaskedNode) else mine,
    params,
    full_params,
    is_leaf=lambda n: isinstance(n, optax.MaskedNode),
  )


def test_adaptive_mode_in_multi_transform_with_the_masked_params_filled():
  # The README advises multi_transform for parameters outside the blocks;
  # outputs_fn then received optax.MaskedNode leaves and Flax raised
  # ScopeParamNotFoundError. Filled from the full params, the K-FAC group
  # moves as a lone adaptive K-FAC whose other layer gets zero gradients.
  params, batch, split, loss_fn = sigmoid_problem()
  labels = {"Dense_0": "kfac", "Dense_1": "frozen"}
  multi = optax.multi_transform(
    {"kfac": adaptive_tx(), "frozen": optax.set_to_zero()}, labels
  )
  alone = kfac_jax.scale_by_kfac(
    damping=1.0,
    kl_clip=None,
    compute_eigenvalue_outer_product=False,
    adaptive=kfac_jax.AdaptiveConfig(),
    skip_layers=["^Dense_1$"],
    compute_method="eigen",
  )

  @jax.jit
  def multi_step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
    filled = kfac_jax.SplitLoss(
      lambda p: split.outputs_fn(fill_masked(p, params)),
      split.loss_fn,
      lambda p: split.regularizer(fill_masked(p, params)),
    )
    return multi.update(
      grads, state, params, kfac_stats=stats, split_loss=filled
    )

  @jax.jit
  def alone_step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(
      loss_fn, skip_layers=["^Dense_1$"]
    )(params, *batch)
    grads["Dense_1"] = jax.tree.map(jnp.zeros_like, grads["Dense_1"])
    return alone.update(
      grads, state, params, kfac_stats=stats, split_loss=split
    )

  multi_params, multi_state = params, multi.init(params)
  alone_params, alone_state = params, alone.init(params)
  steps = 0
  for _ in range(3):  # the second step on uses the previous update too
    multi_updates, multi_state = multi_step(multi_params, multi_state)
    alone_updates, alone_state = alone_step(alone_params, alone_state)
    assert not any(np.any(u) for u in jax.tree.leaves(alone_updates["Dense_1"]))
    # The same steps in two programs: each step's rounding through K-FAC's
    # conditioning (λ = 1 adapted a little), carried by the next ones.
    steps += 1
    tolerance = dict(
      terms=steps * SIGMOID_STEP_TERMS,
      condition=reference.kfac_condition(
        alone_state.factors, float(alone_state.quadratic_model.damping)
      ),
      scale=reference.largest(jax.tree.leaves(alone_updates)),
    )
    jax.tree.map(
      # B023: tree.map calls it at once.
      lambda a, b: close(a, b, **tolerance),  # noqa: B023
      multi_updates,
      alone_updates,
    )
    multi_params = optax.apply_updates(multi_params, multi_updates)
    alone_params = optax.apply_updates(alone_params, alone_updates)
