"""scale_by_kfac against the independent float64 reference (tests/reference.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import reference

CONV_STRIDES = (2, 1)
CONV_PADDING = ((1, 1), (0, 1))
DAMPING = 0.003
LEARNING_RATE = 0.1
close = reference.assert_float32_close
# reference.assert_float32_close's ``terms`` for make_problem's models. The
# rounding a layer's rows carry: the forward's contractions, the softmax's
# few and the backward's (MLP: 5, 7, 4, 4, 7; CNN: the conv's 3·3·2, the
# dense 36, 4, 4, 36); twice in a factor, which also sums ROWS rows.
CHAIN = {"mlp": 5 + 7 + 4 + 4 + 7, "cnn": 18 + 36 + 4 + 4 + 36}
ROWS = {"mlp": 16, "cnn": 16 * 12}
# KL clipping's sum over the params.
PARAMS = {"mlp": 6 * 7 + 8 * 4, "cnn": 19 * 3 + 37 * 4}


def factor_terms(kind: str, micro_batches: int = 1, mixes: int = 1) -> int:
  """A running factor's: its batch factor's (2·CHAIN + ROWS, summed over
  ``micro_batches``) and each mix's 3."""
  return 2 * CHAIN[kind] + ROWS[kind] + micro_batches + 3 * mixes


def update_terms(kind: str, shape: tuple[int, int], **factor_kwargs) -> int:
  """A preconditioned gradient's ``[dA, dG]``: the factors', the
  gradient's (CHAIN + ROWS), the eigh's (dA² + dG², test_batched), the
  products' and KL clipping's; through K-FAC's conditioning."""
  return (factor_terms(kind, **factor_kwargs) + CHAIN[kind] + ROWS[kind] +
          shape[0]**2 + shape[1]**2 + shape[0] + shape[1] + PARAMS[kind])


class MLP(nn.Module):
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(7, use_bias=self.use_bias)(x))
    return nn.Dense(4, use_bias=self.use_bias)(x)


class CNN(nn.Module):
  use_bias: bool

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(3, (3, 3), strides=CONV_STRIDES, padding=CONV_PADDING,
                use_bias=self.use_bias)(x)
    x = jax.nn.relu(x).reshape(x.shape[0], -1)
    return nn.Dense(4, use_bias=self.use_bias)(x)


def make_problem(kind: str, use_bias: bool, batch: int = 16, seed: int = 0):
  rng = np.random.default_rng(seed)
  if kind == "mlp":
    model = MLP(use_bias)
    shape = (batch, 5)
  else:
    model = CNN(use_bias)
    shape = (batch, 6, 5, 2)
  x0 = jnp.asarray(rng.normal(size=shape), jnp.float32)
  params = model.init(jax.random.PRNGKey(seed), x0)["params"]
  # Non-zero biases so the bias rows matter.
  params = jax.tree.map(
      lambda p: p + 0.1 * jnp.asarray(rng.normal(size=p.shape), p.dtype),
      params)

  def batches():
    while True:
      yield (jnp.asarray(rng.normal(size=shape), jnp.float32),
             jnp.asarray(rng.integers(0, 4, size=shape[0]), jnp.int32))

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def reference_tensors(params, x, y):
    numpy_params = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    x, y = np.asarray(x, np.float64), np.asarray(y)
    if kind == "mlp":
      return reference.mlp_forward_backward(numpy_params, x, y, use_bias)
    return reference.cnn_forward_backward(numpy_params, x, y, use_bias,
                                          CONV_STRIDES, CONV_PADDING)

  return params, batches(), loss_fn, reference_tensors


def as_matrix(layer_tree) -> np.ndarray:
  kernel = np.asarray(layer_tree["kernel"], np.float64)
  matrix = kernel.reshape(-1, kernel.shape[-1])
  if "bias" in layer_tree:
    matrix = np.concatenate([matrix, np.asarray(layer_tree["bias"])[None]])
  return matrix


def run_and_compare(kind, use_bias, steps=3, accumulation_steps=1, **kwargs):
  """Runs scale_by_kfac and the reference side by side; checks every step."""
  params, batches, loss_fn, reference_tensors = make_problem(kind, use_bias)
  tx = kfac_jax.scale_by_kfac(learning_rate=LEARNING_RATE, damping=DAMPING,
                              accumulation_steps=accumulation_steps, **kwargs)
  ref = reference.KFACReference(
      damping=DAMPING,
      factor_decay=kwargs.get("factor_decay", 0.95),
      learning_rate=LEARNING_RATE,
      kl_clip=kwargs.get("kl_clip", 0.001),
      method=kwargs.get("compute_method", "eigen"),
      factor_update_steps=kwargs.get("factor_update_steps", 1),
      inv_update_steps=kwargs.get("inv_update_steps", 1),
      outer_product=kwargs.get("compute_eigenvalue_outer_product", True))
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)

  for _ in range(steps):
    micro = [next(batches) for _ in range(accumulation_steps)]
    for i, (x, y) in enumerate(micro):
      updates, state = step(params, state, x, y)
      if i < accumulation_steps - 1:
        assert all(not np.any(u) for u in jax.tree.leaves(updates))
    expected = ref.update([reference_tensors(params, x, y) for x, y in micro])
    mixes = sum(step % ref.factor_update_steps == 0
                for step in range(ref.step))
    rounding = dict(micro_batches=accumulation_steps, mixes=mixes)
    for name, p_ref in expected.items():
      where = f"{name} at step {ref.step}"
      close(as_matrix(updates[name]), p_ref,
            terms=update_terms(kind, p_ref.shape, **rounding),
            condition=reference.kfac_condition({name: ref.factors[name]},
                                               DAMPING), err_msg=where)
      a_ref, g_ref = ref.factors[name]
      identity_weight = ref.factor_decay**mixes
      for got, factor in ((state.factors[name].activation_factor, a_ref),
                          (state.factors[name].gradient_factor, g_ref)):
        close(got, factor, terms=factor_terms(kind, **rounding),
              scale=reference.running_factor_scale(factor, identity_weight),
              err_msg=where)
      if ref.method == "eigen":
        _, da, _, dg, _ = ref.decomposition[name]
        precond = state.preconditioners[name]
        # The factor's rounding and the eigh's (d², test_batched): Weyl.
        for got, values in ((precond.activation_eigenvalues, da),
                            (precond.gradient_eigenvalues, dg)):
          close(got, values,
                terms=factor_terms(kind, **rounding) + len(values)**2,
                err_msg=where)
    # Move the params so the next step sees new activations.
    params = optax.apply_updates(
        params, jax.tree.map(lambda u: -LEARNING_RATE * u, updates))
  assert int(state.count) == steps


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_matches_reference(kind, use_bias, compute_method, kl_clip):
  run_and_compare(kind, use_bias, compute_method=compute_method,
                  kl_clip=kl_clip)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_update_intervals(compute_method):
  run_and_compare("cnn", True, steps=6, compute_method=compute_method,
                  factor_update_steps=2, inv_update_steps=3, factor_decay=0.8)


def test_eigenvalue_outer_product_formed_each_step():
  run_and_compare("mlp", True, steps=4, inv_update_steps=2,
                  compute_eigenvalue_outer_product=False)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_accumulation(kind):
  run_and_compare(kind, True, steps=2, accumulation_steps=3,
                  inv_update_steps=2)


def test_accumulation_with_factor_updates_every_other_step():
  # The micro-batches' factor sums follow the optimizer step's count: summed
  # on factor steps only, zeros blended in otherwise.
  run_and_compare("mlp", True, steps=4, accumulation_steps=2,
                  factor_update_steps=2, inv_update_steps=2)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_accumulation_steps_equal_one_step_on_the_concatenated_batch(kind):
  # G was the mean of the micro-batches' G: k² times the concatenated
  # batch's, as each micro-batch's loss is a mean over its own rows.
  params, batches, loss_fn, _ = make_problem(kind, True)
  micro = [next(batches) for _ in range(3)]
  whole = tuple(np.concatenate(arrays) for arrays in zip(*micro))
  capture = jax.jit(kfac_jax.value_grad_and_stats(loss_fn))
  settings = dict(damping=DAMPING, kl_clip=None, factor_decay=0.5)
  accumulating = kfac_jax.scale_by_kfac(accumulation_steps=3, **settings)
  state = accumulating.init(params)
  for x, y in micro:
    _, grads, stats = capture(params, x, y)
    updates, state = accumulating.update(grads, state, params,
                                         kfac_stats=stats)
  single = kfac_jax.scale_by_kfac(**settings)
  _, grads, stats = capture(params, *whole)
  expected, expected_state = single.update(grads, single.init(params), params,
                                           kfac_stats=stats)
  # The micro-batches' factor sums against the whole batch's, in another
  # order: each side's factor rounding, through K-FAC's conditioning.
  condition = reference.kfac_condition(expected_state.factors, DAMPING)
  for name, update in expected.items():
    shape = (len(expected_state.factors[name].activation_factor),
             len(expected_state.factors[name].gradient_factor))
    jax.tree.map(lambda a, b, shape=shape: close(
        a, b, terms=update_terms(kind, shape, micro_batches=3),
        condition=condition, scale=reference.largest(jax.tree.leaves(update))),
                 updates[name], update)
  jax.tree.map(lambda a, b: close(
      a, b, terms=factor_terms(kind, micro_batches=3),
      scale=reference.running_factor_scale(b, 0.5)), state.factors,
               expected_state.factors)


def test_schedules_are_called_with_the_step():
  damping = optax.linear_schedule(0.01, 0.001, 4)
  params, batches, loss_fn, reference_tensors = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(damping=damping, kl_clip=None,
                              compute_method="inverse")
  state = tx.init(params)
  for step in range(3):
    x, y = next(batches)
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
  a = np.asarray(state.factors["Dense_0"].activation_factor, np.float64)
  reference.assert_damped_inverse(
      state.preconditioners["Dense_0"].activation_inverse, a,
      float(damping(2)))


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
      jax.tree.map(lambda a, b, shape=shape, scale=scale, step=step: close(
          a, b, terms=update_terms("mlp", shape, mixes=step + 1),
          condition=condition, scale=scale), got[name], layer)


def test_schedules_that_go_out_of_range_later_leave_the_state_as_it_was():
  # Checked at step 0 only, such a schedule silently corrupted training: λ
  # going negative gave finite, wrongly signed preconditioners; a decay
  # going NaN made the factors NaN; an interval reaching 0 stopped the
  # updates (count % 0 == count).
  bad_from_2 = lambda good, bad: lambda step: jnp.where(step < 2, good, bad)
  base = dict(kl_clip=None, inv_update_steps=1)
  updates, state = _run_steps(kfac_jax.scale_by_kfac(
      damping=bad_from_2(DAMPING, -1.0), **base))
  reference_updates, reference_state = _run_steps(
      kfac_jax.scale_by_kfac(damping=DAMPING, **base))
  for step in range(2):
    assert_same_steps(updates[step:step + 1], reference_updates[step:step + 1],
                      reference_state)
  for step in (2, 3):  # no K-FAC step, each decomposition counted
    assert all(not np.any(u) for u in jax.tree.leaves(updates[step]))
  assert int(state.rejected_decompositions) == 2 * 2
  jax.tree.map(np.testing.assert_array_equal, state.factors,
               reference_state.factors)  # λ does not enter the factors
  _, two_steps = _run_steps(kfac_jax.scale_by_kfac(damping=DAMPING, **base),
                            steps=2)
  # Kept from step 1: the same decomposition of the same factors (bit for
  # bit, above) in another program; the elementwise work after it may round
  # differently (3 roundings).
  jax.tree.map(lambda a, b: close(a, b, terms=3), state.preconditioners,
               two_steps.preconditioners)
  # +inf passes `λ > 0`: refused as non-finite, not decomposed into zeros.
  updates, state = _run_steps(kfac_jax.scale_by_kfac(
      damping=bad_from_2(DAMPING, float("inf")), **base))
  assert all(not np.any(u) for u in jax.tree.leaves(updates[2:]))
  assert int(state.rejected_decompositions) == 2 * 2
  jax.tree.map(lambda a, b: close(a, b, terms=3), state.preconditioners,
               two_steps.preconditioners)

  for bad in (float("nan"), 1.5):
    _, state = _run_steps(kfac_jax.scale_by_kfac(
        damping=DAMPING, factor_decay=bad_from_2(0.5, bad), **base))
    _, two_steps = _run_steps(kfac_jax.scale_by_kfac(
        damping=DAMPING, factor_decay=0.5, **base), steps=2)
    assert int(state.skipped_factor_updates) == 2
    jax.tree.map(np.testing.assert_array_equal, state.factors,
                 two_steps.factors)

  # An interval that reaches 0 counts as 1: the same run as interval 1.
  updates, state = _run_steps(kfac_jax.scale_by_kfac(
      damping=DAMPING, kl_clip=None,
      inv_update_steps=bad_from_2(jnp.int32(1), jnp.int32(0)),
      factor_update_steps=bad_from_2(jnp.int32(1), jnp.int32(-3))))
  assert_same_steps(updates, reference_updates, reference_state)

  # A NaN learning rate (KL clipping reads it): no K-FAC step either, also
  # beside a schedule that stays in range (every one must be).
  updates, _ = _run_steps(kfac_jax.scale_by_kfac(
      damping=lambda step: jnp.float32(DAMPING),
      learning_rate=bad_from_2(0.1, float("nan"))))
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
  assert all(not np.any(u) for u in jax.tree.leaves(updates[3]))
  assert any(np.any(u) for u in jax.tree.leaves(updates[1]))


def test_injected_values_out_of_range_under_a_jitted_init_are_guarded():
  # Traced, they could not be range-checked; a negative λ gave finite,
  # wrongly signed preconditioners.
  tx = optax.inject_hyperparams(
      kfac_jax.scale_by_kfac,
      static_args=("accumulation_steps",))(damping=-1.0, kl_clip=None)
  params, batches, loss_fn, _ = make_problem("mlp", True)
  state = jax.jit(tx.init)(params)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  updates, state = jax.jit(
      lambda g, s, st: tx.update(g, s, params, kfac_stats=st))(grads, state,
                                                                stats)
  assert all(not np.any(u) for u in jax.tree.leaves(updates))
  assert int(state.inner_state.rejected_decompositions) == 2


def test_an_accumulator_past_its_last_micro_step_emits_or_is_refused():
  # A state saved mid-accumulation with accumulation_steps=3 (micro-step 2)
  # and resumed with 2: the update held forever (micro_step == 1 never
  # again) and emitted zeros.
  _, state = _run_steps(kfac_jax.scale_by_kfac(
      damping=DAMPING, accumulation_steps=3), steps=5)
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
    resumed[k] = jax.jit(lambda g, s, st, tx=tx: tx.update(
        g, s, params, kfac_stats=st))(grads, state, stats)
  updates, new_state = resumed[2]
  assert int(new_state.count) == 2
  assert int(new_state.accumulator.micro_step) == 0
  assert any(np.any(u) for u in jax.tree.leaves(updates))
  # The same mean of the same sums, by 3 either way (1 rounding), mixed
  # in (3), then the same step: its rounding through K-FAC's conditioning.
  updates_3, state_3 = resumed[3]
  assert_same_steps([updates], [updates_3], state_3)
  jax.tree.map(lambda a, b: close(a, b, terms=1 + 3), new_state.factors,
               state_3.factors)


def test_zero_learning_rate_clips_nothing():
  """At lr 0 (a warmup's first step) ν = 1: the update is the unclipped one."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  warmup = optax.linear_schedule(0.0, LEARNING_RATE, 10)
  updates = {}
  for kl_clip in (1e-12, None):  # 1e-12 would clip any step with lr > 0
    tx = kfac_jax.scale_by_kfac(learning_rate=warmup, damping=DAMPING,
                                kl_clip=kl_clip)
    updates[kl_clip], _ = tx.update(grads, tx.init(params), params,
                                    kfac_stats=stats)
  for a, b in zip(jax.tree.leaves(updates[1e-12]),
                  jax.tree.leaves(updates[None])):
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
    tx = kfac_jax.scale_by_kfac(learning_rate=LEARNING_RATE, damping=DAMPING,
                                kl_clip=kl_clip)
    updates[kl_clip], _ = tx.update(grads, tx.init(params), params,
                                    kfac_stats=stats)
  # ν = 1 exactly: the same preconditioned gradients (in another program:
  # their products' dA + dG roundings, at most 8 + 7).
  for name, layer in updates[None].items():
    scale = reference.largest(jax.tree.leaves(layer))
    jax.tree.map(lambda a, b, scale=scale: close(a, b, terms=8 + 7,
                                                 scale=scale),
                 updates[1e6][name], layer)


def _gradient_matrix(layer) -> np.ndarray:
  """``[kernel; bias]`` of a Dense layer's params or gradient, float64."""
  return np.concatenate([np.asarray(layer["kernel"], np.float64),
                         np.asarray(layer["bias"], np.float64)[None]])


@pytest.mark.parametrize("outer_product", [True, False])
def test_eigen_damping_between_decompositions(outer_product):
  """With compute_eigenvalue_outer_product the scale 1/(d_A d_Gᵀ + λ) is
  computed at the decomposition and keeps that step's λ; without, each step
  divides by its own λ. Against Q_A[(Q_Aᵀ∇Q_G)/(d_A d_Gᵀ + λ)]Q_Gᵀ in
  float64 from the state's eigenbases."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  decomposition_damping, later_damping = 1e-2, 1.0
  tx = kfac_jax.scale_by_kfac(
      damping=lambda step: jnp.where(step == 0, decomposition_damping,
                                     later_damping),
      kl_clip=None, inv_update_steps=2,
      compute_eigenvalue_outer_product=outer_product)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  _, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  damping = decomposition_damping if outer_product else later_damping
  for name, preconditioner in state.preconditioners.items():
    q_a, d_a, q_g, d_g = (np.asarray(a, np.float64) for a in (
        preconditioner.activation_eigenvectors,
        preconditioner.activation_eigenvalues,
        preconditioner.gradient_eigenvectors,
        preconditioner.gradient_eigenvalues))
    gradient = _gradient_matrix(grads[name])
    rotated = q_a.T @ gradient @ q_g
    scales = np.outer(d_a, d_g) + damping
    expected = q_a @ (rotated / scales) @ q_g.T
    # Both rotations' products (2·(dA + dG)), the division and the outer
    # product: each of ‖∇‖, divided by at most the smallest d_A d_Gᵀ + λ.
    terms = 2 * sum(gradient.shape) + 2
    close(_gradient_matrix(updates[name]), expected, terms=terms,
          scale=np.linalg.norm(gradient) / scales.min(), err_msg=name)


@pytest.mark.parametrize("compute_method, outer_product, scale", [
    ("inverse", False, 1.0), ("eigen", True, 1.0),
    ("eigen", False, 1 / (1 + DAMPING))])
def test_the_preconditioner_before_the_first_decomposition(
    compute_method, outer_product, scale):
  """What ``init`` holds until the first decomposition (a step that is not
  one, here count 1 of 10; or a rejected first one): identity factors. The
  inverse method and the eigen method's precomputed scale hold them
  undamped (λ enters at the decomposition), so ∇ passes unchanged; the
  eigen method without it divides by d_A d_Gᵀ + λ = 1 + λ."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(damping=DAMPING, kl_clip=None,
                              inv_update_steps=10,
                              compute_method=compute_method,
                              compute_eigenvalue_outer_product=outer_product)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  state = tx.init(params)
  updates, _ = tx.update(grads, state._replace(count=jnp.ones_like(
      state.count)), params, kfac_stats=stats)
  for name in stats:
    # Identity factors: at most λ's shift and the division round.
    close(_gradient_matrix(updates[name]),
          scale * _gradient_matrix(grads[name]), terms=2)


def test_dense_layer_equals_explicit_kronecker_solve():
  """P = solve(kron(A, G) + λI, vec(∇)) with the explicit Kronecker matrix."""
  params, batches, loss_fn, reference_tensors = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(damping=DAMPING, kl_clip=None, factor_decay=0.5)
  state = tx.init(params)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  tensors = reference_tensors(params, x, y)
  for name in ("Dense_0", "Dense_1"):
    a = 0.5 * np.eye(tensors[name].activation_rows.shape[1]) + 0.5 * reference.cov(
        tensors[name].activation_rows)
    g = 0.5 * np.eye(tensors[name].gradient_rows.shape[1]) + 0.5 * reference.cov(
        tensors[name].gradient_rows)
    grad = tensors[name].gradient
    kron = np.kron(a, g) + DAMPING * np.eye(a.shape[0] * g.shape[0])
    expected = np.linalg.solve(kron, grad.reshape(-1)).reshape(grad.shape)
    close(as_matrix(updates[name]), expected,
          terms=update_terms("mlp", grad.shape),
          condition=reference.kfac_condition({name: (a, g)}, DAMPING),
          err_msg=name)


def test_unregistered_gradients_pass_through_and_skip_layers():
  class WithNorm(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.LayerNorm()(nn.Dense(6, name="encoder")(x))
      return nn.Dense(3, name="head")(x)

  model = WithNorm()
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(params):
    return jnp.sum(model.apply({"params": params}, x)**2)

  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  table = kfac_jax.trace_layers(loss_fn, params)
  for skip, preconditioned, layers in [(None, {"encoder", "head"}, None),
                                       (["^head$"], {"encoder"}, None),
                                       (["Dense"], set(), None),
                                       # By class with the table too (init
                                       # once said the params lacked them).
                                       (["Dense"], set(), table),
                                       (["^head$"], {"encoder"}, table),
                                       # By path: no K-FAC state at all.
                                       (["encoder|head"], set(), None)]:
    tx = kfac_jax.scale_by_kfac(skip_layers=skip, layers=layers)
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params, kfac_stats=stats)
    for name in ("encoder", "head", "LayerNorm_0"):
      same = all(
          np.array_equal(u, g)
          for u, g in zip(jax.tree.leaves(updates[name]),
                          jax.tree.leaves(grads[name])))
      assert same == (name not in preconditioned), (skip, layers, name)


class Encoder(nn.Module):

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4)(jnp.tanh(nn.Dense(6)(x))))


class EncoderThenHead(nn.Module):
  """Layers under a parent module (``encoder/Dense_0``, ``encoder/Dense_1``)
  and one at the top (``head``)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="head")(Encoder(name="encoder")(x))


def test_a_skipped_module_leaves_every_layer_under_it():
  # An anchored pattern naming a parent module matches none of its layers'
  # own paths: the modules above each layer are tested too.
  model = EncoderThenHead()
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p: jnp.sum(model.apply({"params": p}, x)**2))(params)
  tx = kfac_jax.scale_by_kfac(skip_layers=["^encoder$"])
  state = tx.init(params)
  assert sorted(state.factors) == ["head"]
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  jax.tree.map(np.testing.assert_array_equal, updates["encoder"],
               grads["encoder"])
  assert not np.array_equal(updates["head"]["kernel"], grads["head"]["kernel"])


def test_a_table_with_a_parent_module_withheld_by_the_chain():
  """The layer table has encoder/Dense_0 and encoder/Dense_1; Adam gets the
  whole encoder, labelled as one module (one optax.MaskedNode in K-FAC's
  params): not layers the params lack, and the head is preconditioned as
  when K-FAC skips the encoder."""
  model = EncoderThenHead()
  x = jnp.asarray(np.random.default_rng(9).normal(size=(4, 5)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x)**2)
  table = kfac_jax.trace_layers(loss_fn, params)
  assert sorted(table) == ["encoder/Dense_0", "encoder/Dense_1", "head"]
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  kfac = kfac_jax.scale_by_kfac(damping=DAMPING, kl_clip=None, layers=table)
  tx = optax.multi_transform({"kfac": kfac, "adam": optax.adam(1e-3)},
                             {"encoder": "adam", "head": "kfac"})
  state = tx.init(params)
  assert list(state.inner_states["kfac"].inner_state.factors) == ["head"]
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  skipping = kfac_jax.scale_by_kfac(damping=DAMPING, kl_clip=None,
                                    layers=table, skip_layers=["^encoder/"])
  expected, _ = skipping.update(grads, skipping.init(params), params,
                                kfac_stats=stats)
  # The same step on the same inputs in another program: head's factor
  # sums (4 rows) and eigh (to 5² + 3²), through K-FAC's conditioning.
  tolerance = dict(
      terms=4 + 5**2 + 3**2,
      condition=reference.kfac_condition(
          state.inner_states["kfac"].inner_state.factors, DAMPING),
      scale=reference.largest(jax.tree.leaves(expected["head"])))
  jax.tree.map(lambda a, b: close(a, b, **tolerance), updates["head"],
               expected["head"])


@pytest.mark.parametrize("labels_as", ["leaves", "prefix"])
@pytest.mark.parametrize("wrap", ["multi_transform", "masked"])
def test_layers_masked_out_by_the_chain_are_left_alone(wrap, labels_as):
  """K-FAC on the body, Adam on the head (multi_transform), or K-FAC masked
  to the body: equal to K-FAC skipping the head (init once crashed on
  optax.MaskedNode). Labels per leaf, or per module (a prefix of the params,
  as optax allows: update once raised on the head's stats)."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  label = lambda name: "adam" if name == "Dense_1" else "kfac"
  labels = {name: (label(name) if labels_as == "prefix" else
                   jax.tree.map(lambda _, name=name: label(name), leaves))
            for name, leaves in params.items()}
  body = kfac_jax.kfac(LEARNING_RATE, damping=DAMPING)
  if wrap == "multi_transform":
    tx = optax.multi_transform({"kfac": body, "adam": optax.adam(1e-3)},
                               labels)
  else:
    tx = optax.masked(body, jax.tree.map(lambda label: label == "kfac",
                                         labels))
  updates, _ = jax.jit(lambda g, s: tx.update(g, s, params, kfac_stats=stats))(
      grads, tx.init(params))
  skipping = kfac_jax.kfac(LEARNING_RATE, damping=DAMPING,
                           skip_layers=["^Dense_1$"])
  expected, skipping_state = skipping.update(grads, skipping.init(params),
                                            params, kfac_stats=stats)
  # One jitted, the other not: float32 rounding apart (2.2e-5 relative in
  # one entry with --xla_cpu_multi_thread_eigen=false, a reduction order):
  # one step's, through K-FAC's conditioning, on the layer's update.
  tolerance = dict(
      terms=update_terms("mlp", (6, 7)),
      condition=reference.kfac_condition(
          reference.kfac_state(skipping_state).factors, DAMPING),
      scale=reference.largest(jax.tree.leaves(expected["Dense_0"])))
  jax.tree.map(lambda a, b: close(a, b, **tolerance), updates["Dense_0"],
               expected["Dense_0"])
  head = (optax.adam(1e-3).update(grads["Dense_1"], optax.adam(1e-3).init(
      params["Dense_1"]))[0] if wrap == "multi_transform" else
          grads["Dense_1"])  # optax.masked passes the rest through
  # Adam's elementwise chain: 10 roundings.
  jax.tree.map(lambda a, b: close(a, b, terms=10), updates["Dense_1"], head)


def test_inject_hyperparams_equals_building_with_the_values():
  """optax.inject_hyperparams(kfac_jax.kfac / scale_by_kfac): a jitted update
  equals the transformation built with the same values, and changing an
  injected value in the state equals building with the new one."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  update = jax.jit(lambda tx, g, s: tx.update(g, s, params, kfac_stats=stats),
                   static_argnums=0)
  cases = [
      (optax.inject_hyperparams(kfac_jax.kfac)(
          learning_rate=LEARNING_RATE, damping=DAMPING),
       "learning_rate", 0.5 * LEARNING_RATE,
       lambda lr: kfac_jax.kfac(lr, damping=DAMPING)),
      # damping was left in **kfac_kwargs, static: not in the hyperparams.
      (optax.inject_hyperparams(kfac_jax.kfac)(
          learning_rate=LEARNING_RATE, damping=DAMPING),
       "damping", 10 * DAMPING,
       lambda damping: kfac_jax.kfac(LEARNING_RATE, damping=damping)),
      (optax.inject_hyperparams(
          kfac_jax.scale_by_kfac, static_args=("accumulation_steps",))(
              learning_rate=LEARNING_RATE, damping=DAMPING),
       "damping", 10 * DAMPING,
       lambda damping: kfac_jax.scale_by_kfac(learning_rate=LEARNING_RATE,
                                              damping=damping))]
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
      assert_same_steps([updates], [expected],
                        reference.kfac_state(built_state))
  # A dtype given as the scalar type (callable: inject_hyperparams calls it
  # as a schedule) is refused with the way out.
  with pytest.raises(TypeError, match="inv_dtype must be a dtype.*static_args"):
    optax.inject_hyperparams(kfac_jax.scale_by_kfac)(
        inv_dtype=jnp.bfloat16).init(params)
  # Static arguments must stay static, and the error says how.
  injected = optax.inject_hyperparams(kfac_jax.scale_by_kfac)(damping=DAMPING)
  with pytest.raises(TypeError, match="static_args=\\('accumulation_steps',\\)"):
    update(injected, grads, injected.init(params))


# A NumPy integer as well: the alias once wrapped SGD in MultiSteps only for
# a Python int, so SGD stepped on every micro-batch. Nesterov reaches SGD.
@pytest.mark.parametrize("steps_type,nesterov",
                         [(int, False), (np.int64, False), (int, True)])
def test_kfac_alias_with_accumulation_matches_manual_chain(steps_type,
                                                           nesterov):
  params, batches, loss_fn, _ = make_problem("mlp", True)
  micro = [next(batches) for _ in range(6)]
  # A KL bound that binds, so the learning rate K-FAC gets shows (and one
  # other than scale_by_kfac's default).
  learning_rate = 0.05
  kwargs = dict(damping=DAMPING, inv_update_steps=2, accumulation_steps=2,
                kl_clip=1e-5)
  alias = kfac_jax.kfac(learning_rate, momentum=0.9, weight_decay=1e-3,
                        nesterov=nesterov,
                        **{**kwargs, "accumulation_steps": steps_type(2)})
  plain = kfac_jax.scale_by_kfac(learning_rate=learning_rate, **kwargs)
  sgd = optax.chain(optax.add_decayed_weights(1e-3),
                    optax.sgd(learning_rate, momentum=0.9, nesterov=nesterov))

  def run_alias(params):
    state = alias.init(params)
    for x, y in micro:
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
      updates, state = alias.update(grads, state, params, kfac_stats=stats)
      params = optax.apply_updates(params, updates)
    return params

  def run_manual(params):
    state, sgd_state = plain.init(params), sgd.init(params)
    for x, y in micro:
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
      pre, state = plain.update(grads, state, params, kfac_stats=stats)
      if int(state.accumulator.micro_step) == 0:  # an optimizer step ended
        updates, sgd_state = sgd.update(pre, sgd_state, params)
        params = optax.apply_updates(params, updates)
    return params, state

  # Three optimizer steps, each its update's rounding (two micro-batches,
  # KL clipping) through K-FAC's conditioning, on the params' scale.
  manual_params, manual_state = run_manual(params)
  tolerance = dict(
      terms=3 * update_terms("mlp", (8, 7), micro_batches=2, mixes=3),
      condition=reference.kfac_condition(manual_state.factors, DAMPING),
      scale=reference.largest(jax.tree.leaves(manual_params)))
  for a, b in zip(jax.tree.leaves(run_alias(params)),
                  jax.tree.leaves(manual_params)):
    close(a, b, **tolerance)
