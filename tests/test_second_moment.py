"""second_moment_decay: the gradient's second moment in K-FAC's eigenbasis,
against a float64 replay of its definition (``preconditioning.second_moment``)
over steps with and without statistics and a basis refresh."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests.reference import assert_float32_close

BATCH, IN, HIDDEN, OUT = 16, 4, 5, 3
BETA, DAMPING, LR = 0.9, 0.01, 0.1
# Steps 0 and 2 decompose (step 2 carries v into the new bases); step 3 has
# no statistics, so its factors stay and only v moves.
STEPS, INV_EVERY, NO_STATS_STEP = 4, 2, 3
LAYERS = ("Dense_0", "Dense_1")


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(OUT)(jnp.tanh(nn.Dense(HIDDEN)(x)))


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(HIDDEN, (3, 3))(x))
    return nn.Dense(OUT)(jnp.mean(h, axis=(1, 2)))


def squared_error(model):
  return lambda params, x, y: jnp.mean(
    (model.apply({"params": params}, x) - y) ** 2
  )


def transformation(**kwargs):
  return kfac_jax.scale_by_kfac(
    second_moment_decay=BETA,
    damping=DAMPING,
    kl_clip=None,
    inv_update_steps=INV_EVERY,
    **kwargs,
  )


def run(tx, model: nn.Module | None = None, input_shape=(IN,)):
  """Trains ``STEPS`` steps of ``tx`` then SGD on ``model`` (the MLP); per
  step the float32 gradients, K-FAC's updates and the state after it."""
  model = MLP() if model is None else model
  x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, *input_shape))
  y = jax.random.normal(jax.random.PRNGKey(1), (BATCH, OUT))
  params = model.init(jax.random.PRNGKey(2), x)["params"]
  value_grad_and_stats = kfac_jax.value_grad_and_stats(squared_error(model))
  state = tx.init(params)
  history = []
  for step in range(STEPS):
    _, grads, stats = value_grad_and_stats(params, x, y)
    if step == NO_STATS_STEP:
      stats = kfac_jax.NO_STATS
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    history.append((grads, updates, state))
    params = optax.apply_updates(
      params, jax.tree.map(lambda u: -LR * u, updates)
    )
  return history


def matrix(layer):
  """``[kernel; bias]``, ``[dA, dG]`` with the bias row last (a conv's
  kernel ``[kh, kw, in, out]`` flattened to ``[kh·kw·in, out]``), float64."""
  kernel = np.asarray(layer["kernel"], np.float64)
  return np.concatenate(
    [
      kernel.reshape(-1, kernel.shape[-1]),
      np.asarray(layer["bias"], np.float64)[None],
    ]
  )


def rounding_terms(dims, steps=1):
  """Roundings of ``P`` and ``v`` of a ``[dA, dG]`` block: the rotations
  there and back (dA + dG each way), the mean of √v̂ (dA·dG terms), and the
  average, √ and division, a few per step."""
  return 2 * sum(dims) + dims[0] * dims[1] + 4 * steps


def bases(state, name):
  p = state.preconditioners[name]
  return (
    np.asarray(p.activation_eigenvectors, np.float64),
    np.asarray(p.gradient_eigenvectors, np.float64),
  )


@pytest.fixture(scope="module")
def history():
  return run(transformation())


@pytest.mark.parametrize("name", LAYERS)
def test_moment_and_update_replay_the_definition(history, name):
  check_replay(history, name)


@pytest.mark.parametrize("name", ["Conv_0", "Dense_0"])
def test_convolution_replays_the_definition(name):
  history = run(transformation(), ConvNet(), (6, 6, 2))
  check_replay(history, name)


def check_replay(history, name):
  """``v`` and ``P`` of layer ``name`` at every step of ``history`` against
  their definition in float64, from the same gradients and bases."""
  dims = matrix(history[0][0][name]).shape
  moment = np.zeros(dims)
  old_a, old_g = np.eye(dims[0]), np.eye(dims[1])
  for step, (grads, updates, state) in enumerate(history):
    q_a, q_g = bases(state, name)
    if step % INV_EVERY == 0:  # carried into the new bases (ekfac.reproject)
      moment = (q_a.T @ old_a) ** 2 @ moment @ ((q_g.T @ old_g) ** 2).T
    rotated = q_a.T @ matrix(grads[name]) @ q_g
    moment = BETA * moment + (1 - BETA) * rotated**2
    rms = np.sqrt(moment / (1 - BETA ** (step + 1)))
    divisor = rms / rms.mean() + DAMPING  # relative damping
    expected = q_a @ (rotated / divisor) @ q_g.T
    # The division multiplies R's error by up to 1/min(divisor).
    terms = rounding_terms(dims, step + 1)
    assert_float32_close(
      state.eigenvalue_scales[name],
      moment,
      terms=terms,
      err_msg=f"v at step {step}",
    )
    assert_float32_close(
      matrix(updates[name]),
      expected,
      terms=terms,
      scale=np.abs(rotated).max(),
      condition=1 / divisor.min(),
      err_msg=f"P at step {step}",
    )
    old_a, old_g = q_a, q_g


def test_step_without_statistics_moves_only_the_moment(history):
  before, after = history[NO_STATS_STEP - 1][2], history[NO_STATS_STEP][2]
  for name in LAYERS:
    np.testing.assert_array_equal(
      after.factors[name].activation_factor,
      before.factors[name].activation_factor,
    )
    assert not np.array_equal(
      after.eigenvalue_scales[name], before.eigenvalue_scales[name]
    )


def test_non_finite_gradient_leaves_the_state_usable(history):
  tx = transformation()
  # After step 2: step 3 decomposes nothing, so v would move by R² alone.
  grads, _, state = history[2]
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
  params = MLP().init(jax.random.PRNGKey(2), jnp.zeros((BATCH, IN)))["params"]
  _, new_state = tx.update(bad, state, params, kfac_stats=kfac_jax.NO_STATS)
  for name in LAYERS:
    np.testing.assert_array_equal(
      new_state.eigenvalue_scales[name], state.eigenvalue_scales[name]
    )
  good, _ = tx.update(grads, new_state, params, kfac_stats=kfac_jax.NO_STATS)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(good))


def test_jitted_steps_match_eager(history):
  tx = transformation()
  grads, _, state = history[1]
  params = MLP().init(jax.random.PRNGKey(2), jnp.zeros((BATCH, IN)))["params"]
  update = lambda g, s: tx.update(g, s, params, kfac_stats=kfac_jax.NO_STATS)
  eager, eager_state = update(grads, state)
  jitted, jitted_state = jax.jit(update)(grads, state)
  # One program against another: XLA may fuse and reorder the same
  # float32 operations; the division by √v̂/mean + λ ≥ λ amplifies them.
  terms = max(
    rounding_terms((IN + 1, HIDDEN)), rounding_terms((HIDDEN + 1, OUT))
  )
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    assert_float32_close(a, b, terms=terms, condition=1 / DAMPING)
  for name in LAYERS:
    assert_float32_close(
      jitted_state.eigenvalue_scales[name],
      eager_state.eigenvalue_scales[name],
      terms=terms,
    )


@pytest.mark.parametrize(
  "kwargs, other",
  [
    (dict(eigenvalue_correction=True), "eigenvalue_correction"),
    (dict(gradient_from_stats=True), "gradient_from_stats"),
    (dict(compute_method="inverse"), "compute_method='eigen'"),
    (
      dict(adaptive=kfac_jax.AdaptiveConfig(), kl_clip=None, damping=1.0),
      "adaptive",
    ),
  ],
)
def test_incompatible_settings_are_refused_by_name(kwargs, other):
  kwargs = {"kl_clip": None, **kwargs}
  with pytest.raises(ValueError, match="second_moment_decay") as error:
    kfac_jax.scale_by_kfac(second_moment_decay=BETA, **kwargs)
  assert other in str(error.value)


@pytest.mark.parametrize("decay", [1.0, -0.1, float("nan")])
def test_decay_out_of_range_is_refused(decay):
  with pytest.raises(ValueError, match=r"second_moment_decay.*\[0, 1\)"):
    kfac_jax.scale_by_kfac(second_moment_decay=decay)


def test_state_of_another_setting_is_refused(history):
  plain = kfac_jax.scale_by_kfac(kl_clip=None, compute_method="eigen")
  grads, _, state = history[0]
  params = MLP().init(jax.random.PRNGKey(2), jnp.zeros((BATCH, IN)))["params"]
  with pytest.raises(ValueError, match="eigenvalue_scales"):
    plain.update(grads, state, params, kfac_stats=kfac_jax.NO_STATS)
