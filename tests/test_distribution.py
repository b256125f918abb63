"""Distributed K-FAC: strategies, assignment, layout and partition specs.

The multi-device checks run the programs of ``tests/multidevice*.py`` in a
subprocess with 8 simulated CPU devices (marker ``multidevice``); the rest
runs here on one.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

import kfac_jax
from examples.hlo_cost import per_device_costs
from kfac_jax.distribution import layout as layout_lib
from kfac_jax.distribution import strategy as strategy_lib
from kfac_jax.distribution.assignment import assign_layers, layer_cost
from kfac_jax.preconditioning.methods import make_method
from tests import (
  multidevice,
  multidevice_checkpoint,
  multidevice_fsdp,
  reference,
)

# Each program by the module that holds it.
MODULES = {
  program: module.__name__
  for module in (multidevice, multidevice_checkpoint, multidevice_fsdp)
  for program in module.PROGRAMS
}


def run_on_eight_devices(program: str, axis_type: str) -> None:
  multidevice.run_on_eight_devices(MODULES[program], program, axis_type)


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_every_strategy_on_every_mesh_equals_one_device(axis_type):
  """COMM/HYBRID/MEM on (8,), (2,4), (4,2) (Explicit: (2,4)): updates and
  states within 1e-5."""
  run_on_eight_devices("equality", axis_type)


@pytest.mark.multidevice
def test_the_subspace_solver_on_a_mesh_equals_one_device():
  run_on_eight_devices("subspace_solver", "Auto")


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_ekfac_on_a_mesh_equals_one_device(axis_type):
  run_on_eight_devices("ekfac", axis_type)


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_eager_update_on_a_subset_of_axes_and_other_mesh_edges(axis_type):
  run_on_eight_devices("edges", axis_type)


@pytest.mark.multidevice
def test_fsdp_sharded_kernels_train_as_one_device_and_keep_their_specs():
  # Auto axes: on Explicit axes a Flax linen model with sharded kernels needs
  # sharding annotations of its own before it runs at all.
  run_on_eight_devices("fsdp", "Auto")


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_row_sharded_kernels_with_kfac_on_another_axis_equal_one_device(
  axis_type,
):
  # The kernels' 'model' axis is Auto either way (on Explicit axes a Linen
  # model with sharded kernels needs annotations of its own).
  run_on_eight_devices("row_parallel", axis_type)


@pytest.mark.multidevice
def test_fsdp_kernels_without_mesh_axes_keep_the_state_specs():
  # Before, the preconditioning of a sharded kernel pulled its factors and
  # preconditioner onto the kernel's sharding (a donated step compiled
  # twice), or into one XLA could not lay out (kernel rows over 'data').
  run_on_eight_devices("local_fsdp", "Auto")


@pytest.mark.multidevice
def test_fsdp_specs_given_to_kfac_inside_multi_transform_equal_one_device():
  # Auto axes, as the fsdp program. The full tree of specs was refused: init
  # and update see the layers withheld from K-FAC as optax.MaskedNodes.
  run_on_eight_devices("multi_transform_fsdp", "Auto")


@pytest.mark.multidevice
def test_a_step_jitted_with_the_specs_reruns_on_its_own_state():
  # Auto axes: on Explicit ones jax returns every leaf with full-rank specs.
  run_on_eight_devices("stable_state", "Auto")


@pytest.mark.multidevice
def test_a_mesh_of_explicit_and_auto_axes_equals_one_device():
  run_on_eight_devices("mixed", "Auto")


@pytest.mark.multidevice
def test_adaptive_mode_on_a_mesh_with_fsdp_kernels_equals_one_device():
  run_on_eight_devices("adaptive", "Auto")


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_gradient_from_stats_on_a_batch_sharded_batch_equals_one_device(
  axis_type,
):
  run_on_eight_devices("gradient_from_stats", axis_type)


@pytest.mark.multidevice
def test_compiled_program_divides_decompositions_and_memory():
  """Per-device eigh/Cholesky FLOPs ≤ 1.25/n; MEM_OPT bytes ≤ 1.25/n."""
  run_on_eight_devices("division", "Auto")


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_partition_specs_match_the_shardings_of_init(axis_type):
  run_on_eight_devices("specs", axis_type)


@pytest.mark.multidevice
def test_blocks_of_scanned_and_grouped_layers_train_as_one_device():
  """9 blocks (3 scan slices x (2 conv groups + 1 dense)), kernels sharded."""
  run_on_eight_devices("blocks", "Auto")


@pytest.mark.multidevice
def test_checkpoint_moves_a_state_to_another_strategy_and_device_count():
  run_on_eight_devices("checkpoint", "Explicit")


@pytest.mark.multidevice
def test_rows_restored_under_another_assignment_are_decomposed_again():
  """Same rows shape, other offsets: detected by the layout fingerprint; the
  next update equals a decomposition step of the recomputed state."""
  run_on_eight_devices("restored_layout", "Auto")


@pytest.mark.multidevice
def test_ekfac_restored_elsewhere_leaves_stale_micro_batches_out():
  """Micro-batch S summed in bases of another layout never enters S."""
  run_on_eight_devices("restored_ekfac_accumulation", "Explicit")


# ---------------------------------------------------------------- one device


def test_greedy_assignment_is_largest_first_to_least_loaded():
  # 10 → 0; 7 → 1; 5 → 1 (7 < 10); 3 → 0 (10 < 12); 3 → 1 (12 < 13).
  owner = assign_layers({"a": 10, "b": 7, "c": 5, "d": 3, "e": 3}, 2)
  assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
  # Groups of two first ({a, d} vs {b, c, e}: 13 vs 15), then members.
  owner = assign_layers({"a": 10, "b": 7, "c": 5, "d": 3, "e": 3}, 4, 2)
  assert owner == {"a": 0, "d": 1, "b": 2, "c": 3, "e": 3}
  assert layer_cost(3, 2, strategy_lib.AssignmentStrategy.COMPUTE) == 35
  assert layer_cost(3, 2, strategy_lib.AssignmentStrategy.MEMORY) == 13


def test_greedy_assignment_balances_the_autoencoder_within_kaisa_bound():
  dims = [
    (785, 1000),
    (1001, 500),
    (501, 250),
    (251, 30),
    (31, 250),
    (251, 500),
    (501, 1000),
    (1001, 784),
  ]
  costs = {
    str(i): layer_cost(*d, strategy_lib.AssignmentStrategy.COMPUTE)
    for i, d in enumerate(dims)
  }
  for n in (2, 4):
    owner = assign_layers(costs, n)
    loads = [
      sum(c for name, c in costs.items() if owner[name] == d) for d in range(n)
    ]
    # Greedy LPT: the largest load exceeds the mean by at most one layer.
    assert max(loads) <= sum(loads) / n + max(costs.values())
    assert sorted(set(owner.values())) == list(range(n))


@pytest.mark.parametrize(
  "fraction, expected",
  [
    (kfac_jax.DistributedStrategy.COMM_OPT, 8),
    (kfac_jax.DistributedStrategy.HYBRID_OPT, 4),
    (kfac_jax.DistributedStrategy.MEM_OPT, 1),
    ("hybrid_opt", 4),
    (0.25, 2),
    (1.0, 8),
    (1 / 8, 1),
  ],
)
def test_group_size_of_each_fraction(fraction, expected):
  mesh = AbstractMesh((2, 4), ("data", "fsdp"))
  config = strategy_lib.make_config(("data", "fsdp"), fraction, "compute")
  assert strategy_lib.group_size(config, mesh) == (8, expected)


def test_group_size_over_a_subset_of_the_mesh_axes():
  mesh = AbstractMesh((2, 4), ("data", "fsdp"))
  config = strategy_lib.make_config("fsdp", "mem_opt", "memory")
  assert strategy_lib.group_size(config, mesh) == (4, 1)


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(mesh_axes=("data", "model")), ValueError, "'model'"),
    (
      dict(mesh_axes="data", grad_worker_fraction=0.3),
      ValueError,
      "whole divisor of 2",
    ),
    (
      dict(mesh_axes=("data", "fsdp"), grad_worker_fraction=3 / 8),
      ValueError,
      "f in {1/8, 2/8, 4/8, 8/8}",
    ),
    (
      dict(mesh_axes="fsdp", grad_worker_fraction=0.0),
      ValueError,
      "grad_worker_fraction",
    ),
    (
      dict(mesh_axes="fsdp", grad_worker_fraction="fast"),
      ValueError,
      "grad_worker_fraction='fast'",
    ),
    (
      dict(mesh_axes="fsdp", assignment_strategy="time"),
      ValueError,
      "assignment_strategy",
    ),
    (dict(mesh_axes=()), TypeError, "mesh_axes"),
    (dict(mesh_axes=("data", "data")), TypeError, "distinct"),
    (dict(mesh_axes=[1]), TypeError, "mesh_axes"),
  ],
)
def test_bad_distribution_arguments_are_named(kwargs, error, message):
  mesh = AbstractMesh((2, 4), ("data", "fsdp"))
  with pytest.raises(error, match=None) as raised:
    config = strategy_lib.make_config(
      kwargs.get("mesh_axes"),
      kwargs.get("grad_worker_fraction", "comm_opt"),
      kwargs.get("assignment_strategy", "compute"),
    )
    strategy_lib.group_size(config, mesh)
  assert message in str(raised.value)


def test_mesh_axes_without_a_mesh_is_a_clear_error():
  params = {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}}
  with pytest.raises(ValueError, match="jax.set_mesh"):
    kfac_jax.scale_by_kfac(mesh_axes="data").init(params)


@pytest.mark.parametrize("use_eigen", [True, False])
@pytest.mark.parametrize(
  "dims",
  [
    {"a": (5, 3), "b": (4, 4), "c": (2, 6), "d": (7, 1), "e": (3, 3)},
    # Devices 1 and 2 (of groups 0 and 1) together outweigh every group: a
    # row sized over any two neighbours was too long.
    {
      "l0": (27, 62),
      "l1": (57, 34),
      "l2": (8, 2),
      "l3": (12, 52),
      "l4": (1, 64),
      "l5": (43, 32),
    },
  ],
)
def test_layout_packs_disjoint_segments_and_round_trips(use_eigen, dims):
  method = make_method(use_eigen, jnp.float32, precompute_damped_inverse=True)
  plan = layout_lib.make_layout(
    dims, method.init, 4, 2, strategy_lib.AssignmentStrategy.MEMORY
  )
  for device in range(4):
    end = 0
    for name in plan.owned(device):
      assert plan.offset[name] == end
      end += plan.size[name]
    assert end <= plan.segment_size
  assert plan.segment_size == max(
    sum(plan.size[n] for n in plan.owned(d)) for d in range(4)
  )
  # A group's row is its two members' layers back to back, unpadded.
  assert plan.row_size == max(
    sum(plan.size[n] for d in (2 * j, 2 * j + 1) for n in plan.owned(d))
    for j in range(2)
  )
  everything = layout_lib.make_layout(
    dims, method.init, 4, 4, strategy_lib.AssignmentStrategy.MEMORY
  )
  assert everything.row_size == sum(plan.size.values())
  starts = sorted((everything.row_offset(n), n) for n in dims)
  for (start, name), (next_start, _) in zip(starts, starts[1:]):
    assert start + plan.size[name] == next_start
  for name, (activation_dim, gradient_dim) in dims.items():
    preconditioner = method.init(activation_dim, gradient_dim)
    preconditioner = jax.tree.map(
      lambda x: x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape),
      preconditioner,
    )
    vector = layout_lib.pack(preconditioner)
    assert vector.shape == (plan.size[name],)
    back = layout_lib.unpack(vector, plan.templates[name])
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(preconditioner)):
      np.testing.assert_array_equal(x, y)


class TwoLayers(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(jnp.tanh(nn.Dense(5)(x)))


@pytest.mark.parametrize("strategy", list(kfac_jax.DistributedStrategy))
def test_a_one_device_mesh_trains_as_the_local_placement(strategy):
  model = TwoLayers()
  x = jax.random.normal(jax.random.key(0), (8, 4))
  params = model.init(jax.random.key(1), x)["params"]
  loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)

  def run(**kwargs):
    tx = optax.chain(
      kfac_jax.scale_by_kfac(damping=0.01, **kwargs), optax.sgd(0.1)
    )
    state = tx.init(params)
    p = params
    for _ in range(3):
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(p)
      updates, state = jax.jit(tx.update)(grads, state, p, kfac_stats=stats)
      p = optax.apply_updates(p, updates)
    return p, state[0]

  expected, local_state = run()
  with jax.set_mesh(jax.make_mesh((1,), ("devices",))):
    actual, state = run(mesh_axes="devices", grad_worker_fraction=strategy)
    specs = kfac_jax.get_opt_state_partition_specs(
      params, mesh_axes="devices", grad_worker_fraction=strategy
    )
  assert isinstance(state.preconditioners, kfac_jax.ShardedPreconditioners)
  assert specs.preconditioners.rows == PartitionSpec(("devices",))
  # The packing moves bits; what may round differently is each step's
  # factor sums (8 rows) and decomposition (backward stable, to the largest
  # dimension, 6), through K-FAC's conditioning, over 3 steps.
  tolerance = dict(
    terms=3 * (8 + 6),
    condition=reference.kfac_condition(state.factors, 0.01),
    scale=reference.largest(jax.tree.leaves(expected)),
  )
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    reference.assert_float32_close(a, b, **tolerance)
  # One device: the row is every layer's packed preconditioner, in layout order.
  assert state.preconditioners.rows.shape == (
    1,
    sum(x.size for x in jax.tree.leaves(local_state.preconditioners)),
  )


def test_hlo_reader_counts_a_vmapped_eigh_and_a_cholesky():
  stack = jnp.broadcast_to(jnp.eye(5), (3, 5, 5))
  eigh_text = (
    jax.jit(jax.vmap(jnp.linalg.eigh)).lower(stack).compile().as_text()
  )
  assert per_device_costs(eigh_text, 1)[0].decomposition_flops == 3 * 9 * 125
  cholesky_text = (
    jax.jit(jnp.linalg.cholesky).lower(jnp.eye(6)).compile().as_text()
  )
  assert per_device_costs(cholesky_text, 1)[0].decomposition_flops == 216 / 3


def test_params_partition_specs_must_fit_the_params():
  params = {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}}
  wrong_structure = {"Dense_0": {"kernel": PartitionSpec()}}
  with pytest.raises(ValueError, match="structure of the params"):
    kfac_jax.scale_by_kfac(params_partition_specs=wrong_structure).init(params)
  too_long = {
    "Dense_0": {"kernel": PartitionSpec(None, None, "x"), "bias": None}
  }
  with pytest.raises(ValueError, match=r"\['Dense_0'\]\['kernel'\]"):
    kfac_jax.scale_by_kfac(params_partition_specs=too_long).init(params)


def test_an_unconstrained_entry_in_params_specs_names_no_axis():
  # Crashed update with "'UnconstrainedSingleton' object is not iterable".
  model = nn.Dense(4)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
  specs = {
    "kernel": PartitionSpec(None, PartitionSpec.UNCONSTRAINED),
    "bias": PartitionSpec(),
  }
  reference_tx = kfac_jax.scale_by_kfac()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  expected, state = reference_tx.update(
    grads, reference_tx.init(params), params, kfac_stats=stats
  )
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  with jax.set_mesh(mesh):
    tx = kfac_jax.scale_by_kfac(params_partition_specs=specs)
    updates, _ = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  # The same step but for the specs: its factor sums (8 rows) and
  # decomposition (to the largest dimension, 4) through K-FAC's conditioning
  # (the default λ, 1e-3).
  tolerance = dict(
    terms=8 + 4,
    condition=reference.kfac_condition(state.factors, 1e-3),
    scale=reference.largest(jax.tree.leaves(expected)),
  )
  for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
    reference.assert_float32_close(got, want, **tolerance)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_bfloat16_preconditioners_on_a_mesh_are_packed_in_bfloat16(
  compute_method,
):
  # Rows of the storage dtype: float32 rows would double the memory that
  # inv_dtype=bfloat16 is for (the local placement's arrays are bf16).
  model = TwoLayers()
  x = jax.random.normal(jax.random.key(0), (8, 4))
  params = model.init(jax.random.key(1), x)["params"]
  loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  kwargs = dict(
    damping=0.01, compute_method=compute_method, inv_dtype=jnp.bfloat16
  )
  local = kfac_jax.scale_by_kfac(**kwargs)
  local_state = local.update(
    grads, local.init(params), params, kfac_stats=stats
  )[1]
  assert {x.dtype for x in jax.tree.leaves(local_state.preconditioners)} == {
    jnp.dtype(jnp.bfloat16)
  }
  with jax.set_mesh(jax.make_mesh((1,), ("devices",))):
    tx = kfac_jax.scale_by_kfac(mesh_axes="devices", **kwargs)
    state = tx.update(grads, tx.init(params), params, kfac_stats=stats)[1]
    specs = kfac_jax.get_opt_state_partition_specs(
      params, mesh_axes="devices", **kwargs
    )
  assert state.preconditioners.rows.dtype == jnp.bfloat16
  assert specs.preconditioners.rows == PartitionSpec(("devices",))
  # One device: the row is the local preconditioners packed in layout order.
  assert state.preconditioners.rows.size == sum(
    x.size for x in jax.tree.leaves(local_state.preconditioners)
  )


def test_a_rejected_decomposition_on_a_mesh_keeps_the_layers_row():
  """The mesh placement's form of test_numerics'
  test_non_finite_decomposition_keeps_the_previous_one: a layer whose
  decomposition fails keeps its packed preconditioner, not the identity."""
  model = TwoLayers()
  x = jax.random.normal(jax.random.key(0), (8, 4))
  params = model.init(jax.random.key(1), x)["params"]
  loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  kwargs = dict(
    damping=0.01, compute_method="inverse", kl_clip=None, mesh_axes="devices"
  )
  with jax.set_mesh(jax.make_mesh((1,), ("devices",))):
    tx = kfac_jax.scale_by_kfac(**kwargs)
    _, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
    previous = np.asarray(state.preconditioners.rows)
    assert not np.allclose(
      previous, np.asarray(tx.init(params).preconditioners.rows)
    )
    # Indefinite beyond the damping (finite, so not restarted): Cholesky
    # fails; no factor update replaces it.
    broken = dict(state.factors)
    broken["Dense_0"] = broken["Dense_0"]._replace(
      activation_factor=-1e3 * jnp.eye(6, dtype=jnp.float32)
    )
    frozen = kfac_jax.scale_by_kfac(factor_update_steps=1000, **kwargs)
    updates, state = frozen.update(
      grads,
      state._replace(factors=broken, count=jnp.int32(1)),
      params,
      kfac_stats=stats,
    )
  assert int(state.rejected_decompositions) == 1
  # The other layer decomposes its unchanged factors again: the same row
  # throughout (the same routine on the same bits; the elementwise work
  # after it, λ shift and reciprocal, may round differently: 3 roundings).
  reference.assert_float32_close(
    np.asarray(state.preconditioners.rows), previous, terms=3
  )
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("labels_as", ["leaves", "prefix"])
def test_partition_specs_inside_multi_transform_keep_the_masked_nodes(
  labels_as,
):
  """K-FAC on part of the params (optax.multi_transform, Adam on the rest):
  the accumulated gradients and Adam's moments are masked trees. With
  accumulation_steps=2 no keyword arguments passed the state check; each
  params-shaped part now gets the params' specs, MaskedNodes kept (one per
  leaf, or one for a whole module when the labels are a prefix)."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="head")(jnp.tanh(nn.Dense(5, name="body")(x)))

  x = jnp.ones((8, 4))
  params = Model().init(jax.random.key(0), x)["params"]
  labels = {
    "body": {"kernel": "kfac", "bias": "kfac"},
    "head": {"kernel": "adam", "bias": "adam"},
  }
  if labels_as == "prefix":
    labels = {"body": "kfac", "head": "adam"}
  specs = {
    "body": {
      "kernel": PartitionSpec(None, "data"),
      "bias": PartitionSpec("data"),
    },
    "head": {"kernel": PartitionSpec("data"), "bias": PartitionSpec()},
  }
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  is_spec = lambda s: isinstance(s, PartitionSpec)
  with jax.set_mesh(mesh):
    tx = optax.multi_transform(
      {
        "kfac": kfac_jax.kfac(0.1, accumulation_steps=2),
        "adam": optax.adam(1e-3),
      },
      labels,
    )
    state_specs = kfac_jax.get_opt_state_partition_specs(
      params,
      tx=tx,
      skip_layers="head",
      accumulation_steps=2,
      params_partition_specs=specs,
    )
    state = jax.jit(
      tx.init,
      out_shardings=jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, s),
        state_specs,
        is_leaf=is_spec,
      ),
    )(params)
    assert jax.tree.structure(
      state_specs, is_leaf=is_spec
    ) == jax.tree.structure(state)
    kfac_specs = state_specs.inner_states["kfac"].inner_state[0]
    gradients = kfac_specs.accumulator.gradients
    assert gradients["body"] == specs["body"]
    masked = jax.tree.map(lambda _: optax.MaskedNode(), labels["head"])
    assert gradients["head"] == masked
    adam = state.inner_states["adam"].inner_state[0]
    assert (
      jax.tree.map(lambda a: a.sharding.spec, adam.mu["head"])
      == (specs["head"])
    )
    assert jax.tree.structure(adam.mu["body"]) == jax.tree.structure(
      jax.tree.map(lambda _: optax.MaskedNode(), labels["body"])
    )
    # K-FAC given none of the params: its accumulated gradients are masked
    # whole; their specs keep the MaskedNodes (not None).
    tx = optax.multi_transform(
      {
        "kfac": kfac_jax.scale_by_kfac(accumulation_steps=2, skip_layers=".*"),
        "adam": optax.adam(1e-3),
      },
      {"body": "adam", "head": "adam"},
    )
    state_specs = kfac_jax.get_opt_state_partition_specs(
      params, tx=tx, accumulation_steps=2, skip_layers=".*"
    )
    state = tx.init(params)
    jax.tree.map(lambda spec, leaf: None, state_specs, state, is_leaf=is_spec)
    assert jax.tree.structure(
      state_specs, is_leaf=is_spec
    ) == jax.tree.structure(state)


def test_params_with_none_leaves_get_partition_specs():
  # A None in the params (no array) made the helper's default all-None specs
  # miscount: "must have the structure of the params".
  model = nn.Dense(4)
  x = jnp.ones((8, 3))
  params = {**model.init(jax.random.key(0), x)["params"], "unused": None}
  specs = kfac_jax.get_opt_state_partition_specs(
    params, chain_with=optax.sgd(0.1, momentum=0.9)
  )
  state = optax.chain(
    kfac_jax.scale_by_kfac(), optax.sgd(0.1, momentum=0.9)
  ).init(params)
  is_spec = lambda s: isinstance(s, PartitionSpec)
  assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(state)
  assert specs[1][0].trace["unused"] is None
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  with jax.set_mesh(mesh):
    given = {
      "kernel": PartitionSpec(None, "data"),
      "bias": None,
      "unused": None,
    }
    tx = kfac_jax.scale_by_kfac(params_partition_specs=given)
    tx.init(params)


def test_partition_specs_of_the_kfac_alias_from_its_transformation():
  # chain_with could not express kfac()'s first-order part (an identity or
  # weight decay stage before SGD, MultiSteps under accumulation).
  model = nn.Dense(4)
  x = jnp.ones((8, 3))
  params = model.init(jax.random.key(0), x)["params"]
  specs = {"kernel": PartitionSpec(None, "data"), "bias": PartitionSpec()}
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  kw = dict(
    params_partition_specs=specs, mesh_axes="data", accumulation_steps=2
  )
  is_spec = lambda s: isinstance(s, PartitionSpec)
  with jax.set_mesh(mesh):
    tx = kfac_jax.kfac(0.1, weight_decay=1e-4, **kw)
    state_specs = kfac_jax.get_opt_state_partition_specs(params, tx=tx, **kw)
    state = jax.jit(
      tx.init,
      out_shardings=jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, s),
        state_specs,
        is_leaf=is_spec,
      ),
    )(params)
    assert jax.tree.structure(
      state_specs, is_leaf=is_spec
    ) == jax.tree.structure(state)
    # SGD's momentum and MultiSteps' accumulated gradients follow the params.
    momentum = state[1].inner_opt_state[1][0].trace
    assert jax.tree.map(lambda a: a.sharding.spec, momentum) == specs
    with pytest.raises(ValueError, match="would not make"):
      kfac_jax.get_opt_state_partition_specs(params, tx=tx, mesh_axes="data")
    with pytest.raises(ValueError, match="not both"):
      kfac_jax.get_opt_state_partition_specs(params, optax.sgd(0.1), tx=tx)
