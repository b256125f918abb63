"""The adaptive mode's factored damping (π-split λ) and its Fisher-scaled
factors, against dense references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax.capture.layers import ConvGeometry, LayerSignature
from kfac_jax.factors import batch as batch_lib
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import inverse as inverse_lib
from tests import reference
from tests.adaptive_problems import L2, flat64, run_steps, sigmoid_problem

close = reference.assert_float32_close


def test_fisher_scaled_gradient_factor_is_the_per_example_covariance():
  """Dense: ``G = (1/N) Σ ∇ℓᵢ ∇ℓᵢᵀ`` of the output layer, in closed form."""
  params, batch, _, loss_fn = sigmoid_problem()
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  _, gradient_factor = batch_lib.batch_factors(
    stats["Dense_1"], fisher_scaled=True
  )
  x, y = batch
  hidden = np.tanh(
    np.asarray(x, np.float64)
    @ np.asarray(params["Dense_0"]["kernel"], np.float64)
    + np.asarray(params["Dense_0"]["bias"], np.float64)
  )
  logits = hidden @ np.asarray(
    params["Dense_1"]["kernel"], np.float64
  ) + np.asarray(params["Dense_1"]["bias"], np.float64)
  per_example = 1 / (1 + np.exp(-logits)) - np.asarray(y, np.float64)
  # The residuals σ(z) − y carry the dots of 4 and 6, the bias, tanh and
  # the sigmoid (14 roundings), twice in each product; the sum over 32, / 32.
  close(
    gradient_factor[0],
    per_example.T @ per_example / len(per_example),
    terms=2 * 14 + 32 + 1,
  )


def test_fisher_scales_of_a_convolution():
  conv = LayerSignature(
    "Conv", True, conv=ConvGeometry((3, 3), (1, 1), "SAME", (1, 1), (1, 1))
  )
  # B = 2 examples, T = 4·5 output positions: (T², N²·T) with N = B·T.
  assert batch_lib.fisher_scales(jnp.zeros((2, 4, 5, 7)), conv) == (
    20.0**2,
    40.0**2 * 20,
  )


def test_factored_damping_splits_lambda_by_the_trace_ratio():
  """``(A/(π√λ) + I)⁻¹ ∇ (Gπ/√λ + I)⁻¹ = λ (A + π√λI)⁻¹ ∇ (G + √λ/π I)⁻¹``."""
  rng = np.random.default_rng(0)
  a_root, g_root = rng.normal(size=(5, 5)), rng.normal(size=(3, 3))
  activation, gradient = a_root @ a_root.T, 40.0 * g_root @ g_root.T
  grad = rng.normal(size=(5, 3))
  damping = 0.7
  (scaled,) = inverse_lib.factored_damping_scaled(
    {
      "layer": LayerFactors(
        jnp.asarray(activation, jnp.float32), jnp.asarray(gradient, jnp.float32)
      )
    },
    jnp.float32(damping),
  ).values()
  result = (
    np.linalg.inv(np.asarray(scaled.activation_factor) + np.eye(5))
    @ grad
    @ np.linalg.inv(np.asarray(scaled.gradient_factor) + np.eye(3))
  )
  pi = np.sqrt((np.trace(activation) / 5) / (np.trace(gradient) / 3))
  expected = damping * (
    np.linalg.inv(activation + pi * np.sqrt(damping) * np.eye(5))
    @ grad
    @ np.linalg.inv(gradient + np.sqrt(damping) / pi * np.eye(3))
  )
  # The factors' rounding to float32 and π's (traces over 5 and 3, their
  # ratio, the square root; √λ, the division): 13, each factor's through
  # its conditioning, of ‖(A/(π√λ) + I)⁻¹‖‖∇‖‖(Gπ/√λ + I)⁻¹‖.
  a_shifted = np.asarray(scaled.activation_factor, np.float64) + np.eye(5)
  g_shifted = np.asarray(scaled.gradient_factor, np.float64) + np.eye(3)
  close(
    result,
    expected,
    terms=13,
    condition=np.linalg.cond(a_shifted) + np.linalg.cond(g_shifted),
    scale=damping
    * np.linalg.norm(np.linalg.inv(a_shifted), 2)
    * np.linalg.norm(grad)
    * np.linalg.norm(np.linalg.inv(g_shifted), 2),
  )


@pytest.mark.parametrize("gradient_from_stats", [False, True])
def test_inverse_direction_keeps_its_scale_against_unregistered_params(
  gradient_from_stats,
):
  """Adaptive inverse method: the direction is ``(A + π√λI)⁻¹ ∇ (G +
  √λ/π I)⁻¹`` on a registered layer beside the raw ``∇`` of a skipped one,
  so ``v = αΔ`` is one multiple of both. Without the ``/λ`` that undoes
  ``factored_damping_scaled``'s factor the registered part came out λ times
  too large (invisible when every parameter is registered: α absorbs it).
  With ``gradient_from_stats`` at 2 rows the layer is preconditioned as
  ``aᵀg`` (2·(5² + 6² + 5·6) = 182 < 5·6·11 = 330 FLOPs) and the ``/λ``
  is taken on ``g``; its direction is then the data loss's alone."""
  rows = 2 if gradient_from_stats else 32
  params, batch, split, loss_fn = sigmoid_problem(batch=rows)
  damping = 10.0
  tx = kfac_jax.scale_by_kfac(
    damping=damping,
    kl_clip=None,
    compute_method="inverse",
    skip_layers="Dense_1",
    gradient_from_stats=gradient_from_stats,
    adaptive=kfac_jax.AdaptiveConfig(use_momentum=False),
  )
  _, _, history = run_steps(tx, params, batch, split, loss_fn, 2)
  _, _, updates, grads, _ = history[0]
  factors = history[1][1].factors["Dense_0"]
  activation = np.asarray(factors.activation_factor, np.float64)
  gradient = np.asarray(factors.gradient_factor, np.float64)
  pi = np.sqrt(
    (np.trace(activation) / len(activation))
    / (np.trace(gradient) / len(gradient))
  )
  root = np.sqrt(damping)
  layer_gradient = np.concatenate(
    [grads["Dense_0"]["kernel"], grads["Dense_0"]["bias"][None]]
  )
  if gradient_from_stats:
    # aᵀg is the data loss's gradient alone: the loss's L2 term is not in
    # the stats (scale_by_kfac's gradient_from_stats says so).
    layer_params = history[0][0]["Dense_0"]
    layer_gradient = layer_gradient - L2 * np.concatenate(
      [layer_params["kernel"], layer_params["bias"][None]]
    )
  layer_direction = (
    np.linalg.inv(activation + pi * root * np.eye(len(activation)))
    @ layer_gradient
    @ np.linalg.inv(gradient + root / pi * np.eye(len(gradient)))
  )
  direction = np.concatenate(
    [layer_direction.ravel(), flat64(grads["Dense_1"])]
  )
  update = np.concatenate(
    [
      np.concatenate(
        [updates["Dense_0"]["kernel"], updates["Dense_0"]["bias"][None]]
      ).ravel(),
      flat64(updates["Dense_1"]),
    ]
  )
  alpha = (update @ direction) / (direction @ direction)
  assert alpha < 0
  # The float32 direction: the Cholesky inverses (3·(5 + 1), 3·(6 + 1),
  # reference.assert_damped_inverse) through their conditioning, the
  # product with ∇ (5 + 6, and the sum over the rows of aᵀg); α's scale is
  # fitted away.
  condition = np.linalg.cond(
    activation + pi * root * np.eye(len(activation))
  ) + np.linalg.cond(gradient + root / pi * np.eye(len(gradient)))
  close(
    update,
    alpha * direction,
    terms=3 * (5 + 1) + 3 * (6 + 1) + 5 + 6 + rows,
    condition=condition,
  )


def test_factored_damping_gives_each_layer_its_own_pi():
  # Layers of other sizes and trace ratios, scaled together: π = 2 and 1/3,
  # √λ = 2, so every scaled factor is a multiple of I in closed form.
  scaled = inverse_lib.factored_damping_scaled(
    {
      "a": LayerFactors(4 * jnp.eye(3), jnp.eye(2)),
      "b": LayerFactors(jnp.eye(5), 9 * jnp.eye(4)),
    },
    jnp.float32(4.0),
  )
  # π from the traces (up to 5 terms), their ratio, its root, √λ, the
  # division: 10 roundings.
  close(scaled["a"].activation_factor, np.eye(3), terms=10)
  close(scaled["a"].gradient_factor, np.eye(2), terms=10)
  close(scaled["b"].activation_factor, 1.5 * np.eye(5), terms=10)
  close(scaled["b"].gradient_factor, 1.5 * np.eye(4), terms=10)


def test_factored_damping_of_far_apart_traces_does_not_overflow():
  # tr A/dA ÷ tr G/dG = 1e40 overflowed float32 (π = 1e20 does not): π = ∞
  # zeroed A's side and G's inverse, and the layer stopped moving.
  (scaled,) = inverse_lib.factored_damping_scaled(
    {"layer": LayerFactors(1e20 * jnp.eye(3), 1e-20 * jnp.eye(2))},
    jnp.float32(1.0),
  ).values()
  # π from the traces (3 and 2 terms), their ratio, its root, √λ, the
  # division: 8 roundings.
  close(scaled.activation_factor, np.eye(3), terms=8)
  close(scaled.gradient_factor, np.eye(2), terms=8)


def _numpy_forward(params, x, y):
  """``sigmoid_problem``'s model in float64 numpy: (x, hidden, logits, y)."""
  f64 = lambda a: np.asarray(a, np.float64)
  x, y = f64(x), f64(y)
  pre = x @ f64(params["Dense_0"]["kernel"]) + f64(params["Dense_0"]["bias"])
  hidden = np.tanh(pre)
  logits = hidden @ f64(params["Dense_1"]["kernel"]) + f64(
    params["Dense_1"]["bias"]
  )
  return x, hidden, logits, y


def test_adaptive_running_gradient_factor_is_on_the_fishers_scale():
  """Through ``scale_by_kfac(adaptive=...)``: after one step the output
  layer's running ``G = d·I + (1 − d)·(1/N) Σ ∇ℓᵢ∇ℓᵢᵀ`` (closed form, the
  per-example sigmoid residuals), not KAISA's ``1/N²`` of it; ``A`` is the
  plain covariance of ``[hidden, 1]``."""
  params, batch, split, loss_fn = sigmoid_problem()
  decay = 0.5
  tx = kfac_jax.scale_by_kfac(
    damping=1e-2,
    kl_clip=None,
    factor_decay=decay,
    adaptive=kfac_jax.AdaptiveConfig(),
  )
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  _, state = tx.update(grads, state, params, kfac_stats=stats, split_loss=split)
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
    (factors.activation_factor, a_expected, 2 * 6 + 32 + 3),
  ):
    close(
      got,
      expected,
      terms=terms,
      scale=reference.running_factor_scale(expected, decay),
    )


def test_factored_damping_of_a_zero_gradient_factor_uses_pi_one():
  """Documented: a zero factor gets π = 1 (not 0 or ∞), so with G = 0 the
  result is ``(A/√λ, 0)`` whatever A's trace (closed form)."""
  activation = np.diag([2.0, 6.0])  # mean diagonal 4: π would be 2 with G's 1
  for g_zero, a_zero in ((True, False), (False, True)):
    a = np.zeros((2, 2)) if a_zero else activation
    g = np.zeros((3, 3)) if g_zero else 5 * np.eye(3)
    (scaled,) = inverse_lib.factored_damping_scaled(
      {
        "layer": LayerFactors(
          jnp.asarray(a, jnp.float32), jnp.asarray(g, jnp.float32)
        )
      },
      jnp.float32(9.0),
    ).values()
    # √9 = 3 exactly, one division.
    close(scaled.activation_factor, a / 3, terms=1)
    close(scaled.gradient_factor, g / 3, terms=1)
