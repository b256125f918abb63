"""Flax NNX's functional API: optax outside ``nnx.Optimizer``.

``graphdef, params = nnx.split(model, nnx.Param)`` gives an ``nnx.State`` of
``nnx.Param`` variables, which optax's own transformations take as it is.
``scale_by_kfac`` takes it too (``init``, ``update``, the partition-spec
helper, checkpoints), returns updates in that container, and computes what
``nnx.Optimizer`` and the Linen twin of the model compute.
"""

from __future__ import annotations

import doctest
import os
import tempfile
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from kfac_jax import checkpoint
from kfac_jax.transform import nnx_variables
from tests.nnx_common import as_pure

STEPS = 3
KFAC = dict(damping=0.01, inv_update_steps=2)


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(5, 7, rngs=rngs)
    self.l2 = nnx.Linear(7, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


class LinenMlp(nn.Module):
  """``Mlp`` in Linen, with its module names."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="l2")(jnp.tanh(nn.Dense(7, name="l1")(x)))


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def model_loss(model, x, y):
  return cross_entropy(model(x), y)


def batches():
  rng = np.random.default_rng(0)
  return [
    (
      jnp.asarray(rng.normal(size=(16, 5)), jnp.float32),
      jnp.asarray(rng.integers(0, 4, size=16), jnp.int32),
    )
    for _ in range(STEPS)
  ]


def functional_step(graphdef, tx):
  """One step as Flax documents optax outside nnx.Optimizer; the stats come
  from the model the params make (the capture's gradients are the same
  ``nnx.State`` of Params)."""

  @jax.jit
  def step(params, opt_state, x, y):
    loss = lambda p, x, y: cross_entropy(nnx.merge(graphdef, p)(x), y)
    grads = jax.grad(loss)(params, x, y)
    _, _, stats = kfac_jax.value_grad_and_stats(model_loss)(
      nnx.merge(graphdef, params), x, y
    )
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state, updates

  return step


def assert_params(tree, kind) -> None:
  """Every leaf of ``tree`` (an ``nnx.State``) sits in a ``kind``."""
  assert isinstance(tree, nnx.State), type(tree)
  nodes = jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, nnx.Variable))
  assert nodes and all(type(n) is kind for n in nodes), nodes


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_functional_api_equals_nnx_optimizer_and_linen(accumulation_steps):
  tx = kfac_jax.kfac(
    0.1, momentum=0.9, accumulation_steps=accumulation_steps, **KFAC
  )
  data = batches()

  graphdef, params = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)
  opt_state = tx.init(params)
  step = functional_step(graphdef, tx)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for x, y in data:
      params, opt_state, updates = step(params, opt_state, x, y)
  # flax 0.12.12 deprecates APIs of 0.12.2 (nnx.pure): none is used.
  assert not [
    w for w in caught if issubclass(w.category, DeprecationWarning)
  ], [str(w.message) for w in caught]
  assert_params(updates, nnx.Param)
  assert_params(params, nnx.Param)
  functional = nnx.to_pure_dict(params)

  model = Mlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def optimizer_step(model, optimizer, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(model_loss)(model, x, y)
    optimizer.update(model, grads, kfac_stats=stats)

  for x, y in data:
    optimizer_step(model, optimizer, x, y)
  with_optimizer = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  linen = LinenMlp()
  linen_params = nnx.to_pure_dict(nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)[1])
  linen_state = tx.init(linen_params)

  @jax.jit
  def linen_step(params, opt_state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p, x, y: cross_entropy(linen.apply({"params": p}, x), y)
    )(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  for x, y in data:
    linen_params, linen_state = linen_step(linen_params, linen_state, x, y)

  # The same float32 program on the same arrays each way.
  jax.tree.map(np.testing.assert_array_equal, functional, with_optimizer)
  jax.tree.map(np.testing.assert_array_equal, functional, linen_params)
  assert not np.array_equal(
    functional["l1"]["kernel"],
    nnx.to_pure_dict(nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)[1])["l1"]["kernel"],
  )


def test_adaptive_mode_on_variables_equals_it_on_their_arrays():
  """The adaptive mode's state holds the previous update (params-shaped)
  and its split_loss merges the params it is handed."""
  graphdef, params = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)
  tx = kfac_jax.scale_by_kfac(
    kl_clip=None, damping=1.0, adaptive=kfac_jax.AdaptiveConfig()
  )

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(model_loss)(
      nnx.merge(graphdef, params), x, y
    )
    split = kfac_jax.SplitLoss(
      lambda p: nnx.merge(graphdef, p)(x),
      lambda logits: cross_entropy(logits, y),
    )
    updates, state = tx.update(
      grads, state, params, kfac_stats=stats, split_loss=split
    )
    return optax.apply_updates(params, updates), state, updates

  runs = []
  for start in (params, as_pure(params)):
    state = tx.init(start)
    current = start
    for x, y in batches():
      current, state, updates = step(current, state, x, y)
    runs.append((current, state, updates))
  (params, state, updates), (pure_params, pure_state, pure_updates) = runs
  assert_params(updates, nnx.Param)
  assert_params(state.quadratic_model.previous_update, nnx.Param)
  for got, want in (
    (params, pure_params),
    (state, pure_state),
    (updates, pure_updates),
  ):
    jax.tree.map(np.testing.assert_array_equal, as_pure(got), want)


def test_partition_specs_and_checkpoints_take_the_param_state():
  graphdef, params = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)
  # Auto: on Explicit axes a Flax model with sharded kernels needs their
  # shardings in the model (tests/test_distribution.py, fsdp).
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
  # Specs as jax.tree.map makes them from the params: in Params.
  kwargs = dict(
    accumulation_steps=2,
    params_partition_specs=jax.tree.map(
      lambda _: PartitionSpec("data"), params
    ),
    **KFAC,
  )
  chain_with = optax.sgd(0.1, momentum=0.9)
  tx = optax.chain(kfac_jax.scale_by_kfac(**kwargs), chain_with)
  is_spec = lambda s: isinstance(s, PartitionSpec)
  with jax.set_mesh(mesh):
    specs = kfac_jax.get_opt_state_partition_specs(
      params, chain_with=chain_with, **kwargs
    )
    # A spec where init puts an array: in the Params of the params-shaped
    # parts, whose specs are the params'.
    assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(
      jax.eval_shape(tx.init, params)
    )
    assert_params(specs[0].accumulator.gradients, nnx.Param)
    assert {
      spec
      for spec in jax.tree.leaves(
        specs[0].accumulator.gradients, is_leaf=is_spec
      )
    } == {PartitionSpec("data")}
    opt_state = jax.jit(
      tx.init,
      out_shardings=jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec
      ),
    )(params)
    assert_params(opt_state[0].accumulator.gradients, nnx.Param)
    assert_params(opt_state[1][0].trace, nnx.Param)  # optax's own state

    step = functional_step(graphdef, tx)
    data = batches()
    params, opt_state, _ = step(params, opt_state, *data[0])
    directory = os.path.join(tempfile.mkdtemp(), "ckpt")
    checkpoint.save(directory, {"params": params, "opt_state": opt_state})
    restored = checkpoint.restore(
      directory,
      jax.eval_shape(lambda: {"params": params, "opt_state": opt_state}),
    )
    assert_params(restored["params"], nnx.Param)
    assert_params(restored["opt_state"][0].accumulator.gradients, nnx.Param)
    continued = [
      step(*start, *data[1])[:2]
      for start in (
        (params, opt_state),
        (restored["params"], restored["opt_state"]),
      )
    ]
    jax.tree.map(np.testing.assert_array_equal, *continued)
    # Saved without preconditioners, they are decomposed again.
    bare = os.path.join(tempfile.mkdtemp(), "ckpt")
    checkpoint.save(bare, opt_state, include_preconditioners=False)
    target = jax.eval_shape(lambda: opt_state)
    recomputed = checkpoint.recompute_preconditioners(
      checkpoint.restore(
        bare, (target[0]._replace(preconditioners=None), target[1])
      ),
      KFAC["damping"],
    )
  assert_params(recomputed[0].accumulator.gradients, nnx.Param)


def test_nnx_variables_docstring_examples_run():
  result = doctest.testmod(nnx_variables, raise_on_error=False)
  assert result.attempted > 0 and result.failed == 0, result


def test_params_in_which_the_capture_finds_no_layer_warn():
  """A bare weight (or a model built inside the loss from a plain dict):
  a warning, not silence. A loss that merges the nnx.State it is given is
  captured (tests/test_nnx_merge.py)."""
  x, _ = batches()[0]
  weights = {"w": jnp.ones((5,))}
  with pytest.warns(UserWarning, match="captured no layer"):
    _, _, stats = kfac_jax.value_grad_and_stats(
      lambda p, x: jnp.sum(x @ p["w"])
    )(weights, x)
  assert stats == {}
