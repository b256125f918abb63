"""Programs for 8 simulated CPU devices, run by ``test_distribution.py``,
and what those of ``multidevice_fsdp.py`` and ``multidevice_checkpoint.py``
share.

``python -m tests.multidevice <program> <axis type>`` (or another of those
modules) with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set by the caller so
the single-device tests of the main process keep one device;
``eight_device_env`` gives callers that environment). Each program asserts
and prints ``ok``.
"""

from __future__ import annotations

import functools
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
from kfac_jax.factors.running import factor_dims
from kfac_jax.transform.config import KFACConfig
from tests.reference import assert_float32_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_eight_devices(module: str, program: str, axis_type: str) -> None:
  """Runs ``python -m module program axis_type`` on 8 simulated devices; the
  program prints ``ok`` when its checks pass."""
  result = subprocess.run(
    [sys.executable, "-m", module, program, axis_type],
    env=eight_device_env(),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=280,
  )
  assert result.returncode == 0, result.stderr[-6000:]
  assert result.stdout.strip().endswith("ok")


def eight_device_env() -> dict[str, str]:
  """This process's environment for a program on 8 simulated CPU devices.

  The device count is added to the inherited ``XLA_FLAGS`` (``make test``
  sets compile flags there) and ``JAX_PLATFORMS=cpu`` keeps the simulated
  devices where an accelerator is present.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8",
  )


MESHES = (
  ((8,), ("devices",)),
  ((2, 4), ("data", "fsdp")),
  ((4, 2), ("data", "fsdp")),
)
STRATEGIES = (
  kfac_jax.DistributedStrategy.COMM_OPT,
  kfac_jax.DistributedStrategy.HYBRID_OPT,
  kfac_jax.DistributedStrategy.MEM_OPT,
)
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


def fsdp_problem(axis_type: AxisType):
  """``conv_problem``'s params on a (2, 4) ('data', 'fsdp') mesh, kernels
  sharded over 'fsdp' where they divide; with its loss, batches, mesh and
  params specs."""
  params, loss_fn, batches = conv_problem()
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  params_specs = jax.tree.map(
    lambda p: PartitionSpec("fsdp") if p.shape[0] % 4 == 0 else PartitionSpec(),
    params,
  )
  params = jax.device_put(
    params, jax.tree.map(lambda s: NamedSharding(mesh, s), params_specs)
  )
  return params, loss_fn, batches, mesh, params_specs


def train(
  params,
  loss_fn,
  batches,
  kwargs,
  mesh=None,
  batch_spec=None,
  params_sharding=None,
  split_loss=None,
  states=None,
):
  """``STEPS`` steps of K-FAC + SGD: (updates per step, K-FAC state, tx).

  With ``split_loss(x, y) -> SplitLoss``: K-FAC's adaptive mode alone.
  ``states``, a list, receives the K-FAC state after each step.
  """
  if split_loss is None:
    tx = optax.chain(
      kfac_jax.scale_by_kfac(
        **{"damping": 0.01, "inv_update_steps": 2, **kwargs}
      ),
      optax.sgd(0.1, momentum=0.9),
    )
  else:
    tx = kfac_jax.scale_by_kfac(
      damping=1.0,
      kl_clip=None,
      inv_update_steps=2,
      adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=2),
      **kwargs,
    )

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    extra = {} if split_loss is None else dict(split_loss=split_loss(x, y))
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **extra)
    return optax.apply_updates(params, updates), state, updates

  if mesh is not None:  # Explicit axes need the params placed on the mesh.
    params = jax.device_put(
      params, params_sharding or NamedSharding(mesh, PartitionSpec())
    )
  state = jax.jit(tx.init)(params)
  all_updates = []
  for i in range(STEPS):
    x, y = (b[i] for b in batches)
    if mesh is not None:
      x, y = (
        jax.device_put(b, NamedSharding(mesh, batch_spec)) for b in (x, y)
      )
    params, state, updates = step(params, state, x, y)
    # One step in flight at a time: simulated CPU devices can deadlock in a
    # collective otherwise (examples/sharded_mnist.py).
    all_updates.append(jax.block_until_ready(updates))
    if states is not None:
      states.append(state if split_loss else state[0])
  return all_updates, (state if split_loss else state[0]), tx


def comparable(preconditioner) -> list[np.ndarray]:
  """Arrays that do not depend on the sign/rotation freedom of eigenvectors."""
  if isinstance(preconditioner, kfac_jax.InversePreconditioner):
    return [np.asarray(x, np.float32) for x in preconditioner]
  out = []
  for vectors, values in (
    (
      preconditioner.activation_eigenvectors,
      preconditioner.activation_eigenvalues,
    ),
    (preconditioner.gradient_eigenvectors, preconditioner.gradient_eigenvalues),
  ):
    vectors, values = np.asarray(vectors), np.asarray(values)
    out += [values, (vectors * values) @ vectors.T, vectors @ vectors.T]
  if preconditioner.damped_inverse is not None:
    out.append(np.asarray(preconditioner.damped_inverse))
  return out


def per_layer(state, kwargs):
  """``state``'s preconditioners per layer, read in the layout of the
  ``scale_by_kfac`` arguments ``kwargs``."""
  placement = KFACConfig(**kwargs).placement
  return placement.per_layer(factor_dims(state.factors), state.preconditioners)


def assert_same_run(
  run, reference, kwargs, reference_kwargs, label, updates_close=None
):
  """``run`` trains as ``reference``: updates (``updates_close(actual,
  expected, err_msg)`` if given, else within TOLERANCE), factors,
  preconditioners and counters."""
  (updates, state, _), (ref_updates, ref_state, _) = run, reference
  for step, (a, b) in enumerate(zip(updates, ref_updates)):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      message = f"{label}: updates of step {step}"
      if updates_close is None:
        np.testing.assert_allclose(
          np.asarray(x), np.asarray(y), **TOLERANCE, err_msg=message
        )
      else:
        updates_close(np.asarray(x), np.asarray(y), err_msg=message)
  for x, y in zip(
    jax.tree.leaves(state.factors), jax.tree.leaves(ref_state.factors)
  ):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), **TOLERANCE, err_msg=f"{label}: factors"
    )
  layers, ref_layers = (
    per_layer(state, kwargs),
    per_layer(ref_state, reference_kwargs),
  )
  assert set(layers) == set(ref_layers)
  for name in layers:
    for x, y in zip(comparable(layers[name]), comparable(ref_layers[name])):
      np.testing.assert_allclose(
        x, y, **TOLERANCE, err_msg=f"{label}: preconditioner {name}"
      )
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
        kwargs = dict(
          compute_method=method, mesh_axes=names, grad_worker_fraction=strategy
        )
        with jax.set_mesh(mesh):
          run = train(
            params, loss_fn, batches, kwargs, mesh, PartitionSpec(names)
          )
          rows = run[1].preconditioners.rows
          assert rows.sharding.is_equivalent_to(
            NamedSharding(mesh, PartitionSpec(names)), rows.ndim
          )
          assert_same_run(
            run,
            reference,
            kwargs,
            {"compute_method": method},
            f"{method} {strategy.name} on {shape}",
          )
  # Second-order work over one axis of two, replicated over the other.
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  kwargs = dict(mesh_axes="fsdp", grad_worker_fraction="hybrid_opt")
  with jax.set_mesh(mesh):
    run = train(
      params, loss_fn, batches, kwargs, mesh, PartitionSpec(("data", "fsdp"))
    )
    rows = run[1].preconditioners.rows
    assert rows.sharding.is_equivalent_to(
      NamedSharding(mesh, PartitionSpec("fsdp")), rows.ndim
    )
    assert_same_run(
      run,
      train(params, loss_fn, batches, {}),
      kwargs,
      {},
      "hybrid_opt over 'fsdp' of (2, 4)",
    )


def subspace_solver(axis_type: AxisType) -> None:
  """The subspace solver refines each layer's basis on the device that keeps
  it, from the basis stored there: as on one device."""
  params, loss_fn, batches = conv_problem()
  solver = dict(eigen_solver="subspace")
  reference = train(params, loss_fn, batches, solver)
  kwargs = dict(
    solver, mesh_axes=("data", "fsdp"), grad_worker_fraction="hybrid_opt"
  )
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    run = train(
      params, loss_fn, batches, kwargs, mesh, PartitionSpec(("data", "fsdp"))
    )
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
  axes) kernels sharded over 'fsdp'; so does ``second_moment_decay``, on
  the same path; ``S`` (``v``) and the rest of the state stay where
  ``get_opt_state_partition_specs`` says."""
  # More rows a step (64) than any factor's dimension (≤ 13): no factor
  # has a cluster of equal eigenvalues, in which eigh's basis, and so S's
  # entries there, would be arbitrary.
  model = DenseNet()
  keys = jax.random.split(jax.random.key(2), 3)
  batches = (
    jax.random.normal(keys[0], (STEPS, 64, 6)),
    jax.random.randint(keys[1], (STEPS, 64), 0, 3),
  )
  params = model.init(keys[2], batches[0][0])["params"]

  def loss_fn(params, x, y):
    # Summed, and a short factor_decay, so that S_batch (O(|a|²|g|²) per
    # row) outweighs the identity's S = 1 after two factor updates.
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(axis_type,) * 2)
  specs = jax.tree.map(
    lambda p: (
      PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim == 2 and p.shape[-1] % 4 == 0
      else PartitionSpec()
    ),
    params,
  )
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  base = dict(eigenvalue_correction=True, factor_decay=0.5)
  runs = [
    (dict(base, grad_worker_fraction=strategy), None) for strategy in STRATEGIES
  ]
  runs.append(
    (dict(base, grad_worker_fraction="hybrid_opt", accumulation_steps=2), None)
  )
  # The gradient's second moment takes EKFAC's replicated path (its v in
  # place of S). At its first steps R / (|R|/mean|R| + λ) has slope up to
  # 1/λ in R, which λ = 1 bounds by 1, so a mesh's other rounding of the
  # bases moves P no more than it moves R (as for EKFAC).
  runs += [
    (
      dict(
        second_moment_decay=0.9,
        factor_decay=0.5,
        damping=1.0,
        grad_worker_fraction=s,
      ),
      None,
    )
    for s in (STRATEGIES[0], STRATEGIES[-1])
  ]
  if axis_type == AxisType.Auto:  # As in `fsdp`.
    runs.append(
      (
        dict(
          base, grad_worker_fraction="mem_opt", params_partition_specs=specs
        ),
        sharding,
      )
    )
  references = {}
  for kwargs, params_sharding in runs:
    single = {
      k: v
      for k, v in kwargs.items()
      if k
      in (
        "eigenvalue_correction",
        "second_moment_decay",
        "damping",
        "factor_decay",
        "accumulation_steps",
      )
    }
    key = tuple(sorted(single.items()))
    if key not in references:
      states = []
      references[key] = (
        train(params, loss_fn, batches, single, states=states),
        states,
      )
    reference, reference_states = references[key]
    updates_close = None
    if "second_moment_decay" in kwargs:
      # R = Q_Aᵀ ∇ Q_G moves with the bases, and a basis vector by the
      # factor's rounding (its 64-row sum, then the rotations' dA + dG terms)
      # over its eigenvalue gap, ‖F‖/gap: the worst over the steps' factors.
      # P = Q_A [R / (|R|/mean|R| + λ)] Q_Gᵀ, whose slope in R λ = 1 bounds
      # by 1, and v (sums of R²) move by as much of their largest entries.
      # Near-equal eigenvalues make that condition ~1e4 on this problem: a
      # check of the layout (blocks, shardings, NaN), not of the rounding.
      condition = max(
        sum(
          float(d.max() / np.diff(d).min())
          for d in (
            np.linalg.eigvalsh(np.asarray(f, np.float64))
            for f in (factors.activation_factor, factors.gradient_factor)
          )
        )
        for s in reference_states
        for factors in s.factors.values()
      )
      terms = 2 * (
        64 + max(sum(d) for d in factor_dims(reference[1].factors).values())
      )
      updates_close = functools.partial(
        assert_float32_close, terms=terms, condition=condition
      )
    kwargs = dict(kwargs, mesh_axes=("data", "fsdp"))
    label = f"scaling in the eigenbasis {kwargs}"
    with jax.set_mesh(mesh):
      run = train(
        params,
        loss_fn,
        batches,
        kwargs,
        mesh,
        PartitionSpec("data" if params_sharding else ("data", "fsdp")),
        params_sharding,
      )
      expected = kfac_jax.get_opt_state_partition_specs(
        params, **{"damping": 0.01, "inv_update_steps": 2, **kwargs}
      )
      assert_same_run(run, reference, kwargs, single, label, updates_close)
    state, reference_state = run[1], reference[1]
    for block in reference_state.eigenvalue_scales:
      actual = np.asarray(state.eigenvalue_scales[block])
      expected_scales = np.asarray(reference_state.eigenvalue_scales[block])
      if updates_close is None:
        np.testing.assert_allclose(
          actual, expected_scales, **TOLERANCE, err_msg=f"{label}: S of {block}"
        )
      else:
        updates_close(actual, expected_scales, err_msg=f"{label}: v of {block}")
    is_spec = lambda s: isinstance(s, PartitionSpec)
    for leaf, spec in zip(
      jax.tree.leaves(state), jax.tree.leaves(expected, is_leaf=is_spec)
    ):
      assert leaf.sharding.is_equivalent_to(
        NamedSharding(mesh, spec), leaf.ndim
      ), (label, leaf.shape, leaf.sharding, spec)


class ScannedGroupedBlocks(nn.Module):
  """Three scanned slices of grouped conv -> Dense: 9 Kronecker blocks."""

  @nn.compact
  def __call__(self, x):

    class Body(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        h = jnp.tanh(nn.Conv(4, (3,), feature_group_count=2, name="conv")(x))
        return jnp.tanh(nn.Dense(4, name="dense")(h)), None

    scan = nn.scan(
      Body, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
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
    lambda p: (
      PartitionSpec(*([None] * (p.ndim - 1)), "fsdp")
      if p.ndim >= 3
      else PartitionSpec()
    ),
    params,
  )
  sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  for strategy in STRATEGIES:
    kwargs = dict(
      mesh_axes=("data", "fsdp"),
      grad_worker_fraction=strategy,
      layers=table,
      params_partition_specs=specs,
    )
    with jax.set_mesh(mesh):
      run = train(
        params,
        loss_fn,
        (x, y),
        kwargs,
        mesh,
        PartitionSpec(("data", "fsdp")),
        sharding,
      )
      assert_same_run(
        run, reference, kwargs, {"layers": table}, f"blocks {strategy.name}"
      )
    for update, expected in zip(
      jax.tree.leaves(run[0][-1]), jax.tree.leaves(sharding)
    ):
      assert update.sharding.is_equivalent_to(expected, update.ndim), (
        update.sharding,
        expected,
      )


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
        logits, y
      ).mean(),
    )

  base = dict(compute_method="inverse", factor_batch_size=8)
  reference = train(params, loss_fn, batches, base, split_loss=split_loss)
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
  kwargs = dict(
    base,
    mesh_axes=("data", "fsdp"),
    grad_worker_fraction=kfac_jax.DistributedStrategy.MEM_OPT,
    params_partition_specs=specs,
  )
  with jax.set_mesh(mesh):
    run = train(
      params,
      loss_fn,
      batches,
      kwargs,
      mesh,
      PartitionSpec("data"),
      sharding,
      split_loss=split_loss,
    )
    assert_same_run(run, reference, kwargs, base, "adaptive MEM_OPT, FSDP")
  model_state, ref_model_state = (
    r[1].quadratic_model for r in (run, reference)
  )
  for x, y in zip(
    jax.tree.leaves(model_state), jax.tree.leaves(ref_model_state)
  ):
    np.testing.assert_allclose(
      np.asarray(x),
      np.asarray(y),
      **TOLERANCE,
      err_msg="adaptive: quadratic-model state",
    )
  assert float(model_state.damping) != 1.0  # adapted at steps 0 and 2
  for leaf, expected in zip(
    jax.tree.leaves(model_state.previous_update), jax.tree.leaves(sharding)
  ):
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

  for method, inv_dtype in (
    ("eigen", jnp.float32),
    ("inverse", jnp.float32),
    ("inverse", jnp.bfloat16),
  ):
    base = dict(compute_method=method, inv_dtype=inv_dtype)
    kwargs = dict(base, gradient_from_stats=True)
    # bfloat16 products round the dense and the factored forms' middle
    # products differently: there the reference is the factored form too.
    reference = train(
      params, loss_fn, (x, y), base if inv_dtype == jnp.float32 else kwargs
    )
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
      run = train(params, loss_fn, (x, y), kwargs, mesh, PartitionSpec("data"))
    assert_same_run(
      run,
      reference,
      kwargs,
      base,
      f"gradient_from_stats {method} {jnp.dtype(inv_dtype)}, "
      "batch over 8 devices",
    )


def edges(axis_type: AxisType) -> None:
  """An update called outside jit with mesh_axes naming one of two axes
  (jax ran such a shard_map only under jit); a model whose layers are all
  skipped (a zero-size all_gather failed to compile); a params spec naming
  an axis the mesh lacks (a bare KeyError)."""
  params, loss_fn, (x, y) = conv_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x[0], y[0])
  local = kfac_jax.scale_by_kfac(damping=0.01)
  expected, _ = local.update(
    grads, local.init(params), params, kfac_stats=stats
  )
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh):
    placed = jax.device_put(
      (params, grads, stats), NamedSharding(mesh, PartitionSpec())
    )
    for strategy in STRATEGIES:
      for mesh_axes in ("data", "model"):
        tx = kfac_jax.scale_by_kfac(
          damping=0.01, mesh_axes=mesh_axes, grad_worker_fraction=strategy
        )
        updates, _ = tx.update(
          placed[1], tx.init(placed[0]), placed[0], kfac_stats=placed[2]
        )
        jax.tree.map(
          lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE),
          updates,
          expected,
        )

      skipping = kfac_jax.scale_by_kfac(
        mesh_axes=("data", "model"),
        grad_worker_fraction=strategy,
        skip_layers=[".*"],
      )
      updates, state = jax.jit(
        lambda g, s, p, st, tx=skipping: tx.update(g, s, p, kfac_stats=st)
      )(placed[1], skipping.init(placed[0]), placed[0], placed[2])
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


def main(programs: dict) -> None:
  """``python -m <module> <program> <axis type>``: runs ``programs[program]``
  on this process's 8 devices and prints ``ok``."""
  assert jax.device_count() == 8, jax.devices()
  programs[sys.argv[1]](getattr(AxisType, sys.argv[2]))
  print("ok")


PROGRAMS = {
  f.__name__: f
  for f in (
    adaptive,
    equality,
    blocks,
    gradient_from_stats,
    edges,
    subspace_solver,
    ekfac,
  )
}

if __name__ == "__main__":
  main(PROGRAMS)
