"""``mesh=`` of ``get_opt_state_partition_specs`` and
``recompute_preconditioners``: shardings built before entering a mesh.

The checks run on 8 simulated CPU devices in a subprocess
(``python -m tests.test_mesh_argument <program> <axis type>``, the
environment of ``tests.multidevice.eight_device_env``), on Auto and Explicit
axes as ``tests/multidevice_fsdp.py``'s ``specs`` program; the argument checks
that need no mesh axes run here.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from kfac_jax import checkpoint
from tests import multidevice

is_spec = lambda x: isinstance(x, PartitionSpec)


def expect_error(error, match: str, call) -> None:
  try:
    call()
  except error as e:
    assert match in str(e), e
  else:
    raise AssertionError(f"no {error.__name__} matching {match!r}")


def specs(axis_type: AxisType) -> None:
  """Specs from ``mesh=`` outside any context equal those inside it, and
  the state ``init`` makes there is laid out as they say."""
  params, _, _, mesh, params_specs = multidevice.fsdp_problem(axis_type)
  chain_with = optax.sgd(0.1, momentum=0.9)
  for strategy in multidevice.STRATEGIES:
    for method in ("eigen", "inverse"):
      kwargs = dict(
        mesh_axes=("data", "fsdp"),
        grad_worker_fraction=strategy,
        compute_method=method,
        params_partition_specs=params_specs,
        accumulation_steps=2,
      )
      outside = kfac_jax.get_opt_state_partition_specs(
        params, chain_with=chain_with, mesh=mesh, **kwargs
      )
      abstract = kfac_jax.get_opt_state_partition_specs(
        params, chain_with=chain_with, mesh=mesh.abstract_mesh, **kwargs
      )
      # Built before the context, as jax.jit's out_shardings.
      shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), outside, is_leaf=is_spec
      )
      assert jax.sharding.get_abstract_mesh().empty
      tx = optax.chain(kfac_jax.scale_by_kfac(**kwargs), chain_with)
      with jax.set_mesh(mesh):
        inside = kfac_jax.get_opt_state_partition_specs(
          params, chain_with=chain_with, **kwargs
        )
        same = kfac_jax.get_opt_state_partition_specs(
          params, chain_with=chain_with, mesh=mesh, **kwargs
        )
        state = jax.jit(tx.init, out_shardings=shardings)(params)
      for other in (abstract, inside, same):
        assert other == outside, (strategy, method)
      for leaf, spec in zip(
        jax.tree.leaves(state), jax.tree.leaves(outside, is_leaf=is_spec)
      ):
        assert leaf.sharding.is_equivalent_to(
          NamedSharding(mesh, spec), leaf.ndim
        ), (leaf.shape, spec)
  kwargs = dict(mesh_axes="data", params_partition_specs=params_specs)
  expect_error(
    ValueError,
    "needs a mesh",
    lambda: kfac_jax.get_opt_state_partition_specs(params, **kwargs),
  )
  # Mesh axis names are checked against the mesh given.
  expect_error(
    ValueError,
    "'model'",
    lambda: kfac_jax.get_opt_state_partition_specs(
      params, mesh=mesh, mesh_axes="model"
    ),
  )
  check_mismatches(
    mesh,
    lambda m: kfac_jax.get_opt_state_partition_specs(params, mesh=m, **kwargs),
  )


def check_mismatches(mesh, call) -> None:
  """``call(other mesh)`` under ``jax.set_mesh(mesh)`` raises naming both."""
  devices = np.asarray(jax.devices())
  others = (
    jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=mesh.axis_types),
    jax.make_mesh((2, 4), ("data", "model"), axis_types=mesh.axis_types),
    # The same axes over other devices.
    jax.sharding.Mesh(
      devices[::-1].reshape(2, 4), ("data", "fsdp"), axis_types=mesh.axis_types
    ),
  )
  with jax.set_mesh(mesh):
    for other in others:
      # B023: expect_error calls the lambda at once.
      expect_error(
        ValueError,
        "is not the mesh set by jax.set_mesh",
        lambda: call(other),  # noqa: B023
      )
    expect_error(
      TypeError, "mesh must be a jax.sharding.Mesh", lambda: call("data")
    )


def recompute(axis_type: AxisType) -> None:
  """``recompute_preconditioners(..., mesh=mesh)`` outside the context
  decomposes as it does inside."""
  params, loss_fn, batches, mesh, _ = multidevice.fsdp_problem(axis_type)
  kwargs = dict(mesh_axes=("data", "fsdp"), grad_worker_fraction="hybrid_opt")
  with jax.set_mesh(mesh):
    _, state, _ = multidevice.train(
      params, loss_fn, batches, kwargs, mesh, PartitionSpec(("data", "fsdp"))
    )
    inside = checkpoint.recompute_preconditioners(
      state._replace(preconditioners=None), 0.01, **kwargs
    )
  outside = checkpoint.recompute_preconditioners(
    state._replace(preconditioners=None), 0.01, mesh=mesh, **kwargs
  )
  jax.tree.map(
    np.testing.assert_array_equal,
    outside.preconditioners,
    inside.preconditioners,
  )
  assert outside.preconditioners.rows.sharding.is_equivalent_to(
    NamedSharding(mesh, PartitionSpec(("data", "fsdp"))), 2
  )
  expect_error(
    ValueError,
    "needs a mesh",
    lambda: checkpoint.recompute_preconditioners(
      state._replace(preconditioners=None), 0.01, **kwargs
    ),
  )
  check_mismatches(
    mesh,
    lambda m: checkpoint.recompute_preconditioners(
      state, 0.01, mesh=m, **kwargs
    ),
  )
  expect_error(
    TypeError,
    "mesh must be a jax.sharding.Mesh",
    lambda: checkpoint.recompute_preconditioners(
      state, 0.01, mesh=mesh.abstract_mesh, **kwargs
    ),
  )


PROGRAMS = {f.__name__: f for f in (specs, recompute)}


@pytest.mark.multidevice
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_mesh_argument_on_eight_devices(program, axis_type):
  multidevice.run_on_eight_devices(
    "tests.test_mesh_argument", program, axis_type
  )


def test_specs_without_mesh_axes_take_a_mesh_or_none():
  """Without mesh axes no mesh is needed; one given is still checked."""
  params, _, _ = multidevice.conv_problem()
  mesh = jax.make_mesh((1,), ("data",))
  assert kfac_jax.get_opt_state_partition_specs(
    params, mesh=mesh
  ) == kfac_jax.get_opt_state_partition_specs(params)
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    kfac_jax.get_opt_state_partition_specs(params, mesh=("data",))


if __name__ == "__main__":
  multidevice.main(PROGRAMS)
