"""scale_by_kfac against the independent float64 reference (reference.py)."""

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
  as_matrix,
  factor_terms,
  make_problem,
  update_terms,
)

close = reference.assert_float32_close


def run_and_compare(kind, use_bias, steps=3, accumulation_steps=1, **kwargs):
  """Runs scale_by_kfac and the reference side by side; checks every step."""
  params, batches, loss_fn, reference_tensors = make_problem(kind, use_bias)
  kwargs = {"compute_method": "eigen", "kl_clip": 0.001, **kwargs}
  tx = kfac_jax.scale_by_kfac(
    learning_rate=LEARNING_RATE,
    damping=DAMPING,
    accumulation_steps=accumulation_steps,
    **kwargs,
  )
  ref = reference.KFACReference(
    damping=DAMPING,
    factor_decay=kwargs.get("factor_decay", 0.95),
    learning_rate=LEARNING_RATE,
    kl_clip=kwargs.get("kl_clip", 0.001),
    method=kwargs.get("compute_method", "eigen"),
    factor_update_steps=kwargs.get("factor_update_steps", 1),
    inv_update_steps=kwargs.get("inv_update_steps", 1),
    outer_product=kwargs.get("compute_eigenvalue_outer_product", True),
    relative=kwargs.get("damping_mode", "relative") == "relative",
    momentum=kwargs.get("momentum", 0.0),
  )
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
    mixes = sum(step % ref.factor_update_steps == 0 for step in range(ref.step))
    rounding = dict(micro_batches=accumulation_steps, mixes=mixes)
    for name, p_ref in expected.items():
      where = f"{name} at step {ref.step}"
      # Relative damping adds the normalizations' sums of dA and dG
      # diagonal entries.
      close(
        as_matrix(updates[name]),
        p_ref,
        terms=update_terms(kind, p_ref.shape, **rounding)
        + (sum(p_ref.shape) if ref.relative else 0),
        condition=reference.kfac_condition(
          {name: ref.factors[name]}, DAMPING, ref.relative, ref.method
        ),
        err_msg=where,
      )
      a_ref, g_ref = ref.factors[name]
      identity_weight = ref.factor_decay**mixes
      for got, factor in (
        (state.factors[name].activation_factor, a_ref),
        (state.factors[name].gradient_factor, g_ref),
      ):
        close(
          got,
          factor,
          terms=factor_terms(kind, **rounding),
          scale=reference.running_factor_scale(factor, identity_weight),
          err_msg=where,
        )
      if ref.method == "eigen":
        _, da, _, dg, _ = ref.decomposition[name]
        precond = state.preconditioners[name]
        # The factor's rounding and the eigh's (d², test_batched): Weyl.
        for got, values in (
          (precond.activation_eigenvalues, da),
          (precond.gradient_eigenvalues, dg),
        ):
          close(
            got,
            values,
            terms=factor_terms(kind, **rounding) + len(values) ** 2,
            err_msg=where,
          )
    # Move the params so the next step sees new activations.
    params = optax.apply_updates(
      params, jax.tree.map(lambda u: -LEARNING_RATE * u, updates)
    )
  assert int(state.count) == steps


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [0.001, None])
@pytest.mark.parametrize("damping_mode", ["relative", "absolute"])
def test_matches_reference(
  kind, use_bias, compute_method, kl_clip, damping_mode
):
  run_and_compare(
    kind,
    use_bias,
    compute_method=compute_method,
    kl_clip=kl_clip,
    damping_mode=damping_mode,
  )


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_kl_clipping_measures_the_chained_momentums_step(compute_method):
  run_and_compare(
    "mlp", True, compute_method=compute_method, momentum=0.9, kl_clip=1e-4
  )


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_update_intervals(compute_method):
  run_and_compare(
    "cnn",
    True,
    steps=6,
    compute_method=compute_method,
    factor_update_steps=2,
    inv_update_steps=3,
    factor_decay=0.8,
  )


def test_eigenvalue_outer_product_formed_each_step():
  run_and_compare(
    "mlp",
    True,
    steps=4,
    inv_update_steps=2,
    compute_eigenvalue_outer_product=False,
  )


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_accumulation(kind):
  run_and_compare(kind, True, steps=2, accumulation_steps=3, inv_update_steps=2)


def test_accumulation_with_factor_updates_every_other_step():
  # The micro-batches' factor sums follow the optimizer step's count: summed
  # on factor steps only, zeros blended in otherwise.
  run_and_compare(
    "mlp",
    True,
    steps=4,
    accumulation_steps=2,
    factor_update_steps=2,
    inv_update_steps=2,
  )


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
    updates, state = accumulating.update(grads, state, params, kfac_stats=stats)
  single = kfac_jax.scale_by_kfac(**settings)
  _, grads, stats = capture(params, *whole)
  expected, expected_state = single.update(
    grads, single.init(params), params, kfac_stats=stats
  )
  # The micro-batches' factor sums against the whole batch's, in another
  # order: each side's factor rounding, through K-FAC's conditioning.
  condition = reference.kfac_condition(expected_state.factors, DAMPING)
  for name, update in expected.items():
    shape = (
      len(expected_state.factors[name].activation_factor),
      len(expected_state.factors[name].gradient_factor),
    )
    jax.tree.map(
      # B023: tree.map calls it at once.
      lambda a, b, shape=shape: close(
        a,
        b,
        terms=update_terms(kind, shape, micro_batches=3),
        condition=condition,
        scale=reference.largest(jax.tree.leaves(update)),  # noqa: B023
      ),
      updates[name],
      update,
    )
  jax.tree.map(
    lambda a, b: close(
      a,
      b,
      terms=factor_terms(kind, micro_batches=3),
      scale=reference.running_factor_scale(b, 0.5),
    ),
    state.factors,
    expected_state.factors,
  )


def _gradient_matrix(layer) -> np.ndarray:
  """``[kernel; bias]`` of a Dense layer's params or gradient, float64."""
  return np.concatenate(
    [
      np.asarray(layer["kernel"], np.float64),
      np.asarray(layer["bias"], np.float64)[None],
    ]
  )


@pytest.mark.parametrize("outer_product", [True, False])
@pytest.mark.parametrize("damping_mode", ["relative", "absolute"])
def test_eigen_damping_between_decompositions(outer_product, damping_mode):
  """With compute_eigenvalue_outer_product the scale 1/(d_A d_Gᵀ + λ) is
  computed at the decomposition and keeps that step's λ; without, each step
  divides by its own λ. Against Q_A[(Q_Aᵀ∇Q_G)/(d_A d_Gᵀ + λ)]Q_Gᵀ in
  float64 from the state's eigenbases (relative damping: the eigenvalues
  divided by their means)."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  decomposition_damping, later_damping = 1e-2, 1.0
  tx = kfac_jax.scale_by_kfac(
    damping=lambda step: jnp.where(
      step == 0, decomposition_damping, later_damping
    ),
    kl_clip=None,
    inv_update_steps=2,
    damping_mode=damping_mode,
    compute_method="eigen",
    compute_eigenvalue_outer_product=outer_product,
  )
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  _, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  damping = decomposition_damping if outer_product else later_damping
  for name, preconditioner in state.preconditioners.items():
    q_a, d_a, q_g, d_g = (
      np.asarray(a, np.float64)
      for a in (
        preconditioner.activation_eigenvectors,
        preconditioner.activation_eigenvalues,
        preconditioner.gradient_eigenvectors,
        preconditioner.gradient_eigenvalues,
      )
    )
    gradient = _gradient_matrix(grads[name])
    rotated = q_a.T @ gradient @ q_g
    if damping_mode == "relative":
      d_a, d_g = d_a / d_a.mean(), d_g / d_g.mean()
    scales = np.outer(d_a, d_g) + damping
    expected = q_a @ (rotated / scales) @ q_g.T
    # Both rotations' products (2·(dA + dG)), the division and the outer
    # product (and the means' sums of dA and dG): each of ‖∇‖, divided by at
    # most the smallest d_A d_Gᵀ + λ.
    terms = 3 * sum(gradient.shape) + 2
    close(
      _gradient_matrix(updates[name]),
      expected,
      terms=terms,
      scale=np.linalg.norm(gradient) / scales.min(),
      err_msg=name,
    )


@pytest.mark.parametrize(
  "compute_method, outer_product, scale",
  [
    ("inverse", False, 1.0),
    ("eigen", True, 1.0),
    ("eigen", False, 1 / (1 + DAMPING)),
  ],
)
def test_the_preconditioner_before_the_first_decomposition(
  compute_method, outer_product, scale
):
  """What ``init`` holds until the first decomposition (a step that is not
  one, here count 1 of 10; or a rejected first one): identity factors. The
  inverse method and the eigen method's precomputed scale hold them
  undamped (λ enters at the decomposition), so ∇ passes unchanged; the
  eigen method without it divides by d_A d_Gᵀ + λ = 1 + λ."""
  params, batches, loss_fn, _ = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    kl_clip=None,
    inv_update_steps=10,
    compute_method=compute_method,
    compute_eigenvalue_outer_product=outer_product,
  )
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  state = tx.init(params)
  updates, _ = tx.update(
    grads,
    state._replace(count=jnp.ones_like(state.count)),
    params,
    kfac_stats=stats,
  )
  for name in stats:
    # Identity factors: at most λ's shift and the division round.
    close(
      _gradient_matrix(updates[name]),
      scale * _gradient_matrix(grads[name]),
      terms=2,
    )


@pytest.mark.parametrize("damping_mode", ["relative", "absolute"])
def test_dense_layer_equals_explicit_kronecker_solve(damping_mode):
  """P = solve(kron(A, G) + λI, vec(∇)) with the explicit Kronecker matrix
  (relative damping: of A and G divided by their mean eigenvalues)."""
  params, batches, loss_fn, reference_tensors = make_problem("mlp", True)
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    kl_clip=None,
    factor_decay=0.5,
    damping_mode=damping_mode,
    compute_method="eigen",
  )
  state = tx.init(params)
  x, y = next(batches)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  tensors = reference_tensors(params, x, y)
  for name in ("Dense_0", "Dense_1"):
    a = 0.5 * np.eye(
      tensors[name].activation_rows.shape[1]
    ) + 0.5 * reference.cov(tensors[name].activation_rows)
    g = 0.5 * np.eye(
      tensors[name].gradient_rows.shape[1]
    ) + 0.5 * reference.cov(tensors[name].gradient_rows)
    grad = tensors[name].gradient
    if damping_mode == "relative":
      a, g = a / np.trace(a) * len(a), g / np.trace(g) * len(g)
    kron = np.kron(a, g) + DAMPING * np.eye(a.shape[0] * g.shape[0])
    expected = np.linalg.solve(kron, grad.reshape(-1)).reshape(grad.shape)
    close(
      as_matrix(updates[name]),
      expected,
      terms=update_terms("mlp", grad.shape) + sum(grad.shape),
      condition=reference.kfac_condition({name: (a, g)}, DAMPING),
      err_msg=name,
    )


# A NumPy integer as well: the alias once wrapped SGD in MultiSteps only for
# a Python int, so SGD stepped on every micro-batch. Nesterov reaches SGD.
@pytest.mark.parametrize(
  "steps_type,nesterov", [(int, False), (np.int64, False), (int, True)]
)
def test_kfac_alias_with_accumulation_matches_manual_chain(
  steps_type, nesterov
):
  params, batches, loss_fn, _ = make_problem("mlp", True)
  micro = [next(batches) for _ in range(6)]
  # A KL bound that binds, so the learning rate K-FAC gets shows (and one
  # other than scale_by_kfac's default).
  learning_rate = 0.05
  kwargs = dict(
    damping=DAMPING, inv_update_steps=2, accumulation_steps=2, kl_clip=1e-5
  )
  alias = kfac_jax.kfac(
    learning_rate,
    momentum=0.9,
    weight_decay=1e-3,
    nesterov=nesterov,
    **{**kwargs, "accumulation_steps": steps_type(2)},
  )
  plain = kfac_jax.scale_by_kfac(
    learning_rate=learning_rate, momentum=0.9, **kwargs
  )
  sgd = optax.chain(
    optax.add_decayed_weights(1e-3),
    optax.sgd(learning_rate, momentum=0.9, nesterov=nesterov),
  )

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
    scale=reference.largest(jax.tree.leaves(manual_params)),
  )
  for a, b in zip(
    jax.tree.leaves(run_alias(params)), jax.tree.leaves(manual_params)
  ):
    close(a, b, **tolerance)
