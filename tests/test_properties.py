"""Property tests: over random Dense shapes and hyper-parameters, the update is
the damped Kronecker solve of the gradient, computed in float64 from the
state's own running factors.

For a layer with gradient matrix ``∇: [dA, dG]`` and running factors ``A``,
``G`` (read back from the state after the step), the references are

* eigen: ``solve(kron(A, G) + λI, vec(∇))``;
* inverse: ``inv(A + λI) ∇ inv(G + λI)``.

The library computes in float32, so the forward error is bounded by the
conditioning, not by a fixed tolerance. With ``ε`` the float32 unit roundoff
and ``C`` a modest constant:

* eigen is backward stable: float32 ``eigh`` gives the exact eigenbasis of
  ``A + E`` with ``‖E‖ ≲ ε‖A‖`` (same for G), so with
  ``M = kron(A, G) + λI`` the residual ``‖M vec(P) − vec(∇)‖`` must be
  ``≤ C·ε·(‖M‖‖P‖ + ‖∇‖)`` whatever the conditioning (this check stays tight
  where damping 1e-6 makes the forward bound loose), and
  ``‖P − P_ref‖ ≤ C·ε·κ(M)·‖P_ref‖``;
* inverse forms ``(A + λI)⁻¹`` explicitly (Cholesky), with error
  ``≲ ε·κ(A + λI)·‖(A + λI)⁻¹‖``; multiplied into ``∇`` that gives
  ``‖P − P_ref‖ ≤ C·ε·(κ(A + λI) + κ(G + λI))·‖(A + λI)⁻¹‖‖∇‖‖(G + λI)⁻¹‖``
  (relative to ``‖P_ref‖`` this can be κ² ε: a gradient along A's large
  eigenvalues, as with a batch of one, makes ``P_ref`` small).

Each example starts from random PSD running factors and also checks the step's
factor update ``F ← d·F + (1 − d)·F_batch`` against float64. Every example
compiles one program (its shapes are new), so an example holds one or two
independent layers and both methods, and examples are few.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kfac_jax
from tests import reference

# The unit roundoff u, the ε of the bounds above (reference.EPS32 is 2u).
UNIT_ROUNDOFF = reference.EPS32 / 2
# Error constant. Over 40 random examples the largest observed ratios were
# 6.3 (eigen backward), 12.5 (eigen forward) and 1.3 (inverse forward); 200
# leaves a margin of 16 for layers of up to 13·12 entries.
C = 200.0

LAYER = st.tuples(st.integers(1, 12), st.integers(1, 12), st.booleans())


class ParallelDense(nn.Module):
  """Independent Dense layers, ``layer{k}`` applied to ``inputs[k]``."""

  specs: tuple[tuple[int, int, bool], ...]

  @nn.compact
  def __call__(self, inputs):
    return [
      nn.Dense(out, use_bias=bias, name=f"layer{k}")(x)
      for k, ((_, out, bias), x) in enumerate(zip(self.specs, inputs))
    ]


def as_matrix(layer_tree) -> np.ndarray:
  """``[kernel; bias]`` in float64: the matrix K-FAC preconditions."""
  matrix = np.asarray(layer_tree["kernel"], np.float64)
  if "bias" in layer_tree:
    matrix = np.concatenate(
      [matrix, np.asarray(layer_tree["bias"], np.float64)[None]]
    )
  return matrix


def covariance(rows: np.ndarray) -> np.ndarray:
  product = rows.T @ rows / rows.shape[0]
  return (product + product.T) / 2


def check_eigen(a, g, grad, p, damping, where):
  m = np.kron(a, g) + damping * np.eye(len(a) * len(g))
  expected = np.linalg.solve(m, grad.reshape(-1)).reshape(grad.shape)
  d_a = np.clip(np.linalg.eigvalsh(a), 0, None)
  d_g = np.clip(np.linalg.eigvalsh(g), 0, None)
  kappa = (d_a.max() * d_g.max() + damping) / (d_a.min() * d_g.min() + damping)
  residual = np.linalg.norm(m @ p.reshape(-1) - grad.reshape(-1))
  scale = np.linalg.norm(m, 2) * np.linalg.norm(p) + np.linalg.norm(grad)
  assert residual <= C * UNIT_ROUNDOFF * scale, (
    f"{where}: backward error {residual / scale / UNIT_ROUNDOFF:.1f} ε"
  )
  error = np.linalg.norm(p - expected)
  bound = C * UNIT_ROUNDOFF * kappa * np.linalg.norm(expected)
  assert error <= bound, (
    f"{where}: forward error "
    f"{error / np.linalg.norm(expected) / UNIT_ROUNDOFF:.1f} ε"
    f" with κ = {kappa:.3g}"
  )


def check_inverse(a, g, grad, p, damping, where):
  a_damped = a + damping * np.eye(len(a))
  g_damped = g + damping * np.eye(len(g))
  a_inverse, g_inverse = np.linalg.inv(a_damped), np.linalg.inv(g_damped)
  expected = a_inverse @ grad @ g_inverse
  kappa = np.linalg.cond(a_damped) + np.linalg.cond(g_damped)
  scale = (
    np.linalg.norm(a_inverse, 2)
    * np.linalg.norm(grad)
    * np.linalg.norm(g_inverse, 2)
  )
  error = np.linalg.norm(p - expected)
  assert error <= C * UNIT_ROUNDOFF * kappa * scale, (
    f"{where}: forward error {error / scale / UNIT_ROUNDOFF:.1f} "
    "ε·‖(A+λI)⁻¹‖‖∇‖"
    f"‖(G+λI)⁻¹‖ with κ = {kappa:.3g}"
  )


@settings(max_examples=18, deadline=None, print_blob=True)
@given(
  specs=st.lists(LAYER, min_size=1, max_size=2).map(tuple),
  batch=st.integers(1, 24),
  damping=st.floats(-6, 0).map(lambda e: 10.0**e),
  # float32-representable decays: smaller ones round to 0 and are rejected.
  factor_decay=st.floats(1e-30, 1),
  outer_product=st.booleans(),
  seed=st.integers(0, 2**31 - 1),
)
@example(
  specs=((1, 1, False), (12, 12, True)),
  batch=1,
  damping=1e-6,
  factor_decay=1e-3,
  outer_product=True,
  seed=0,
)
@example(
  specs=((12, 1, True), (1, 12, True)),
  batch=1,
  damping=1.0,
  factor_decay=1.0,
  outer_product=False,
  seed=1,
)
def test_update_is_the_damped_kronecker_solve(
  specs, batch, damping, factor_decay, outer_product, seed
):
  rng = np.random.default_rng(seed)
  model = ParallelDense(specs)

  inputs = [rng.normal(size=(batch, i)).astype(np.float32) for i, _, _ in specs]
  targets = [
    rng.normal(size=(batch, o)).astype(np.float32) for _, o, _ in specs
  ]
  # Drawn directly (model.init would compile eagerly for every new shape);
  # non-zero biases, so the bias rows carry signal.
  params = {
    f"layer{k}": {
      "kernel": (rng.normal(size=(i, out)) / np.sqrt(i)).astype(np.float32),
      **(
        {"bias": 0.1 * rng.normal(size=out).astype(np.float32)} if bias else {}
      ),
    }
    for k, (i, out, bias) in enumerate(specs)
  }
  config = dict(
    damping=damping,
    factor_decay=factor_decay,
    kl_clip=None,
    damping_mode="absolute",
  )
  transforms = {
    "eigen": kfac_jax.scale_by_kfac(
      compute_method="eigen",
      compute_eigenvalue_outer_product=outer_product,
      **config,
    ),
    "inverse": kfac_jax.scale_by_kfac(compute_method="inverse", **config),
  }

  def loss_fn(params, inputs, targets):
    outputs = model.apply({"params": params}, inputs)
    return sum(jnp.mean((y - t) ** 2) for y, t in zip(outputs, targets))

  @jax.jit
  def step(params, old_factors, inputs, targets):
    """One step of each method from ``old_factors``, on the same batch."""
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
      params, inputs, targets
    )
    return grads, {
      method: tx.update(
        grads,
        tx.init(params)._replace(factors=old_factors),
        params,
        kfac_stats=stats,
      )
      for method, tx in transforms.items()
    }

  # Running factors that are not the identity, so the step mixes two general
  # PSD matrices.
  def random_factor(dim):
    return (np.eye(dim) + covariance(rng.normal(size=(3, dim)))).astype(
      np.float32
    )

  old_factors = {
    f"layer{k}": kfac_jax.LayerFactors(
      random_factor(i + bias), random_factor(out)
    )
    for k, (i, out, bias) in enumerate(specs)
  }
  grads, results = step(params, old_factors, inputs, targets)

  # The running factors follow F ← d·F + (1 − d)·F_batch.
  d = float(np.float32(factor_decay))
  for k, (_, out, bias) in enumerate(specs):
    name = f"layer{k}"
    x = np.asarray(inputs[k], np.float64)
    rows = np.concatenate([x, np.ones((batch, 1))], 1) if bias else x
    layer = params[name]
    y = x @ np.asarray(layer["kernel"], np.float64)
    if bias:
      y = y + np.asarray(layer["bias"], np.float64)
    cotangents = 2 * (y - np.asarray(targets[k], np.float64)) / (batch * out)
    for method, (updates, state) in results.items():
      where = f"{name} {specs[k]} {method}"
      old = old_factors[name]
      a = np.asarray(state.factors[name].activation_factor, np.float64)
      g = np.asarray(state.factors[name].gradient_factor, np.float64)
      # float32 (reference.assert_float32_close): the sum over the batch's
      # rows, / batch, the mix (3 roundings); G's cotangents
      # 2(x·W + b − t)/(batch·out) add their dot of ``inputs`` and 4 more,
      # twice in each product. Each entry on its two parts' magnitudes.
      inputs_dim = specs[k][0]
      for got, old_factor, batch_factor, terms in (
        (a, old.activation_factor, covariance(rows), batch + 3),
        (
          g,
          old.gradient_factor,
          covariance(cotangents),
          2 * (inputs_dim + 4) + batch + 3,
        ),
      ):
        old_factor = np.asarray(old_factor, np.float64)
        reference.assert_float32_close(
          got,
          d * old_factor + (1 - d) * batch_factor,
          terms=terms,
          scale=d * np.abs(old_factor) + (1 - d) * np.abs(batch_factor).max(),
          err_msg=where,
        )
      p = as_matrix(updates[name])
      assert np.all(np.isfinite(p)), where
      check = check_eigen if method == "eigen" else check_inverse
      check(a, g, as_matrix(grads[name]), p, damping, where)
