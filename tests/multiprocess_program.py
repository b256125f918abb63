"""Training and checkpoints across processes, run by ``test_multiprocess.py``.

``python -m tests.multiprocess_program distributed --process-id I
--num-processes 2 --port P --out DIR`` is one of 2 processes with 4
simulated CPU devices each (``jax.distributed.initialize`` on localhost,
gloo collectives), ``... single --out DIR`` one process with 8: the
reference. Both run the same ``CASES`` on a (2, 4) ``("data", "fsdp")``
mesh, each process feeding its own rows of every batch
(``jax.make_array_from_process_local_data``), and write what they computed,
gathered to the host, to ``DIR/<role>_<process>.npz``; the test compares
them. The checkpoints go through ``kfac_jax.checkpoint`` from every process:

* ``distributed`` saves a HYBRID_OPT state (Explicit axes) with and without
  its preconditioners, restores it onto the mesh and without a mesh (each
  process onto its own first device) bit for bit, and moves it to COMM_OPT
  (``recompute_preconditioners``) for one more step, which ``single`` repeats
  with its own checkpoint;
* ``single`` then restores the 2 processes' checkpoint onto one process: onto
  its 8 devices bit for bit, and onto 4 devices (MEM_OPT) and one
  (recomputed), whose preconditioners must agree.

Any exception exits the process at once with status 1 (``os._exit``):
``jax.distributed``'s shutdown at exit would wait for the other process.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from kfac_jax import checkpoint
from kfac_jax.factors.running import factor_dims
from kfac_jax.transform.config import KFACConfig
from tests.multidevice import STRATEGIES, TOLERANCE, comparable

# Local devices of each role (the caller sets them in XLA_FLAGS).
_ROLE_DEVICES = {"distributed": 4, "single": 8}
STEPS = 3  # decompositions at steps 0 and 2 (inv_update_steps=2)
AXES = ("data", "fsdp")
DAMPING = 0.01
MARKER = "distributed_checkpoints_written"
_START = time.monotonic()


def log(message: str) -> None:
  """Progress with the time since start, for the test's logs."""
  print(f"{time.monotonic() - _START:6.1f} s  {message}", flush=True)


class MLP(nn.Module):
  """Three layers of unequal sizes: the packing is not uniform."""

  @nn.compact
  def __call__(self, x):
    for width in (16, 12):
      x = jnp.tanh(nn.Dense(width)(x))
    return nn.Dense(4)(x)


MODEL = MLP()


def problem():
  """Host (numpy) params, batches ``(x, y)`` of ``STEPS`` steps, the loss
  (a regression: integer labels need one-hot ones on Explicit axes) and the
  adaptive mode's split loss."""
  keys = jax.random.split(jax.random.key(0), 3)
  x = np.asarray(jax.random.normal(keys[0], (STEPS, 16, 6)))
  y = np.asarray(jax.random.normal(keys[1], (STEPS, 16, 4)))
  params = jax.tree.map(np.asarray, MODEL.init(keys[2], x[0])["params"])

  def loss_fn(params, x, y):
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)

  def split_loss(x, y):
    return kfac_jax.SplitLoss(
      lambda p: MODEL.apply({"params": p}, x),
      lambda out: jnp.mean((out - y) ** 2),
    )

  return params, (x, y), loss_fn, split_loss


def fsdp_specs(params):
  """Kernels' output axis over 'fsdp' where it divides."""
  return jax.tree.map(
    lambda p: (
      PartitionSpec(None, "fsdp")
      if p.ndim == 2 and p.shape[-1] % 4 == 0
      else PartitionSpec()
    ),
    params,
  )


def process_local(sharding: NamedSharding, value: np.ndarray) -> jax.Array:
  """The global array of ``value`` from this process's rows only, as a
  data loader of a multi-host program would read them."""
  index = sharding.addressable_devices_indices_map(value.shape).values()
  rows = sorted(
    {
      (i[0].start or 0, value.shape[0] if i[0].stop is None else i[0].stop)
      for i in index
    }
  )
  start, stop = rows[0][0], rows[-1][1]
  assert all(a[1] >= b[0] for a, b in zip(rows, rows[1:])), rows  # contiguous
  return jax.make_array_from_process_local_data(
    sharding, value[start:stop], value.shape
  )


def place(tree, shardings):
  """Host arrays (equal in every process) as global arrays."""
  return jax.tree.map(
    lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
    tree,
    shardings,
  )


def named(mesh, specs):
  return jax.tree.map(
    lambda s: NamedSharding(mesh, s),
    specs,
    is_leaf=lambda s: isinstance(s, PartitionSpec),
  )


def to_host(tree):
  """Every array of ``tree`` in full, in every process."""
  return jax.tree.map(
    np.asarray, multihost_utils.process_allgather(tree, tiled=True)
  )


def kfac_kwargs(kwargs, adaptive):
  """The ``scale_by_kfac`` arguments of a run: ``kwargs`` and the mode's."""
  if adaptive:
    return dict(
      kwargs,
      damping=1.0,
      kl_clip=None,
      inv_update_steps=2,
      adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=2),
    )
  return dict(kwargs, damping=DAMPING, inv_update_steps=2)


def make_tx(kwargs, adaptive):
  """K-FAC alone in the adaptive mode, else chained with SGD."""
  kfac = kfac_jax.scale_by_kfac(**kfac_kwargs(kwargs, adaptive))
  return kfac if adaptive else optax.chain(kfac, optax.sgd(0.1, momentum=0.9))


def train(
  mesh,
  kwargs,
  params_specs,
  batch_spec,
  adaptive=False,
  state=None,
  params=None,
  steps=range(STEPS),
):
  """Jitted steps under ``mesh`` from host params (or given ones and a
  state); returns (host updates per step, params, opt_state)."""
  host_params, batches, loss_fn, split_loss = problem()
  tx = make_tx(kwargs, adaptive)

  @jax.jit
  def step(params, state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    extra = dict(split_loss=split_loss(x, y)) if adaptive else {}
    updates, state = tx.update(grads, state, params, kfac_stats=stats, **extra)
    return optax.apply_updates(params, updates), state, updates

  if params is None:
    params = place(host_params, named(mesh, params_specs))
    specs = kfac_jax.get_opt_state_partition_specs(
      params, tx=tx, **kfac_kwargs(kwargs, adaptive)
    )
    state = jax.jit(tx.init, out_shardings=named(mesh, specs))(params)
  batch_sharding = NamedSharding(mesh, batch_spec)
  all_updates = []
  for i in steps:
    x, y = (process_local(batch_sharding, b[i]) for b in batches)
    params, state, updates = step(params, state, x, y)
    all_updates.append(to_host(jax.block_until_ready(updates)))
  return all_updates, params, state


def per_layer(state, kwargs):
  """``{layer: preconditioner}`` of a (host) state of
  ``scale_by_kfac(**kwargs)``, read in the layout its placement packs."""
  return KFACConfig(**kwargs).placement.per_layer(
    factor_dims(state.factors), state.preconditioners
  )


def record(records, label, updates, state, kwargs):
  """Adds the run's updates and K-FAC state (the eigenvectors' sign
  freedom taken out: ``multidevice.comparable``) to ``records``;
  ``kwargs`` are the ``scale_by_kfac`` arguments."""
  kfac_state = (
    state if isinstance(state, kfac_jax.ScaleByKFACState) else (state[0])
  )
  host = to_host(kfac_state)
  for step, tree in enumerate(updates):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      records[f"{label}/updates/{step}{jax.tree_util.keystr(path)}"] = leaf
  for path, leaf in jax.tree_util.tree_flatten_with_path(
    host._replace(preconditioners=None)
  )[0]:
    records[f"{label}/state{jax.tree_util.keystr(path)}"] = leaf
  for name, preconditioner in per_layer(host, kwargs).items():
    for i, array in enumerate(comparable(preconditioner)):
      records[f"{label}/preconditioner/{name}/{i}"] = array


def cases(records):
  """Every strategy on Auto and Explicit axes (on Auto MEM_OPT with FSDP
  kernels), and the adaptive mode; returns the HYBRID_OPT run on Explicit
  axes and its mesh, for the checkpoints."""
  params, _, _, _ = problem()
  replicated = jax.tree.map(lambda _: PartitionSpec(), params)
  kept = None
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((2, 4), AXES, axis_types=(axis_type,) * 2)
    for strategy in STRATEGIES:
      fsdp = axis_type == AxisType.Auto and strategy.name == "MEM_OPT"
      specs = fsdp_specs(params) if fsdp else replicated
      kwargs = dict(mesh_axes=AXES, grad_worker_fraction=strategy)
      if fsdp:
        kwargs["params_partition_specs"] = specs
      with jax.set_mesh(mesh):
        updates, run_params, state = train(
          mesh, kwargs, specs, PartitionSpec("data" if fsdp else AXES)
        )
        record(
          records,
          f"{axis_type.name}/{strategy.name}",
          updates,
          state,
          kfac_kwargs(kwargs, False),
        )
      log(f"{axis_type.name} {strategy.name}")
      if axis_type == AxisType.Explicit and strategy.name == "HYBRID_OPT":
        kept = mesh, kwargs, run_params, state
  mesh = jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Auto,) * 2)
  kwargs = dict(
    compute_method="inverse",
    factor_batch_size=8,
    mesh_axes=AXES,
    grad_worker_fraction="mem_opt",
    params_partition_specs=fsdp_specs(params),
  )
  with jax.set_mesh(mesh):
    updates, _, state = train(
      mesh, kwargs, fsdp_specs(params), PartitionSpec("data"), adaptive=True
    )
    record(records, "adaptive", updates, state, kfac_kwargs(kwargs, True))
  log("adaptive")
  return kept


def target_of(mesh, kwargs, params, preconditioners=True):
  """The abstract ``{"params", "opt_state"}`` on ``mesh``, from the specs."""
  tx = make_tx(kwargs, False)
  specs = {
    "params": jax.tree.map(lambda _: PartitionSpec(), params),
    "opt_state": kfac_jax.get_opt_state_partition_specs(
      params, tx=tx, **kfac_kwargs(kwargs, False)
    ),
  }
  shapes = jax.eval_shape(
    lambda: {"params": params, "opt_state": tx.init(params)}
  )
  target = jax.tree.map(
    lambda shape, sharding: jax.ShapeDtypeStruct(
      shape.shape, shape.dtype, sharding=sharding
    ),
    shapes,
    named(mesh, specs),
  )
  if not preconditioners:
    kfac_state = target["opt_state"][0]._replace(preconditioners=None)
    target["opt_state"] = (kfac_state,) + tuple(target["opt_state"][1:])
  return target


def without_mesh(tree):
  """A target of ``tree``'s shapes without shardings, as ``jax.eval_shape``
  gives one outside a mesh."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def assert_bit_exact(got, expected, label):
  got, expected = jax.tree.map(np.asarray, (got, expected))
  assert jax.tree.structure(got) == jax.tree.structure(expected), label
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), label


def moved_to_comm_opt(records, kept, directory: pathlib.Path):
  """The HYBRID_OPT state saved from every process (with and without its
  preconditioners), restored onto the mesh and without one, and continued
  as COMM_OPT after ``recompute_preconditioners``; returns the saved tree."""
  mesh, kwargs, params, state = kept
  tree = {"params": params, "opt_state": state}
  checkpoint.save(directory / "full", tree)
  checkpoint.save(directory / "small", tree, include_preconditioners=False)
  saved = to_host(tree)
  with jax.set_mesh(mesh):
    on_mesh = checkpoint.restore(
      directory / "full", target_of(mesh, kwargs, params)
    )
    assert_bit_exact(to_host(on_mesh), saved, "restored onto the mesh")
    comm = dict(kwargs, grad_worker_fraction="comm_opt")
    moved = checkpoint.restore(
      directory / "small", target_of(mesh, comm, params, False)
    )
    moved = checkpoint.recompute_preconditioners(moved, DAMPING, **comm)
    updates, _, moved_state = train(
      mesh,
      comm,
      None,
      PartitionSpec(AXES),
      state=moved["opt_state"],
      params=moved["params"],
      steps=[0],
    )
    record(
      records,
      "moved_to_comm_opt",
      updates,
      moved_state,
      kfac_kwargs(comm, False),
    )
  log("saved, restored on the mesh, moved to COMM_OPT")
  # Outside the mesh: every array whole on this process's first device.
  restored = checkpoint.restore(directory / "full", without_mesh(saved))
  for leaf in jax.tree.leaves(restored):
    assert leaf.sharding.device_set == {jax.local_devices()[0]}, leaf.sharding
  assert_bit_exact(restored, saved, "restored without a mesh")
  log("restored without a mesh")
  return saved


def restored_elsewhere(out: pathlib.Path) -> None:
  """One process restores the 2 processes' checkpoints: onto its 8 devices
  bit for bit, then onto 4 devices (MEM_OPT) and onto one, recomputed there
  with the same preconditioners (``comparable`` arrays within the mesh
  tolerance of ``tests/multidevice.py``)."""
  deadline = time.monotonic() + 240
  while not (out / MARKER).exists():
    assert time.monotonic() < deadline, "the distributed run wrote nothing"
    time.sleep(0.5)
  saved = dict(np.load(out / "saved.npz"))
  directory = out / "distributed"
  params, _, _, _ = problem()
  eight = jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Explicit,) * 2)
  kwargs = dict(mesh_axes=AXES, grad_worker_fraction="hybrid_opt")
  with jax.set_mesh(eight):
    full = checkpoint.restore(
      directory / "full", target_of(eight, kwargs, params)
    )
  assert_bit_exact(_flat(to_host(full)), saved, "8 devices of 1 process")
  four = jax.make_mesh(
    (4,),
    ("devices",),
    axis_types=(AxisType.Explicit,),
    devices=jax.devices()[4:],
  )
  four_kwargs = dict(mesh_axes="devices", grad_worker_fraction="mem_opt")
  with jax.set_mesh(four):
    on_four = checkpoint.restore(
      directory / "small", target_of(four, four_kwargs, params, False)
    )
    on_four = checkpoint.recompute_preconditioners(
      on_four, DAMPING, **four_kwargs
    )
    four_layers = per_layer(
      to_host(on_four["opt_state"][0]), kfac_kwargs(four_kwargs, False)
    )
  small = {k: v for k, v in saved.items() if "preconditioners" not in k}
  shapes = jax.eval_shape(
    lambda: {"params": params, "opt_state": make_tx({}, False).init(params)}
  )
  one = checkpoint.restore(directory / "small", shapes)
  one = checkpoint.recompute_preconditioners(one, DAMPING)
  assert_bit_exact(
    {
      k: v
      for k, v in _flat(one).items()
      if "preconditioners" not in k and "rejected" not in k
    },
    {k: v for k, v in small.items() if "rejected" not in k},
    "factors and momentum on one device",
  )
  one_layers = one["opt_state"][0].preconditioners
  for name, preconditioner in one_layers.items():
    for a, b in zip(comparable(four_layers[name]), comparable(preconditioner)):
      np.testing.assert_allclose(a, b, **TOLERANCE, err_msg=name)


def _flat(tree) -> dict[str, np.ndarray]:
  return {
    jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("role", choices=sorted(_ROLE_DEVICES))
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--port", type=int, default=0)
  args = parser.parse_args()
  if args.role == "distributed":
    jax.distributed.initialize(
      coordinator_address=f"localhost:{args.port}",
      num_processes=args.num_processes,
      process_id=args.process_id,
      initialization_timeout=60,
    )
  assert jax.local_device_count() == _ROLE_DEVICES[args.role], jax.devices()
  assert jax.device_count() == 8, jax.devices()
  records = {}
  kept = cases(records)
  directory = args.out / args.role
  saved = moved_to_comm_opt(records, kept, directory)
  if args.role == "distributed" and jax.process_index() == 0:
    np.savez(args.out / "saved.npz", **_flat(saved))
    (args.out / MARKER).touch()
  if args.role == "single":
    restored_elsewhere(args.out)
  np.savez(args.out / f"{args.role}_{jax.process_index()}.npz", **records)
  print("ok", flush=True)


if __name__ == "__main__":
  try:
    main()
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access
