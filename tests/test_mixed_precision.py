"""bfloat16 params, activations and factors: dtypes, training, accuracy."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import kfac_jax

# Unit roundoff of bfloat16: 8 significand bits, round to nearest.
BF16_ROUNDOFF = 2.0**-8


class MLP(nn.Module):
  dtype: jnp.dtype = jnp.bfloat16
  param_dtype: jnp.dtype = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    dense = lambda n: nn.Dense(n, dtype=self.dtype,
                               param_dtype=self.param_dtype)
    x = jnp.tanh(dense(32)(x))
    return dense(10)(x)


@functools.cache
def digits():
  data = load_digits()
  return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def loss_fn(model, params, x, y):
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def float32_params():
  x, _ = digits()
  return MLP(jnp.float32, jnp.float32).init(jax.random.PRNGKey(0),
                                            x[:1])["params"]


def init(model):
  # The float32 init cast: one (slow, random-number) init for every test.
  return jax.tree.map(lambda p: p.astype(model.param_dtype), float32_params())


def all_finite(tree) -> bool:
  return all(np.all(np.isfinite(np.asarray(x, np.float32)))
             for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


@pytest.mark.parametrize("param_dtype, dtype, compute_method", [
    (jnp.bfloat16, jnp.bfloat16, "eigen"),
    (jnp.bfloat16, jnp.bfloat16, "inverse"),
    (jnp.float32, jnp.bfloat16, "eigen"),
], ids=["bf16-eigen", "bf16-inverse", "f32-params-bf16-activations-eigen"])
def test_storage_dtypes(param_dtype, dtype, compute_method):
  x, y = digits()
  model = MLP(dtype, param_dtype)
  params = init(model)
  tx = kfac_jax.scale_by_kfac(factor_dtype=jnp.bfloat16,
                              compute_method=compute_method)

  @jax.jit
  def step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(
        lambda p: loss_fn(model, p, x[:64], y[:64]))(params)
    return tx.update(grads, state, params, kfac_stats=stats)

  updates, state = step(params, tx.init(params))
  assert {f.dtype for f in jax.tree.leaves(state.factors)} == {
      jnp.dtype(jnp.bfloat16)}
  # inv_dtype defaults to float32, whatever the factors.
  assert {p.dtype for p in jax.tree.leaves(state.preconditioners)} == {
      jnp.dtype(jnp.float32)}
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
    assert u.dtype == p.dtype == jnp.dtype(param_dtype)
  assert all_finite(updates) and all_finite(state)


def test_bf16_model_trains_on_digits():
  x, y = digits()
  model = MLP()
  params = init(model)
  tx = kfac_jax.kfac(0.1, momentum=0.9, damping=3e-3,
                     factor_dtype=jnp.bfloat16)

  @jax.jit
  def step(params, opt_state, xb, yb):
    loss, grads, stats = kfac_jax.value_grad_and_stats(
        lambda p: loss_fn(model, p, xb, yb))(params)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    params = optax.apply_updates(params, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in
                                jax.tree.leaves((loss, params, opt_state))
                                if jnp.issubdtype(leaf.dtype, jnp.inexact)]))
    return params, opt_state, finite

  full_loss = jax.jit(lambda p: loss_fn(model, p, x, y))
  rng = np.random.default_rng(0)
  initial = float(full_loss(params))
  opt_state = tx.init(params)
  for t in range(100):
    batch = rng.choice(len(x), 64, replace=False)
    params, opt_state, finite = step(params, opt_state, x[batch], y[batch])
    assert bool(finite), f"non-finite loss, params or state at step {t}"
  final = float(full_loss(params))
  # Observed: 2.37 -> 0.09. A quarter leaves room for other seeds/platforms.
  assert final < 0.25 * initial, (initial, final)
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  kfac_state = opt_state[0]
  assert int(kfac_state.skipped_factor_updates) == 0
  assert int(kfac_state.rejected_decompositions) == 0


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_bf16_factors_change_the_step_by_their_rounding_only(compute_method):
  """One step with bfloat16 vs float32 factors, float32 model.

  Both runs see the same gradient ∇, so they differ only through the factors:
  the bf16 run preconditions with ``M' = A'⊗G' + λI`` (eigen) or the damped
  inverses of ``A', G'`` (inverse), where ``A' = A + δA`` is A rounded to
  bfloat16, ``|δA_ij| ≤ u|A_ij|`` with ``u = 2⁻⁸``. For exact solves,
  ``P' − P = M⁻¹(M − M')P'``, so

      ‖P' − P‖ ≤ ‖M⁻¹‖₂ (‖δA‖₂‖G'‖₂ + ‖A‖₂‖δG‖₂) ‖P'‖ (eigen),

  and for the inverse method, with ``Ã = A + λI``,
  ``Ã'⁻¹ − Ã⁻¹ = Ã⁻¹(Ã − Ã')Ã'⁻¹`` gives

      ‖P' − P‖ ≤ ‖Ã⁻¹‖₂‖δA‖₂‖Ã'⁻¹‖₂‖∇‖‖G̃'⁻¹‖₂ + ‖Ã⁻¹‖₂‖∇‖‖G̃⁻¹‖₂‖δG‖₂‖G̃'⁻¹‖₂.

  The test checks these bounds with the actual δA, δG, plus 1e-5 relative
  for float32 arithmetic. A priori, ``‖δA‖₂ ≤ ‖δA‖_F ≤ u‖A‖_F``; one step
  from the identity with decay 0.95 keeps A and G within a small factor of
  the identity, so the relative change is a few u: the test also requires
  ``‖P' − P‖ ≤ 4u‖P‖`` (about 1.6%), the loose tolerance a user can expect.
  """
  x, y = digits()
  model = MLP(jnp.float32, jnp.float32)
  params = init(model)
  damping = 1e-3
  transforms = [
      kfac_jax.scale_by_kfac(damping=damping, kl_clip=None,
                             compute_method=compute_method,
                             factor_dtype=factor_dtype)
      for factor_dtype in (jnp.float32, jnp.bfloat16)
  ]

  @jax.jit
  def steps(params):
    _, grads, stats = kfac_jax.value_grad_and_stats(
        lambda p: loss_fn(model, p, x[:128], y[:128]))(params)
    return grads, [tx.update(grads, tx.init(params), params, kfac_stats=stats)
                   for tx in transforms]

  grads, ((p32, s32), (p16, s16)) = steps(params)
  norm2 = lambda m: np.linalg.norm(m, 2)
  for name in s32.factors:
    matrix = lambda tree: np.concatenate(
        [np.asarray(tree[name]["kernel"], np.float64),
         np.asarray(tree[name]["bias"], np.float64)[None]])
    p, p_bf16, grad = matrix(p32), matrix(p16), matrix(grads)
    a, g = (np.asarray(f, np.float64) for f in s32.factors[name])
    a16, g16 = (np.asarray(f, np.float64) for f in s16.factors[name])
    assert np.all(np.abs(a16 - a) <= BF16_ROUNDOFF * np.abs(a))
    assert np.all(np.abs(g16 - g) <= BF16_ROUNDOFF * np.abs(g))
    da, dg = a16 - a, g16 - g
    if compute_method == "eigen":
      m_inverse = 1 / (np.linalg.eigvalsh(a).min() * np.linalg.eigvalsh(g).min()
                       + damping)
      bound = m_inverse * (norm2(da) * norm2(g16) + norm2(a) * norm2(dg)) * (
          np.linalg.norm(p_bf16))
    else:
      inv = lambda f: np.linalg.inv(f + damping * np.eye(len(f)))
      bound = np.linalg.norm(grad) * (
          norm2(inv(a)) * norm2(da) * norm2(inv(a16)) * norm2(inv(g16)) +
          norm2(inv(a)) * norm2(inv(g)) * norm2(dg) * norm2(inv(g16)))
    error = np.linalg.norm(p_bf16 - p)
    assert error <= bound + 1e-5 * np.linalg.norm(p), (name, error, bound)
    assert error <= 4 * BF16_ROUNDOFF * np.linalg.norm(p), (
        name, error / np.linalg.norm(p))
    assert error > 0  # The bf16 factors did change something.
