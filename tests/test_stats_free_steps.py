"""Steps without statistics: ``update(kfac_stats=NO_STATS)`` after a plain
``jax.value_and_grad``, on the steps ``factor_update_steps`` leaves out."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kfac_jax
from tests import reference
from tests.kfac_problems import make_problem

BATCH = 16


def _factor_products(jaxpr: jax.core.Jaxpr) -> list[tuple[int, ...]]:
  """The output shapes of the ``dot_general``s in ``jaxpr`` (and every
  sub-jaxpr: ``cond`` branches, ``pjit``) that contract the batch's rows into
  square matrices (stacked by block or not): ``aᵀa`` and ``gᵀg``, the batch
  factors' products."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contracting, _), _ = eqn.params["dimension_numbers"]
      shape = eqn.outvars[0].aval.shape
      rows = [eqn.invars[0].aval.shape[d] for d in contracting]
      if rows == [BATCH] and shape[-1] == shape[-2]:
        found.append(shape[-2:])
    for sub in _subjaxprs(eqn.params.values()):
      found.extend(_factor_products(sub))
  return found


def _subjaxprs(values):
  """The jaxprs among an equation's params (``cond``'s branches, ``pjit``'s
  and ``custom_jvp_call``'s jaxpr)."""
  for value in values:
    if isinstance(value, (tuple, list)):
      yield from _subjaxprs(value)
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
      yield value.jaxpr  # a ClosedJaxpr
    elif hasattr(value, "eqns"):
      yield value


def _steps(tx, loss_fn):
  def with_stats(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=stats)

  def without_stats(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    return tx.update(grads, state, params, kfac_stats=kfac_jax.NO_STATS)

  return with_stats, without_stats


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_a_step_without_statistics_computes_no_factor_products(method):
  params, batches, loss_fn, _ = make_problem("mlp", use_bias=True)
  tx = kfac_jax.scale_by_kfac(
    compute_method=method, factor_update_steps=4, inv_update_steps=4
  )
  state = tx.init(params)
  x, y = next(batches)
  with_stats, without_stats = _steps(tx, loss_fn)
  # A [6, 6], [8, 8] (the bias column) and G [7, 7], [4, 4] of the two layers.
  products = _factor_products(
    jax.make_jaxpr(with_stats)(params, state, x, y).jaxpr
  )
  assert sorted(products) == [(4, 4), (6, 6), (7, 7), (8, 8)]
  assert (
    _factor_products(jax.make_jaxpr(without_stats)(params, state, x, y).jaxpr)
    == []
  )


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_off_factor_steps_without_statistics_update_as_with_them(method):
  """With ``factor_update_steps=3``, statistics on steps 0 and 3 only give
  the updates and factors of statistics on every step."""
  params, batches, loss_fn, _ = make_problem("mlp", use_bias=True)
  tx = kfac_jax.scale_by_kfac(
    compute_method=method,
    factor_update_steps=3,
    inv_update_steps=3,
    kl_clip=None,
  )
  with_stats, without_stats = map(jax.jit, _steps(tx, loss_fn))
  every, some = tx.init(params), tx.init(params)
  for step in range(5):
    x, y = next(batches)
    expected, every = with_stats(params, every, x, y)
    run = with_stats if step % 3 == 0 else without_stats
    got, some = run(params, some, x, y)
    # The same program parts on the same inputs: only XLA's fusion choices
    # differ between the two programs, a rounding of each product's terms
    # (at most the 16 rows of a factor product and the 8-wide
    # preconditioning products), through the damped inverse's condition
    # (the relative damping's 1/λ = 1000 at most).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      reference.assert_float32_close(a, b, terms=2 * (BATCH + 8), condition=1e3)
  assert int(some.skipped_factor_updates) == 0
  for a, b in zip(
    jax.tree.leaves(some.factors), jax.tree.leaves(every.factors)
  ):
    reference.assert_float32_close(a, b, terms=BATCH + 1)


def test_a_factor_step_without_statistics_keeps_the_factors_and_counts():
  params, batches, loss_fn, _ = make_problem("mlp", use_bias=True)
  tx = kfac_jax.scale_by_kfac()
  state = tx.init(params)
  _, without_stats = _steps(tx, loss_fn)
  _, after = jax.jit(without_stats)(params, state, *next(batches))
  assert int(after.skipped_factor_updates) == 1
  for a, b in zip(
    jax.tree.leaves(after.factors), jax.tree.leaves(state.factors)
  ):
    np.testing.assert_array_equal(a, b)


def test_no_statistics_is_refused_where_the_step_needs_them():
  params, batches, loss_fn, _ = make_problem("mlp", use_bias=True)
  grads = jax.grad(loss_fn)(params, *next(batches))
  accumulating = kfac_jax.scale_by_kfac(accumulation_steps=2)
  with pytest.raises(ValueError, match="accumulation_steps=2.*each micro"):
    accumulating.update(
      grads, accumulating.init(params), params, kfac_stats=kfac_jax.NO_STATS
    )
  by_class = kfac_jax.scale_by_kfac(skip_layers=["Conv"])
  with pytest.raises(ValueError, match="NO_STATS.*layers=kfac_jax.trace"):
    by_class.update(
      grads, by_class.init(params), params, kfac_stats=kfac_jax.NO_STATS
    )
  # Forgetting the stats altogether still says how to pass them.
  with pytest.raises(ValueError, match="needs kfac_stats.*NO_STATS"):
    by_class.update(grads, by_class.init(params), params)
