"""eigen_solver="subspace": warm-started subspace iteration vs float64 eigh."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

import kfac_jax
from kfac_jax.preconditioning import subspace
from tests.reference import EPS32, assert_float32_close

DIM = 10
# Consecutive eigenvalues in the ratio R (1, R, R², …): one subspace step
# shrinks each column's angle to its eigenvector by about R.
R = 2 / 3
# Largest rotation of the eigenbasis per step (radians).
DRIFT = 1e-3


def random_orthogonal(rng, dim):
  q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
  return q * np.sign(np.diag(r))


def drifting_factors(steps, seed=0):
  """``F_t = U_t diag(λ) U_tᵀ``, ``U_{t+1} = exp(DRIFT·K) U_t``, ‖K‖₂ = 1."""
  rng = np.random.default_rng(seed)
  eigenvalues = R ** np.arange(DIM)
  generator = rng.standard_normal((DIM, DIM))
  generator = generator - generator.T
  generator /= np.linalg.norm(generator, 2)
  step = scipy.linalg.expm(DRIFT * generator)
  basis = random_orthogonal(rng, DIM)
  for _ in range(steps + 1):
    yield basis @ np.diag(eigenvalues) @ basis.T, basis, eigenvalues
    basis = step @ basis


def test_a_slowly_drifting_factor_keeps_its_eigenbasis():
  # Exact arithmetic: one step maps tan θ to ≤ R·(tan θ + DRIFT) for the
  # dominant j-column subspaces, so their angles settle at ≤ R·DRIFT/(1 − R);
  # an eigenvector lies between two of them (twice that). Float32 adds
  # d·ε·λ_max / (smallest gap) to an angle (a perturbation of F by d·ε·‖F‖).
  gap = R ** (DIM - 1) * (1 / R - 1)
  angle_bound = 2 * R * DRIFT / (1 - R) + DIM * EPS32 / gap
  factors = drifting_factors(60)
  _, basis, _ = next(factors)
  q = jnp.asarray(basis, jnp.float32)
  worst = 0.0
  for factor, exact_basis, exact_eigenvalues in factors:
    eigenvalues, q, drift = subspace.subspace_refresh(
      jnp.asarray(factor, jnp.float32), q, steps=1
    )
    q64 = np.asarray(q, np.float64)
    # Columns come by decreasing eigenvalue, as the exact ones are built.
    cosines = np.abs(np.sum(q64 * exact_basis, axis=0))
    sines = np.sqrt(np.maximum(1 - cosines**2, 0))
    worst = max(worst, sines.max())
    assert sines.max() <= angle_bound, (sines.max(), angle_bound)
    # A Rayleigh quotient is off by ≤ (λ_max − λ_min)·sin²θ, plus the
    # rounding of qᵀ(Fq), 2d terms of λ_max = 1.
    error_bound = (1 - R ** (DIM - 1)) * sines**2 + 2 * DIM * EPS32
    assert np.all(
      np.abs(np.asarray(eigenvalues, np.float64) - exact_eigenvalues)
      <= error_bound
    )
    # The drift is ‖offdiag(QᵀFQ)‖_F / ‖F‖_F, read to about √(d·ε).
    b = q64.T @ factor @ q64
    exact_drift = np.linalg.norm(b - np.diag(np.diag(b))) / np.linalg.norm(
      factor
    )
    assert abs(float(drift) - exact_drift) <= np.sqrt(4 * DIM * EPS32)
  print(f"largest angle {worst:.2e} against the bound {angle_bound:.2e}")
  assert worst > 0  # The basis did move.


def test_zero_steps_keep_the_basis_until_it_drifts_past_the_threshold():
  # With no subspace step the stored basis stays (columns sorted by their
  # quotient) and only the eigenvalues diag(QᵀFQ) move, while the drift
  # ‖offdiag(QᵀFQ)‖_F / ‖F‖_F of the kept basis grows with the rotation of
  # F's eigenvectors; past the threshold eigh replaces it.
  threshold = 0.02
  # The drift is read to about √(4d·ε) (test above); rounding of qᵀ(Fq):
  # 2d terms of λ_max = 1.
  read = np.sqrt(4 * DIM * EPS32)
  factors = drifting_factors(200, seed=4)
  factor, basis, _ = next(factors)
  q = jnp.asarray(basis, jnp.float32)
  kept = fell = 0
  for factor, _, _ in factors:
    f32 = jnp.asarray(factor, jnp.float32)
    refreshed = subspace.subspace_refresh(f32, q, steps=0)
    eigenvalues, new_q, drift = refreshed
    q64 = np.asarray(q, np.float64)
    b = q64.T @ factor @ q64
    order = np.argsort(-np.diag(b))
    np.testing.assert_array_equal(new_q, np.asarray(q)[:, order])
    assert_float32_close(eigenvalues, np.diag(b)[order], terms=2 * DIM)
    exact_drift = np.linalg.norm(b - np.diag(np.diag(b))) / np.linalg.norm(
      factor
    )
    assert abs(float(drift) - exact_drift) <= read
    (eigenvalues, q), fell_back = subspace.refresh_or_eigh(
      f32, refreshed, q, threshold
    )
    if exact_drift > threshold + read:
      assert int(fell_back) == 1
    elif exact_drift < threshold - read:
      assert int(fell_back) == 0
      np.testing.assert_array_equal(q, new_q)
    kept += 1 - int(fell_back)
    fell += int(fell_back)
  # Both happened: the basis was kept for steps, and replaced when it drifted.
  assert kept > fell > 0, (kept, fell)


def test_an_abrupt_change_falls_back_to_eigh():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((3 * DIM, DIM))
  factor = x.T @ x / len(x)
  unrelated = jnp.asarray(random_orthogonal(rng, DIM), jnp.float32)
  f32 = jnp.asarray(factor, jnp.float32)
  refreshed = subspace.subspace_refresh(f32, unrelated, steps=1)
  assert float(refreshed[2]) > subspace.DEFAULT_DRIFT_THRESHOLD
  (eigenvalues, basis), fell_back = subspace.refresh_or_eigh(
    f32, refreshed, unrelated, subspace.DEFAULT_DRIFT_THRESHOLD
  )
  assert int(fell_back) == 1
  # eigh's own accuracy: d² roundings of ‖F‖ (tests/test_batched.py).
  q = np.asarray(basis, np.float64)
  assert_float32_close(
    q @ np.diag(np.asarray(eigenvalues, np.float64)) @ q.T, factor, terms=DIM**2
  )

  # The identity basis of a fresh state goes to eigh too, uncounted.
  identity = jnp.eye(DIM, dtype=jnp.float32)
  (eigenvalues, basis), fell_back = subspace.refresh_or_eigh(
    f32,
    subspace.subspace_refresh(f32, identity, 1),
    identity,
    subspace.DEFAULT_DRIFT_THRESHOLD,
  )
  assert int(fell_back) == 0
  q = np.asarray(basis, np.float64)
  assert_float32_close(
    q @ np.diag(np.asarray(eigenvalues, np.float64)) @ q.T, factor, terms=DIM**2
  )


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(5)(x)))


def loss_fn(params, x, y):
  return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)


@pytest.mark.parametrize("solver", ["subspace", kfac_jax.SubspaceSolver(0)])
def test_the_transformation_counts_fallbacks_and_decomposes_exactly(solver):
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 4))
  y = jax.random.normal(jax.random.PRNGKey(1), (16, 3))
  params = MLP().init(jax.random.PRNGKey(2), x)["params"]
  tx = kfac_jax.scale_by_kfac(eigen_solver=solver, kl_clip=None)
  state = tx.init(params)
  assert int(state.eigh_fallbacks) == 0
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  update = jax.jit(lambda s: tx.update(grads, s, params, kfac_stats=stats)[1])

  def assert_exact_eigenbases(state):
    for name, factors in state.factors.items():
      p = state.preconditioners[name]
      for factor, q, d in (
        (
          factors.activation_factor,
          p.activation_eigenvectors,
          p.activation_eigenvalues,
        ),
        (
          factors.gradient_factor,
          p.gradient_eigenvectors,
          p.gradient_eigenvalues,
        ),
      ):
        q = np.asarray(q, np.float64)
        reference = np.asarray(factor, np.float64)
        assert_float32_close(
          q @ np.diag(np.asarray(d, np.float64)) @ q.T,
          (reference + reference.T) / 2,
          terms=len(q) ** 2,
          err_msg=name,
        )

  # The first decomposition starts from the identity: eigh, not counted.
  state = update(state)
  assert int(state.eigh_fallbacks) == 0
  assert_exact_eigenbases(state)

  # Factors replaced by unrelated ones: every factor's refresh drifts.
  rng = np.random.default_rng(3)

  def unrelated(f):
    x = rng.standard_normal((2 * f.shape[0], f.shape[0]))
    return jnp.asarray(x.T @ x / len(x), f.dtype)

  state = state._replace(factors=jax.tree.map(unrelated, state.factors))
  state = update(state)
  assert int(state.eigh_fallbacks) == 2 * len(state.factors)
  assert_exact_eigenbases(state)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(eigen_solver="lanczos"), "eigen_solver must be"),
    (
      dict(eigen_solver="subspace", compute_method="inverse"),
      "needs compute_method='eigen'",
    ),
    (
      dict(eigen_solver=kfac_jax.SubspaceSolver(drift_threshold=0.0)),
      "drift_threshold must be",
    ),
    (
      dict(eigen_solver=kfac_jax.SubspaceSolver(drift_threshold=1.5)),
      "drift_threshold must be",
    ),
    (
      dict(eigen_solver=kfac_jax.SubspaceSolver(steps=-1)),
      "SubspaceSolver.steps must be an integer ≥ 0",
    ),
  ],
)
def test_solver_arguments_are_validated(kwargs, message):
  with pytest.raises(ValueError, match=message):
    kfac_jax.scale_by_kfac(**kwargs)


def test_a_solver_survives_inject_hyperparams():
  # Numbers among scale_by_kfac's arguments would be traced; the solver's
  # settings sit in one NamedTuple that is not.
  tx = optax.inject_hyperparams(
    kfac_jax.scale_by_kfac, static_args=("accumulation_steps",)
  )(eigen_solver=kfac_jax.SubspaceSolver(steps=2))
  params = MLP().init(jax.random.PRNGKey(2), jnp.zeros((1, 4)))["params"]
  assert int(jax.jit(tx.init)(params).inner_state.eigh_fallbacks) == 0
