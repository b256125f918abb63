"""Flax NNX layers under lifted transforms (remat, jit, cond, vmap), module
subclasses and NNX objects among the loss's arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfac_jax
from kfac_jax.factors.batch import batch_factors
from tests import reference
from tests.nnx_common import as_pure, nnx_loss

close = reference.assert_float32_close

# Lifted with ``sum(m(x)**2)`` on 4 examples: dense (3), head (3), the sum
# over 4 × 2 outputs; its gradients, backward and the kernels' sums over 4.
LIFTED_FORWARD = 3 + 3 + 8
LIFTED_GRADIENT = 2 * LIFTED_FORWARD + 4


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
      hidden = nnx.cond(
        jnp.sum(x) > -1e9,
        lambda layer, x: layer(x),
        lambda layer, x: -2 * layer(x),
        self.dense,
        x,
      )
    else:
      hidden = getattr(nnx, self.transform)(lambda layer, x: layer(x))(
        self.dense, x
      )
    return self.head(jnp.tanh(hidden))


@pytest.mark.parametrize("transform", ["remat", "jit", "cond"])
def test_a_layer_under_remat_jit_or_cond_is_captured_as_called_plainly(
  transform,
):
  # These were refused (any layer in another trace than the loss), though
  # they pass the probes through like the params; only loops are refused now.
  model = Lifted(nnx.Rngs(0), transform)
  x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 3)), jnp.float32)
  loss_fn = lambda m: jnp.sum(m(x) ** 2)
  table = kfac_jax.trace_layers(loss_fn, model)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  _, plain_grads, plain_stats = kfac_jax.value_grad_and_stats(loss_fn)(
    Lifted(nnx.Rngs(0))
  )
  assert table == kfac_jax.trace_layers(loss_fn, Lifted(nnx.Rngs(0)))
  for name in ("dense", "head"):
    for got, expected in zip(
      batch_factors(stats[name]), batch_factors(plain_stats[name])
    ):
      # The covariance sums the 4 rows' products.
      close(got[0], expected[0], terms=LIFTED_GRADIENT + 4)
  tx = kfac_jax.scale_by_kfac(damping=0.01, layers=table)
  grads, plain_grads = as_pure(grads), as_pure(plain_grads)
  updates, _ = tx.update(grads, tx.init(grads), kfac_stats=stats)
  plain_updates, state = tx.update(
    plain_grads, tx.init(plain_grads), kfac_stats=plain_stats
  )
  tolerance = dict(
    terms=LIFTED_GRADIENT + 4,
    condition=reference.kfac_condition(state.factors, 0.01),
    scale=reference.largest(jax.tree.leaves(plain_updates)),
  )
  jax.tree.map(
    lambda a, b: close(a, b, **tolerance),
    nnx.to_pure_dict(updates),
    nnx.to_pure_dict(plain_updates),
  )
  # Preconditioned (with Variable leaves the update was the gradient).
  assert not np.allclose(updates["dense"]["kernel"], grads["dense"]["kernel"])


def test_a_vmap_around_value_grad_and_stats_over_the_data_only():
  # The model closed over (its params broadcast), the data mapped outside
  # the capture: each batch's statistics are those of its own call (the
  # refusal of a vmap inside the loss subtracts the ones around it).
  # (Lifted plain, not NnxModel: BatchNorm's statistics cannot be updated
  # under the vmap.)
  rng = np.random.default_rng(3)
  xs = jnp.asarray(rng.normal(size=(2, 6, 3)), jnp.float32)
  targets = jnp.asarray(rng.normal(size=(2, 6, 2)), jnp.float32)
  capture = kfac_jax.value_grad_and_stats(nnx_loss)
  model = Lifted(nnx.Rngs(0))
  _, _, stats = jax.vmap(lambda x, t: capture(model, x, t))(xs, targets)
  assert sorted(stats) == ["dense", "head"]
  for index in range(2):
    _, _, alone = capture(model, xs[index], targets[index])
    # nnx_loss's mean over 6 × 2 outputs: dense and head (3 each) forward
    # and backward.
    reference.assert_member_stats(stats, index, alone, terms=2 * (3 + 3 + 12))


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
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5, 3)), jnp.float32)
  loss_fn = lambda m: jnp.mean(m(x) ** 2)
  table = kfac_jax.trace_layers(loss_fn, model)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  assert list(table) == list(stats) == ["head"]
  tx = kfac_jax.scale_by_kfac(layers=table, skip_layers=["^batched$"])
  params, grads = as_pure(nnx.state(model, nnx.Param)), as_pure(grads)
  updates, _ = tx.update(grads, tx.init(params), kfac_stats=stats)
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.to_pure_dict(updates)["batched"],
    nnx.to_pure_dict(grads)["batched"],
  )


def test_skipped_layers_are_left_to_the_chained_optimizer():
  model = Lifted(nnx.Rngs(0), "remat")
  x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 3)), jnp.float32)
  loss_fn = lambda m: jnp.sum(m(x) ** 2)
  skip = ["^dense$"]
  table = kfac_jax.trace_layers(loss_fn, model, skip_layers=skip)
  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn, skip_layers=skip)(
    model
  )
  expected_loss, expected_grads = nnx.value_and_grad(loss_fn)(model)
  assert list(table) == list(stats) == ["head"]
  close(loss, expected_loss, terms=LIFTED_FORWARD)
  jax.tree.map(
    lambda a, b: close(a, b, terms=LIFTED_GRADIENT),
    nnx.to_pure_dict(grads),
    nnx.to_pure_dict(expected_grads),
  )
  optimizer = nnx.Optimizer(
    model,
    kfac_jax.scale_by_kfac(kl_clip=None, layers=table, skip_layers=skip),
    wrt=nnx.Param,
  )
  before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  optimizer.update(model, grads, kfac_stats=stats)
  after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  # scale_by_kfac alone: params move by the (preconditioned) update.
  # Two roundings (the add, the subtraction) of the params' magnitude.
  jax.tree.map(
    lambda a, b, g: close(a - b, g, terms=2, scale=np.abs(b).max()),
    after["dense"],
    before["dense"],
    nnx.to_pure_dict(grads)["dense"],
  )


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
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))

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
    return jnp.mean(
      (model(batch["x"], rngs) - batch["teacher"](batch["x"])) ** 2
    )

  model, rngs, teacher = make()
  twin, twin_rngs, twin_teacher = make()
  for _ in range(2):  # The second call draws new dropout masks.
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(
      model, rngs, {"x": x, "teacher": teacher}
    )
    # nnx.value_and_grad refuses an object shared by the model and another
    # argument; the reference reaches it through the model instead.
    twin_batch = {"x": x, "teacher": twin_teacher}
    expected_loss, expected_grads = (
      nnx.value_and_grad(lambda m, batch: loss_fn(m, m.kept, batch))(
        twin, twin_batch
      )
      if shared
      else nnx.value_and_grad(loss_fn)(twin, twin_rngs, twin_batch)
    )
    # hidden (4), head (8), the mean over 6 × 2 outputs; gradients
    # backward and the kernels' sums over 6 examples.
    close(loss, expected_loss, terms=4 + 8 + 12)
    jax.tree.map(
      lambda a, b: close(a, b, terms=2 * (4 + 8 + 12) + 6),
      nnx.to_pure_dict(grads),
      nnx.to_pure_dict(expected_grads),
    )
    for ours, theirs in [(rngs, twin_rngs), (model.kept, twin.kept)]:
      assert int(ours.dropout.count[...]) == int(theirs.dropout.count[...])
  assert int(rngs.dropout.count[...]) == (4 if shared else 2)
  assert sorted(stats) == ["head", "hidden"]
  assert kfac_jax.trace_layers(
    loss_fn, model, rngs, {"x": x, "teacher": teacher}
  ).keys() == {"head", "hidden"}
