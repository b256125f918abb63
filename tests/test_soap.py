"""The race's SOAP baseline (``benchmarks/soap.py``) against the paper.

A float64 NumPy transcription of Vyas et al. 2024, Algorithm 3 (Adam's
first moment kept in the parameters' basis and projected every step) and
Algorithm 4 (power iteration + QR, ``V`` permuted by the sorted estimated
eigenvalues), run on a few steps of three parameters: a square matrix
(both factors), a matrix whose second axis exceeds ``max_precond_dim``
(one factor) and a vector (plain Adam).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import soap
from tests import reference

B1, B2, EPS, FREQUENCY, MAX_DIM = 0.9, 0.95, 1e-8, 2, 4
STEPS = 6  # the first sets the bases; refreshes after Adam steps 2 and 4


def eigenbasis(factor: np.ndarray) -> np.ndarray:
  """Eigenvectors by decreasing eigenvalue."""
  return np.linalg.eigh(factor)[1][:, ::-1]


def reference_soap(
  grads: list[np.ndarray], refresh: str
) -> tuple[list[np.ndarray], float]:
  """The paper's updates ``N`` for a matrix (or vector) parameter, and the
  condition of the float32 computation of them: the largest ``‖F‖/gap``
  of the factors (an eigenbasis's sensitivity) times the largest
  ``max|G'| / √V`` (a component's rounding, relative to the largest
  component, divided by its √V in Adam's quotient)."""
  shape = grads[0].shape
  sides = [len(shape) == 2 and 1 < n <= MAX_DIM for n in shape]
  gram = (lambda g: g @ g.T, lambda g: g.T @ g)
  factors = [np.zeros((n, n)) for n in shape]
  bases = [np.eye(n) for n in shape]
  first = np.zeros(shape)  # M, in the parameters' basis
  second = np.zeros(shape)  # V, in the eigenbasis
  updates, gaps, quotients = [], 1.0, 1.0

  def project(x, back=False):
    if len(shape) == 1:
      return x
    left, right = bases
    return left @ x @ right.T if back else left.T @ x @ right

  def gap_condition(f):
    values = np.linalg.eigvalsh(f)
    return values[-1] / np.diff(values).min()

  for step, g in enumerate(grads):
    if step == 0:
      factors = [(1 - B2) * gram[i](g) for i in range(len(shape))]
      gaps = max(
        [gaps] + [gap_condition(f) for f, side in zip(factors, sides) if side]
      )
      bases = [
        eigenbasis(f) if side else q
        for f, q, side in zip(factors, bases, sides)
      ]
      updates.append(np.zeros(shape))
      continue
    rotated = project(g)
    first = B1 * first + (1 - B1) * g
    second = B2 * second + (1 - B2) * rotated**2
    quotients = max(quotients, np.abs(rotated).max() / np.sqrt(second).min())
    scale = np.sqrt(1 - B2**step) / (1 - B1**step)
    updates.append(
      scale * project(project(first) / (np.sqrt(second) + EPS), back=True)
    )
    factors = [B2 * f + (1 - B2) * gram[i](g) for i, f in enumerate(factors)]
    if step % FREQUENCY:
      continue
    for axis, (f, side) in enumerate(zip(factors, sides)):
      if not side:
        continue
      gaps = max(gaps, gap_condition(f))
      if refresh == "eigh":
        bases[axis] = eigenbasis(f)
        continue
      order = np.argsort(-np.diag(bases[axis].T @ f @ bases[axis]))
      second = np.take(second, order, axis=axis)
      bases[axis] = np.linalg.qr(f @ bases[axis][:, order])[0]
  return updates, gaps * quotients


def gradients(
  rng: np.random.Generator, shape: tuple[int, ...]
) -> list[np.ndarray]:
  """A fixed matrix with distinct singular values plus noise, so that the
  factors' eigenvalues are apart (an eigenbasis of close ones is not
  determined, in float32 or float64). After the first step the singular
  values are reversed and tripled: by the first refresh the order of the
  eigenvalues has turned, and Algorithm 4 permutes ``V``."""
  base = rng.normal(size=shape)
  later = base
  if len(shape) == 2:
    u, _, vt = np.linalg.svd(base, full_matrices=False)
    values = np.arange(len(vt), 0, -1.0)
    base = u @ np.diag(values) @ vt
    later = u @ np.diag(3 * values[::-1]) @ vt
  return [
    ((base if step == 0 else later) + 0.3 * rng.normal(size=shape)).astype(
      np.float32
    )
    for step in range(STEPS)
  ]


@pytest.mark.parametrize("refresh", ["qr", "eigh"])
def test_soap_matches_the_papers_algorithm(refresh):
  rng = np.random.default_rng(0)
  shapes = {"square": (4, 4), "wide": (3, 6), "bias": (5,)}
  grads = {name: gradients(rng, shape) for name, shape in shapes.items()}
  tx = soap.scale_by_soap(
    b1=B1,
    b2=B2,
    eps=EPS,
    precondition_frequency=FREQUENCY,
    max_precond_dim=MAX_DIM,
    refresh=refresh,
  )
  params = {name: jnp.zeros(shape) for name, shape in shapes.items()}
  state = tx.init(params)
  update = jax.jit(tx.update)
  actual = {name: [] for name in shapes}
  for step in range(STEPS):
    g = {name: jnp.asarray(grads[name][step]) for name in shapes}
    updates, state = update(g, state, params)
    for name in shapes:
      actual[name].append(np.asarray(updates[name]))
  assert int(state.count) == STEPS
  # "wide" keeps one factor (6 > MAX_DIM), the vector none.
  assert [f is None for f in state.factors["wide"]] == [False, True]
  assert state.factors["bias"] == (None,)
  for name in shapes:
    expected, condition = reference_soap(
      [g.astype(np.float64) for g in grads[name]], refresh
    )
    for step, (a, e) in enumerate(zip(actual[name], expected)):
      if step == 0:
        np.testing.assert_array_equal(a, 0.0)
        continue
      # Roundings: the Gram sums (6 products), each basis (eigh or QR of
      # 4 rows), the projection in and out (4 products each), the moments'
      # sums over the steps and the quotient; through the condition above.
      terms = 6 + 4 + 2 * 4 + 2 * STEPS + 2
      reference.assert_float32_close(
        a, e, terms=terms, condition=condition, err_msg=f"{name}, step {step}"
      )


def test_soap_moves_against_the_gradient_and_refuses_bad_settings():
  """From the second step on, ``-lr·N`` decreases a quadratic; settings
  out of range are refused by name."""
  target = jnp.arange(12.0).reshape(3, 4) / 12
  loss = lambda w: 0.5 * jnp.sum((w - target) ** 2)
  tx = soap.soap(1e-2, weight_decay=0.0)
  params = jnp.zeros((3, 4))
  state = tx.init(params)
  losses = []
  for _ in range(20):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = params + updates
    losses.append(float(loss(params)))
  assert losses[0] == float(loss(jnp.zeros((3, 4))))  # the first: no step
  assert all(b < a for a, b in zip(losses, losses[1:]))
  for kwargs, name in (
    (dict(b1=1.0), "b1"),
    (dict(eps=0.0), "eps"),
    (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(refresh="svd"), "refresh"),
  ):
    with pytest.raises(ValueError, match=name):
      soap.scale_by_soap(**kwargs)
