"""Sharded-parameter programs for 8 simulated CPU devices
(``tests/multidevice.py`` runs them): FSDP and row-parallel kernels, mixed
and divided meshes, the state's partition specs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from examples.hlo_cost import per_device_costs
from tests import multidevice
from tests.multidevice import (
  MESHES,
  STEPS,
  STRATEGIES,
  TOLERANCE,
  EqualMLP,
  assert_same_run,
  conv_problem,
  fsdp_problem,
  train,
)


def fsdp(axis_type: AxisType) -> None:
  """Kernels sharded over 'fsdp': same training, updates keep their specs."""
  params, loss_fn, batches = conv_problem()
  reference = train(params, loss_fn, batches, {})
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  specs = jax.tree.map(
    lambda p: (
      PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 2 and p.shape[-1] % 4 == 0
      else PartitionSpec()
    ),
    params,
  )
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  for strategy in STRATEGIES:
    kwargs = dict(
      mesh_axes=("data", "fsdp"),
      grad_worker_fraction=strategy,
      params_partition_specs=specs,
    )
    with jax.set_mesh(mesh):
      run = train(
        params, loss_fn, batches, kwargs, mesh, PartitionSpec("data"), sharding
      )
      assert_same_run(run, reference, kwargs, {}, f"FSDP {strategy.name}")
    for update, expected in zip(
      jax.tree.leaves(run[0][-1]), jax.tree.leaves(sharding)
    ):
      assert update.sharding.is_equivalent_to(expected, update.ndim), (
        update.sharding,
        expected,
      )
  assert_no_full_gradient_copies(params, specs, mesh)


def row_parallel(axis_type: AxisType) -> None:
  """Kernel rows sharded over 'model' (Auto), K-FAC spread over 'data' only
  ('data' of ``axis_type``): each strategy equals one device. (Arrays
  sharded over 'model' inside the per-device branches of the placement made
  XLA wait on collectives the other branches never reach: MEM_OPT aborted
  on Auto axes, COMM_OPT with 'data' Explicit.)"""
  params, loss_fn, batches = conv_problem()
  reference = train(params, loss_fn, batches, {})
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(axis_type, AxisType.Auto)
  )
  # One kernel sharded: its neighbours' gradients then come out of the
  # backward pass sharded over 'model', though their kernels are not.
  specs = jax.tree.map(lambda _: PartitionSpec(), params)
  specs["Dense_1"]["kernel"] = PartitionSpec("model", None)
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  for strategy in STRATEGIES:
    kwargs = dict(
      mesh_axes="data",
      grad_worker_fraction=strategy,
      params_partition_specs=specs,
    )
    with jax.set_mesh(mesh):
      run = train(
        params, loss_fn, batches, kwargs, mesh, PartitionSpec("data"), sharding
      )
      assert_same_run(run, reference, kwargs, {}, f"rows {strategy.name}")


def assert_no_full_gradient_copies(params, specs, mesh) -> None:
  """The compiled update never forms a sharded kernel's whole gradient.

  Reads the program of ``tx.update`` alone (the model's own FSDP forward
  gathers kernels, which is not K-FAC's doing), inverse method (the eigen
  method's state holds a replicated ``[dA, dG]`` scale of the same shape).
  """
  for strategy in STRATEGIES:
    tx = kfac_jax.scale_by_kfac(
      compute_method="inverse",
      mesh_axes=("data", "fsdp"),
      grad_worker_fraction=strategy,
      params_partition_specs=specs,
    )
    _, loss_fn, (x, y) = conv_problem()
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    with jax.set_mesh(mesh):
      placed = jax.device_put(params, shardings)
      state = jax.jit(tx.init)(placed)
      batch = [
        jax.device_put(b[0], NamedSharding(mesh, PartitionSpec("data")))
        for b in (x, y)
      ]
      _, grads, stats = jax.jit(kfac_jax.value_grad_and_stats(loss_fn))(
        placed, *batch
      )
      grads = jax.device_put(grads, shardings)
      # B023: compiled here, within this iteration.
      text = (
        jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st))  # noqa: B023
        .lower(grads, state, stats)
        .compile()
        .as_text()
      )
    forbidden = []
    for layer, values in params.items():
      kernel_spec = specs[layer]["kernel"]
      if all(entry is None for entry in kernel_spec):
        continue
      kernel = values["kernel"]
      rows = int(np.prod(kernel.shape[:-1])) + int("bias" in values)
      # precondition_in_place pads both sides to multiples of the kernel's
      # devices (4 on 'fsdp'): gathered whole, the padded matrix shows.
      padded = tuple(d + -d % 4 for d in (rows, kernel.shape[-1]))
      for shape in (kernel.shape, (rows, kernel.shape[-1]), padded):
        forbidden.append("f32[" + ",".join(map(str, shape)) + "]")
    assert forbidden
    found = [shape for shape in forbidden if shape in text]
    assert not found, (strategy, found)


def compiled_step(tx, params, loss_fn, x, mesh):
  """The compiled ``update`` of one step, under ``mesh``."""

  def step(params, state, x):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x)
    return tx.update(grads, state, params, kfac_stats=stats)

  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)
    return jax.jit(step).lower(params, state, x).compile(), state


def division(axis_type: AxisType) -> None:
  """The compiled program divides decompositions and (MEM_OPT) memory by n."""
  model = EqualMLP()
  x = jax.random.normal(jax.random.key(0), (16, 16))
  params = model.init(jax.random.key(1), x)["params"]
  loss_fn = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
  # hlo_cost's counts: eigh 9·d³; Cholesky d³/3 plus two triangular solves.
  # The inverse method pads G (16 rows) to A's 17 (batched.padded_sizes).
  for method, flops_per_layer in (
    ("eigen", 9 * (17**3 + 16**3)),
    ("inverse", 7 / 3 * 2 * 17**3),
  ):
    local_state = kfac_jax.scale_by_kfac(compute_method=method).init(params)
    total_bytes = sum(
      x.nbytes for x in jax.tree.leaves(local_state.preconditioners)
    )
    for shape, names in MESHES[:2]:
      n = int(np.prod(shape))
      mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
      for strategy, group in zip(STRATEGIES, (n, n // 2, 1)):
        label = f"{method} {strategy.name} on {shape}"
        tx = kfac_jax.scale_by_kfac(
          compute_method=method, mesh_axes=names, grad_worker_fraction=strategy
        )
        compiled, state = compiled_step(tx, params, loss_fn, x, mesh)
        costs = per_device_costs(compiled.as_text(), n, path="max")
        flops = [c.decomposition_flops for c in costs]
        # Every decomposition exactly once on the mesh, evenly divided.
        np.testing.assert_allclose(
          sum(flops), 8 * flops_per_layer, err_msg=label
        )
        assert max(flops) <= 1.25 / n * sum(flops), (label, flops)
        rows = state.preconditioners.rows
        device_bytes = max(s.data.nbytes for s in rows.addressable_shards)
        assert device_bytes <= 1.25 * group / n * total_bytes, (
          label,
          device_bytes,
          total_bytes,
        )
        plain = per_device_costs(compiled.as_text(), n, path="min")
        if group == n:  # COMM_OPT: no second-order traffic between updates.
          assert all(c.collective_bytes == 0 for c in plain), (label, plain)
        else:  # The preconditioned gradients are gathered every step.
          gradient_bytes = 8 * 17 * 16 * 4
          assert all(c.collective_bytes == gradient_bytes for c in plain), (
            label,
            plain,
          )


def local_fsdp(axis_type: AxisType) -> None:
  """Kernels sharded without mesh_axes: one device's training, and the state
  the jitted update returns keeps get_opt_state_partition_specs (replicated
  factors and preconditioners)."""
  params, loss_fn, batches = conv_problem()
  methods = {
    method: dict(compute_method=method) for method in ("eigen", "inverse")
  }
  references = {
    method: train(params, loss_fn, batches, kwargs)
    for method, kwargs in methods.items()
  }
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)

  def kernel_spec(p, rows_axis):
    if p.ndim < 2 or p.shape[-1] % 4:
      return PartitionSpec()
    rows = rows_axis if p.shape[-2] % 2 == 0 else None
    return PartitionSpec(*([None] * (p.ndim - 2)), rows, "fsdp")

  for rows_axis in (None, "data"):
    # B023: called within this iteration, before the variable changes.
    specs = jax.tree.map(lambda p: kernel_spec(p, rows_axis), params)  # noqa: B023
    sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    for method, method_kwargs in methods.items():
      kwargs = dict(method_kwargs, params_partition_specs=specs)
      with jax.set_mesh(mesh):
        run = train(
          params,
          loss_fn,
          batches,
          kwargs,
          mesh,
          PartitionSpec("data"),
          sharding,
        )
        expected = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
      label = f"local {method}, kernel rows over {rows_axis}"
      assert_same_run(run, references[method], kwargs, method_kwargs, label)
      is_spec = lambda x: isinstance(x, PartitionSpec)
      for leaf, spec in zip(
        jax.tree.leaves(run[1]), jax.tree.leaves(expected, is_leaf=is_spec)
      ):
        assert leaf.sharding.is_equivalent_to(
          NamedSharding(mesh, spec), leaf.ndim
        ), (label, leaf.shape, leaf.sharding, spec)


def mixed(axis_type: AxisType) -> None:
  """A mesh of one Explicit and one Auto axis: mesh_axes naming either kind
  equal one device; naming both in one spec is a clear error."""
  del axis_type  # the mesh has both
  params, loss_fn, batches = conv_problem()
  reference = train(params, loss_fn, batches, {})
  for kinds in (
    (AxisType.Explicit, AxisType.Auto),
    (AxisType.Auto, AxisType.Explicit),
  ):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=kinds)
    for mesh_axes in ("data", "model"):
      kwargs = dict(mesh_axes=mesh_axes, grad_worker_fraction=0.5)
      with jax.set_mesh(mesh):
        run = train(params, loss_fn, batches, kwargs, mesh, PartitionSpec())
        assert_same_run(run, reference, kwargs, {}, f"{kinds} {mesh_axes}")
    try:
      with jax.set_mesh(mesh):
        train(
          params,
          loss_fn,
          batches,
          dict(mesh_axes=("data", "model")),
          mesh,
          PartitionSpec(),
        )
    except ValueError as error:
      assert "Explicit and Auto" in str(error), error
    else:
      raise AssertionError(f"no ValueError for both axes of {kinds}")


def specs(axis_type: AxisType) -> None:
  """get_opt_state_partition_specs is what jit(tx.init) produces."""
  params, _, _, mesh, params_specs = fsdp_problem(axis_type)
  chains = [None]
  if axis_type == AxisType.Explicit:  # optax's own states follow the params.
    chains.append(optax.sgd(0.1, momentum=0.9))
  with jax.set_mesh(mesh):
    for strategy in STRATEGIES + (0.25,):
      for method in ("eigen", "inverse"):
        for chain_with in chains:
          kwargs = dict(
            mesh_axes=("data", "fsdp"),
            grad_worker_fraction=strategy,
            compute_method=method,
            params_partition_specs=params_specs,
            accumulation_steps=2,
          )
          tx = kfac_jax.scale_by_kfac(**kwargs)
          if chain_with is not None:
            tx = optax.chain(tx, chain_with)
          expected = kfac_jax.get_opt_state_partition_specs(
            params, chain_with=chain_with, **kwargs
          )
          state = jax.jit(tx.init)(params)
          assert jax.tree.structure(state) == jax.tree.structure(
            expected, is_leaf=lambda s: isinstance(s, PartitionSpec)
          )
          for leaf, spec in zip(
            jax.tree.leaves(state),
            jax.tree.leaves(
              expected, is_leaf=lambda s: isinstance(s, PartitionSpec)
            ),
          ):
            assert leaf.sharding.is_equivalent_to(
              NamedSharding(mesh, spec), leaf.ndim
            ), (strategy, method, leaf.shape, leaf.sharding, spec)
          placed = jax.jit(
            tx.init,
            out_shardings=jax.tree.map(
              lambda s: NamedSharding(mesh, s),
              expected,
              is_leaf=lambda s: isinstance(s, PartitionSpec),
            ),
          )(params)
          assert jax.tree.structure(placed) == jax.tree.structure(state)
    for bad, message in (
      (dict(mesh_axes=("data", "model")), "'model'"),
      (
        dict(mesh_axes="data", grad_worker_fraction=0.3),
        "grad_worker_fraction",
      ),
      (
        dict(mesh_axes=("data", "fsdp"), grad_worker_fraction=3 / 8),
        "whole divisor of 8",
      ),
    ):
      try:
        kfac_jax.get_opt_state_partition_specs(params, **bad)
      except ValueError as error:
        assert message in str(error), (bad, error)
      else:
        raise AssertionError(f"no ValueError for {bad}")


def stable_state(axis_type: AxisType) -> None:
  """A step jitted with the specs as its state's in_shardings runs again on
  its own output, every leaf as the specs say: the accumulator's G sums
  followed the sharded kernels (the second call raised), and the
  preconditioner rows came back as P(axes) where the specs said
  P(axes, None) (a donated step compiled twice)."""
  params, loss_fn, (x, y) = conv_problem()
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  params_specs = jax.tree.map(
    lambda p: (
      PartitionSpec(None, "fsdp")
      if p.ndim == 2 and p.shape[1] % 4 == 0
      else PartitionSpec()
    ),
    params,
  )
  named = lambda tree: jax.tree.map(
    lambda s: NamedSharding(mesh, s),
    tree,
    is_leaf=lambda s: isinstance(s, PartitionSpec),
  )
  params = jax.device_put(params, named(params_specs))
  with jax.set_mesh(mesh):
    for strategy in (STRATEGIES[0], STRATEGIES[2]):
      for accumulation_steps in (1, 2):
        kwargs = dict(
          mesh_axes=("data", "fsdp"),
          grad_worker_fraction=strategy,
          params_partition_specs=params_specs,
          accumulation_steps=accumulation_steps,
        )
        tx = kfac_jax.scale_by_kfac(**kwargs)
        specs = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
        state = jax.jit(tx.init, out_shardings=named(specs))(params)

        def step(state, x, y, tx=tx):
          _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
          return tx.update(grads, state, params, kfac_stats=stats)[1]

        jitted = jax.jit(step, in_shardings=(named(specs), None, None))
        for i in range(3):
          state = jitted(state, x[i], y[i])
        for leaf, spec in zip(
          jax.tree.leaves(state),
          jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
          ),
        ):
          assert leaf.sharding.spec == spec, (
            strategy,
            accumulation_steps,
            leaf.shape,
            leaf.sharding.spec,
            spec,
          )


def multi_transform_fsdp(axis_type: AxisType) -> None:
  """K-FAC on part of the params inside ``optax.multi_transform`` (Adam on
  the last layer), given the whole tree of FSDP specs: ``init`` and
  ``update`` see the withheld layer as ``optax.MaskedNode``s (the full tree
  was refused). Trains as one device does, the state as the helper's specs
  say, the updates as the params'."""
  params, loss_fn, (x, y) = conv_problem()
  labels = {name: "adam" if name == "Dense_2" else "kfac" for name in params}
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  params_specs = jax.tree.map(
    lambda p: (
      PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 2 and p.shape[-1] % 4 == 0
      else PartitionSpec()
    ),
    params,
  )
  named = lambda tree: jax.tree.map(
    lambda s: NamedSharding(mesh, s),
    tree,
    is_leaf=lambda s: isinstance(s, PartitionSpec),
  )

  def make_tx(**kwargs):
    kfac = optax.chain(
      kfac_jax.scale_by_kfac(
        damping=0.01, inv_update_steps=2, skip_layers="Dense_2", **kwargs
      ),
      optax.sgd(0.1, momentum=0.9),
    )
    return optax.multi_transform(
      {"kfac": kfac, "adam": optax.adam(1e-3)}, labels
    )

  def run(tx, params, state, place=lambda b: b):
    @jax.jit
    def step(params, state, x, y):
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
      updates, state = tx.update(grads, state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), state, updates

    all_updates = []
    for i in range(STEPS):
      params, state, updates = step(params, state, place(x[i]), place(y[i]))
      all_updates.append(jax.block_until_ready(updates))
    return all_updates, state

  tx = make_tx()
  reference, _ = run(tx, params, tx.init(params))
  kwargs = dict(mesh_axes=("data", "fsdp"), params_partition_specs=params_specs)
  with jax.set_mesh(mesh):
    tx = make_tx(**kwargs)
    specs = kfac_jax.get_opt_state_partition_specs(
      params,
      tx=tx,
      skip_layers="Dense_2",
      damping=0.01,
      inv_update_steps=2,
      **kwargs,
    )
    sharded_params = jax.device_put(params, named(params_specs))
    state = jax.jit(tx.init, out_shardings=named(specs))(sharded_params)
    got, state = run(
      tx,
      sharded_params,
      state,
      lambda b: jax.device_put(b, NamedSharding(mesh, PartitionSpec("data"))),
    )
  for step, (a, b) in enumerate(zip(got, reference)):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(
        np.asarray(u),
        np.asarray(v),
        **TOLERANCE,
        err_msg=f"updates of step {step}",
      )
  # K-FAC's layers (Adam's update is placed as XLA likes).
  kfac_layers = [name for name, label in labels.items() if label == "kfac"]
  for update, spec in zip(
    jax.tree.leaves([got[-1][name] for name in kfac_layers]),
    jax.tree.leaves(
      [params_specs[name] for name in kfac_layers],
      is_leaf=lambda s: isinstance(s, PartitionSpec),
    ),
  ):
    assert update.sharding.is_equivalent_to(
      NamedSharding(mesh, spec), update.ndim
    ), (update.sharding, spec)
  kfac_state = state.inner_states["kfac"].inner_state[0]
  kfac_specs = specs.inner_states["kfac"].inner_state[0]
  for leaf, spec in zip(
    jax.tree.leaves(kfac_state.preconditioners),
    jax.tree.leaves(
      kfac_specs.preconditioners, is_leaf=lambda s: isinstance(s, PartitionSpec)
    ),
  ):
    assert leaf.sharding.is_equivalent_to(
      NamedSharding(mesh, spec), leaf.ndim
    ), (leaf.sharding, spec)


PROGRAMS = {
  f.__name__: f
  for f in (
    fsdp,
    row_parallel,
    division,
    local_fsdp,
    mixed,
    specs,
    stable_state,
    multi_transform_fsdp,
  )
}


if __name__ == "__main__":
  multidevice.main(PROGRAMS)
