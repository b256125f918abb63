"""Schedules and injected hyperparameters of ``scale_by_kfac``: called with the
step, guarded where they leave their range, equal to building with the
values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import reference
from tests.kfac_problems import (
  DAMPING,
  LEARNING_RATE,
  make_problem,
  update_terms,
)

close = reference.assert_float32_close


def test_schedules_are_called_with_the_step():
  damping = optax.linear_schedule(0.01, 0.001, 4)
  params, batches, loss_fn, reference_tensors = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(
    damping=damping,
    kl_clip=None,
    compute_method="inverse",
    damping_mode="absolute",
  )
  state = tx.init(params)
  for _ in range(3):
    x, y = next(batches)
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
  a = np.asarray(state.factors["Dense_0"].activation_factor, np.float64)
  reference.assert_damped_inverse(
    state.preconditioners["Dense_0"].activation_inverse, a, float(damping(2))
  )


def _run_steps(tx, steps: int = 4):
  """``steps`` jitted updates of the MLP problem; (per-step updates, final
  state)."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  update = jax.jit(lambda g, s, st: tx.update(g, s, params, kfac_stats=st))
  state = tx.init(params)
  all_updates = []
  for _ in range(steps):
    x, y = next(batches)
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, state = update(grads, state, stats)
    all_updates.append(updates)
  return all_updates, state


def assert_same_steps(updates, expected, state) -> None:
  """_run_steps's per-step ``updates`` are ``expected``'s, the same steps in
  another program: step k's running factors carry k + 1 batch factors'
  rounding, then the update's; through K-FAC's conditioning, on each
  layer's update."""
  condition = reference.kfac_condition(state.factors, DAMPING)
  for step, (got, want) in enumerate(zip(updates, expected)):
    for name, layer in want.items():
      factors = state.factors[name]
      shape = (len(factors.activation_factor), len(factors.gradient_factor))
      scale = reference.largest(jax.tree.leaves(layer))
      jax.tree.map(
        lambda a, b, shape=shape, scale=scale, step=step: close(
          a,
          b,
          terms=update_terms("mlp", shape, mixes=step + 1),
          condition=condition,
          scale=scale,
        ),
        got[name],
        layer,
      )


def test_schedules_that_go_out_of_range_later_leave_the_state_as_it_was():
  # Checked at step 0 only, such a schedule silently corrupted training: λ
  # going negative gave finite, wrongly signed preconditioners; a decay
  # going NaN made the factors NaN; an interval reaching 0 stopped the
  # updates (count % 0 == count).
  bad_from_2 = lambda good, bad: lambda step: jnp.where(step < 2, good, bad)
  base = dict(kl_clip=None, inv_update_steps=1)
  updates, state = _run_steps(
    kfac_jax.scale_by_kfac(damping=bad_from_2(DAMPING, -1.0), **base)
  )
  reference_updates, reference_state = _run_steps(
    kfac_jax.scale_by_kfac(damping=DAMPING, **base)
  )
  for step in range(2):
    assert_same_steps(
      updates[step : step + 1],
      reference_updates[step : step + 1],
      reference_state,
    )
  for step in (2, 3):  # no K-FAC step, each decomposition counted
    assert all(not np.any(u) for u in jax.tree.leaves(updates[step]))
  assert int(state.rejected_decompositions) == 2 * 2
  jax.tree.map(
    np.testing.assert_array_equal, state.factors, reference_state.factors
  )  # λ does not enter the factors
  _, two_steps = _run_steps(
    kfac_jax.scale_by_kfac(damping=DAMPING, **base), steps=2
  )
  # Kept from step 1: the same decomposition of the same factors (bit for
  # bit, above) in another program; the elementwise work after it may round
  # differently (3 roundings).
  jax.tree.map(
    lambda a, b: close(a, b, terms=3),
    state.preconditioners,
    two_steps.preconditioners,
  )
  # +inf passes `λ > 0`: refused as non-finite, not decomposed into zeros.
  updates, state = _run_steps(
    kfac_jax.scale_by_kfac(damping=bad_from_2(DAMPING, float("inf")), **base)
  )
  assert all(not np.any(u) for u in jax.tree.leaves(updates[2:]))
  assert int(state.rejected_decompositions) == 2 * 2
  jax.tree.map(
    lambda a, b: close(a, b, terms=3),
    state.preconditioners,
    two_steps.preconditioners,
  )

  for bad in (float("nan"), 1.5):
    _, state = _run_steps(
      kfac_jax.scale_by_kfac(
        damping=DAMPING, factor_decay=bad_from_2(0.5, bad), **base
      )
    )
    _, two_steps = _run_steps(
      kfac_jax.scale_by_kfac(damping=DAMPING, factor_decay=0.5, **base), steps=2
    )
    assert int(state.skipped_factor_updates) == 2
    jax.tree.map(
      np.testing.assert_array_equal, state.factors, two_steps.factors
    )

  # An interval that reaches 0 counts as 1: the same run as interval 1.
  updates, state = _run_steps(
    kfac_jax.scale_by_kfac(
      damping=DAMPING,
      kl_clip=None,
      inv_update_steps=bad_from_2(jnp.int32(1), jnp.int32(0)),
      factor_update_steps=bad_from_2(jnp.int32(1), jnp.int32(-3)),
    )
  )
  assert_same_steps(updates, reference_updates, reference_state)

  # A NaN learning rate (KL clipping reads it): no K-FAC step either, also
  # beside a schedule that stays in range (every one must be).
  updates, _ = _run_steps(
    kfac_jax.scale_by_kfac(
      damping=lambda step: jnp.float32(DAMPING),
      learning_rate=bad_from_2(0.1, float("nan")),
    )
  )
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
  assert all(not np.any(u) for u in jax.tree.leaves(updates[3]))
  assert any(np.any(u) for u in jax.tree.leaves(updates[1]))


def test_injected_values_out_of_range_under_a_jitted_init_are_guarded():
  # Traced, they could not be range-checked; a negative λ gave finite,
  # wrongly signed preconditioners.
  tx = optax.inject_hyperparams(
    kfac_jax.scale_by_kfac, static_args=("accumulation_steps",)
  )(damping=-1.0, kl_clip=None)
  params, batches, loss_fn, _ = make_problem("mlp", True)
  state = jax.jit(tx.init)(params)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  updates, state = jax.jit(
    lambda g, s, st: tx.update(g, s, params, kfac_stats=st)
  )(grads, state, stats)
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  assert int(state.inner_state.rejected_decompositions) == 2


def test_an_accumulator_past_its_last_micro_step_emits_or_is_refused():
  # A state saved mid-accumulation with accumulation_steps=3 (micro-step 2)
  # and resumed with 2: the update held forever (micro_step == 1 never
  # again) and emitted zeros.
  _, state = _run_steps(
    kfac_jax.scale_by_kfac(damping=DAMPING, accumulation_steps=3), steps=5
  )
  assert int(state.accumulator.micro_step) == 2
  params, batches, loss_fn, _ = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(damping=DAMPING, accumulation_steps=2)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  with pytest.raises(ValueError, match="micro-step 2.*accumulation_steps=2"):
    tx.update(grads, state, params, kfac_stats=stats)
  # Under jit it emits at once, the mean of the three micro-batches held: as
  # the k=3 transformation would (it divided their sum by 2).
  resumed = {}
  for k in (2, 3):
    tx = kfac_jax.scale_by_kfac(damping=DAMPING, accumulation_steps=k)
    resumed[k] = jax.jit(
      lambda g, s, st, tx=tx: tx.update(g, s, params, kfac_stats=st)
    )(grads, state, stats)
  updates, new_state = resumed[2]
  assert int(new_state.count) == 2
  assert int(new_state.accumulator.micro_step) == 0
  assert any(np.any(u) for u in jax.tree.leaves(updates))
  # The same mean of the same sums, by 3 either way (1 rounding), mixed
  # in (3), then the same step: its rounding through K-FAC's conditioning.
  updates_3, state_3 = resumed[3]
  assert_same_steps([updates], [updates_3], state_3)
  jax.tree.map(
    lambda a, b: close(a, b, terms=1 + 3), new_state.factors, state_3.factors
  )


def test_zero_learning_rate_clips_nothing():
  """At lr 0 (a warmup's first step) ν = 1: the update is the unclipped one."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  warmup = optax.linear_schedule(0.0, LEARNING_RATE, 10)
  updates = {}
  for kl_clip in (1e-12, None):  # 1e-12 would clip any step with lr > 0
    tx = kfac_jax.scale_by_kfac(
      learning_rate=warmup, damping=DAMPING, kl_clip=kl_clip
    )
    updates[kl_clip], _ = tx.update(
      grads, tx.init(params), params, kfac_stats=stats
    )
  for a, b in zip(
    jax.tree.leaves(updates[1e-12]), jax.tree.leaves(updates[None])
  ):
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)


def test_a_kl_bound_that_is_not_reached_leaves_the_update_unscaled():
  """ν = min(1, √(kl_clip / |vg|)): a bound far above |vg| scales by 1, the
  update of kl_clip=None (never enlarged)."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  updates = {}
  for kl_clip in (1e6, None):
    tx = kfac_jax.scale_by_kfac(
      learning_rate=LEARNING_RATE, damping=DAMPING, kl_clip=kl_clip
    )
    updates[kl_clip], _ = tx.update(
      grads, tx.init(params), params, kfac_stats=stats
    )
  # ν = 1 exactly: the same preconditioned gradients (in another program:
  # their products' dA + dG roundings, at most 8 + 7).
  for name, layer in updates[None].items():
    scale = reference.largest(jax.tree.leaves(layer))
    jax.tree.map(
      lambda a, b, scale=scale: close(a, b, terms=8 + 7, scale=scale),
      updates[1e6][name],
      layer,
    )


def test_inject_hyperparams_equals_building_with_the_values():
  """optax.inject_hyperparams(kfac_jax.kfac / scale_by_kfac): a jitted update
  equals the transformation built with the same values, and changing an
  injected value in the state equals building with the new one."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  update = jax.jit(
    lambda tx, g, s: tx.update(g, s, params, kfac_stats=stats), static_argnums=0
  )
  cases = [
    (
      optax.inject_hyperparams(kfac_jax.kfac)(
        learning_rate=LEARNING_RATE, damping=DAMPING
      ),
      "learning_rate",
      0.5 * LEARNING_RATE,
      lambda lr: kfac_jax.kfac(lr, damping=DAMPING),
    ),
    # damping was left in **kfac_kwargs, static: not in the hyperparams.
    (
      optax.inject_hyperparams(kfac_jax.kfac)(
        learning_rate=LEARNING_RATE, damping=DAMPING
      ),
      "damping",
      10 * DAMPING,
      lambda damping: kfac_jax.kfac(LEARNING_RATE, damping=damping),
    ),
    (
      optax.inject_hyperparams(
        kfac_jax.scale_by_kfac, static_args=("accumulation_steps",)
      )(learning_rate=LEARNING_RATE, damping=DAMPING),
      "damping",
      10 * DAMPING,
      lambda damping: kfac_jax.scale_by_kfac(
        learning_rate=LEARNING_RATE, damping=damping
      ),
    ),
  ]
  for injected, name, changed, build in cases:
    state = injected.init(params)
    initial = state.hyperparams[name]
    for value in (float(initial), changed):
      state.hyperparams[name] = jnp.asarray(value, initial.dtype)
      updates, _ = update(injected, grads, state)
      built = build(value)
      expected, built_state = update(built, grads, built.init(params))
      # The same step, its values traced or constant: its rounding through
      # K-FAC's conditioning, on each layer's update.
      assert_same_steps(
        [updates], [expected], reference.kfac_state(built_state)
      )
  # A dtype given as the scalar type (callable: inject_hyperparams calls it
  # as a schedule) is refused with the way out.
  with pytest.raises(TypeError, match="inv_dtype must be a dtype.*static_args"):
    optax.inject_hyperparams(kfac_jax.scale_by_kfac)(
      inv_dtype=jnp.bfloat16
    ).init(params)
  # Static arguments must stay static, and the error says how.
  injected = optax.inject_hyperparams(kfac_jax.scale_by_kfac)(damping=DAMPING)
  with pytest.raises(
    TypeError, match="static_args=\\('accumulation_steps',\\)"
  ):
    update(injected, grads, injected.init(params))
