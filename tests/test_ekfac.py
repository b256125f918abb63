"""eigenvalue_correction=True (EKFAC) against float64 per-example gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax.preconditioning import ekfac
from kfac_jax.preconditioning.eigen import EigenPreconditioner
from tests.reference import EPS32, assert_float32_close

BATCH, IN, HIDDEN, OUT = 16, 4, 5, 3
# Roundings a row carries: the forward's contractions (IN, HIDDEN), the
# squared error's mean (OUT) and the backward's (OUT, HIDDEN).
CHAIN = IN + HIDDEN + OUT + OUT + HIDDEN
DAMPING = 1e-3


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(OUT)(jnp.tanh(nn.Dense(HIDDEN)(x)))


def loss_fn(params, x, y):
  """The mean over examples of ``ℓ_n = mean((f(x_n) − y_n)²)``."""
  return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)


def example_loss(params, x, y):
  """``ℓ_n`` of one example ``x [IN]``, ``y [OUT]``."""
  return loss_fn(params, x[None], y[None])


def problem():
  x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, IN))
  y = jax.random.normal(jax.random.PRNGKey(1), (BATCH, OUT))
  return MLP().init(jax.random.PRNGKey(2), x)["params"], x, y


def one_step(**kwargs):
  """The updates and state of the first step, with ``S = S_batch`` (d = 0)."""
  params, x, y = problem()
  tx = kfac_jax.scale_by_kfac(
    eigenvalue_correction=True,
    factor_decay=0.0,
    kl_clip=None,
    damping=DAMPING,
    **{"damping_mode": "absolute", **kwargs},
  )
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  updates, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  return params, x, y, grads, updates, state


def gradient_matrix(layer_grads):
  """``[kernel; bias]``: ``[dA, dG]`` with the bias row last, float64."""
  return np.concatenate(
    [
      np.asarray(layer_grads["kernel"], np.float64),
      np.asarray(layer_grads["bias"], np.float64)[None],
    ]
  )


def bases(state, name):
  p = state.preconditioners[name]
  return (
    np.asarray(p.activation_eigenvectors, np.float64),
    np.asarray(p.gradient_eigenvectors, np.float64),
  )


@pytest.mark.parametrize("name", ["Dense_0", "Dense_1"])
def test_scales_are_second_moments_of_per_example_gradients(name):
  params, x, y, _, _, state = one_step()
  per_example = jax.vmap(jax.grad(example_loss), (None, 0, 0))(params, x, y)
  q_a, q_g = bases(state, name)
  # B023: tree.map calls the lambda at once, per example n.
  rotated = np.stack(
    [
      q_a.T
      @ gradient_matrix(jax.tree.map(lambda g: g[n], per_example[name]))  # noqa: B023
      @ q_g
      for n in range(BATCH)
    ]
  )
  # The captured cotangents are those of the mean loss, 1/N of each
  # example's: S holds the second moments of ∇ℓ_n / N.
  expected = np.mean(rotated**2, axis=0) / BATCH**2
  dims = q_a.shape[0] + q_g.shape[0]
  # Each square doubles a row's relative rounding (the chain and the
  # rotation); the mean adds BATCH.
  assert_float32_close(
    state.eigenvalue_scales[name], expected, terms=2 * (CHAIN + dims) + BATCH
  )


class StackBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(HIDDEN)(h)), None


class ScannedMLP(nn.Module):
  """Dense, two HIDDEN → HIDDEN layers under ``nn.scan`` (one layer of two
  blocks), dense."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(HIDDEN)(x)
    h, _ = nn.scan(
      StackBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=2,
    )(name="stack")(h, None)
    return nn.Dense(OUT)(h)


def test_a_scanned_stacks_blocks_get_their_own_second_moments():
  _, x, y = problem()
  model = ScannedMLP()
  params = model.init(jax.random.PRNGKey(3), x)["params"]
  loss = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
  tx = kfac_jax.scale_by_kfac(
    eigenvalue_correction=True,
    factor_decay=0.0,
    kl_clip=None,
    damping=DAMPING,
    layers=kfac_jax.trace_layers(lambda p: loss(p, x, y), params),
  )
  _, grads, stats = kfac_jax.value_grad_and_stats(loss)(params, x, y)
  _, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  per_example = jax.vmap(
    jax.grad(lambda p, x, y: loss(p, x[None], y[None])), (None, 0, 0)
  )(params, x, y)["stack"]["Dense_0"]
  blocks = sorted(b for b in state.eigenvalue_scales if b.endswith("]"))
  assert len(blocks) == 2, list(state.eigenvalue_scales)
  # Forward IN + 3·HIDDEN, the mean OUT, backward OUT + 2·HIDDEN.
  chain = IN + 5 * HIDDEN + 2 * OUT
  for i, block in enumerate(blocks):
    q_a, q_g = bases(state, block)
    # B023: tree.map calls the lambda at once, per example n.
    rotated = np.stack(
      [
        q_a.T
        @ gradient_matrix(jax.tree.map(lambda g: g[n, i], per_example))  # noqa: B023
        @ q_g
        for n in range(BATCH)
      ]
    )
    expected = np.mean(rotated**2, axis=0) / BATCH**2
    dims = q_a.shape[0] + q_g.shape[0]
    assert_float32_close(
      state.eigenvalue_scales[block],
      expected,
      terms=2 * (chain + dims) + BATCH,
      err_msg=block,
    )


def test_the_update_is_the_dense_solve_in_the_eigenbasis():
  _, _, _, grads, updates, state = one_step()
  for name in ("Dense_0", "Dense_1"):
    q_a, q_g = bases(state, name)
    scales = np.asarray(state.eigenvalue_scales[name], np.float64)
    q = np.kron(q_a, q_g)  # Acts on row-major vec([dA, dG]).
    dense = q @ np.diag(scales.ravel() + DAMPING) @ q.T
    gradient = gradient_matrix(grads[name])
    expected = np.linalg.solve(dense, gradient.ravel()).reshape(gradient.shape)
    condition = (scales.max() + DAMPING) / (scales.min() + DAMPING)
    # Two sandwiches of products of lengths dA and dG each.
    assert_float32_close(
      gradient_matrix(updates[name]),
      expected,
      terms=2 * sum(gradient.shape),
      condition=condition,
      err_msg=name,
    )


def test_reproject_is_the_diagonal_of_the_rotated_uncorrelated_moments():
  rng = np.random.default_rng(0)
  dims = (6, 4)

  def orthogonal(d):
    return np.linalg.qr(rng.standard_normal((d, d)))[0]

  def preconditioner(q_a, q_g):
    return EigenPreconditioner(
      jnp.asarray(q_a, jnp.float32),
      jnp.ones(dims[0]),
      jnp.asarray(q_g, jnp.float32),
      jnp.ones(dims[1]),
      None,
    )

  old = [orthogonal(d) for d in dims]
  new = [orthogonal(d) for d in dims]
  scales = rng.uniform(0.1, 1.0, dims)
  # Uncorrelated entries of variance S in the old basis: their covariance
  # diag(vec S), rotated into the new basis whole.
  rotation = np.kron(new[0].T @ old[0], new[1].T @ old[1])
  expected = np.diag(rotation @ np.diag(scales.ravel()) @ rotation.T)
  result = ekfac.reproject(
    jnp.asarray(scales, jnp.float32), preconditioner(*old), preconditioner(*new)
  )
  assert_float32_close(result, expected.reshape(dims), terms=2 * sum(dims))
  # A doubly stochastic mix: the total second moment is kept (positive
  # entries, each within the products' rounding, summed with `size` more).
  np.testing.assert_allclose(
    float(jnp.sum(result)),
    scales.sum(),
    rtol=(2 * sum(dims) + scales.size) * EPS32,
  )


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(eigen_solver="subspace", inv_update_steps=2),
    dict(inv_dtype=jnp.bfloat16, factor_batch_size=8),
    dict(gradient_from_stats=True),
    dict(adaptive=kfac_jax.AdaptiveConfig(), kl_clip=None, damping=1e-2),
  ],
  ids=["plain", "subspace", "bf16-subset", "from-stats", "adaptive"],
)
def test_training_with_ekfac_lowers_the_loss(kwargs):
  params, x, y = problem()
  kwargs.setdefault("kl_clip", 1e-2)
  kwargs.setdefault("damping", DAMPING)
  adaptive = kwargs.get("adaptive") is not None
  tx = kfac_jax.scale_by_kfac(eigenvalue_correction=True, **kwargs)
  if not adaptive:
    tx = optax.chain(tx, optax.sgd(0.1))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    extra = {}
    if adaptive:
      extra["split_loss"] = kfac_jax.SplitLoss(
        lambda p: MLP().apply({"params": p}, x),
        lambda out: jnp.mean((out - y) ** 2),
      )
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **extra)
    return optax.apply_updates(params, updates), state, loss

  first = None
  for _ in range(15):
    params, state, loss = step(params, state)
    first = float(loss) if first is None else first
  assert np.isfinite(float(loss)) and float(loss) < first
  scales = (state if adaptive else state[0]).eigenvalue_scales
  assert all(np.all(np.isfinite(s)) for s in jax.tree.leaves(scales))


def test_accumulated_micro_batches_give_the_whole_batchs_scales():
  # Off decomposition steps (the bases fixed), k micro-batches' S_batch,
  # each in the same bases, average to the whole batch's.
  params, x, y = problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
  halves = [
    kfac_jax.value_grad_and_stats(loss_fn)(params, x[i::2], y[i::2])
    for i in range(2)
  ]
  settings = dict(
    eigenvalue_correction=True,
    factor_decay=0.0,
    kl_clip=None,
    damping=DAMPING,
    inv_update_steps=2,
  )
  whole = kfac_jax.scale_by_kfac(**settings)
  state = whole.init(params)
  for _ in range(2):  # A decomposition step, then one without.
    _, state = whole.update(grads, state, params, kfac_stats=stats)
  accumulating = kfac_jax.scale_by_kfac(accumulation_steps=2, **settings)
  accumulated = accumulating.init(params)
  for _ in range(2):
    for _, half_grads, half_stats in halves:
      _, accumulated = accumulating.update(
        half_grads, accumulated, params, kfac_stats=half_stats
      )
  for name in ("Dense_0", "Dense_1"):
    q_a, q_g = bases(state, name)
    dims = q_a.shape[0] + q_g.shape[0]
    # The same rows, rotated in bases equal up to eigh's rounding (d² of
    # it, tests/test_batched.py), each entry squared twice.
    assert_float32_close(
      accumulated.eigenvalue_scales[name],
      state.eigenvalue_scales[name],
      terms=2 * (CHAIN + dims**2) + BATCH,
      err_msg=name,
    )


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.Conv(3, (3, 3))(x).reshape(x.shape[0], -1))


def test_convolutions_are_refused_by_name():
  x = jnp.ones((2, 5, 5, 1))
  params = CNN().init(jax.random.PRNGKey(0), x)["params"]
  loss = lambda p, x: jnp.sum(CNN().apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss)(params, x)
  tx = kfac_jax.scale_by_kfac(eigenvalue_correction=True)
  with pytest.raises(ValueError, match="layer 'Conv_0' is a Conv"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)


def test_the_inverse_method_is_refused():
  with pytest.raises(ValueError, match="needs compute_method='eigen'"):
    kfac_jax.scale_by_kfac(eigenvalue_correction=True, compute_method="inverse")
