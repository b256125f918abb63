"""kfac_jax.checkpoint: Orbax round trips, left-out preconditioners, meshes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax import checkpoint
from tests import multidevice, reference
from tests.checkpoint_problems import (
  DAMPING,
  MLP,
  RECOMPUTE_TERMS,
  STEP_TERMS,
  assert_bit_exact,
  batches,
  loss_fn,
  make_training,
  train,
)


@pytest.mark.parametrize(
  "kfac_kwargs",
  [
    dict(compute_method="eigen", inv_update_steps=2),
    # Saved mid-accumulation (micro_step 1 of 2) with bfloat16 inverses.
    dict(
      compute_method="inverse", accumulation_steps=2, inv_dtype=jnp.bfloat16
    ),
    dict(compute_method="eigen", factor_dtype=jnp.bfloat16),
    # The subspace solver's counter and EKFAC's scaling are state too.
    dict(
      compute_method="eigen",
      eigen_solver="subspace",
      eigenvalue_correction=True,
    ),
  ],
  ids=[
    "eigen",
    "inverse-accumulating-bf16",
    "eigen-bf16-factors",
    "eigen-subspace-ekfac",
  ],
)
def test_round_trip_is_bit_exact_and_training_continues(tmp_path, kfac_kwargs):
  params, tx, step = make_training(**kfac_kwargs)
  data = batches()
  params, opt_state = train(step, params, tx.init(params), data, 3)
  if opt_state[0].accumulator is not None:
    assert int(opt_state[0].accumulator.micro_step) == 1
  saved = {"params": params, "opt_state": opt_state}
  checkpoint.save(tmp_path / "ckpt", saved)
  restored = checkpoint.restore(
    tmp_path / "ckpt", jax.eval_shape(lambda: saved)
  )
  assert_bit_exact(restored, saved)

  # Training goes on from the restored tree exactly as without the break.
  later = [next(data) for _ in range(3)]
  uninterrupted = train(step, params, opt_state, iter(later), 3)
  resumed = train(
    step, restored["params"], restored["opt_state"], iter(later), 3
  )
  assert_bit_exact(resumed, uninterrupted)


def test_round_trip_of_the_bare_state(tmp_path):
  params, _, _ = make_training()
  tx = kfac_jax.scale_by_kfac(compute_eigenvalue_outer_product=False)
  state = tx.init(params)
  checkpoint.save(tmp_path / "ckpt", state)
  restored = checkpoint.restore(
    tmp_path / "ckpt", jax.eval_shape(tx.init, params)
  )
  assert isinstance(restored, kfac_jax.ScaleByKFACState)
  assert_bit_exact(restored, state)


@pytest.mark.parametrize(
  "compute_method, outer_product",
  [("eigen", True), ("eigen", False), ("inverse", True)],
)
def test_left_out_preconditioners_are_recomputed_from_the_factors(
  tmp_path, compute_method, outer_product
):
  config = dict(
    compute_method=compute_method,
    compute_eigenvalue_outer_product=outer_product,
  )
  # With inv_update_steps=1 every saved preconditioner was decomposed by the
  # update from the saved factors: the reference for the recomputed ones.
  params, tx, step = make_training(inv_update_steps=1, **config)
  data = batches()
  params, opt_state = train(step, params, tx.init(params), data, 2)
  saved = {"params": params, "opt_state": opt_state}
  checkpoint.save(tmp_path / "ckpt", saved, include_preconditioners=False)
  restored = checkpoint.restore(
    tmp_path / "ckpt", jax.eval_shape(lambda: saved)
  )
  assert restored["opt_state"][0].preconditioners is None
  assert_bit_exact(restored["opt_state"][0].factors, opt_state[0].factors)

  restored = checkpoint.recompute_preconditioners(restored, DAMPING, **config)
  state = restored["opt_state"][0]
  assert int(state.rejected_decompositions) == 0
  assert jax.tree.structure(state) == jax.tree.structure(opt_state[0])
  for a, b in zip(
    jax.tree.leaves(state.preconditioners),
    jax.tree.leaves(opt_state[0].preconditioners),
  ):
    assert a.dtype == b.dtype
    reference.assert_float32_close(a, b, terms=RECOMPUTE_TERMS)

  # The next update decomposes before it preconditions, so the run resumes
  # bit for bit.
  later = [next(data) for _ in range(2)]
  assert_bit_exact(
    train(step, restored["params"], restored["opt_state"], iter(later), 2),
    train(step, params, opt_state, iter(later), 2),
  )


def test_a_full_save_restores_onto_a_target_without_preconditioners(tmp_path):
  # Restoring onto preconditioners=None (another device count or strategy
  # next) reads only the factors; recomputing gives back the saved ones.
  params, tx, step = make_training(inv_update_steps=1)
  params, opt_state = train(step, params, tx.init(params), batches(), 2)
  checkpoint.save(tmp_path / "ckpt", opt_state)
  target = jax.eval_shape(lambda: opt_state)
  target = (target[0]._replace(preconditioners=None),) + tuple(target[1:])
  restored = checkpoint.restore(tmp_path / "ckpt", target)
  assert restored[0].preconditioners is None
  assert_bit_exact(restored[0].factors, opt_state[0].factors)
  assert_bit_exact(restored[1:], opt_state[1:])
  recomputed = checkpoint.recompute_preconditioners(restored, DAMPING)
  for a, b in zip(
    jax.tree.leaves(recomputed[0].preconditioners),
    jax.tree.leaves(opt_state[0].preconditioners),
  ):
    reference.assert_float32_close(a, b, terms=RECOMPUTE_TERMS)


def test_recompute_reads_a_damping_schedule_at_the_states_count():
  params, _, _ = make_training()
  tx = kfac_jax.scale_by_kfac(damping=DAMPING)
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(
    lambda p: loss_fn(MLP(), p, *next(batches()))
  )(params)
  for _ in range(3):
    _, state = tx.update(grads, state, params, kfac_stats=stats)
  state = state._replace(preconditioners=None)
  schedule = lambda step: jnp.where(step < 3, 1.0, 1e-3)
  at_count = checkpoint.recompute_preconditioners(state, schedule)
  constant = checkpoint.recompute_preconditioners(state, 1e-3)
  at_start = checkpoint.recompute_preconditioners(state, 1.0)
  assert_bit_exact(at_count.preconditioners, constant.preconditioners)
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(at_count.preconditioners),
      jax.tree.leaves(at_start.preconditioners),
    )
  )


def test_recomputed_at_a_count_where_the_damping_schedule_is_bad():
  # update rejects the decompositions at such a count; recompute used the
  # bad λ (a negative one: mixed-sign preconditioners, uphill steps).
  params, _, _ = make_training()
  tx = kfac_jax.scale_by_kfac()
  state = tx.init(params)._replace(count=jnp.int32(2), preconditioners=None)
  schedule = lambda step: jnp.where(step == 2, -0.05, DAMPING)
  recomputed = checkpoint.recompute_preconditioners(state, schedule)
  assert int(recomputed.rejected_decompositions) == 2
  assert_bit_exact(recomputed.preconditioners, tx.init(params).preconditioners)
  later = checkpoint.recompute_preconditioners(
    state._replace(count=jnp.int32(3)), schedule
  )
  assert int(later.rejected_decompositions) == 0


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_non_finite_recomputed_decomposition_falls_back_to_init(compute_method):
  params, _, _ = make_training()
  tx = kfac_jax.scale_by_kfac(compute_method=compute_method)
  state = tx.init(params)
  factors = dict(state.factors)
  factors["head"] = factors["head"]._replace(
    gradient_factor=jnp.full((3, 3), jnp.nan)
  )
  recomputed = checkpoint.recompute_preconditioners(
    state._replace(factors=factors, preconditioners=None),
    DAMPING,
    compute_method=compute_method,
  )
  assert int(recomputed.rejected_decompositions) == 1
  assert_bit_exact(
    recomputed.preconditioners["head"], state.preconditioners["head"]
  )
  assert all(
    np.all(np.isfinite(x))
    for x in jax.tree.leaves(recomputed.preconditioners["hidden"])
  )


MULTIDEVICE_PROGRAM = textwrap.dedent("""
    import sys

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec
    from jax.sharding import SingleDeviceSharding

    from kfac_jax import checkpoint
    from tests.checkpoint_problems import (
      assert_bit_exact, batches, make_training)

    directory, axis_type = sys.argv[1], getattr(AxisType, sys.argv[2])
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))

    params, tx, step = make_training(inv_update_steps=2)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    data = batches()
    for _ in range(2):
      x, y = jax.device_put(next(data), batch_sharding)
      assert len(x.addressable_shards) == 8
      params, opt_state = step(params, opt_state, x, y)
      # One step in flight: simulated devices can deadlock in collectives.
      jax.block_until_ready(opt_state)
    trained = {"params": params, "opt_state": opt_state}
    for leaf in jax.tree.leaves(trained):
      assert leaf.sharding.is_fully_replicated and len(leaf.devices()) == 8
    checkpoint.save(directory + "/ckpt", trained)
    np.savez(directory + "/expected.npz",
             *[np.asarray(leaf) for leaf in jax.tree.leaves(trained)])

    four = NamedSharding(
        jax.make_mesh((4,), ("data",), axis_types=(axis_type,),
                      devices=jax.devices()[4:]),
        PartitionSpec())
    one = SingleDeviceSharding(jax.devices()[3])
    abstract = jax.eval_shape(lambda: trained)
    for sharding in (four, one):
      target = jax.tree.map(
          lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
          abstract)
      restored = checkpoint.restore(directory + "/ckpt", target)
      assert_bit_exact(restored, trained)
      for leaf in jax.tree.leaves(restored):
        assert leaf.sharding == sharding, (leaf.sharding, sharding)

    # The README's recipe: the target from eval_shape under the mesh (on
    # Explicit axes its shardings are over the abstract mesh, which Orbax
    # cannot place on; on Auto axes it has none, and the leaves went to one
    # device, which the next step under the mesh refused).
    with jax.set_mesh(mesh):
      target = jax.eval_shape(lambda: {"params": params,
                                       "opt_state": tx.init(params)})
      restored = checkpoint.restore(directory + "/ckpt", target)
      assert_bit_exact(restored, trained)
      for leaf in jax.tree.leaves(restored):
        assert leaf.sharding.is_fully_replicated and len(leaf.devices()) == 8
      x, y = jax.device_put(next(data), batch_sharding)
      assert_bit_exact(step(restored["params"], restored["opt_state"], x, y),
                       step(params, opt_state, x, y))
    print("ok")
""")


@pytest.mark.multidevice
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_saved_on_eight_devices_restores_on_four_and_on_one(
  tmp_path, axis_type
):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
    [sys.executable, "-c", MULTIDEVICE_PROGRAM, str(tmp_path), axis_type],
    env=multidevice.eight_device_env(),
    cwd=root,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert result.returncode == 0, result.stderr[-5000:]
  assert result.stdout.strip().endswith("ok")

  # And in this (single-device) process, onto the default device.
  params, tx, _ = make_training(inv_update_steps=2)
  target = jax.eval_shape(
    lambda: {"params": params, "opt_state": tx.init(params)}
  )
  restored = checkpoint.restore(tmp_path / "ckpt", target)
  expected = np.load(tmp_path / "expected.npz")
  leaves = jax.tree.leaves(restored)
  assert len(leaves) == len(expected.files)
  for i, leaf in enumerate(leaves):
    assert leaf.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    saved = expected[f"arr_{i}"]
    assert (leaf.dtype, leaf.shape) == (saved.dtype, saved.shape)
    assert np.asarray(leaf).tobytes() == saved.tobytes()


def test_adaptive_state_round_trip_and_recompute(tmp_path):
  """The adaptive mode's state (λ, δ) survives; recomputing uses its own λ."""
  model = MLP()
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 5)))["params"]
  tx = kfac_jax.scale_by_kfac(
    damping=1.0,
    kl_clip=None,
    compute_method="inverse",
    inv_update_steps=1,
    adaptive=kfac_jax.AdaptiveConfig(),
  )

  @jax.jit
  def step(params, opt_state, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p: loss_fn(model, p, x, y)
    )(params)
    split = kfac_jax.SplitLoss(
      lambda p: model.apply({"params": p}, x),
      lambda logits: optax.softmax_cross_entropy_with_integer_labels(
        logits, y
      ).mean(),
    )
    updates, opt_state = tx.update(
      grads, opt_state, params, kfac_stats=stats, split_loss=split
    )
    return optax.apply_updates(params, updates), opt_state

  data = batches()
  # Step 0 adapts λ and step 1 decomposes with the adapted λ, which the saved
  # state holds: the reference for the recomputed inverses.
  params, opt_state = train(step, params, tx.init(params), data, 2)
  assert float(opt_state.quadratic_model.damping) != 1.0
  saved = {"params": params, "opt_state": opt_state}
  checkpoint.save(tmp_path / "ckpt", saved, include_preconditioners=False)
  restored = checkpoint.restore(
    tmp_path / "ckpt", jax.eval_shape(lambda: saved)
  )
  assert_bit_exact(
    restored["opt_state"].quadratic_model, opt_state.quadratic_model
  )
  restored = checkpoint.recompute_preconditioners(
    restored, damping=123.0, compute_method="inverse"
  )
  for a, b in zip(
    jax.tree.leaves(restored["opt_state"].preconditioners),
    jax.tree.leaves(opt_state.preconditioners),
  ):
    reference.assert_float32_close(a, b, terms=RECOMPUTE_TERMS)
  later = [next(data) for _ in range(2)]
  assert_bit_exact(
    train(step, restored["params"], restored["opt_state"], iter(later), 2),
    train(step, params, opt_state, iter(later), 2),
  )

  # A λ out of range (a corrupted checkpoint, or other bounds) is clipped as
  # update clips it when the AdaptiveConfig is given: NaN to max_damping.
  config = kfac_jax.AdaptiveConfig(max_damping=10.0)
  corrupted = restored["opt_state"]._replace(
    quadratic_model=restored["opt_state"].quadratic_model._replace(
      damping=jnp.asarray(jnp.nan, jnp.float32)
    )
  )
  clipped = corrupted._replace(
    quadratic_model=corrupted.quadratic_model._replace(
      damping=jnp.asarray(10.0, jnp.float32)
    )
  )
  recompute = functools.partial(
    checkpoint.recompute_preconditioners, damping=1.0, compute_method="inverse"
  )
  assert_bit_exact(
    recompute(corrupted, adaptive=config).preconditioners,
    recompute(clipped).preconditioners,
  )
  assert int(recompute(corrupted).rejected_decompositions) > int(
    corrupted.rejected_decompositions
  )


def test_nnx_model_and_optimizer_resume_bit_exact(tmp_path):
  """The README's NNX recipe: save the model's state and
  nnx.pure(optimizer.opt_state), load them into a fresh model and optimizer,
  and training continues as the uninterrupted run."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from tests.nnx_common import as_pure  # pylint: disable=g-import-not-at-top

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(5, 8, rngs=rngs)
      self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.hidden(x)))

  def nnx_loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  def build():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(
      model,
      kfac_jax.kfac(0.1, damping=DAMPING, inv_update_steps=2),
      wrt=nnx.Param,
    )

  @nnx.jit
  def step(model, optimizer, x, y):
    _, grads, stats = kfac_jax.value_grad_and_stats(nnx_loss)(model, x, y)
    optimizer.update(model, grads, kfac_stats=stats)

  data = batches()
  model, optimizer = build()
  for _ in range(3):  # Saved between decompositions.
    step(model, optimizer, *next(data))
  checkpoint.save(
    tmp_path / "ckpt",
    {"model": nnx.state(model), "opt_state": as_pure(optimizer.opt_state)},
  )

  resumed_model, resumed_optimizer = build()
  target = jax.eval_shape(
    lambda: {
      "model": nnx.state(resumed_model),
      "opt_state": as_pure(resumed_optimizer.opt_state),
    }
  )
  restored = checkpoint.restore(tmp_path / "ckpt", target)
  nnx.update(resumed_model, restored["model"])
  jax.tree.map(
    lambda variable, value: variable.set_value(value),
    resumed_optimizer.opt_state,
    restored["opt_state"],
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )

  for x, y in [next(data) for _ in range(3)]:
    step(model, optimizer, x, y)
    step(resumed_model, resumed_optimizer, x, y)
  assert_bit_exact(as_pure(nnx.state(resumed_model)), as_pure(nnx.state(model)))
  assert_bit_exact(
    as_pure(resumed_optimizer.opt_state), as_pure(optimizer.opt_state)
  )


class _UnfingerprintedRows(NamedTuple):
  """``ShardedPreconditioners`` as saved before its ``layout_fingerprint``."""

  rows: jax.Array


def test_rows_saved_without_a_layout_fingerprint_are_decomposed_again(tmp_path):
  """Packed rows from a checkpoint of an earlier version (no fingerprint)
  restore with fingerprint −1, which no layout has: the next update (no
  decomposition step) equals a decomposition step of the recomputed state.
  They did not restore at all; the advice was to re-save them."""
  mesh = jax.make_mesh((1,), ("devices",))
  with jax.set_mesh(mesh):
    params, tx, step = make_training(mesh_axes="devices", inv_update_steps=2)
    data = batches()
    params, opt_state = train(step, params, tx.init(params), data, 3)
    kfac_state = opt_state[0]
    old = (
      kfac_state._replace(
        preconditioners=_UnfingerprintedRows(kfac_state.preconditioners.rows)
      ),
    ) + tuple(opt_state[1:])
    checkpoint.save(tmp_path / "ckpt", {"params": params, "opt_state": old})
    restored = checkpoint.restore(
      tmp_path / "ckpt",
      jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)}),
    )
    preconditioners = restored["opt_state"][0].preconditioners
    assert int(preconditioners.layout_fingerprint) == -1
    assert_bit_exact(preconditioners.rows, kfac_state.preconditioners.rows)

    x, y = next(data)
    _, reference_step = make_training(mesh_axes="devices", inv_update_steps=1)[
      1:
    ]
    recomputed = checkpoint.recompute_preconditioners(
      restored["opt_state"], DAMPING, mesh_axes="devices"
    )
    condition = reference.kfac_condition(kfac_state.factors, DAMPING)
    for a, b in zip(
      jax.tree.leaves(step(params, restored["opt_state"], x, y)),
      jax.tree.leaves(reference_step(params, recomputed, x, y)),
    ):
      reference.assert_float32_close(
        a, b, terms=STEP_TERMS, condition=condition
      )
