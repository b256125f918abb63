"""Flax logical partitioning on 8 simulated CPU devices.

``tests/multidevice.py`` runs it; ``tests/test_boxed_params.py`` holds the
test: a model whose kernels carry logical axis names trains sharded from
``nn.get_partition_spec`` and the logical axis rules alone."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from kfac_jax.factors.running import factor_dims
from kfac_jax.transform.config import KFACConfig
from tests import multidevice
from tests.multidevice import STEPS, TOLERANCE, comparable

# Kernels' 'mlp' dimensions over 'fsdp' (FSDP), the batch over both axes.
RULES = (("batch", ("data", "fsdp")), ("mlp", "fsdp"), ("embed", None))
MESH_AXES = ("data", "fsdp")


class LogicalMLP(nn.Module):
  """Three layers annotated as maxtext-style models annotate theirs."""

  @nn.compact
  def __call__(self, x):
    logical = lambda names: nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), names
    )
    x = jnp.tanh(nn.Dense(16, kernel_init=logical(("embed", "mlp")))(x))
    x = jnp.tanh(nn.Dense(12, kernel_init=logical(("mlp", "embed")))(x))
    return nn.Dense(4, kernel_init=logical(("embed", "mlp")))(x)


def logical(axis_type: AxisType) -> None:
  """The boxed run (every sharding from the boxes and ``RULES``) equals
  the unboxed one (the same shardings given as specs) within
  ``TOLERANCE``: updates, factors, preconditioners. Adam's moments of the
  kernels are sharded like the kernels, the packed rows over ``mesh_axes``,
  and ``get_opt_state_partition_specs(logical_axis_rules=...)`` gives the
  same specs as Flax's route."""
  model = LogicalMLP()
  keys = jax.random.split(jax.random.key(3), 3)
  batches = (
    jax.random.normal(keys[0], (STEPS, 16, 6)),
    jax.random.normal(keys[1], (STEPS, 16, 4)),
  )
  boxed = model.init(keys[2], batches[0][0])["params"]
  loss_fn = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  params_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), RULES)
  kwargs = dict(
    damping=0.01,
    inv_update_steps=2,
    mesh_axes=MESH_AXES,
    grad_worker_fraction=kfac_jax.DistributedStrategy.MEM_OPT,
    params_partition_specs=params_specs,
  )
  adam = optax.adam(0.01)
  tx = optax.chain(kfac_jax.scale_by_kfac(**kwargs), adam)
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(tx.init, boxed)
    # Flax's route: the state's boxes, the user's rules, nothing else.
    state_shardings = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(shapes), mesh, RULES
    )
    params_shardings = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(boxed), mesh, RULES
    )
    specs = kfac_jax.get_opt_state_partition_specs(
      boxed, chain_with=adam, logical_axis_rules=RULES, **kwargs
    )
    assert specs == nn.logical_to_mesh(nn.get_partition_spec(shapes), RULES)
    batch_sharding = NamedSharding(
      mesh, nn.logical_to_mesh_axes(("batch",), RULES)
    )
    boxed_run = _train(
      tx,
      loss_fn,
      jax.device_put(boxed, params_shardings),
      batches,
      batch_sharding,
      (params_shardings, state_shardings),
    )
    plain = jax.device_put(nn.unbox(boxed), params_shardings)
    plain_shardings = jax.tree.map(
      lambda spec: NamedSharding(mesh, spec),
      kfac_jax.get_opt_state_partition_specs(plain, chain_with=adam, **kwargs),
      is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    plain_run = _train(
      tx,
      loss_fn,
      plain,
      batches,
      batch_sharding,
      (nn.unbox(params_shardings), plain_shardings),
    )
    updates, state = boxed_run
    _assert_same_run(
      ([nn.unbox(u) for u in updates], nn.unbox(state[0])),
      (plain_run[0], plain_run[1][0]),
      kwargs,
    )
  moments = state[1][0]
  for moment in (moments.mu, moments.nu):
    for leaf, kernel in zip(
      jax.tree.leaves(nn.unbox(moment)), jax.tree.leaves(nn.unbox(updates[-1]))
    ):
      np.testing.assert_equal(leaf.shape, kernel.shape)
      assert leaf.sharding.is_equivalent_to(kernel.sharding, leaf.ndim), (
        leaf.sharding,
        kernel.sharding,
      )
  kernel = nn.unbox(moments.mu)["Dense_0"]["kernel"]
  assert kernel.sharding.is_equivalent_to(
    NamedSharding(mesh, PartitionSpec(None, "fsdp")), 2
  ), kernel.sharding
  rows = nn.unbox(state[0].preconditioners.rows)
  assert rows.sharding.is_equivalent_to(
    NamedSharding(mesh, PartitionSpec(MESH_AXES)), rows.ndim
  )
  for name, factors in state[0].factors.items():
    for factor in factors:
      assert factor.sharding.is_fully_replicated, name


def _assert_same_run(run, reference, kwargs):
  """Updates of every step, factors and preconditioners (read in the
  layout of ``scale_by_kfac(**kwargs)``; ``multidevice.comparable``) and
  counters within ``TOLERANCE``."""
  (updates, state), (ref_updates, ref_state) = run, reference
  close = lambda label: (
    lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), **TOLERANCE, err_msg=label
    )
  )
  for step, (a, b) in enumerate(zip(updates, ref_updates)):
    jax.tree.map(close(f"updates of step {step}"), a, b)
  jax.tree.map(close("factors"), state.factors, ref_state.factors)
  per_layer = lambda s: KFACConfig(**kwargs).placement.per_layer(
    factor_dims(s.factors), s.preconditioners
  )
  layers, ref_layers = per_layer(state), per_layer(ref_state)
  assert set(layers) == set(ref_layers)
  for name in layers:
    for a, b in zip(comparable(layers[name]), comparable(ref_layers[name])):
      close(f"preconditioner {name}")(a, b)
  for field in ("count", "skipped_factor_updates", "rejected_decompositions"):
    assert int(getattr(state, field)) == int(getattr(ref_state, field)), field


def _train(tx, loss_fn, params, batches, batch_sharding, shardings):
  """``STEPS`` steps, state and params kept in ``shardings``; returns
  (updates per step, final state)."""
  params_shardings, state_shardings = shardings

  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), state, updates

  step = jax.jit(
    step, out_shardings=(params_shardings, state_shardings, params_shardings)
  )
  state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  all_updates = []
  for x, y in zip(*batches):
    x, y = jax.device_put((x, y), batch_sharding)
    params, state, updates = step(params, state, x, y)
    # One step in flight at a time (simulated devices: multidevice.train).
    all_updates.append(jax.block_until_ready(updates))
  return all_updates, state


PROGRAMS = {f.__name__: f for f in (logical,)}

if __name__ == "__main__":
  multidevice.main(PROGRAMS)
