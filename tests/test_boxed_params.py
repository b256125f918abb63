"""Params boxed with Flax's partitioning metadata.

``nn.with_logical_partitioning`` and ``nn.with_partitioning`` params: captured,
preconditioned and checkpointed as their arrays, with the state boxed where it
is params-shaped.

Boxing adds no operation on the arrays, so on one device a boxed run is
compared with the unboxed one bit for bit. The sharded run (8 simulated
devices, ``tests/multidevice_boxed.py``) is compared within the mesh
tests' tolerance.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import kfac_jax
from kfac_jax import checkpoint
from tests import multidevice

RULES = (("batch", "data"), ("mlp", "data"), ("embed", None))
STEPS = 3


class LogicalMLP(nn.Module):
  """Kernels annotated with logical names (as Flax's lm1b and maxtext-style
  models do), the head with mesh names (``nn.with_partitioning``)."""

  @nn.compact
  def __call__(self, x):
    logical = lambda names: nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), names
    )
    x = jnp.tanh(nn.Dense(8, kernel_init=logical(("embed", "mlp")))(x))
    x = jnp.tanh(nn.Dense(8, kernel_init=logical(("mlp", "embed")))(x))
    return nn.Dense(
      3,
      kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), (None, None)
      ),
      name="head",
    )(x)


def problem():
  """Boxed params, the loss, the split loss of the adaptive mode, batches."""
  model = LogicalMLP()
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (STEPS, 16, 5))
  y = jax.random.normal(keys[1], (STEPS, 16, 3))
  boxed = model.init(keys[2], x[0])["params"]
  loss_fn = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
  split_loss = lambda x, y: kfac_jax.SplitLoss(
    lambda p: model.apply({"params": p}, x),
    lambda out: jnp.mean((out - y) ** 2),
  )
  return boxed, loss_fn, split_loss, (x, y)


def train(tx, params, loss_fn, batches, split_loss=None):
  """``STEPS`` jitted steps; returns (updates per step, final state)."""

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    extra = {} if split_loss is None else dict(split_loss=split_loss(x, y))
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **extra)
    return optax.apply_updates(params, updates), state, updates

  state, all_updates = tx.init(params), []
  for x, y in zip(*batches):
    params, state, updates = step(params, state, x, y)
    all_updates.append(updates)
  return all_updates, state


def boxes_of(tree):
  """``{path: (box type, names)}`` of the boxes in ``tree``."""
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return {
    jax.tree_util.keystr(path): (type(leaf), leaf.names)
    for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_box
    )[0]
    if is_box(leaf)
  }


def test_gradients_and_stats_of_boxed_params_are_the_unboxed_ones_boxed():
  boxed, loss_fn, _, (x, y) = problem()
  params = nn.unbox(boxed)
  value, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
    boxed, x[0], y[0]
  )
  expected = kfac_jax.value_grad_and_stats(loss_fn)(params, x[0], y[0])
  # As jax.value_and_grad gives them: in the params' boxes.
  assert jax.tree.structure(grads) == jax.tree.structure(boxed)
  assert boxes_of(grads) == boxes_of(boxed)
  jax.tree.map(
    np.testing.assert_array_equal, (value, nn.unbox(grads), stats), expected
  )
  assert kfac_jax.trace_layers(
    loss_fn, boxed, x[0], y[0]
  ) == kfac_jax.trace_layers(loss_fn, params, x[0], y[0])


@pytest.mark.parametrize("mode", ["accumulation", "adaptive"])
def test_boxed_training_equals_unboxed_and_boxes_the_params_shaped_state(mode):
  """Accumulated gradients (chained with Adam) and the adaptive mode's
  previous update: the params-shaped parts of the K-FAC state."""
  boxed, loss_fn, split_loss, batches = problem()
  if mode == "accumulation":
    make_tx = lambda: optax.chain(
      kfac_jax.scale_by_kfac(
        damping=0.01, inv_update_steps=2, accumulation_steps=2
      ),
      optax.adam(0.01),
    )
    split_loss = None
  else:
    make_tx = lambda: kfac_jax.scale_by_kfac(
      damping=1.0,
      kl_clip=None,
      inv_update_steps=2,
      adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=1),
    )
  updates, state = train(make_tx(), boxed, loss_fn, batches, split_loss)
  expected_updates, expected_state = train(
    make_tx(), nn.unbox(boxed), loss_fn, batches, split_loss
  )
  for got, expected in zip(updates, expected_updates):
    assert boxes_of(got) == boxes_of(boxed)
    jax.tree.map(np.testing.assert_array_equal, nn.unbox(got), expected)
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(state), expected_state)
  kfac_state = state[0] if mode == "accumulation" else state
  params_shaped = (
    kfac_state.accumulator.gradients
    if mode == "accumulation"
    else kfac_state.quadratic_model.previous_update
  )
  assert boxes_of(params_shaped) == boxes_of(boxed)
  # Factors and counters are replicated: arrays, no boxes.
  assert not boxes_of(kfac_state.factors) and not boxes_of(kfac_state.count)
  if mode == "accumulation":  # Adam's moments, boxed by optax's tree_map.
    assert boxes_of(state[1][0].mu) == boxes_of(boxed)


def test_partition_specs_of_a_boxed_state_follow_the_rules():
  """``get_opt_state_partition_specs(logical_axis_rules=...)`` equals Flax's
  route, ``nn.logical_to_mesh(nn.get_partition_spec(state), rules)``: the
  kernels' logical names mapped, the packed rows over ``mesh_axes``. One
  axis is a string in a ``PartitionSpec``, a logical name to Flax: its
  route needs the axis mapped to itself (several pass through: the
  8-device test)."""
  boxed, _, _, _ = problem()
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  kwargs = dict(mesh_axes="data", accumulation_steps=2)
  adam = optax.adam(0.01)
  with jax.set_mesh(mesh):
    tx = optax.chain(kfac_jax.scale_by_kfac(**kwargs), adam)
    shapes = jax.eval_shape(tx.init, boxed)
    specs = kfac_jax.get_opt_state_partition_specs(
      boxed, chain_with=adam, logical_axis_rules=RULES, **kwargs
    )
  flax_specs = nn.logical_to_mesh(
    nn.get_partition_spec(shapes), RULES + (("data", "data"),)
  )
  assert specs == flax_specs
  kfac_specs = specs[0]
  assert kfac_specs.preconditioners.rows == PartitionSpec("data", None)
  kernel = kfac_specs.accumulator.gradients["Dense_0"]["kernel"]
  assert kernel == PartitionSpec(None, "data")  # ("embed", "mlp")
  assert specs[1][0].mu["Dense_1"]["kernel"] == PartitionSpec("data", None)
  assert kfac_specs.accumulator.gradients["head"]["kernel"] == PartitionSpec(
    None, None
  )
  assert kfac_specs.factors["Dense_0"].activation_factor == PartitionSpec()


def test_rules_without_boxes_and_logical_boxes_without_rules_are_refused():
  boxed, _, _, _ = problem()
  with pytest.raises(
    ValueError,
    match="logical_axis_rules given, but the "
    "params hold no Flax partitioning boxes",
  ):
    kfac_jax.get_opt_state_partition_specs(
      nn.unbox(boxed), logical_axis_rules=RULES
    )
  with pytest.raises(
    ValueError,
    match=r"nn.LogicallyPartitioned boxes \(axis "
    r"names \('embed', 'mlp'\)\) and no logical axis rules",
  ):
    kfac_jax.get_opt_state_partition_specs(boxed, accumulation_steps=2)
  # The rules of an enclosing nn.logical_axis_rules do.
  with nn.logical_axis_rules(RULES):
    specs = kfac_jax.get_opt_state_partition_specs(boxed, accumulation_steps=2)
  assert specs.accumulator.gradients["Dense_0"]["kernel"] == PartitionSpec(
    None, "data"
  )


def test_a_boxed_state_checkpoints_and_recomputes_in_its_boxes(tmp_path):
  boxed, _, _, _ = problem()
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  kwargs = dict(mesh_axes="data", accumulation_steps=2)
  with jax.set_mesh(mesh):
    tx = optax.chain(kfac_jax.scale_by_kfac(**kwargs), optax.adam(0.01))
    tree = {"params": boxed, "opt_state": tx.init(boxed)}
    checkpoint.save(tmp_path / "full", tree)
    checkpoint.save(tmp_path / "small", tree, include_preconditioners=False)
    target = jax.eval_shape(lambda: tree)
    restored = checkpoint.restore(tmp_path / "full", target)
    recomputed = checkpoint.recompute_preconditioners(
      checkpoint.restore(tmp_path / "small", target), 1e-3, **kwargs
    )
    expected = checkpoint.recompute_preconditioners(tree, 1e-3, **kwargs)
  for result, reference in ((restored, tree), (recomputed, expected)):
    assert jax.tree.structure(result) == jax.tree.structure(tree)
    jax.tree.map(np.testing.assert_array_equal, result, reference)
  rows = recomputed["opt_state"][0].preconditioners.rows
  assert isinstance(rows, nn.Partitioned) and rows.names == (("data",), None)


@pytest.mark.multidevice
def test_logical_partitioning_on_eight_devices_equals_the_unboxed_run():
  """Sharded from ``nn.get_partition_spec`` and the rules alone: updates
  and state as the unboxed run's within the mesh tolerance, Adam's moments
  sharded like the kernels, the rows over ``mesh_axes``."""
  multidevice.run_on_eight_devices("tests.multidevice_boxed", "logical", "Auto")
