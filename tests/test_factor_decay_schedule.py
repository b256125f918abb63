"""KAISA's factor-averaging schedule and a factor_decay in [0, 1].

``kfac_jax.schedules.exp_decay_factor_averaging`` is checked against
KAISA's formula, written out here as ``kfac_pytorch`` writes it, through the
float64 reference (tests/reference.py): factors, eigenvalues and
preconditioned gradients of the first steps, where the decay is 0 (the
identity start forgotten) and then a running mean.

Tolerances are float32's eps times the size of the computation behind each
quantity (``SIZE``: the longest float32 sum behind a factor entry) and, for
the preconditioned gradients, the condition number of the damped curvature
they are solved with (``conditioning``).
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import reference
from tests.kfac_problems import DAMPING, LEARNING_RATE, as_matrix, make_problem

EPS = float(np.finfo(np.float32).eps)
BATCH = 16  # make_problem's
# A factor entry is a sum over the BATCH rows, of rows that come from dot
# products of at most 7 terms (the MLP's widest layer input, and its
# backward pass through the 7 → 4 kernel).
SIZE = BATCH + 7
KAISA_CAP = 0.95


def kaisa_factor_weight(step: int) -> float:
  """``kfac.hyperparams.exp_decay_factor_averaging()(step)`` of KAISA's
  kfac_pytorch, as written there: its ``step`` is the K-FAC steps taken
  before this one, 0 first, as ``ScaleByKFACState.count``."""
  if step < 0:
    raise ValueError(f"step value cannot be negative. Got step={step}.")
  if step == 0:
    step = 1
  return min(1 - (1 / step), KAISA_CAP)


def conditioning(method: str, a: np.ndarray, g: np.ndarray) -> float:
  """First-order growth of a relative error of A, G or ∇ into the
  preconditioned gradient: ``‖K⁻¹‖·‖K‖`` of ``K = A ⊗ G + λI`` (eigen), or
  the sum of the two damped factors' condition numbers plus their product
  (inverse: ``P = (A + λI)⁻¹ ∇ (G + λI)⁻¹``, each term perturbed apart)."""
  da, dg = (np.maximum(np.linalg.eigvalsh(f), 0) for f in (a, g))
  if method == "eigen":
    return (da.max() * dg.max() + DAMPING) / (da.min() * dg.min() + DAMPING)
  kappa_a, kappa_g = (
    (d.max() + DAMPING) / (d.min() + DAMPING) for d in (da, dg)
  )
  return kappa_a + kappa_g + kappa_a * kappa_g


def compare_with_reference(tx, ref, steps: int, decay_of_step) -> None:
  """``steps`` updates of ``tx`` against ``ref``, whose ``factor_decay`` is
  set to ``decay_of_step(step)`` before each of its steps."""
  params, batches, loss_fn, reference_tensors = make_problem("mlp", True)
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)

  # Per layer, the largest entry of any batch factor so far: the running
  # factors are convex combinations of them (with the identity's 1).
  largest = {}
  for _ in range(steps):
    x, y = next(batches)
    updates, state = step(params, state, x, y)
    tensors = reference_tensors(params, x, y)
    ref.factor_decay = decay_of_step(ref.step)
    expected = ref.update([tensors])
    for name, p_ref in expected.items():
      batch = (
        reference.cov(tensors[name].activation_rows),
        reference.cov(tensors[name].gradient_rows),
      )
      largest[name] = np.maximum(
        largest.get(name, (1.0, 1.0)), [np.abs(f).max() for f in batch]
      )
      a_ref, g_ref = ref.factors[name]
      ours = state.factors[name]
      for got, want, scale, label in (
        (ours.activation_factor, a_ref, largest[name][0], "A"),
        (ours.gradient_factor, g_ref, largest[name][1], "G"),
      ):
        # SIZE roundings per entry, and the decay's own (d and 1 − d).
        np.testing.assert_allclose(
          got,
          want,
          rtol=0,
          atol=(SIZE + 2) * EPS * scale,
          err_msg=f"{name} {label} at {ref.step}",
        )
      factor_error = [
        (SIZE + 2) * EPS * s * len(f)  # ‖δF‖₂ ≤ d·max|δF|
        for s, f in zip(largest[name], (a_ref, g_ref))
      ]
      if ref.method == "eigen":
        _, da, _, dg, _ = ref.decomposition[name]
        precond = state.preconditioners[name]
        # Weyl: |δλ| ≤ ‖δF‖₂, plus eigh's backward error d·eps·‖F‖₂.
        for got, want, error in (
          (precond.activation_eigenvalues, da, factor_error[0]),
          (precond.gradient_eigenvalues, dg, factor_error[1]),
        ):
          np.testing.assert_allclose(
            got,
            want,
            rtol=0,
            atol=error + len(want) * EPS * want.max(),
            err_msg=f"{name} eigenvalues at {ref.step}",
          )
      # Relative errors of the factors (and of ∇, SIZE roundings) grow by
      # the damped curvature's conditioning; KL clipping's ν = √(κ/vg)
      # adds half of vg's, itself at most P's (vg = ∇ᵀK⁻¹∇ > 0: no
      # cancellation).
      relative = max(
        factor_error[0] / largest[name][0],
        factor_error[1] / largest[name][1],
        SIZE * EPS,
      )
      bound = (
        relative
        * conditioning(ref.method, a_ref, g_ref)
        * (1.5 if ref.kl_clip is not None else 1.0)
      )
      got = as_matrix(updates[name])
      assert np.linalg.norm(got - p_ref) <= bound * np.linalg.norm(p_ref), (
        name,
        ref.step,
        np.linalg.norm(got - p_ref) / np.linalg.norm(p_ref),
        bound,
      )
    params = optax.apply_updates(
      params, jax.tree.map(lambda u: -LEARNING_RATE * u, updates)
    )
  assert int(state.skipped_factor_updates) == 0


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_kaisa_schedule_matches_kaisas_formula(compute_method, kl_clip):
  # Steps 0 and 1 at decay 0, then 1/2, 2/3: the first factor is the batch's.
  tx = kfac_jax.scale_by_kfac(
    learning_rate=LEARNING_RATE,
    damping=DAMPING,
    kl_clip=kl_clip,
    compute_method=compute_method,
    damping_mode="absolute",
    factor_decay=kfac_jax.schedules.exp_decay_factor_averaging(),
  )
  ref = reference.KFACReference(
    damping=DAMPING,
    factor_decay=0.0,
    learning_rate=LEARNING_RATE,
    kl_clip=kl_clip,
    method=compute_method,
  )
  compare_with_reference(tx, ref, 4, kaisa_factor_weight)


def test_constant_zero_decay_replaces_the_factors_by_the_batch_factors():
  tx = kfac_jax.scale_by_kfac(
    learning_rate=LEARNING_RATE,
    damping=DAMPING,
    kl_clip=None,
    compute_method="inverse",
    factor_decay=0.0,
    damping_mode="absolute",
  )
  ref = reference.KFACReference(
    damping=DAMPING,
    factor_decay=0.0,
    learning_rate=LEARNING_RATE,
    kl_clip=None,
    method="inverse",
  )
  compare_with_reference(tx, ref, 2, lambda step: 0.0)


def test_schedule_values_and_the_lambda_users_write():
  schedule = kfac_jax.schedules.exp_decay_factor_averaging()
  by_hand = lambda step: jnp.minimum(1.0 - 1.0 / jnp.maximum(step, 1), 0.95)
  kfac_jax.scale_by_kfac(factor_decay=by_hand)  # refused before: 0 at step 0
  steps = jnp.arange(100, dtype=jnp.int32)
  expected = np.array([kaisa_factor_weight(int(t)) for t in steps])
  # 1 − 1/t in float32: one rounding of 1/t and one of the difference.
  np.testing.assert_allclose(
    jax.vmap(schedule)(steps), expected, rtol=0, atol=2 * EPS
  )
  np.testing.assert_array_equal(
    jax.vmap(schedule)(steps), jax.vmap(by_hand)(steps)
  )
  other = kfac_jax.schedules.exp_decay_factor_averaging(min_value=0.5)
  assert [float(other(t)) for t in range(4)] == [0.0, 0.0, 0.5, 0.5]


def test_schedules_docstring_examples_run():
  result = doctest.testmod(kfac_jax.schedules, raise_on_error=False)
  assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(factor_decay=-1e-3), ValueError, r"factor_decay must be in \[0, 1\]"),
    (
      dict(factor_decay=1.0 + 1e-6),
      ValueError,
      r"factor_decay must be in \[0, 1\]",
    ),
    (
      dict(factor_decay=lambda step: jnp.where(step < 1, -0.5, 0.5)),
      ValueError,
      r"factor_decay must be in \[0, 1\].*step 0",
    ),
  ],
)
def test_decay_outside_zero_one_is_refused(kwargs, error, match):
  with pytest.raises(error, match=match):
    kfac_jax.scale_by_kfac(**kwargs)


@pytest.mark.parametrize(
  "min_value, error, match",
  [
    (1.5, ValueError, r"min_value must be in \[0, 1\]"),
    (-0.1, ValueError, r"min_value must be in \[0, 1\]"),
    (lambda step: 0.9, TypeError, "min_value must be a number"),
    ("0.95", TypeError, "min_value must be a real number"),
  ],
)
def test_schedule_min_value_is_checked(min_value, error, match):
  with pytest.raises(error, match=match):
    kfac_jax.schedules.exp_decay_factor_averaging(min_value)


def test_a_decay_below_zero_later_skips_those_factor_updates_only():
  # Valid (0) at steps 0 and 1, negative from 2: two skipped updates, and
  # the factors are those of the two steps at decay 0.
  factors = []
  for decay, steps in (
    (lambda step: jnp.where(step < 2, 0.0, -0.5), 4),
    (0.0, 2),
  ):
    params, batches, loss_fn, _ = make_problem("mlp", True)
    tx = kfac_jax.scale_by_kfac(
      damping=DAMPING, kl_clip=None, factor_decay=decay
    )
    state = tx.init(params)
    # B023: params is read when traced, within this iteration.
    update = jax.jit(
      lambda g, s, st, tx=tx: tx.update(g, s, params, kfac_stats=st)  # noqa: B023
    )
    for _ in range(steps):
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
        params, *next(batches)
      )
      _, state = update(grads, state, stats)
    factors.append(state)
  assert int(factors[0].skipped_factor_updates) == 2
  assert int(factors[1].skipped_factor_updates) == 0
  jax.tree.map(
    np.testing.assert_array_equal, factors[0].factors, factors[1].factors
  )
