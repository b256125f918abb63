"""Flax NNX: capture, nnx.Optimizer, and agreement with the Linen path."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import kfac_jax
from kfac_jax.factors.batch import batch_factors
from tests import reference
from tests.nnx_common import NnxModel, as_pure, nnx_loss

close = reference.assert_float32_close


class LinenModel(nn.Module):
  """The same network in Linen."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Conv(4, (3,), feature_group_count=2, name="conv")(x))
    h = h.reshape(x.shape[0], -1)
    h = jnp.tanh(nn.Dense(8, name="hidden")(h))
    h = nn.DenseGeneral((2, 3), name="heads")(h).reshape(x.shape[0], -1)
    for i in range(2):
      h = jnp.tanh(nn.Dense(6, name=f"blocks_{i}")(h))
    # BatchNorm over the batch, without the scale/bias params.
    mean = h.mean(0)
    return (h - mean) / jnp.sqrt(h.var(0) + 1e-5)


def _data():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(6, 6, 2)), jnp.float32)
  target = jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)
  return x, target


# reference.assert_float32_close's ``terms`` (roundings a float32 value
# accumulates) for NnxModel's loss on _data(): the contraction lengths of
# conv (3), hidden (24), heads (8) and the blocks (6, 6), BatchNorm's mean
# and variance over the batch (6, 6) and the loss's mean (36).
NNX_FORWARD = 3 + 24 + 8 + 6 + 6 + 6 + 6 + 36
# Its gradients: the same contractions backward, and the kernels' sums over
# the examples (the conv's 6 × 4 positions the longest).
NNX_GRADIENT = 2 * NNX_FORWARD + 24


def test_gradients_stats_and_batch_statistics_match_nnx_value_and_grad():
  x, target = _data()
  model = NnxModel(nnx.Rngs(0))
  twin = nnx.clone(model)
  loss, grads, stats = kfac_jax.value_grad_and_stats(nnx_loss)(model, x, target)
  expected_loss, expected_grads = nnx.value_and_grad(nnx_loss)(twin, x, target)
  close(loss, expected_loss, terms=NNX_FORWARD)
  jax.tree.map(
    lambda a, b: close(a, b, terms=NNX_GRADIENT), grads, expected_grads
  )
  # State the loss updates (BatchNorm running statistics) reaches the model.
  # (1 − momentum)·the batch mean of tanh values (|h| ≤ 1), which cancel.
  close(
    model.norm.mean[...],
    twin.norm.mean[...],
    terms=NNX_FORWARD,
    scale=1 - model.norm.momentum,
  )
  assert not np.allclose(model.norm.mean[...], 0)
  assert sorted(stats) == ["blocks/0", "blocks/1", "conv", "heads", "hidden"]
  np.testing.assert_array_equal(stats["conv"].inputs[0], x)
  assert stats["heads"].output_cotangents[0].shape == (6, 2, 3)
  # The first block's input is known: A = cov([h, 1]) of its recorded input.
  h = np.asarray(stats["blocks/0"].inputs[0], np.float64)
  (a,), _ = batch_factors(stats["blocks/0"])
  rows = np.concatenate([h, np.ones((6, 1))], 1)
  close(a, reference.cov(rows), terms=6 + 1)  # 6 products summed, / 6


def _linen_params(model: NnxModel) -> dict:
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = {name: state[name] for name in ("conv", "hidden", "heads")}
  for i in range(2):
    params[f"blocks_{i}"] = state["blocks"][i]
  return jax.tree.map(jnp.asarray, params)


def _train_nnx_and_linen(
  make_tx,
  nnx_extra=lambda model, x: {},
  linen_extra=lambda linen, x: {},
  damping=0.01,
):
  """Three K-FAC steps through nnx.Optimizer and the same steps in Linen.

  ``make_tx(layer_table)`` builds the transformation; ``nnx_extra(model, x)``
  and ``linen_extra(linen, x)`` give the extra ``update`` arguments. Checks
  losses and params agree, up to each step's gradient rounding through
  K-FAC's conditioning at ``damping`` (the smallest λ of the run); returns
  the NNX optimizer and the Linen state.
  """
  x, target = _data()
  model = NnxModel(nnx.Rngs(0))
  params = _linen_params(model)
  optimizer = nnx.Optimizer(
    model,
    make_tx(kfac_jax.trace_layers(nnx_loss, model, x, target)),
    wrt=nnx.Param,
  )

  @nnx.jit
  def nnx_step(model, optimizer, x, target):
    loss, grads, stats = kfac_jax.value_grad_and_stats(nnx_loss)(
      model, x, target
    )
    optimizer.update(model, grads, kfac_stats=stats, **nnx_extra(model, x))
    return loss

  linen = LinenModel()
  linen_loss = lambda p, x, t: jnp.mean(
    (linen.apply({"params": p}, x) - t) ** 2
  )
  tx = make_tx(kfac_jax.trace_layers(linen_loss, params, x, target))
  state = tx.init(params)

  @jax.jit
  def linen_step(params, state, x, target):
    loss, grads, stats = kfac_jax.value_grad_and_stats(linen_loss)(
      params, x, target
    )
    updates, state = tx.update(
      grads, state, params, kfac_stats=stats, **linen_extra(linen, x)
    )
    return optax.apply_updates(params, updates), state, loss

  terms = 0
  for _ in range(3):
    model_loss = nnx_step(model, optimizer, x, target)
    params, state, loss = linen_step(params, state, x, target)
    condition = reference.kfac_condition(
      reference.kfac_state(state).factors, damping
    )
    # The previous steps' updates, each through K-FAC, then this loss.
    close(model_loss, loss, terms=terms * condition + NNX_FORWARD)
    terms += NNX_GRADIENT
  scale = reference.largest(jax.tree.leaves(params))
  jax.tree.map(
    lambda a, b: close(a, b, terms=terms, condition=condition, scale=scale),
    _linen_params(model),
    params,
  )
  return optimizer, state


def test_nnx_optimizer_matches_the_linen_path():
  """Three K-FAC steps through nnx.Optimizer equal the same steps in Linen."""
  optimizer, _ = _train_nnx_and_linen(
    lambda table: optax.chain(
      kfac_jax.scale_by_kfac(damping=0.01, kl_clip=0.01, layers=table),
      optax.sgd(0.1, momentum=0.9),
    )
  )
  assert sorted(optimizer.opt_state[0].factors) == [
    "blocks/0",
    "blocks/1",
    "conv[0]",
    "conv[1]",
    "heads",
    "hidden",
  ]


def test_a_list_layer_withheld_by_multi_transform_goes_to_adam():
  # With the table, init raised that the table's 'blocks/1' was missing from
  # the params; and 'blocks/1' (an nnx.List index, an int key) was not
  # found masked in the gradients.
  x, target = _data()
  model = NnxModel(nnx.Rngs(0))
  table = kfac_jax.trace_layers(nnx_loss, model, x, target)
  withheld = lambda path: (
    [getattr(k, "key", None) for k in path[:2]] == ["blocks", 1]
  )
  labels = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: "adam" if withheld(path) else "kfac", params
  )
  optimizer = nnx.Optimizer(
    model,
    optax.multi_transform(
      {
        "kfac": kfac_jax.kfac(0.1, damping=0.01, layers=table),
        "adam": optax.adam(1e-3),
      },
      labels,
    ),
    wrt=nnx.Param,
  )
  before = jax.tree.map(jnp.copy, nnx.state(model.blocks[1], nnx.Param))
  _, grads, stats = kfac_jax.value_grad_and_stats(nnx_loss)(model, x, target)
  optimizer.update(model, grads, kfac_stats=stats)
  assert (
    "blocks/1" not in optimizer.opt_state.inner_states["kfac"][0][0].factors
  )
  adam_step, _ = optax.adam(1e-3).update(
    grads["blocks"][1], optax.adam(1e-3).init(before)
  )
  # Adam's elementwise chain (moments, bias corrections, sqrt, divide,
  # scale: 10 roundings) on steps of 1e-3, then the add to the param.
  jax.tree.map(
    lambda a, b: close(a, b, terms=10),
    nnx.state(model.blocks[1], nnx.Param),
    optax.apply_updates(before, adam_step),
  )


def test_full_params_specs_inside_multi_transform_under_nnx_optimizer():
  # nnx.Optimizer hands init Param(MaskedNode()) for the params withheld
  # from K-FAC; the full tree of specs was refused ("must have the structure
  # of the params").
  x, target = _data()
  labels = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: "adam" if path[0].key == "heads" else "kfac", params
  )
  params = as_pure(nnx.state(NnxModel(nnx.Rngs(0)), nnx.Param))
  specs = jax.tree.map(lambda p: PartitionSpec(), params)
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  updated = []
  for kwargs in ({}, dict(params_partition_specs=specs)):
    with jax.set_mesh(mesh):
      model = NnxModel(nnx.Rngs(0))
      table = kfac_jax.trace_layers(
        nnx_loss, model, x, target, skip_layers="^heads$"
      )
      optimizer = nnx.Optimizer(
        model,
        optax.multi_transform(
          {
            "kfac": kfac_jax.scale_by_kfac(
              damping=0.01, skip_layers="^heads$", layers=table, **kwargs
            ),
            "adam": optax.adam(1e-3),
          },
          labels,
        ),
        wrt=nnx.Param,
      )
      _, grads, stats = kfac_jax.value_grad_and_stats(
        nnx_loss, skip_layers="^heads$"
      )(model, x, target)
      optimizer.update(model, grads, kfac_stats=stats)
      updated.append(nnx.state(model, nnx.Param))
  condition = reference.kfac_condition(
    reference.kfac_state(as_pure(optimizer.opt_state)).factors, 0.01
  )
  scale = reference.largest(jax.tree.leaves(updated[0]))
  jax.tree.map(
    lambda a, b: close(
      a, b, terms=NNX_GRADIENT, condition=condition, scale=scale
    ),
    *updated,
  )


def test_gradient_from_stats_through_nnx_matches_the_dense_linen_path():
  """NNX stats give the factored gradients (``hidden``, 25 × 8 at 6 rows,
  is cheaper so); the Linen twin preconditions every layer densely."""
  from_stats = iter([True, False])  # The harness builds NNX's first.
  _train_nnx_and_linen(
    lambda table: optax.chain(
      kfac_jax.scale_by_kfac(
        damping=0.01,
        kl_clip=0.01,
        layers=table,
        gradient_from_stats=next(from_stats),
      ),
      optax.sgd(0.1, momentum=0.9),
    )
  )


def test_adaptive_mode_through_nnx_optimizer_matches_the_linen_path():
  """The adaptive mode's extra ``split_loss`` reaches it through
  ``nnx.Optimizer.update``; its ``outputs_fn`` gets the Param state."""
  _, target = _data()
  squared_error = lambda outputs: jnp.mean((outputs - target) ** 2)

  def nnx_split(model, x):
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    # A copy: its BatchNorm statistics update the copy inside the
    # linearisation's trace, not the model's variables.
    return dict(
      split_loss=kfac_jax.SplitLoss(
        lambda param_state: nnx.merge(graphdef, param_state, rest, copy=True)(
          x
        ),
        squared_error,
      )
    )

  def linen_split(linen, x):
    return dict(
      split_loss=kfac_jax.SplitLoss(
        lambda p: linen.apply({"params": p}, x), squared_error
      )
    )

  optimizer, state = _train_nnx_and_linen(
    lambda table: kfac_jax.scale_by_kfac(
      damping=1.0,
      kl_clip=None,
      compute_method="inverse",
      layers=table,
      adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=2),
    ),
    # λ from 1 moves once (interval 2, 3 steps): ω = 0.95² at the least.
    nnx_split,
    linen_split,
    damping=0.95**2,
  )
  # λ ← λ·ω or λ/ω at most once a step: 3 roundings.
  close(
    optimizer.opt_state.quadratic_model.damping[...],
    state.quadratic_model.damping,
    terms=3,
  )
  assert float(state.quadratic_model.damping) != 1.0


def test_trace_layers_takes_abstract_arguments():
  """``jax.ShapeDtypeStruct`` arguments give the table concrete ones give;
  other arguments (a Python flag here) stay static."""
  x, target = _data()
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, target)]
  model = NnxModel(nnx.Rngs(0))
  assert kfac_jax.trace_layers(
    nnx_loss, model, *abstract
  ) == kfac_jax.trace_layers(nnx_loss, model, x, target)
  linen = LinenModel()

  def linen_loss(params, x, target, squared=True):
    error = linen.apply({"params": params}, x) - target
    return jnp.mean(error**2 if squared else jnp.abs(error))

  params = _linen_params(model)
  table = kfac_jax.trace_layers(linen_loss, params, x, target)
  assert kfac_jax.trace_layers(linen_loss, params, *abstract) == table
  assert (
    kfac_jax.trace_layers(linen_loss, params, *abstract, squared=False) == table
  )


def test_params_partition_specs_through_nnx_optimizer():
  # nnx.Optimizer inits on nnx.Param-wrapped state and updates with bare
  # arrays: no spec tree passed both checks (one failed at init, the other
  # at update).
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
  mesh = jax.make_mesh(
    (1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  updated = []
  for with_specs in (False, True):
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    kw = {}
    if with_specs:
      kw = dict(
        mesh_axes="data",
        params_partition_specs=jax.tree.map(
          lambda p: (
            jax.sharding.PartitionSpec(None, "data")
            if p.ndim == 2
            else jax.sharding.PartitionSpec()
          ),
          as_pure(nnx.state(model, nnx.Param)),
        ),
      )
    with jax.set_mesh(mesh):
      optimizer = nnx.Optimizer(
        model,
        optax.chain(kfac_jax.scale_by_kfac(**kw), optax.sgd(0.1)),
        wrt=nnx.Param,
      )
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model, x)
      optimizer.update(model, grads, kfac_stats=stats)
    updated.append(as_pure(nnx.state(model, nnx.Param)))
  # mean(model(x)**2) over 8 × 8 outputs, the dot of 4, backward; the
  # factors' sums over 8 rows.
  condition = reference.kfac_condition(
    reference.kfac_state(as_pure(optimizer.opt_state)).factors, 0.001
  )
  scale = reference.largest(jax.tree.leaves(updated[0]))
  for plain, sharded in zip(*map(jax.tree.leaves, updated)):
    close(
      sharded, plain, terms=2 * (4 + 64) + 8, condition=condition, scale=scale
    )


def test_repeated_capture_makes_no_new_module_classes():
  """Each call made two nnx.Module subclasses per layer, which Flax's graph
  registry keeps for good: an eager (or retracing) loop leaked ~14 KiB per
  layer and step."""
  import gc  # pylint: disable=g-import-not-at-top

  model, (x, target) = NnxModel(nnx.Rngs(0)), _data()
  capture = kfac_jax.value_grad_and_stats(nnx_loss)

  def module_classes() -> int:
    gc.collect()
    return len(nnx.graph.GRAPH_REGISTRY)

  capture(model, x, target)
  before = module_classes()
  for _ in range(3):
    capture(model, x, target)
  assert module_classes() == before


def test_layers_frozen_by_the_optimizers_wrt_filter_go_in_skip_layers():
  """nnx.Optimizer(wrt=...) over part of the params: the table's other
  layers are missing from the params, and the error says to skip them; with
  them skipped, K-FAC trains the others and the frozen layer stays as it
  was."""
  x, target = _data()
  trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("hidden")))

  def optimizer_of(model, skip):
    table = kfac_jax.trace_layers(nnx_loss, model, x, target, skip_layers=skip)
    return nnx.Optimizer(
      model,
      kfac_jax.scale_by_kfac(damping=0.01, layers=table, skip_layers=skip),
      wrt=trainable,
    )

  with pytest.raises(ValueError, match=r"\['hidden'\].*skip_layers"):
    optimizer_of(NnxModel(nnx.Rngs(0)), None)
  model = NnxModel(nnx.Rngs(0))
  # The pattern names a layer the params lack: no "skips nothing" warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = optimizer_of(model, ["^hidden$"])
  frozen = nnx.state(model, nnx.PathContains("hidden"))
  _, grads, stats = kfac_jax.value_grad_and_stats(
    nnx_loss, skip_layers=["^hidden$"]
  )(model, x, target)
  optimizer.update(model, nnx.state(grads, trainable), kfac_stats=stats)
  assert sorted(optimizer.opt_state.factors) == [
    "blocks/0",
    "blocks/1",
    "conv[0]",
    "conv[1]",
    "heads",
  ]
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.state(model, nnx.PathContains("hidden")),
    frozen,
  )


def test_variable_gradients_passed_to_update_directly_are_their_arrays():
  """tx.update given nnx.state(...) as it is (Variables, not nnx.pure), as
  Flax's functional API passes it: the same update as on the arrays, in
  the Variables (tests/test_nnx_functional.py has the whole loop)."""
  model, (x, target) = NnxModel(nnx.Rngs(0)), _data()
  tx = kfac_jax.scale_by_kfac(
    damping=0.01, layers=kfac_jax.trace_layers(nnx_loss, model, x, target)
  )
  params = nnx.state(model, nnx.Param)
  state = tx.init(params)  # as nnx.Optimizer's init gets them
  _, grads, stats = kfac_jax.value_grad_and_stats(nnx_loss)(model, x, target)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  expected, _ = tx.update(
    as_pure(grads), state, as_pure(params), kfac_stats=stats
  )
  assert isinstance(updates["hidden"]["kernel"], nnx.Param)
  jax.tree.map(np.testing.assert_array_equal, as_pure(updates), expected)
  assert not np.allclose(
    expected["hidden"]["kernel"], as_pure(grads)["hidden"]["kernel"]
  )
