"""Checkpoint programs for 8 simulated CPU devices (``tests/multidevice.py``
runs them): a state moved to another strategy and device count, and one
restored under another assignment of its packed rows."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import kfac_jax
from tests import multidevice
from tests.multidevice import (
  TOLERANCE,
  comparable,
  conv_problem,
  per_layer,
  train,
)


def restore_target(params, mesh, kwargs):
  """The abstract ``scale_by_kfac(**kwargs)`` state to restore onto ``mesh``."""
  tx = kfac_jax.scale_by_kfac(**kwargs)
  specs = kfac_jax.get_opt_state_partition_specs(params, **kwargs)
  return jax.tree.map(
    lambda shape, spec: jax.ShapeDtypeStruct(
      shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec)
    ),
    jax.eval_shape(tx.init, params),
    specs,
    is_leaf=lambda s: isinstance(s, PartitionSpec),
  )


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
    _, state, _ = train(
      params, loss_fn, batches, saved_kwargs, eight, PartitionSpec("devices")
    )
  directory = tempfile.mkdtemp() + "/ckpt"
  checkpoint_lib.save(directory, state, include_preconditioners=False)

  def target_on(mesh, kwargs):
    return restore_target(params, mesh, kwargs)

  def restored_on(mesh, kwargs):
    with jax.set_mesh(mesh):
      restored = checkpoint_lib.restore(directory, target_on(mesh, kwargs))
      restored = checkpoint_lib.recompute_preconditioners(
        restored, 0.01, **kwargs
      )
      return restored, per_layer(restored, kwargs)

  four = jax.make_mesh(
    (4,), ("devices",), axis_types=(axis_type,), devices=jax.devices()[4:]
  )
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
      with_rows, target_on(four, four_kwargs)._replace(preconditioners=None)
    )
    assert dropped.preconditioners is None
    dropped = checkpoint_lib.recompute_preconditioners(
      dropped, 0.01, **four_kwargs
    )
    dropped_layers = per_layer(dropped, four_kwargs)
  moved, moved_layers = restored_on(four, four_kwargs)
  one = jax.make_mesh(
    (1,), ("devices",), axis_types=(axis_type,), devices=jax.devices()[:1]
  )
  _, reference_layers = restored_on(one, dict(mesh_axes="devices"))
  assert moved.preconditioners.rows.shape[0] == 4
  for x, y in zip(
    jax.tree.leaves(moved.factors), jax.tree.leaves(state.factors)
  ):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
  for name in reference_layers:
    for layers in (moved_layers, dropped_layers):
      for x, y in zip(
        comparable(layers[name]), comparable(reference_layers[name])
      ):
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
  loss_fn = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)

  def step(kwargs, params, state, i):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x[i], y[i])
    return jax.jit(kfac_jax.scale_by_kfac(**kwargs).update)(
      grads, state, params, kfac_stats=stats
    )

  return params, step


def saved_and_restored(state, params, mesh, kwargs):
  """``state`` saved by ``kfac_jax.checkpoint`` and restored as the state of
  ``scale_by_kfac(**kwargs)`` on ``mesh``."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from kfac_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top

  directory = tempfile.mkdtemp() + "/ckpt"
  checkpoint_lib.save(directory, state)
  return checkpoint_lib.restore(directory, restore_target(params, mesh, kwargs))


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
    assert (
      restored.preconditioners.rows.shape == state.preconditioners.rows.shape
    )
    try:
      per_layer(restored, moved_kwargs)
      raise AssertionError("read rows packed under another assignment")
    except ValueError as error:
      assert "another layout" in str(error), error

    updates, moved = step(moved_kwargs, params, restored, 3)
    # Reference: the factors decomposed under the new layout, then a
    # decomposition step.
    recomputed = checkpoint_lib.recompute_preconditioners(
      restored, 0.01, mesh_axes="devices", assignment_strategy="memory"
    )
    reference_updates, reference = step(
      dict(moved_kwargs, inv_update_steps=1), params, recomputed, 3
    )
    for a, b in zip(
      jax.tree.leaves(updates), jax.tree.leaves(reference_updates)
    ):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOLERANCE)
    layers, reference_layers = (
      per_layer(s, moved_kwargs) for s in (moved, reference)
    )
  for name in reference_layers:
    for a, b in zip(
      comparable(layers[name]), comparable(reference_layers[name])
    ):
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
  base = dict(
    damping=0.01,
    mesh_axes="devices",
    inv_update_steps=2,
    eigenvalue_correction=True,
    accumulation_steps=2,
    factor_decay=0.5,
  )
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
    expected = (
      np.asarray(layers[block].activation_eigenvalues)[:, None]
      * np.asarray(layers[block].gradient_eigenvalues)[None, :]
    )
    # One float32 product of the same two eigenvalues on either side.
    np.testing.assert_allclose(
      np.asarray(scales), expected, rtol=np.finfo(np.float32).eps, err_msg=block
    )


PROGRAMS = {
  f.__name__: f
  for f in (checkpoint, restored_layout, restored_ekfac_accumulation)
}


if __name__ == "__main__":
  multidevice.main(PROGRAMS)
