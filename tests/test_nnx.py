"""Flax NNX: capture, nnx.Optimizer, and agreement with the Linen path."""

from __future__ import annotations

import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import kfac_jax
from kfac_jax.factors.batch import batch_factors
from tests import reference

close = reference.assert_float32_close
# flax 0.12.12 renamed nnx.pure to nnx.as_pure (the old name warns); 0.12.2
# has only nnx.pure.
as_pure = getattr(nnx, "as_pure", None) or nnx.pure


class NnxModel(nnx.Module):
  """Grouped conv, Linear, LinearGeneral, a list of Linears, BatchNorm."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(2, 4, (3,), feature_group_count=2, rngs=rngs)
    self.hidden = nnx.Linear(24, 8, rngs=rngs)
    self.heads = nnx.LinearGeneral(8, (2, 3), rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(2)])
    self.norm = nnx.BatchNorm(6, use_running_average=False, use_scale=False,
                              use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.conv(x)).reshape(x.shape[0], -1)
    h = self.heads(jnp.tanh(self.hidden(h))).reshape(x.shape[0], -1)
    for block in self.blocks:
      h = jnp.tanh(block(h))
    return self.norm(h)


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


def _nnx_loss(model, x, target):
  return jnp.mean((model(x) - target) ** 2)


# reference.assert_float32_close's ``terms`` (roundings a float32 value
# accumulates) for NnxModel's loss on _data(): the contraction lengths of
# conv (3), hidden (24), heads (8) and the blocks (6, 6), BatchNorm's mean
# and variance over the batch (6, 6) and the loss's mean (36).
NNX_FORWARD = 3 + 24 + 8 + 6 + 6 + 6 + 6 + 36
# Its gradients: the same contractions backward, and the kernels' sums over
# the examples (the conv's 6 × 4 positions the longest).
NNX_GRADIENT = 2 * NNX_FORWARD + 24
# Lifted with ``sum(m(x)**2)`` on 4 examples: dense (3), head (3), the sum
# over 4 × 2 outputs; its gradients, backward and the kernels' sums over 4.
LIFTED_FORWARD = 3 + 3 + 8
LIFTED_GRADIENT = 2 * LIFTED_FORWARD + 4
# ScannedBlocks with ``sum(m(x)**2)`` on 5 examples: three blocks and the
# head (4 each), the sum over 5 × 2 outputs; gradients as above.
SCAN_FORWARD = 4 * 4 + 10
SCAN_GRADIENT = 2 * SCAN_FORWARD + 5


def test_gradients_stats_and_batch_statistics_match_nnx_value_and_grad():
  x, target = _data()
  model = NnxModel(nnx.Rngs(0))
  twin = nnx.clone(model)
  loss, grads, stats = kfac_jax.value_grad_and_stats(_nnx_loss)(model, x,
                                                                target)
  expected_loss, expected_grads = nnx.value_and_grad(_nnx_loss)(twin, x, target)
  close(loss, expected_loss, terms=NNX_FORWARD)
  jax.tree.map(lambda a, b: close(a, b, terms=NNX_GRADIENT), grads,
               expected_grads)
  # State the loss updates (BatchNorm running statistics) reaches the model.
  # (1 − momentum)·the batch mean of tanh values (|h| ≤ 1), which cancel.
  close(model.norm.mean[...], twin.norm.mean[...], terms=NNX_FORWARD,
        scale=1 - model.norm.momentum)
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


def _train_nnx_and_linen(make_tx, nnx_extra=lambda model, x: {},
                         linen_extra=lambda linen, x: {}, damping=0.01):
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
      model, make_tx(kfac_jax.trace_layers(_nnx_loss, model, x, target)),
      wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x, target):
    loss, grads, stats = kfac_jax.value_grad_and_stats(_nnx_loss)(model, x,
                                                                  target)
    optimizer.update(model, grads, kfac_stats=stats, **nnx_extra(model, x))
    return loss

  linen = LinenModel()
  linen_loss = lambda p, x, t: jnp.mean((linen.apply({"params": p}, x) - t)**2)
  tx = make_tx(kfac_jax.trace_layers(linen_loss, params, x, target))
  state = tx.init(params)

  @jax.jit
  def linen_step(params, state, x, target):
    loss, grads, stats = kfac_jax.value_grad_and_stats(linen_loss)(params, x,
                                                                   target)
    updates, state = tx.update(grads, state, params, kfac_stats=stats,
                               **linen_extra(linen, x))
    return optax.apply_updates(params, updates), state, loss

  terms = 0
  for _ in range(3):
    nnx_loss = nnx_step(model, optimizer, x, target)
    params, state, loss = linen_step(params, state, x, target)
    condition = reference.kfac_condition(
        reference.kfac_state(state).factors, damping)
    # The previous steps' updates, each through K-FAC, then this loss.
    close(nnx_loss, loss, terms=terms * condition + NNX_FORWARD)
    terms += NNX_GRADIENT
  scale = reference.largest(jax.tree.leaves(params))
  jax.tree.map(lambda a, b: close(a, b, terms=terms, condition=condition,
                                  scale=scale), _linen_params(model), params)
  return optimizer, state


def test_nnx_optimizer_matches_the_linen_path():
  """Three K-FAC steps through nnx.Optimizer equal the same steps in Linen."""
  optimizer, _ = _train_nnx_and_linen(lambda table: optax.chain(
      kfac_jax.scale_by_kfac(damping=0.01, kl_clip=0.01, layers=table),
      optax.sgd(0.1, momentum=0.9)))
  assert sorted(optimizer.opt_state[0].factors) == [
      "blocks/0", "blocks/1", "conv[0]", "conv[1]", "heads", "hidden"]


def test_a_list_layer_withheld_by_multi_transform_goes_to_adam():
  # With the table, init raised that the table's 'blocks/1' was missing from
  # the params; and 'blocks/1' (an nnx.List index, an int key) was not
  # found masked in the gradients.
  x, target = _data()
  model = NnxModel(nnx.Rngs(0))
  table = kfac_jax.trace_layers(_nnx_loss, model, x, target)
  withheld = lambda path: [getattr(k, "key", None) for k in path[:2]] == [
      "blocks", 1]
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "adam" if withheld(path) else "kfac", params)
  optimizer = nnx.Optimizer(model, optax.multi_transform(
      {"kfac": kfac_jax.kfac(0.1, damping=0.01, layers=table),
       "adam": optax.adam(1e-3)}, labels), wrt=nnx.Param)
  before = jax.tree.map(jnp.copy, nnx.state(model.blocks[1], nnx.Param))
  _, grads, stats = kfac_jax.value_grad_and_stats(_nnx_loss)(model, x, target)
  optimizer.update(model, grads, kfac_stats=stats)
  assert "blocks/1" not in optimizer.opt_state.inner_states["kfac"][0][
      0].factors
  adam_step, _ = optax.adam(1e-3).update(grads["blocks"][1],
                                         optax.adam(1e-3).init(before))
  # Adam's elementwise chain (moments, bias corrections, sqrt, divide,
  # scale: 10 roundings) on steps of 1e-3, then the add to the param.
  jax.tree.map(lambda a, b: close(a, b, terms=10),
               nnx.state(model.blocks[1], nnx.Param),
               optax.apply_updates(before, adam_step))


def test_full_params_specs_inside_multi_transform_under_nnx_optimizer():
  # nnx.Optimizer hands init Param(MaskedNode()) for the params withheld
  # from K-FAC; the full tree of specs was refused ("must have the structure
  # of the params").
  x, target = _data()
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "adam" if path[0].key == "heads" else "kfac", params)
  params = as_pure(nnx.state(NnxModel(nnx.Rngs(0)), nnx.Param))
  specs = jax.tree.map(lambda p: PartitionSpec(), params)
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  updated = []
  for kwargs in ({}, dict(params_partition_specs=specs)):
    with jax.set_mesh(mesh):
      model = NnxModel(nnx.Rngs(0))
      table = kfac_jax.trace_layers(_nnx_loss, model, x, target,
                                    skip_layers="^heads$")
      optimizer = nnx.Optimizer(model, optax.multi_transform(
          {"kfac": kfac_jax.scale_by_kfac(damping=0.01, skip_layers="^heads$",
                                          layers=table, **kwargs),
           "adam": optax.adam(1e-3)}, labels), wrt=nnx.Param)
      _, grads, stats = kfac_jax.value_grad_and_stats(
          _nnx_loss, skip_layers="^heads$")(model, x, target)
      optimizer.update(model, grads, kfac_stats=stats)
      updated.append(nnx.state(model, nnx.Param))
  condition = reference.kfac_condition(
      reference.kfac_state(as_pure(optimizer.opt_state)).factors, 0.01)
  scale = reference.largest(jax.tree.leaves(updated[0]))
  jax.tree.map(lambda a, b: close(a, b, terms=NNX_GRADIENT,
                                  condition=condition, scale=scale), *updated)


def test_gradient_from_stats_through_nnx_matches_the_dense_linen_path():
  """NNX stats give the factored gradients (``hidden``, 25 × 8 at 6 rows,
  is cheaper so); the Linen twin preconditions every layer densely."""
  from_stats = iter([True, False])  # The harness builds NNX's first.
  _train_nnx_and_linen(lambda table: optax.chain(
      kfac_jax.scale_by_kfac(damping=0.01, kl_clip=0.01, layers=table,
                             gradient_from_stats=next(from_stats)),
      optax.sgd(0.1, momentum=0.9)))


def test_adaptive_mode_through_nnx_optimizer_matches_the_linen_path():
  """The adaptive mode's extra ``split_loss`` reaches it through
  ``nnx.Optimizer.update``; its ``outputs_fn`` gets the Param state."""
  _, target = _data()
  squared_error = lambda outputs: jnp.mean((outputs - target)**2)

  def nnx_split(model, x):
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    # A copy: its BatchNorm statistics update the copy inside the
    # linearisation's trace, not the model's variables.
    return dict(split_loss=kfac_jax.SplitLoss(
        lambda param_state: nnx.merge(graphdef, param_state, rest,
                                      copy=True)(x), squared_error))

  def linen_split(linen, x):
    return dict(split_loss=kfac_jax.SplitLoss(
        lambda p: linen.apply({"params": p}, x), squared_error))

  optimizer, state = _train_nnx_and_linen(
      lambda table: kfac_jax.scale_by_kfac(
          damping=1.0, kl_clip=None, compute_method="inverse", layers=table,
          adaptive=kfac_jax.AdaptiveConfig(damping_adaptation_interval=2)),
      # λ from 1 moves once (interval 2, 3 steps): ω = 0.95² at the least.
      nnx_split, linen_split, damping=0.95**2)
  # λ ← λ·ω or λ/ω at most once a step: 3 roundings.
  close(optimizer.opt_state.quadratic_model.damping[...],
        state.quadratic_model.damping, terms=3)
  assert float(state.quadratic_model.damping) != 1.0


def test_trace_layers_takes_abstract_arguments():
  """``jax.ShapeDtypeStruct`` arguments give the table concrete ones give;
  other arguments (a Python flag here) stay static."""
  x, target = _data()
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, target)]
  model = NnxModel(nnx.Rngs(0))
  assert (kfac_jax.trace_layers(_nnx_loss, model, *abstract) ==
          kfac_jax.trace_layers(_nnx_loss, model, x, target))
  linen = LinenModel()

  def linen_loss(params, x, target, squared=True):
    error = linen.apply({"params": params}, x) - target
    return jnp.mean(error**2 if squared else jnp.abs(error))

  params = _linen_params(model)
  table = kfac_jax.trace_layers(linen_loss, params, x, target)
  assert kfac_jax.trace_layers(linen_loss, params, *abstract) == table
  assert kfac_jax.trace_layers(linen_loss, params, *abstract,
                               squared=False) == table


class Lifted(nnx.Module):
  """A hidden layer under ``nnx.remat``, ``nnx.jit`` or ``nnx.cond`` (None:
  called plainly), then a head."""

  def __init__(self, rngs, transform=None):
    self.transform = transform
    self.dense = nnx.Linear(3, 3, rngs=rngs)
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    if self.transform is None:
      hidden = self.dense(x)
    elif self.transform == "cond":  # the other branch is traced, not run
      hidden = nnx.cond(jnp.sum(x) > -1e9, lambda layer, x: layer(x),
                        lambda layer, x: -2 * layer(x), self.dense, x)
    else:
      hidden = getattr(nnx, self.transform)(lambda layer, x: layer(x))(
          self.dense, x)
    return self.head(jnp.tanh(hidden))


@pytest.mark.parametrize("transform", ["remat", "jit", "cond"])
def test_a_layer_under_remat_jit_or_cond_is_captured_as_called_plainly(
    transform):
  # These were refused (any layer in another trace than the loss), though
  # they pass the probes through like the params; only loops are refused now.
  model = Lifted(nnx.Rngs(0), transform)
  x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 3)), jnp.float32)
  loss_fn = lambda m: jnp.sum(m(x)**2)
  table = kfac_jax.trace_layers(loss_fn, model)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  _, plain_grads, plain_stats = kfac_jax.value_grad_and_stats(loss_fn)(
      Lifted(nnx.Rngs(0)))
  assert table == kfac_jax.trace_layers(loss_fn, Lifted(nnx.Rngs(0)))
  for name in ("dense", "head"):
    for got, expected in zip(batch_factors(stats[name]),
                             batch_factors(plain_stats[name])):
      # The covariance sums the 4 rows' products.
      close(got[0], expected[0], terms=LIFTED_GRADIENT + 4)
  tx = kfac_jax.scale_by_kfac(damping=0.01, layers=table)
  grads, plain_grads = as_pure(grads), as_pure(plain_grads)
  updates, _ = tx.update(grads, tx.init(grads), kfac_stats=stats)
  plain_updates, state = tx.update(plain_grads, tx.init(plain_grads),
                                   kfac_stats=plain_stats)
  tolerance = dict(terms=LIFTED_GRADIENT + 4,
                   condition=reference.kfac_condition(state.factors, 0.01),
                   scale=reference.largest(jax.tree.leaves(plain_updates)))
  jax.tree.map(lambda a, b: close(a, b, **tolerance),
               nnx.to_pure_dict(updates), nnx.to_pure_dict(plain_updates))
  # Preconditioned (with Variable leaves the update was the gradient).
  assert not np.allclose(updates["dense"]["kernel"],
                         grads["dense"]["kernel"])



def test_a_vmap_around_value_grad_and_stats_over_the_data_only():
  # The model closed over (its params broadcast), the data mapped outside
  # the capture: each batch's statistics are those of its own call (the
  # refusal of a vmap inside the loss subtracts the ones around it).
  # (Lifted plain, not NnxModel: BatchNorm's statistics cannot be updated
  # under the vmap.)
  rng = np.random.default_rng(3)
  xs = jnp.asarray(rng.normal(size=(2, 6, 3)), jnp.float32)
  targets = jnp.asarray(rng.normal(size=(2, 6, 2)), jnp.float32)
  capture = kfac_jax.value_grad_and_stats(_nnx_loss)
  model = Lifted(nnx.Rngs(0))
  _, _, stats = jax.vmap(lambda x, t: capture(model, x, t))(xs, targets)
  assert sorted(stats) == ["dense", "head"]
  for index in range(2):
    _, _, alone = capture(model, xs[index], targets[index])
    # _nnx_loss's mean over 6 × 2 outputs: dense and head (3 each) forward
    # and backward.
    reference.assert_member_stats(stats, index, alone,
                                  terms=2 * (3 + 3 + 12))


def test_linear_general_with_a_batch_axis_is_left_out():
  # Its kernel [batch, in, out] is no Kronecker layer (Linen's DenseGeneral
  # with batch_dims, tests/test_capture.py): not captured, and its gradient
  # passes scale_by_kfac unpreconditioned.

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.batched = nnx.LinearGeneral(3, 2, batch_axis={0: 6}, rngs=rngs)
      self.head = nnx.Linear(2, 1, rngs=rngs)

    def __call__(self, x):
      return self.head(self.batched(x))

  model = Model(nnx.Rngs(0))
  assert model.batched.kernel.shape == (6, 3, 2)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5, 3)),
                  jnp.float32)
  loss_fn = lambda m: jnp.mean(m(x)**2)
  table = kfac_jax.trace_layers(loss_fn, model)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  assert list(table) == list(stats) == ["head"]
  tx = kfac_jax.scale_by_kfac(layers=table, skip_layers=["^batched$"])
  params, grads = as_pure(nnx.state(model, nnx.Param)), as_pure(grads)
  updates, _ = tx.update(grads, tx.init(params), kfac_stats=stats)
  jax.tree.map(np.testing.assert_array_equal,
               nnx.to_pure_dict(updates)["batched"],
               nnx.to_pure_dict(grads)["batched"])


def test_skipped_layers_are_left_to_the_chained_optimizer():
  model = Lifted(nnx.Rngs(0), "remat")
  x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 3)), jnp.float32)
  loss_fn = lambda m: jnp.sum(m(x)**2)
  skip = ["^dense$"]
  table = kfac_jax.trace_layers(loss_fn, model, skip_layers=skip)
  loss, grads, stats = kfac_jax.value_grad_and_stats(
      loss_fn, skip_layers=skip)(model)
  expected_loss, expected_grads = nnx.value_and_grad(loss_fn)(model)
  assert list(table) == list(stats) == ["head"]
  close(loss, expected_loss, terms=LIFTED_FORWARD)
  jax.tree.map(lambda a, b: close(a, b, terms=LIFTED_GRADIENT),
               nnx.to_pure_dict(grads), nnx.to_pure_dict(expected_grads))
  optimizer = nnx.Optimizer(
      model, kfac_jax.scale_by_kfac(kl_clip=None, layers=table,
                                    skip_layers=skip), wrt=nnx.Param)
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  optimizer.update(model, grads, kfac_stats=stats)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  # scale_by_kfac alone: params move by the (preconditioned) update.
  # Two roundings (the add, the subtraction) of the params' magnitude.
  jax.tree.map(lambda a, b, g: close(a - b, g, terms=2,
                                     scale=np.abs(b).max()),
               after["dense"], before["dense"],
               nnx.to_pure_dict(grads)["dense"])


class ScaledLinear(nnx.Linear):
  """An nnx.Linear subclass that overrides ``__call__`` around the base call."""

  def __call__(self, x):
    return 2.0 * super().__call__(x) + 1.0


def test_a_subclass_overriding_call_is_captured_at_the_base_call():
  # The probes apply at nnx.Linear's call, the linear layer, not at the
  # override's output; the subclass's name still names the layer type.

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.scaled = ScaledLinear(4, 3, rngs=rngs)

    def __call__(self, x):
      return self.scaled(x)

  model = Model(nnx.Rngs(0))
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 4))
  y = rng.normal(size=(5, 3))

  def loss_fn(model):
    out = model(jnp.asarray(x, jnp.float32))
    return 0.5 * jnp.mean(jnp.sum((out - y)**2, -1))

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  layer = stats["scaled"]
  assert len(layer.inputs) == 1
  assert layer.signature.module_type == "ScaledLinear"
  kernel = np.asarray(model.scaled.kernel[...], np.float64)
  bias = np.asarray(model.scaled.bias[...], np.float64)
  out = 2.0 * (x @ kernel + bias) + 1.0
  cotangent = 2.0 * (out - y) / len(x)
  close(layer.inputs[0], x, terms=1)  # x rounded to float32
  # The dot of 4, the bias, ·2, +1, −y, ·2/5: 9 roundings.
  close(layer.output_cotangents[0], cotangent, terms=9)
  assert type(model.scaled) is ScaledLinear  # the user's model is untouched


class DropoutModel(nnx.Module):
  """Dropout drawing from an ``nnx.Rngs`` given to the call, and from one the
  model keeps (the same object, in the shared case)."""

  def __init__(self, rngs: nnx.Rngs, kept: nnx.Rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.head = nnx.Linear(8, 2, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.kept = kept

  def __call__(self, x, rngs):
    h = self.drop(jnp.tanh(self.hidden(x)), rngs=rngs)
    return self.head(self.drop(h, rngs=self.kept))


@pytest.mark.parametrize("shared", [False, True])
def test_nnx_objects_among_the_arguments_are_copied_and_updated(shared):
  # An nnx.Rngs argument (dropout) raised TraceContextError: its counter was
  # advanced inside the capture's trace. A second model (a frozen teacher)
  # among the arguments is neither differentiated nor captured.
  x = jnp.asarray(np.random.default_rng(1).normal(size=(6, 4)), jnp.float32)

  def make():
    call_rngs = nnx.Rngs(dropout=1)
    kept = call_rngs if shared else nnx.Rngs(dropout=2)
    teacher = nnx.Linear(4, 2, rngs=nnx.Rngs(3))
    return DropoutModel(nnx.Rngs(0), kept), call_rngs, teacher

  def loss_fn(model, rngs, batch):
    return jnp.mean((model(batch["x"], rngs) - batch["teacher"](batch["x"]))
                    ** 2)

  model, rngs, teacher = make()
  twin, twin_rngs, twin_teacher = make()
  for _ in range(2):  # The second call draws new dropout masks.
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
        model, rngs, {"x": x, "teacher": teacher})
    # nnx.value_and_grad refuses an object shared by the model and another
    # argument; the reference reaches it through the model instead.
    twin_batch = {"x": x, "teacher": twin_teacher}
    expected_loss, expected_grads = (
        nnx.value_and_grad(lambda m, batch: loss_fn(m, m.kept, batch))(
            twin, twin_batch) if shared else
        nnx.value_and_grad(loss_fn)(twin, twin_rngs, twin_batch))
    # hidden (4), head (8), the mean over 6 × 2 outputs; gradients
    # backward and the kernels' sums over 6 examples.
    close(loss, expected_loss, terms=4 + 8 + 12)
    jax.tree.map(lambda a, b: close(a, b, terms=2 * (4 + 8 + 12) + 6),
                 nnx.to_pure_dict(grads), nnx.to_pure_dict(expected_grads))
    for ours, theirs in [(rngs, twin_rngs), (model.kept, twin.kept)]:
      assert int(ours.dropout.count[...]) == int(theirs.dropout.count[...])
  assert int(rngs.dropout.count[...]) == (4 if shared else 2)
  assert sorted(stats) == ["head", "hidden"]
  assert kfac_jax.trace_layers(loss_fn, model, rngs,
                               {"x": x, "teacher": teacher}).keys() == {
                                   "head", "hidden"}


def two_stacked_linears(rngs: nnx.Rngs, features_in: int,
                        features_out: int) -> nnx.Linear:
  """Two ``nnx.Linear`` members stacked on axis 0 by ``nnx.vmap``."""

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return nnx.Linear(features_in, features_out, rngs=rngs)

  return create(rngs)


class Ensemble(nnx.Module):
  """Two Linear members stacked by nnx.vmap, applied by nnx.vmap to one
  batch; ``per_example``: each member by a jax.vmap over the examples."""

  def __init__(self, rngs: nnx.Rngs, per_example: bool = False):
    self.per_example = per_example
    self.members = two_stacked_linears(rngs, 4, 3)

  def __call__(self, x):
    apply = ((lambda m, x: jax.vmap(m)(x)) if self.per_example else
             (lambda m, x: m(x)))
    return nnx.vmap(apply, in_axes=(0, None))(self.members, x)


class ScanBlock(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


class ScannedBlocks(nnx.Module):
  """Three blocks stacked by ``nnx.vmap`` on ``axis`` and run by
  ``nnx.scan``, Flax's scan-over-layers pattern; or, ``unrolled``, the same
  blocks as an ``nnx.List`` called in a loop."""

  def __init__(self, rngs: nnx.Rngs, axis: int = 0, unrolled: bool = False):
    self.axis, self.unrolled = axis, unrolled

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=axis)
    def create(rngs):
      return ScanBlock(rngs)

    self.blocks = (nnx.List([ScanBlock(rngs) for _ in range(3)])
                   if unrolled else create(rngs))
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x, block_axes=None, per_example=False):
    """``block_axes``: the scan's in_axes for the blocks (default
    ``axis``); ``per_example``: apply each block by a ``jax.vmap`` over the
    batch inside the scan (the block's params broadcast)."""
    if self.unrolled:
      for block in self.blocks:
        x = block(x)
      return self.head(x)

    @nnx.scan(in_axes=(nnx.Carry, self.axis if block_axes is None else
                       block_axes), out_axes=nnx.Carry)
    def body(x, block):
      return jax.vmap(block)(x) if per_example else block(x)

    return self.head(body(x, self.blocks))


def _unroll(model: ScannedBlocks) -> ScannedBlocks:
  """The same weights as three separate layers."""
  unrolled = ScannedBlocks(nnx.Rngs(1), unrolled=True)
  stacked = nnx.state(model.blocks, nnx.Param)
  for i, block in enumerate(unrolled.blocks):
    nnx.update(block, jax.tree.map(lambda p: p[i], stacked))
  nnx.update(unrolled.head, nnx.state(model.head))
  return unrolled


def test_nnx_scan_over_stacked_layers_matches_the_unrolled_layers():
  # Layers under nnx.scan were refused. Their probes are now Params of the
  # copy, which the scan slices like the kernel: each block's inputs and
  # cotangents come out stacked, and K-FAC's update of each slice is that
  # of the same layer unrolled.
  model = ScannedBlocks(nnx.Rngs(0))
  unrolled = _unroll(model)
  x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 4)), jnp.float32)
  loss_fn = lambda m, x: jnp.sum(m(x)**2)
  table = kfac_jax.trace_layers(loss_fn, model, x)
  assert table["blocks/lin"].kernel_shape == (3, 4, 4)
  assert table["blocks/lin"].stack_ndim == 1
  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model, x)
  expected_loss, expected_grads = nnx.value_and_grad(loss_fn)(model, x)
  # The scan and the loop accumulate in different orders (1.5e-7 apart on
  # O(1) values seen on an AVX2 machine).
  close(loss, expected_loss, terms=SCAN_FORWARD)
  jax.tree.map(lambda a, b: close(a, b, terms=SCAN_GRADIENT),
               nnx.to_pure_dict(grads), nnx.to_pure_dict(expected_grads))
  unrolled_loss, unrolled_grads, unrolled_stats = (
      kfac_jax.value_grad_and_stats(loss_fn)(unrolled, x))
  close(unrolled_loss, loss, terms=SCAN_FORWARD)
  for i in range(3):
    for field in ("inputs", "output_cotangents"):
      close(getattr(stats["blocks/lin"], field)[0][i],
            getattr(unrolled_stats[f"blocks/{i}/lin"], field)[0],
            terms=SCAN_GRADIENT)

  tx = lambda table: kfac_jax.scale_by_kfac(damping=0.01, layers=table)
  grads, unrolled_grads = as_pure(grads), as_pure(unrolled_grads)
  updates, state = tx(table).update(grads, tx(table).init(grads),
                                    kfac_stats=stats)
  unrolled_table = kfac_jax.trace_layers(loss_fn, unrolled, x)
  unrolled_updates, _ = tx(unrolled_table).update(
      unrolled_grads, tx(unrolled_table).init(unrolled_grads),
      kfac_stats=unrolled_stats)
  updates, unrolled_updates = (nnx.to_pure_dict(updates),
                               nnx.to_pure_dict(unrolled_updates))
  # The factors sum the 5 rows' products.
  tolerance = dict(terms=SCAN_GRADIENT + 5,
                   condition=reference.kfac_condition(state.factors, 0.01),
                   scale=reference.largest(jax.tree.leaves(unrolled_updates)))
  for i in range(3):
    jax.tree.map(lambda a, b: close(a[i], b, **tolerance),
                 updates["blocks"]["lin"],
                 unrolled_updates["blocks"][i]["lin"])
  jax.tree.map(lambda a, b: close(a, b, **tolerance), updates["head"],
               unrolled_updates["head"])
  # Preconditioned (with Variable leaves the update was the gradient).
  assert not np.allclose(updates["head"]["kernel"],
                         nnx.to_pure_dict(grads)["head"]["kernel"])


def test_nnx_scan_over_layers_applied_twice_records_two_calls():
  # Each scan is its own trace, and calls were numbered per trace: both
  # scans were call 0, the stats held one call, the sum of both.
  model = ScannedBlocks(nnx.Rngs(0))
  unrolled = _unroll(model)
  rng = np.random.default_rng(6)
  x1, x2 = (jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
            for _ in range(2))
  loss_fn = lambda m: jnp.sum(m(x1)**2) + jnp.sum(jnp.sin(m(x2)))
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  _, _, unrolled_stats = kfac_jax.value_grad_and_stats(loss_fn)(unrolled)
  layer = stats["blocks/lin"]
  assert len(layer.inputs) == len(stats["head"].inputs) == 2
  for call in range(2):
    for i in range(3):
      for field in ("inputs", "output_cotangents"):
        # Two calls' losses, each as SCAN_FORWARD, forward and backward.
        close(getattr(layer, field)[call][i],
              getattr(unrolled_stats[f"blocks/{i}/lin"], field)[call],
              terms=SCAN_GRADIENT)


def test_nnx_probes_are_one_param_per_array_and_follow_argument_objects():
  # A loss reading every Param (an L2 term over nnx.iter_graph) read the
  # probes' Param as a tuple: TypeError. A layer reached through an argument
  # that is the model's own submodule was rebuilt by the shape pass (an NNX
  # module is a pytree): left out of the stats, or an IndexError.
  model = ScannedBlocks(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(7).normal(size=(5, 4)), jnp.float32)

  def loss_fn(m, head, x):
    l2 = sum(jnp.sum(v[...]**2) for _, v in nnx.iter_graph(m)
             if isinstance(v, nnx.Param))
    return jnp.sum(m(x)**2) + jnp.sum(head(x)**2) + 1e-3 * l2

  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model,
                                                              model.head, x)
  # nnx.value_and_grad refuses the shared head; reach it through the model.
  expected_loss, expected_grads = nnx.value_and_grad(
      lambda m, x: loss_fn(m, m.head, x))(model, x)
  # SCAN_FORWARD, head(x)'s sum (4 + 10) and the L2 sum over 70 params.
  close(loss, expected_loss, terms=SCAN_FORWARD + 14 + 70)
  jax.tree.map(lambda a, b: close(a, b, terms=SCAN_GRADIENT + 14 + 70),
               nnx.to_pure_dict(grads), nnx.to_pure_dict(expected_grads))
  assert len(stats["head"].inputs) == 2
  np.testing.assert_array_equal(stats["head"].inputs[1], x)
  assert set(kfac_jax.trace_layers(loss_fn, model, model.head, x)) == {
      "blocks/lin", "head"}


def test_nnx_scan_that_slices_the_kernel_but_not_the_probes_is_refused():
  # A StateAxes picking the kernel by path broadcast the probes: a jax
  # error about scan carries or custom_vjp shapes, naming no layer.
  model = ScannedBlocks(nnx.Rngs(0))
  x = jnp.ones((5, 4))
  by_path = nnx.StateAxes({nnx.Any(nnx.PathContains("kernel"),
                                   nnx.PathContains("bias")): 0, ...: None})
  with pytest.raises(ValueError, match="'blocks/lin'.*probes.*Probes.*"
                     "skip_layers"):
    kfac_jax.value_grad_and_stats(
        lambda m: jnp.sum(m(x, block_axes=by_path)**2))(model)


def test_nnx_scan_over_layers_inside_a_further_loop_is_refused():
  # The outer loop carries the model, so each of its steps reused the
  # scanned layer's probes: its stats came out summed over those steps.
  model = ScannedBlocks(nnx.Rngs(0))
  x = jnp.ones((5, 4))

  def blocks(m, h):
    return nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, 0),
                    out_axes=nnx.Carry)(h, m.blocks)

  def loss_fn(m):
    _, h = nnx.fori_loop(0, 2, lambda i, c: (c[0], blocks(*c)), (m, x))
    return jnp.sum(h**2)

  with pytest.raises(ValueError,
                     match="'blocks/lin' runs inside a loop of 2 steps.*"
                     r"stack axes \(3,\).*skip_layers"):
    kfac_jax.value_grad_and_stats(loss_fn)(model)


class RecurrentCells(nnx.Module):
  """A cell ``nnx.scan`` broadcasts over time steps; ``ensemble``: two
  cells stacked by ``nnx.vmap`` and sliced by one inside each step."""

  def __init__(self, rngs: nnx.Rngs, ensemble: bool = False):
    self.ensemble = ensemble
    self.cell = (two_stacked_linears(rngs, 4, 4) if ensemble else
                 nnx.Linear(4, 4, rngs=rngs))

  def __call__(self, xs):

    @nnx.scan(in_axes=(nnx.Carry, None, 0), out_axes=(nnx.Carry, 0))
    def step(h, cell, x):
      if self.ensemble:
        h = nnx.vmap(lambda cell, h: jnp.tanh(cell(h) + x))(cell, h)
      else:
        h = jnp.tanh(cell(h) + x)
      return h, h

    shape = (2, *xs.shape[1:]) if self.ensemble else xs.shape[1:]
    return step(jnp.zeros(shape), self.cell, xs)[1]


@pytest.mark.parametrize("ensemble", [False, True])
def test_a_cell_broadcast_over_scan_steps_is_refused(ensemble):
  # The ensemble's stack axis is its vmap's, not the scan's: its inputs and
  # cotangents came out summed over the time steps, unnoticed.
  model = RecurrentCells(nnx.Rngs(0), ensemble)
  xs = jnp.asarray(np.random.default_rng(2).normal(size=(5, 3, 4)),
                   jnp.float32)
  with pytest.raises(ValueError, match="'cell' runs inside a loop of 5 "
                     r"steps.*stack axes \(\).*skip_layers"):
    kfac_jax.value_grad_and_stats(lambda m: jnp.sum(m(xs)**2))(model)


def test_nnx_stacked_layer_under_a_jax_vmap_over_its_inputs_is_refused():
  # Its sliced params broadcast over a per-example vmap inside the scan:
  # inputs and cotangents came out summed over the batch.
  model = ScannedBlocks(nnx.Rngs(0))
  x = jnp.ones((5, 4))
  with pytest.raises(ValueError, match="'blocks/lin'.*jax.vmap.*skip_layers"):
    kfac_jax.value_grad_and_stats(
        lambda m: jnp.sum(m(x, per_example=True)**2))(model)


def test_a_per_example_vmap_inside_the_loss_is_refused_in_an_ensemble_too():
  # In an nnx.vmap ensemble the kernel is itself a vmap tracer, and an inner
  # per-example jax.vmap (the member's params broadcast) went unnoticed:
  # each member's stats came out summed over the examples.
  x = jnp.ones((5, 4))
  loss_fn = lambda m: jnp.sum(jnp.sin(m(x)))
  with pytest.raises(ValueError, match="'members'.*jax.vmap.*skip_layers"):
    kfac_jax.value_grad_and_stats(loss_fn)(Ensemble(nnx.Rngs(0), True))
  # A plain layer: the per-example message, not the lifted-transform one.
  with pytest.raises(ValueError, match="'hidden'.*maps its inputs"):
    kfac_jax.value_grad_and_stats(
        lambda m: jnp.sum(jax.vmap(m.hidden)(jnp.ones((6, 24)))))(
            NnxModel(nnx.Rngs(0)))
  # A vmap around value_grad_and_stats, the params broadcast: each
  # micro-batch's stats, as without the vmap.
  model = ScannedBlocks(nnx.Rngs(0))
  batches = jnp.asarray(np.random.default_rng(9).normal(size=(2, 5, 4)),
                        jnp.float32)
  scan_loss = lambda m, x: jnp.sum(m(x)**2)
  _, _, stats = nnx.vmap(kfac_jax.value_grad_and_stats(scan_loss),
                         in_axes=(None, 0))(model, batches)
  for i in range(2):
    _, _, alone = kfac_jax.value_grad_and_stats(scan_loss)(model, batches[i])
    # 2.35e-5 relative on a cotangent of 0.0165 (3.9e-7 absolute) was seen
    # on a fresh machine: the rounding of the largest entries.
    close(stats["blocks/lin"].output_cotangents[0][i],
          alone["blocks/lin"].output_cotangents[0], terms=SCAN_GRADIENT)


def test_nnx_scan_over_layers_stacked_on_another_axis_is_refused():
  model = ScannedBlocks(nnx.Rngs(0), axis=1)
  x = jnp.ones((5, 4))
  with pytest.raises(ValueError, match=r"'blocks/lin'.*\(4, 3, 4\).*\(4, 4\)"
                     ".*out_axes=0.*skip_layers"):
    kfac_jax.value_grad_and_stats(lambda m: jnp.sum(m(x)**2))(model)


def test_an_nnx_vmap_ensemble_is_captured_per_member():
  """Members stacked by nnx.vmap and applied by nnx.vmap to one batch: each
  member's inputs and cotangents, stacked, as the dense computation gives."""
  model = Ensemble(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(5).normal(size=(5, 4)), jnp.float32)
  loss_fn = lambda m: jnp.sum(jnp.sin(m(x)))
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  kernel, bias = model.members.kernel[...], model.members.bias[...]
  outputs = jnp.einsum("bi,eio->ebo", x, kernel) + bias[:, None]
  layer = stats["members"]
  assert layer.signature.stack_ndim == 1
  np.testing.assert_array_equal(layer.inputs[0], jnp.stack([x, x]))
  # The outputs' dot of 4 and the bias (5 roundings of |outputs|, moving
  # the cosine by as much), and cos's own.
  close(layer.output_cotangents[0], jnp.cos(outputs), terms=5 + 1,
        scale=max(1.0, float(jnp.abs(outputs).max())))


def test_params_partition_specs_through_nnx_optimizer():
  # nnx.Optimizer inits on nnx.Param-wrapped state and updates with bare
  # arrays: no spec tree passed both checks (one failed at init, the other
  # at update).
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)
  loss_fn = lambda model, x: jnp.mean(model(x)**2)
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  updated = []
  for with_specs in (False, True):
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    kw = {}
    if with_specs:
      kw = dict(mesh_axes="data", params_partition_specs=jax.tree.map(
          lambda p: jax.sharding.PartitionSpec(None, "data") if p.ndim == 2
          else jax.sharding.PartitionSpec(),
          as_pure(nnx.state(model, nnx.Param))))
    with jax.set_mesh(mesh):
      optimizer = nnx.Optimizer(
          model, optax.chain(kfac_jax.scale_by_kfac(**kw), optax.sgd(0.1)),
          wrt=nnx.Param)
      _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model, x)
      optimizer.update(model, grads, kfac_stats=stats)
    updated.append(as_pure(nnx.state(model, nnx.Param)))
  # mean(model(x)**2) over 8 × 8 outputs, the dot of 4, backward; the
  # factors' sums over 8 rows.
  condition = reference.kfac_condition(
      reference.kfac_state(as_pure(optimizer.opt_state)).factors, 0.001)
  scale = reference.largest(jax.tree.leaves(updated[0]))
  for plain, sharded in zip(*map(jax.tree.leaves, updated)):
    close(sharded, plain, terms=2 * (4 + 64) + 8, condition=condition,
          scale=scale)


def test_repeated_capture_makes_no_new_module_classes():
  """Each call made two nnx.Module subclasses per layer, which Flax's graph
  registry keeps for good: an eager (or retracing) loop leaked ~14 KiB per
  layer and step."""
  import gc  # pylint: disable=g-import-not-at-top
  model, (x, target) = NnxModel(nnx.Rngs(0)), _data()
  capture = kfac_jax.value_grad_and_stats(_nnx_loss)

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
    table = kfac_jax.trace_layers(_nnx_loss, model, x, target,
                                  skip_layers=skip)
    return nnx.Optimizer(
        model, kfac_jax.scale_by_kfac(damping=0.01, layers=table,
                                      skip_layers=skip), wrt=trainable)

  with pytest.raises(ValueError, match=r"\['hidden'\].*skip_layers"):
    optimizer_of(NnxModel(nnx.Rngs(0)), None)
  model = NnxModel(nnx.Rngs(0))
  # The pattern names a layer the params lack: no "skips nothing" warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = optimizer_of(model, ["^hidden$"])
  frozen = nnx.state(model, nnx.PathContains("hidden"))
  _, grads, stats = kfac_jax.value_grad_and_stats(
      _nnx_loss, skip_layers=["^hidden$"])(model, x, target)
  optimizer.update(model, nnx.state(grads, trainable), kfac_stats=stats)
  assert sorted(optimizer.opt_state.factors) == [
      "blocks/0", "blocks/1", "conv[0]", "conv[1]", "heads"]
  jax.tree.map(np.testing.assert_array_equal, nnx.state(
      model, nnx.PathContains("hidden")), frozen)


def test_variable_gradients_passed_to_update_directly_are_their_arrays():
  """tx.update given nnx.state(...) as it is (Variables, not nnx.pure), as
  Flax's functional API passes it: the same update as on the arrays, in
  the Variables (tests/test_nnx_functional.py has the whole loop)."""
  model, (x, target) = NnxModel(nnx.Rngs(0)), _data()
  tx = kfac_jax.scale_by_kfac(damping=0.01, layers=kfac_jax.trace_layers(
      _nnx_loss, model, x, target))
  params = nnx.state(model, nnx.Param)
  state = tx.init(params)  # as nnx.Optimizer's init gets them
  _, grads, stats = kfac_jax.value_grad_and_stats(_nnx_loss)(model, x, target)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  expected, _ = tx.update(as_pure(grads), state, as_pure(params),
                          kfac_stats=stats)
  assert isinstance(updates["hidden"]["kernel"], nnx.Param)
  jax.tree.map(np.testing.assert_array_equal, as_pure(updates), expected)
  assert not np.allclose(expected["hidden"]["kernel"],
                         as_pure(grads)["hidden"]["kernel"])
