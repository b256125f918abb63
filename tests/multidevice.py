"""Programs for 8 simulated CPU devices, run by ``test_distribution.py``.

``python -m tests.multidevice <program> <axis type>`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set by the caller so
the single-device tests of the main process keep one device;
``eight_device_env`` gives callers that environment). Each program asserts
and prints ``ok``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from examples.hlo_cost import per_device_costs
from kfac_jax.factors.running import factor_dims
from kfac_jax.transform.config import make_placement


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_eight_devices(module: str, program: str, axis_type: str) -> None:
  """Runs ``python -m module program axis_type`` on 8 simulated devices; the
  program prints ``ok`` when its checks pass."""
  result = subprocess.run(
      [sys.executable, "-m", module, program, axis_type],
      env=eight_device_env(), cwd=ROOT, capture_output=True, text=True,
      timeout=280)
  assert result.returncode == 0, result.stderr[-6000:]
  assert result.stdout.strip().endswith("ok")


def eight_device_env() -> dict[str, str]:
  """This process's environment for a program on 8 simulated CPU devices.

  The device count is added to the inherited ``XLA_FLAGS`` (``make test``
  sets compile flags there) and ``JAX_PLATFORMS=cpu`` keeps the simulated
  devices where an accelerator is present.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8")


MESHES = (((8,), ("devices",)), ((2, 4), ("data", "fsdp")),
          ((4, 2), ("data", "fsdp")))
STRATEGIES = (kfac_jax.DistributedStrategy.COMM_OPT,
              kfac_jax.DistributedStrategy.HYBRID_OPT,
              kfac_jax.DistributedStrategy.MEM_OPT)
STEPS = 4
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


class ConvNet(nn.Module):
  """Layers of unequal sizes (and a conv) so the packing is not uniform."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Conv(4, (3, 3))(x))
    x = x.reshape(x.shape[0], -1)
    for width in (12, 8):
      x = jnp.tanh(nn.Dense(width)(x))
    return nn.Dense(3, use_bias=False)(x)


class EqualMLP(nn.Module):
  """Eight equal 16 → 16 layers: balanced decomposition work."""

  @nn.compact
  def __call__(self, x):
    for _ in range(8):
      x = jnp.tanh(nn.Dense(16)(x))
    return x


def conv_problem():
  model = ConvNet()
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (STEPS, 16, 6, 6, 2))
  y = jax.random.randint(keys[1], (STEPS, 16), 0, 3)
  params = model.init(keys[2], x[0])["params"]

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return params, loss_fn, (x, y)


def train(params, loss_fn, batches, kwargs, mesh=None, batch_spec=None,
          params_sharding=None, split_loss=None):
  """``STEPS`` steps of K-FAC + SGD; returns (updates per step, K-FAC state, tx).

  With ``split_loss(x, y) -> SplitLoss``: K-FAC's adaptive mode alone.
  """
  if split_loss is None:
    tx = optax.chain(
        kfac_jax.scale_by_kfac(damping=0.01, inv_update_steps=2, **kwargs),
        optax.sgd(0.1, momentum=0.9))
  else:
    tx = kfac_jax.scale_by_kfac(
        damping=1.0, kl_clip=None, inv_update_steps=2,
        adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=2),
        **kwargs)

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    extra = {} if split_loss is None else dict(split_loss=split_loss(x, y))
    updates, state = tx.update(grads, state, params, kfac_stats=stats,
                               **extra)
    return optax.apply_updates(params, updates), state, updates

  if mesh is not None:  # Explicit axes need the params placed on the mesh.
    params = jax.device_put(
        params, params_sharding or NamedSharding(mesh, PartitionSpec()))
  state = jax.jit(tx.init)(params)
  all_updates = []
  for i in range(STEPS):
    x, y = (b[i] for b in batches)
    if mesh is not None:
      x, y = (jax.device_put(b, NamedSharding(mesh, batch_spec)) for b in (x, y))
    params, state, updates = step(params, state, x, y)
    # One step in flight at a time: simulated CPU devices can deadlock in a
    # collective otherwise (examples/sharded_mnist.py).
    all_updates.append(jax.block_until_ready(updates))
  return all_updates, (state if split_loss else state[0]), tx


def comparable(preconditioner) -> list[np.ndarray]:
  """Arrays that do not depend on the sign/rotation freedom of eigenvectors."""
  if isinstance(preconditioner, kfac_jax.InversePreconditioner):
    return [np.asarray(x, np.float32) for x in preconditioner]
  out = []
  for vectors, values in ((preconditioner.activation_eigenvectors,
                           preconditioner.activation_eigenvalues),
                          (preconditioner.gradient_eigenvectors,
                           preconditioner.gradient_eigenvalues)):
    vectors, values = np.asarray(vectors), np.asarray(values)
    out += [values, (vectors * values) @ vectors.T, vectors @ vectors.T]
  if preconditioner.damped_inverse is not None:
    out.append(np.asarray(preconditioner.damped_inverse))
  return out


def per_layer(state, kwargs):
  placement = make_placement(
      kwargs.get("compute_method", "eigen"), True, jnp.float32,
      kwargs.get("mesh_axes"), kwargs.get("grad_worker_fraction", "comm_opt"),
      kwargs.get("assignment_strategy", "compute"))
  return placement.per_layer(factor_dims(state.factors),
                             state.preconditioners)


def assert_same_run(run, reference, kwargs, reference_kwargs, label):
  (updates, state, _), (ref_updates, ref_state, _) = run, reference
  for step, (a, b) in enumerate(zip(updates, ref_updates)):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOLERANCE,
                                 err_msg=f"{label}: updates of step {step}")
  for x, y in zip(jax.tree.leaves(state.factors),
                  jax.tree.leaves(ref_state.factors)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOLERANCE,
                               err_msg=f"{label}: factors")
  layers, ref_layers = per_layer(state, kwargs), per_layer(ref_state,
                                                           reference_kwargs)
  assert set(layers) == set(ref_layers)
  for name in layers:
    for x, y in zip(comparable(layers[name]), comparable(ref_layers[name])):
      np.testing.assert_allclose(x, y, **TOLERANCE,
                                 err_msg=f"{label}: preconditioner {name}")
  for field in ("count", "skipped_factor_updates", "rejected_decompositions"):
    assert int(getattr(state, field)) == int(getattr(ref_state, field)), field


def equality(axis_type: AxisType) -> None:
  """Every strategy on every mesh trains as one device does.

  Auto axes run the eigen method on every mesh; the inverse method, and
  Explicit axes (whose own concern is how shardings reach the capture, the
  same on any mesh), run on the two-axis (2, 4) mesh only, to keep CI short.
  """
  params, loss_fn, batches = conv_problem()
  for method in ("eigen", "inverse"):
    reference = train(params, loss_fn, batches, {"compute_method": method})
    every_mesh = method == "eigen" and axis_type == AxisType.Auto
    meshes = MESHES if every_mesh else MESHES[1:2]
    for shape, names in meshes:
      mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
      for strategy in STRATEGIES:
        kwargs = dict(compute_method=method, mesh_axes=names,
                      grad_worker_fraction=strategy)
        with jax.set_mesh(mesh):
          run = train(params, loss_fn, batches, kwargs, mesh,
                      PartitionSpec(names))
          rows = run[1].preconditioners.rows
          assert rows.sharding.is_equivalent_to(
              NamedSharding(mesh, PartitionSpec(names)), rows.ndim)
          assert_same_run(run, reference, kwargs, {"compute_method": method},
                          f"{method} {strategy.name} on {shape}")
  # Second-order work over one axis of two, replicated over the other.
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  kwargs = dict(mesh_axes="fsdp", grad_worker_fraction="hybrid_opt")
  with jax.set_mesh(mesh):
    run = train(params, loss_fn, batches, kwargs, mesh,
                PartitionSpec(("data", "fsdp")))
    rows = run[1].preconditioners.rows
    assert rows.sharding.is_equivalent_to(
        NamedSharding(mesh, PartitionSpec("fsdp")), rows.ndim)
    assert_same_run(run, train(params, loss_fn, batches, {}), kwargs, {},
                    "hybrid_opt over 'fsdp' of (2, 4)")


def subspace_solver(axis_type: AxisType) -> None:
  """The subspace solver refines each layer's basis on the device that keeps
  it, from the basis stored there: as on one device."""
  params, loss_fn, batches = conv_problem()
  solver = dict(eigen_solver="subspace")
  reference = train(params, loss_fn, batches, solver)
  kwargs = dict(solver, mesh_axes=("data", "fsdp"),
                grad_worker_fraction="hybrid_opt")
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    run = train(params, loss_fn, batches, kwargs, mesh,
                PartitionSpec(("data", "fsdp")))
    assert_same_run(run, reference, kwargs, solver, "subspace hybrid_opt")
  assert int(run[1].eigh_fallbacks) == int(reference[1].eigh_fallbacks)


class DenseNet(nn.Module):
  """``ConvNet``'s dense layers (EKFAC takes dense layers only)."""

  @nn.compact
  def __call__(self, x):
    for width in (12, 8):
      x = jnp.tanh(nn.Dense(width)(x))
    return nn.Dense(3, use_bias=False)(x)


def ekfac(axis_type: AxisType) -> None:
  """EKFAC on a mesh trains as on one device: every strategy (MEM/HYBRID
  gather the bases, COMM_OPT reads its own row), accumulation and (Auto
  axes) kernels sharded over 'fsdp'; ``S`` and the rest of the state stay
  where ``get_opt_state_partition_specs`` says."""
  # More rows a step (64) than any factor's dimension (≤ 13): no factor
  # has a cluster of equal eigenvalues, in which eigh's basis, and so S's
  # entries there, would be arbitrary.
  model = DenseNet()
  keys = jax.random.split(jax.random.key(2), 3)
  batches = (jax.random.normal(keys[0], (STEPS, 64, 6)),
             jax.random.randint(keys[1], (STEPS, 64), 0, 3))
  params = model.init(keys[2], batches[0][0])["params"]

  def loss_fn(params, x, y):
    # Summed, and a short factor_decay, so that S_batch (O(|a|²|g|²) per
    # row) outweighs the identity's S = 1 after two factor updates.
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  specs = jax.tree.map(
      lambda p: PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim == 2 and p.shape[-1] % 4 == 0 else PartitionSpec(), params)
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  base = dict(eigenvalue_correction=True, factor_decay=0.5)
  runs = [(dict(base, grad_worker_fraction=strategy), None)
          for strategy in STRATEGIES]
  runs.append((dict(base, grad_worker_fraction="hybrid_opt",
                    accumulation_steps=2), None))
  if axis_type == AxisType.Auto:  # As in `fsdp`.
    runs.append((dict(base, grad_worker_fraction="mem_opt",
                      params_partition_specs=specs), sharding))
  references = {}
  for kwargs, params_sharding in runs:
    single = {k: v for k, v in kwargs.items()
              if k in ("eigenvalue_correction", "factor_decay",
                       "accumulation_steps")}
    key = tuple(sorted(single.items()))
    if key not in references:
      references[key] = train(params, loss_fn, batches, single)
    reference = references[key]
    kwargs = dict(kwargs, mesh_axes=("data", "fsdp"))
    label = f"EKFAC {kwargs}"
    with jax.set_mesh(mesh):
      run = train(params, loss_fn, batches, kwargs, mesh,
                  PartitionSpec("data" if params_sharding else
                                ("data", "fsdp")), params_sharding)
      expected = kfac_jax.get_opt_state_partition_specs(
          params, damping=0.01, inv_update_steps=2, **kwargs)
      assert_same_run(run, reference, kwargs, single, label)
    state, reference_state = run[1], reference[1]
    for block in reference_state.eigenvalue_scales:
      np.testing.assert_allclose(
          np.asarray(state.eigenvalue_scales[block]),
          np.asarray(reference_state.eigenvalue_scales[block]), **TOLERANCE,
          err_msg=f"{label}: S of {block}")
    is_spec = lambda s: isinstance(s, PartitionSpec)
    for leaf, spec in zip(jax.tree.leaves(state),
                          jax.tree.leaves(expected, is_leaf=is_spec)):
      assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec),
                                            leaf.ndim), (label, leaf.shape,
                                                         leaf.sharding, spec)


def fsdp(axis_type: AxisType) -> None:
  """Kernels sharded over 'fsdp': same training, updates keep their specs."""
  params, loss_fn, batches = conv_problem()
  reference = train(params, loss_fn, batches, {})
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  specs = jax.tree.map(
      lambda p: PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 2 and p.shape[-1] % 4 == 0 else PartitionSpec(), params)
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  for strategy in STRATEGIES:
    kwargs = dict(mesh_axes=("data", "fsdp"), grad_worker_fraction=strategy,
                  params_partition_specs=specs)
    with jax.set_mesh(mesh):
      run = train(params, loss_fn, batches, kwargs, mesh,
                  PartitionSpec("data"), sharding)
      assert_same_run(run, reference, kwargs, {}, f"FSDP {strategy.name}")
    for update, expected in zip(jax.tree.leaves(run[0][-1]),
                                jax.tree.leaves(sharding)):
      assert update.sharding.is_equivalent_to(expected, update.ndim), (
          update.sharding, expected)
  assert_no_full_gradient_copies(params, specs, mesh)


def row_parallel(axis_type: AxisType) -> None:
  """Kernel rows sharded over 'model' (Auto), K-FAC spread over 'data' only
  ('data' of ``axis_type``): each strategy equals one device. (Arrays
  sharded over 'model' inside the per-device branches of the placement made
  XLA wait on collectives the other branches never reach: MEM_OPT aborted
  on Auto axes, COMM_OPT with 'data' Explicit.)"""
  params, loss_fn, batches = conv_problem()
  reference = train(params, loss_fn, batches, {})
  mesh = jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(axis_type, AxisType.Auto))
  # One kernel sharded: its neighbours' gradients then come out of the
  # backward pass sharded over 'model', though their kernels are not.
  specs = jax.tree.map(lambda _: PartitionSpec(), params)
  specs["Dense_1"]["kernel"] = PartitionSpec("model", None)
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  for strategy in STRATEGIES:
    kwargs = dict(mesh_axes="data", grad_worker_fraction=strategy,
                  params_partition_specs=specs)
    with jax.set_mesh(mesh):
      run = train(params, loss_fn, batches, kwargs, mesh,
                  PartitionSpec("data"), sharding)
      assert_same_run(run, reference, kwargs, {}, f"rows {strategy.name}")


def assert_no_full_gradient_copies(params, specs, mesh) -> None:
  """The compiled update never forms a sharded kernel's whole gradient.

  Reads the program of ``tx.update`` alone (the model's own FSDP forward
  gathers kernels, which is not K-FAC's doing), inverse method (the eigen
  method's state holds a replicated ``[dA, dG]`` scale of the same shape).
  """
  for strategy in STRATEGIES:
    tx = kfac_jax.scale_by_kfac(
        compute_method="inverse", mesh_axes=("data", "fsdp"),
        grad_worker_fraction=strategy, params_partition_specs=specs)
    _, loss_fn, (x, y) = conv_problem()
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    with jax.set_mesh(mesh):
      placed = jax.device_put(params, shardings)
      state = jax.jit(tx.init)(placed)
      batch = [jax.device_put(b[0], NamedSharding(mesh, PartitionSpec("data")))
               for b in (x, y)]
      _, grads, stats = jax.jit(kfac_jax.value_grad_and_stats(loss_fn))(
          placed, *batch)
      grads = jax.device_put(grads, shardings)
      text = jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st)).lower(
          grads, state, stats).compile().as_text()
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
  loss_fn = lambda p, x: jnp.mean(model.apply({"params": p}, x)**2)
  # hlo_cost's counts: eigh 9·d³; Cholesky d³/3 plus two triangular solves.
  # The inverse method pads G (16 rows) to A's 17 (batched.padded_sizes).
  for method, flops_per_layer in (("eigen", 9 * (17**3 + 16**3)),
                                  ("inverse", 7 / 3 * 2 * 17**3)):
    local_state = kfac_jax.scale_by_kfac(compute_method=method).init(params)
    total_bytes = sum(x.nbytes for x in jax.tree.leaves(
        local_state.preconditioners))
    for shape, names in MESHES[:2]:
      n = int(np.prod(shape))
      mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
      for strategy, group in zip(STRATEGIES, (n, n // 2, 1)):
        label = f"{method} {strategy.name} on {shape}"
        tx = kfac_jax.scale_by_kfac(compute_method=method, mesh_axes=names,
                                    grad_worker_fraction=strategy)
        compiled, state = compiled_step(tx, params, loss_fn, x, mesh)
        costs = per_device_costs(compiled.as_text(), n, path="max")
        flops = [c.decomposition_flops for c in costs]
        # Every decomposition exactly once on the mesh, evenly divided.
        np.testing.assert_allclose(sum(flops), 8 * flops_per_layer,
                                   err_msg=label)
        assert max(flops) <= 1.25 / n * sum(flops), (label, flops)
        rows = state.preconditioners.rows
        device_bytes = max(
            s.data.nbytes for s in rows.addressable_shards)
        assert device_bytes <= 1.25 * group / n * total_bytes, (
            label, device_bytes, total_bytes)
        plain = per_device_costs(compiled.as_text(), n, path="min")
        if group == n:  # COMM_OPT: no second-order traffic between updates.
          assert all(c.collective_bytes == 0 for c in plain), (label, plain)
        else:  # The preconditioned gradients are gathered every step.
          gradient_bytes = 8 * 17 * 16 * 4
          assert all(c.collective_bytes == gradient_bytes for c in plain), (
              label, plain)


def local_fsdp(axis_type: AxisType) -> None:
  """Kernels sharded without mesh_axes: one device's training, and the state
  the jitted update returns keeps get_opt_state_partition_specs (replicated
  factors and preconditioners)."""
  params, loss_fn, batches = conv_problem()
  methods = {method: dict(compute_method=method)
             for method in ("eigen", "inverse")}
  references = {method: train(params, loss_fn, batches, kwargs)
                for method, kwargs in methods.items()}
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)

  def kernel_spec(p, rows_axis):
    if p.ndim < 2 or p.shape[-1] % 4:
      return PartitionSpec()
    rows = rows_axis if p.shape[-2] % 2 == 0 else None
    return PartitionSpec(*([None] * (p.ndim - 2)), rows, "fsdp")

  for rows_axis in (None, "data"):
    specs = jax.tree.map(lambda p: kernel_spec(p, rows_axis), params)
    sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    for method, method_kwargs in methods.items():
      kwargs = dict(method_kwargs, params_partition_specs=specs)
      with jax.set_mesh(mesh):
        run = train(params, loss_fn, batches, kwargs, mesh,
                    PartitionSpec("data"), sharding)
        expected = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
      label = f"local {method}, kernel rows over {rows_axis}"
      assert_same_run(run, references[method], kwargs, method_kwargs, label)
      is_spec = lambda x: isinstance(x, PartitionSpec)
      for leaf, spec in zip(jax.tree.leaves(run[1]),
                            jax.tree.leaves(expected, is_leaf=is_spec)):
        assert leaf.sharding.is_equivalent_to(
            NamedSharding(mesh, spec), leaf.ndim), (
                label, leaf.shape, leaf.sharding, spec)


def mixed(axis_type: AxisType) -> None:
  """A mesh of one Explicit and one Auto axis: mesh_axes naming either kind
  equal one device; naming both in one spec is a clear error."""
  del axis_type  # the mesh has both
  params, loss_fn, batches = conv_problem()
  reference = train(params, loss_fn, batches, {})
  for kinds in ((AxisType.Explicit, AxisType.Auto),
                (AxisType.Auto, AxisType.Explicit)):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=kinds)
    for mesh_axes in ("data", "model"):
      kwargs = dict(mesh_axes=mesh_axes, grad_worker_fraction=0.5)
      with jax.set_mesh(mesh):
        run = train(params, loss_fn, batches, kwargs, mesh, PartitionSpec())
        assert_same_run(run, reference, kwargs, {}, f"{kinds} {mesh_axes}")
    try:
      with jax.set_mesh(mesh):
        train(params, loss_fn, batches, dict(mesh_axes=("data", "model")),
              mesh, PartitionSpec())
    except ValueError as error:
      assert "Explicit and Auto" in str(error), error
    else:
      raise AssertionError(f"no ValueError for both axes of {kinds}")


def fsdp_problem(axis_type: AxisType):
  """``conv_problem``'s params on a (2, 4) ('data', 'fsdp') mesh, kernels
  sharded over 'fsdp' where they divide; with its loss, batches, mesh and
  params specs."""
  params, loss_fn, batches = conv_problem()
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  params_specs = jax.tree.map(
      lambda p: PartitionSpec("fsdp") if p.shape[0] % 4 == 0 else
      PartitionSpec(), params)
  params = jax.device_put(
      params, jax.tree.map(lambda s: NamedSharding(mesh, s), params_specs))
  return params, loss_fn, batches, mesh, params_specs


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
          kwargs = dict(mesh_axes=("data", "fsdp"),
                        grad_worker_fraction=strategy, compute_method=method,
                        params_partition_specs=params_specs,
                        accumulation_steps=2)
          tx = kfac_jax.scale_by_kfac(**kwargs)
          if chain_with is not None:
            tx = optax.chain(tx, chain_with)
          expected = kfac_jax.get_opt_state_partition_specs(
              params, chain_with=chain_with, **kwargs)
          state = jax.jit(tx.init)(params)
          assert (jax.tree.structure(state) == jax.tree.structure(
              expected, is_leaf=lambda s: isinstance(s, PartitionSpec)))
          for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(
              expected, is_leaf=lambda s: isinstance(s, PartitionSpec))):
            assert leaf.sharding.is_equivalent_to(
                NamedSharding(mesh, spec), leaf.ndim), (
                    strategy, method, leaf.shape, leaf.sharding, spec)
          placed = jax.jit(tx.init, out_shardings=jax.tree.map(
              lambda s: NamedSharding(mesh, s), expected,
              is_leaf=lambda s: isinstance(s, PartitionSpec)))(params)
          assert jax.tree.structure(placed) == jax.tree.structure(state)
    for bad, message in (
        (dict(mesh_axes=("data", "model")), "'model'"),
        (dict(mesh_axes="data", grad_worker_fraction=0.3), "grad_worker_fraction"),
        (dict(mesh_axes=("data", "fsdp"), grad_worker_fraction=3 / 8),
         "whole divisor of 8"),
    ):
      try:
        kfac_jax.get_opt_state_partition_specs(params, **bad)
      except ValueError as error:
        assert message in str(error), (bad, error)
      else:
        raise AssertionError(f"no ValueError for {bad}")


def restore_target(params, mesh, kwargs):
  """The abstract ``scale_by_kfac(**kwargs)`` state to restore onto ``mesh``."""
  tx = kfac_jax.scale_by_kfac(**kwargs)
  specs = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
  return jax.tree.map(
      lambda shape, spec: jax.ShapeDtypeStruct(
          shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec)),
      jax.eval_shape(tx.init, params), specs,
      is_leaf=lambda s: isinstance(s, PartitionSpec))


def checkpoint(axis_type: AxisType) -> None:
  """A HYBRID_OPT state on 8 devices continues as MEM_OPT on 4 (and on 1).

  Saved without preconditioners, restored onto the new layout, and
  decomposed again there: the preconditioners equal those one device
  recomputes from the same factors.
  """
  import tempfile  # pylint: disable=g-import-not-at-top
  from kfac_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  params, loss_fn, batches = conv_problem()
  eight = jax.make_mesh((8,), ("devices",), axis_types=(axis_type,))
  saved_kwargs = dict(mesh_axes="devices", grad_worker_fraction="hybrid_opt")
  with jax.set_mesh(eight):
    _, state, _ = train(params, loss_fn, batches, saved_kwargs, eight,
                        PartitionSpec("devices"))
  directory = tempfile.mkdtemp() + "/ckpt"
  checkpoint_lib.save(directory, state, include_preconditioners=False)

  def target_on(mesh, kwargs):
    return restore_target(params, mesh, kwargs)

  def restored_on(mesh, kwargs):
    with jax.set_mesh(mesh):
      restored = checkpoint_lib.restore(directory, target_on(mesh, kwargs))
      restored = checkpoint_lib.recompute_preconditioners(
          restored, 0.01, **kwargs)
      return restored, per_layer(restored, kwargs)

  four = jax.make_mesh((4,), ("devices",), axis_types=(axis_type,),
                       devices=jax.devices()[4:])
  four_kwargs = dict(mesh_axes="devices", grad_worker_fraction="mem_opt")
  # Its packed preconditioners cannot move: the error says how, and a target
  # without them reads the rest (a checkpoint saved with them, as by default).
  with_rows = tempfile.mkdtemp() + "/ckpt"
  checkpoint_lib.save(with_rows, state)
  with jax.set_mesh(four):
    try:
      checkpoint_lib.restore(with_rows, target_on(four, four_kwargs))
      raise AssertionError("restored 8 devices' rows onto 4")
    except ValueError as error:
      assert "preconditioners=None" in str(error), error
    dropped = checkpoint_lib.restore(
        with_rows, target_on(four, four_kwargs)._replace(preconditioners=None))
    assert dropped.preconditioners is None
    dropped = checkpoint_lib.recompute_preconditioners(dropped, 0.01,
                                                       **four_kwargs)
    dropped_layers = per_layer(dropped, four_kwargs)
  moved, moved_layers = restored_on(four, four_kwargs)
  one = jax.make_mesh((1,), ("devices",), axis_types=(axis_type,),
                      devices=jax.devices()[:1])
  _, reference_layers = restored_on(one, dict(mesh_axes="devices"))
  assert moved.preconditioners.rows.shape[0] == 4
  for x, y in zip(jax.tree.leaves(moved.factors),
                  jax.tree.leaves(state.factors)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  for name in reference_layers:
    for layers in (moved_layers, dropped_layers):
      for x, y in zip(comparable(layers[name]),
                      comparable(reference_layers[name])):
        np.testing.assert_allclose(x, y, **TOLERANCE, err_msg=name)


class FlippedCosts(nn.Module):
  """Layers [dA, dG] = [10, 10], [11, 13], [14, 1]: by dA³ + dG³ the third
  outranks the first, by dA² + dG² the first outranks the third, so the two
  assignment strategies pack the rows in other orders."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(10)(x))
    x = jnp.tanh(nn.Dense(13)(x))
    return nn.Dense(1)(x)


def flipped_costs_problem(seed: int, batches: int):
  """``FlippedCosts``' params and ``step(kwargs, params, state, i)``: a
  jitted ``scale_by_kfac(**kwargs).update`` on batch ``i`` of ``batches``."""
  model = FlippedCosts()
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (batches, 16, 9))
  y = jax.random.normal(keys[1], (batches, 16, 1))
  params = model.init(keys[2], x[0])["params"]
  loss_fn = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y)**2)

  def step(kwargs, params, state, i):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x[i],
                                                             y[i])
    return jax.jit(kfac_jax.scale_by_kfac(**kwargs).update)(
        grads, state, params, kfac_stats=stats)

  return params, step


def saved_and_restored(state, params, mesh, kwargs):
  """``state`` saved by ``kfac_jax.checkpoint`` and restored as the state of
  ``scale_by_kfac(**kwargs)`` on ``mesh``."""
  import tempfile  # pylint: disable=g-import-not-at-top
  from kfac_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  directory = tempfile.mkdtemp() + "/ckpt"
  checkpoint_lib.save(directory, state)
  return checkpoint_lib.restore(directory,
                                restore_target(params, mesh, kwargs))


def restored_layout(axis_type: AxisType) -> None:
  """A COMM_OPT state restored under another assignment_strategy: the same
  rows shape, other offsets. The stale layout is detected: the next update
  (not a decomposition step) decomposes every layer from the factors, as a
  decomposition step of the state recomputed under the new layout does."""
  from kfac_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  params, step = flipped_costs_problem(0, 4)
  mesh = jax.make_mesh((8,), ("devices",), axis_types=(axis_type,))
  base = dict(damping=0.01, mesh_axes="devices", inv_update_steps=2)
  saved_kwargs = dict(base, assignment_strategy="compute")
  moved_kwargs = dict(base, assignment_strategy="memory")

  with jax.set_mesh(mesh):
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    state = jax.jit(kfac_jax.scale_by_kfac(**saved_kwargs).init)(params)
    for i in range(3):  # Count 3: the next step is no decomposition step.
      updates, state = step(saved_kwargs, params, state, i)
      params = optax.apply_updates(params, updates)
    restored = saved_and_restored(state, params, mesh, moved_kwargs)
    assert restored.preconditioners.rows.shape == state.preconditioners.rows.shape
    try:
      per_layer(restored, moved_kwargs)
      raise AssertionError("read rows packed under another assignment")
    except ValueError as error:
      assert "another layout" in str(error), error

    updates, moved = step(moved_kwargs, params, restored, 3)
    # Reference: the factors decomposed under the new layout, then a
    # decomposition step.
    recomputed = checkpoint_lib.recompute_preconditioners(
        restored, 0.01, mesh_axes="devices", assignment_strategy="memory")
    reference_updates, reference = step(
        dict(moved_kwargs, inv_update_steps=1), params, recomputed, 3)
    for a, b in zip(jax.tree.leaves(updates),
                    jax.tree.leaves(reference_updates)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
    layers, reference_layers = (per_layer(s, moved_kwargs)
                                for s in (moved, reference))
  for name in reference_layers:
    for a, b in zip(comparable(layers[name]),
                    comparable(reference_layers[name])):
      np.testing.assert_allclose(a, b, **TOLERANCE, err_msg=name)


def restored_ekfac_accumulation(axis_type: AxisType) -> None:
  """EKFAC with accumulation, restored under another assignment_strategy:
  the first micro-batch's S is summed in the restored bases, which cannot be
  read in the new layout, so the optimizer step leaves the batch S out and
  S restarts at K-FAC's ``outer(d_A, d_G)`` of the new decomposition."""
  params, step = flipped_costs_problem(3, 8)
  mesh = jax.make_mesh((8,), ("devices",), axis_types=(axis_type,))
  # factor_decay 0.5: a batch S averaged in would move S by half of its
  # distance from outer(d_A, d_G).
  base = dict(damping=0.01, mesh_axes="devices", inv_update_steps=2,
              eigenvalue_correction=True, accumulation_steps=2,
              factor_decay=0.5)
  saved_kwargs = dict(base, assignment_strategy="compute")
  moved_kwargs = dict(base, assignment_strategy="memory")

  with jax.set_mesh(mesh):
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    state = jax.jit(kfac_jax.scale_by_kfac(**saved_kwargs).init)(params)
    for i in range(6):  # Three optimizer steps: the next is no decomposition.
      _, state = step(saved_kwargs, params, state, i)
    moved = saved_and_restored(state, params, mesh, moved_kwargs)
    for i in (6, 7):
      _, moved = step(moved_kwargs, params, moved, i)
    assert int(moved.count) == 4 and int(moved.accumulator.micro_step) == 0
    layers = per_layer(moved, moved_kwargs)
  for block, scales in moved.eigenvalue_scales.items():
    expected = (np.asarray(layers[block].activation_eigenvalues)[:, None] *
                np.asarray(layers[block].gradient_eigenvalues)[None, :])
    # One float32 product of the same two eigenvalues on either side.
    np.testing.assert_allclose(np.asarray(scales), expected,
                               rtol=np.finfo(np.float32).eps, err_msg=block)


class ScannedGroupedBlocks(nn.Module):
  """Three scanned slices of grouped conv -> Dense: 9 Kronecker blocks."""

  @nn.compact
  def __call__(self, x):

    class Body(nn.Module):

      @nn.compact
      def __call__(self, x, _):
        h = jnp.tanh(nn.Conv(4, (3,), feature_group_count=2, name="conv")(x))
        return jnp.tanh(nn.Dense(4, name="dense")(h)), None

    scan = nn.scan(Body, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=3)
    x, _ = scan(name="layers")(x, None)
    return x.reshape(x.shape[0], -1)


def blocks(axis_type: AxisType) -> None:
  """Blocks of scanned layers and grouped convs spread like layers."""
  model = ScannedGroupedBlocks()
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (STEPS, 16, 6, 4))
  y = jax.random.normal(keys[1], (STEPS, 16, 24))
  params = model.init(keys[2], x[0])["params"]

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  table = kfac_jax.trace_layers(loss_fn, params, x[0], y[0])
  reference = train(params, loss_fn, (x, y), {"layers": table})
  assert len(reference[1].factors) == 9
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  # The scanned kernels sharded over their output axis, as FSDP would.
  specs = jax.tree.map(
      lambda p: PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 3 else PartitionSpec(), params)
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  for strategy in STRATEGIES:
    kwargs = dict(mesh_axes=("data", "fsdp"), grad_worker_fraction=strategy,
                  layers=table, params_partition_specs=specs)
    with jax.set_mesh(mesh):
      run = train(params, loss_fn, (x, y), kwargs, mesh,
                  PartitionSpec(("data", "fsdp")), sharding)
      assert_same_run(run, reference, kwargs, {"layers": table},
                      f"blocks {strategy.name}")
    for update, expected in zip(jax.tree.leaves(run[0][-1]),
                                jax.tree.leaves(sharding)):
      assert update.sharding.is_equivalent_to(expected, update.ndim), (
          update.sharding, expected)


def adaptive(axis_type: AxisType) -> None:
  """The adaptive mode (π-split inverses, quadratic model over batch-sharded
  outputs, the previous update sharded like FSDP kernels, factors from half
  of each batch-sharded batch) trains as on one device."""
  params, loss_fn, batches = conv_problem()
  model = ConvNet()

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
        lambda p: model.apply({"params": p}, x),
        lambda logits: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean())

  base = dict(compute_method="inverse", factor_batch_size=8)
  reference = train(params, loss_fn, batches, base, split_loss=split_loss)
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  specs = jax.tree.map(
      lambda p: PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 2 and p.shape[-1] % 4 == 0 else PartitionSpec(), params)
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  kwargs = dict(base, mesh_axes=("data", "fsdp"),
                grad_worker_fraction=kfac_jax.DistributedStrategy.MEM_OPT,
                params_partition_specs=specs)
  with jax.set_mesh(mesh):
    run = train(params, loss_fn, batches, kwargs, mesh, PartitionSpec("data"),
                sharding, split_loss=split_loss)
    assert_same_run(run, reference, kwargs, base, "adaptive MEM_OPT, FSDP")
  model_state, ref_model_state = (r[1].quadratic_model for r in (run,
                                                                 reference))
  for x, y in zip(jax.tree.leaves(model_state),
                  jax.tree.leaves(ref_model_state)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOLERANCE,
                               err_msg="adaptive: quadratic-model state")
  assert float(model_state.damping) != 1.0  # adapted at steps 0 and 2
  for leaf, expected in zip(jax.tree.leaves(model_state.previous_update),
                            jax.tree.leaves(sharding)):
    assert leaf.sharding.is_equivalent_to(expected, leaf.ndim)
  print("ok")


class WideMLP(nn.Module):
  """64-wide layers at 16 rows a batch: gradient_from_stats factors them."""

  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = jnp.tanh(nn.Dense(64)(x))
    return nn.Dense(3)(x)


def gradient_from_stats(axis_type: AxisType) -> None:
  """Data parallel: ``(a Lᵀ)ᵀ(g R)`` contracts the batch-sharded rows of
  ``a`` and ``g``, and trains as the dense path does on one device."""
  model = WideMLP()
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (STEPS, 16, 8))
  y = jax.random.randint(keys[1], (STEPS, 16), 0, 3)
  params = model.init(keys[2], x[0])["params"]

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  for method, inv_dtype in (("eigen", jnp.float32), ("inverse", jnp.float32),
                            ("inverse", jnp.bfloat16)):
    base = dict(compute_method=method, inv_dtype=inv_dtype)
    kwargs = dict(base, gradient_from_stats=True)
    # bfloat16 products round the dense and the factored forms' middle
    # products differently: there the reference is the factored form too.
    reference = train(params, loss_fn, (x, y),
                      base if inv_dtype == jnp.float32 else kwargs)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
      run = train(params, loss_fn, (x, y), kwargs, mesh, PartitionSpec("data"))
    assert_same_run(run, reference, kwargs, base,
                    f"gradient_from_stats {method} {jnp.dtype(inv_dtype)}, "
                    "batch over 8 devices")


def edges(axis_type: AxisType) -> None:
  """An update called outside jit with mesh_axes naming one of two axes
  (jax ran such a shard_map only under jit); a model whose layers are all
  skipped (a zero-size all_gather failed to compile); a params spec naming
  an axis the mesh lacks (a bare KeyError)."""
  params, loss_fn, (x, y) = conv_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x[0], y[0])
  local = kfac_jax.scale_by_kfac(damping=0.01)
  expected, _ = local.update(grads, local.init(params), params,
                             kfac_stats=stats)
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    placed = jax.device_put((params, grads, stats),
                            NamedSharding(mesh, PartitionSpec()))
    for strategy in STRATEGIES:
      for mesh_axes in ("data", "model"):
        tx = kfac_jax.scale_by_kfac(damping=0.01, mesh_axes=mesh_axes,
                                    grad_worker_fraction=strategy)
        updates, _ = tx.update(placed[1], tx.init(placed[0]), placed[0],
                               kfac_stats=placed[2])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b,
                                                             **TOLERANCE),
                     updates, expected)

      skipping = kfac_jax.scale_by_kfac(mesh_axes=("data", "model"),
                                        grad_worker_fraction=strategy,
                                        skip_layers=[".*"])
      updates, state = jax.jit(lambda g, s, p, st, tx=skipping: tx.update(
          g, s, p, kfac_stats=st))(placed[1], skipping.init(placed[0]),
                                   placed[0], placed[2])
      assert not state.factors and int(state.rejected_decompositions) == 0
      jax.tree.map(np.testing.assert_array_equal, updates, grads)

    specs = jax.tree.map(lambda _: PartitionSpec(), params)
    specs["Dense_0"]["kernel"] = PartitionSpec(None, "fsdp")
    try:
      kfac_jax.scale_by_kfac(params_partition_specs=specs).init(placed[0])
    except ValueError as error:
      assert "['fsdp'], not axes of the mesh" in str(error), error
    else:
      raise AssertionError("no ValueError for an axis the mesh lacks")


def stable_state(axis_type: AxisType) -> None:
  """A step jitted with the specs as its state's in_shardings runs again on
  its own output, every leaf as the specs say: the accumulator's G sums
  followed the sharded kernels (the second call raised), and the
  preconditioner rows came back as P(axes) where the specs said
  P(axes, None) (a donated step compiled twice)."""
  params, loss_fn, (x, y) = conv_problem()
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  params_specs = jax.tree.map(
      lambda p: PartitionSpec(None, "fsdp") if p.ndim == 2 and
      p.shape[1] % 4 == 0 else PartitionSpec(), params)
  named = lambda tree: jax.tree.map(
      lambda s: NamedSharding(mesh, s), tree,
      is_leaf=lambda s: isinstance(s, PartitionSpec))
  params = jax.device_put(params, named(params_specs))
  with jax.set_mesh(mesh):
    for strategy in (STRATEGIES[0], STRATEGIES[2]):
      for accumulation_steps in (1, 2):
        kwargs = dict(mesh_axes=("data", "fsdp"),
                      grad_worker_fraction=strategy,
                      params_partition_specs=params_specs,
                      accumulation_steps=accumulation_steps)
        tx = kfac_jax.scale_by_kfac(**kwargs)
        specs = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
        state = jax.jit(tx.init, out_shardings=named(specs))(params)

        def step(state, x, y, tx=tx):
          _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x,
                                                                    y)
          return tx.update(grads, state, params, kfac_stats=stats)[1]

        jitted = jax.jit(step, in_shardings=(named(specs), None, None))
        for i in range(3):
          state = jitted(state, x[i], y[i])
        for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, PartitionSpec))):
          assert leaf.sharding.spec == spec, (
              strategy, accumulation_steps, leaf.shape, leaf.sharding.spec,
              spec)


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
      lambda p: PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 2 and p.shape[-1] % 4 == 0 else PartitionSpec(), params)
  named = lambda tree: jax.tree.map(
      lambda s: NamedSharding(mesh, s), tree,
      is_leaf=lambda s: isinstance(s, PartitionSpec))

  def make_tx(**kwargs):
    kfac = optax.chain(
        kfac_jax.scale_by_kfac(damping=0.01, inv_update_steps=2,
                               skip_layers="Dense_2", **kwargs),
        optax.sgd(0.1, momentum=0.9))
    return optax.multi_transform({"kfac": kfac, "adam": optax.adam(1e-3)},
                                 labels)

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
    specs = kfac_jax.get_opt_state_partition_specs(params, tx=tx,
                                                   skip_layers="Dense_2",
                                                   damping=0.01,
                                                   inv_update_steps=2,
                                                   **kwargs)
    sharded_params = jax.device_put(params, named(params_specs))
    state = jax.jit(tx.init, out_shardings=named(specs))(sharded_params)
    got, state = run(tx, sharded_params, state,
                     lambda b: jax.device_put(
                         b, NamedSharding(mesh, PartitionSpec("data"))))
  for step, (a, b) in enumerate(zip(got, reference)):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(u), np.asarray(v), **TOLERANCE,
                                 err_msg=f"updates of step {step}")
  # K-FAC's layers (Adam's update is placed as XLA likes).
  kfac_layers = [name for name, label in labels.items() if label == "kfac"]
  for update, spec in zip(
      jax.tree.leaves([got[-1][name] for name in kfac_layers]),
      jax.tree.leaves([params_specs[name] for name in kfac_layers],
                      is_leaf=lambda s: isinstance(s, PartitionSpec))):
    assert update.sharding.is_equivalent_to(NamedSharding(mesh, spec),
                                            update.ndim), (update.sharding,
                                                           spec)
  kfac_state = state.inner_states["kfac"].inner_state[0]
  kfac_specs = specs.inner_states["kfac"].inner_state[0]
  for leaf, spec in zip(jax.tree.leaves(kfac_state.preconditioners),
                        jax.tree.leaves(kfac_specs.preconditioners,
                                        is_leaf=lambda s: isinstance(
                                            s, PartitionSpec))):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec),
                                          leaf.ndim), (leaf.sharding, spec)


PROGRAMS = {f.__name__: f for f in (adaptive, equality, fsdp, local_fsdp,
                                    row_parallel,
                                    mixed, division, specs, checkpoint, blocks,
                                    gradient_from_stats, edges,
                                    restored_layout, restored_ekfac_accumulation,
                                    stable_state,
                                    multi_transform_fsdp, subspace_solver, ekfac)}

if __name__ == "__main__":
  assert jax.device_count() == 8, jax.devices()
  PROGRAMS[sys.argv[1]](getattr(AxisType, sys.argv[2]))
  print("ok")
