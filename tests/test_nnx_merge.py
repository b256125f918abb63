"""A loss that merges the ``nnx.State`` it is given is captured.

Flax's functional idiom: ``graphdef, params = nnx.split(model, nnx.Param)``
and ``loss(params, x, y)`` builds ``model = nnx.merge(graphdef, params)``
itself. ``value_grad_and_stats(loss)(params, x, y)`` then gives what
``jax.value_and_grad`` gives, and the stats of the model-passing form,
``value_grad_and_stats(model_loss)(nnx.merge(graphdef, params), x, y)``,
which ``tests/test_nnx.py`` checks against the Linen path and float64
references.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kfac_jax
from kfac_jax.capture import nnx_merge

# Where the two forms run different float32 programs (a jitted step, a
# layer under nnx.remat), their results agree to rounding: float32 eps times
# a factor for the few dozen accumulated products (contractions of <= 36
# terms, three steps of factors and inverses).
RTOL = 64 * float(jnp.finfo(jnp.float32).eps)


class Mlp(nnx.Module):
  """Linear layers, two of them in an nnx.List."""

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(5, 7, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(7, 7, rngs=rngs) for _ in range(2)])
    self.l2 = nnx.Linear(7, 3, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs=None):
    h = self.l1(x)
    for block in self.blocks:
      h = jnp.tanh(block(h))
    if rngs is not None:
      h = self.drop(h, rngs=rngs)
    return self.l2(h)


class ConvNet(nnx.Module):
  """A grouped 2-D convolution and a Linear head."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(2, 4, (3, 3), feature_group_count=2, rngs=rngs)
    self.head = nnx.Linear(4 * 6 * 6, 3, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.conv(x))
    return self.head(h.reshape(h.shape[0], -1))


MODELS = {"linear": (Mlp, (16, 5)), "conv": (ConvNet, (8, 6, 6, 2))}


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def model_loss(model, x, y):
  return cross_entropy(model(x), y)


def problem(kind):
  model_class, x_shape = MODELS[kind]
  graphdef, params = nnx.split(model_class(nnx.Rngs(0)), nnx.Param)
  x = jax.random.normal(jax.random.key(1), x_shape)
  y = jnp.arange(x_shape[0]) % 3

  def merged_loss(params, x, y):
    return cross_entropy(nnx.merge(graphdef, params)(x), y)

  return graphdef, params, x, y, merged_loss


def assert_close(got, want):
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL),
    got,
    want,
  )


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_merged_state_gives_the_model_forms_stats(kind):
  graphdef, params, x, y, merged_loss = problem(kind)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "captured no layer"
    loss, grads, stats = kfac_jax.value_grad_and_stats(merged_loss)(
      params, x, y
    )
  want_loss, want_grads = jax.value_and_grad(merged_loss)(params, x, y)
  _, _, model_stats = kfac_jax.value_grad_and_stats(model_loss)(
    nnx.merge(graphdef, params), x, y
  )

  assert isinstance(grads, nnx.State)
  assert set(stats) == set(model_stats) and len(stats) >= 2
  # Eagerly, both forms run the same operations on the same arrays.
  np.testing.assert_array_equal(loss, want_loss)
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)
  jax.tree.map(np.testing.assert_array_equal, stats, model_stats)
  first = "l1" if kind == "linear" else "conv"
  if kind == "linear":  # a Dense layer's recorded input is its input
    np.testing.assert_array_equal(stats[first].inputs[0], x)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_steps_on_the_merged_state_equal_the_model_forms(kind):
  graphdef, params, x, y, merged_loss = problem(kind)
  # The grouped convolution needs the layer table: read off the State.
  table = kfac_jax.trace_layers(merged_loss, params, x, y)
  tx = kfac_jax.kfac(0.1, damping=0.01, inv_update_steps=2, layers=table)

  @jax.jit
  def merged_step(params, opt_state):
    _, grads, stats = kfac_jax.value_grad_and_stats(merged_loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  @jax.jit
  def model_step(params, opt_state):
    _, grads, stats = kfac_jax.value_grad_and_stats(model_loss)(
      nnx.merge(graphdef, params), x, y
    )
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  runs = []
  for step in (merged_step, model_step):
    current, opt_state = params, tx.init(params)
    for _ in range(3):
      current, opt_state = step(current, opt_state)
    runs.append((current, opt_state))
  assert_close(nnx.to_pure_dict(runs[0][0]), nnx.to_pure_dict(runs[1][0]))
  assert_close(runs[0][1][0].factors, runs[1][1][0].factors)
  assert len(runs[0][1][0].factors) == sum(
    layer.num_blocks for layer in table.values()
  )


def test_trace_layers_of_the_state_equals_the_models():
  graphdef, params, x, y, merged_loss = problem("linear")
  model = nnx.merge(graphdef, params)
  for skip in (None, ["^blocks"], ["Linear"]):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # ["Linear"] leaves no layer
      merged = kfac_jax.trace_layers(
        merged_loss, params, x, y, skip_layers=skip
      )
      from_model = kfac_jax.trace_layers(
        model_loss, model, x, y, skip_layers=skip
      )
    assert merged == from_model, skip
    assert merged.skipped_classes == from_model.skipped_classes, skip
  assert set(merged.skipped_classes) == {"l1", "blocks/0", "blocks/1", "l2"}


@pytest.mark.parametrize("transform", [nnx.jit, nnx.remat])
def test_layers_under_nnx_transforms_inside_the_loss(transform):
  """The probes reach the calls whole, as the params do."""
  graphdef, params, x, y, merged_loss = problem("linear")
  forward = transform(lambda model, x: model(x))
  _, grads, stats = kfac_jax.value_grad_and_stats(
    lambda p, x, y: cross_entropy(forward(nnx.merge(graphdef, p), x), y)
  )(params, x, y)
  _, want_grads, want_stats = kfac_jax.value_grad_and_stats(merged_loss)(
    params, x, y
  )
  assert set(stats) == set(want_stats)
  assert_close(stats, want_stats)
  assert_close(grads, want_grads)


def test_an_rngs_argument_is_updated_as_in_the_model_form():
  graphdef, params, x, y, _ = problem("linear")
  rngs, model_rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
  _, _, stats = kfac_jax.value_grad_and_stats(
    lambda p, rngs, x, y: cross_entropy(nnx.merge(graphdef, p)(x, rngs=rngs), y)
  )(params, rngs, x, y)
  _, _, want = kfac_jax.value_grad_and_stats(
    lambda model, rngs, x, y: cross_entropy(model(x, rngs=rngs), y)
  )(nnx.merge(graphdef, params), model_rngs, x, y)
  jax.tree.map(np.testing.assert_array_equal, stats, want)
  assert (
    int(rngs.dropout.count.get_value())
    == int(model_rngs.dropout.count.get_value())
    == 1
  )


class TiedLm(nnx.Module):
  """Logits through the embedding's ``attend``: the table is not captured."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(11, 4, rngs=rngs)
    self.mix = nnx.LinearGeneral(4, (2, 2), rngs=rngs)

  def __call__(self, tokens):
    h = self.mix(self.embed(tokens)).reshape(*tokens.shape, 4)
    return self.embed.attend(h)


def test_attend_and_linear_general_as_in_the_model_form():
  graphdef, params = nnx.split(TiedLm(nnx.Rngs(0)), nnx.Param)
  tokens = jnp.arange(12).reshape(3, 4) % 11

  def merged(params, tokens):
    return cross_entropy(nnx.merge(graphdef, params)(tokens), tokens)

  _, _, stats = kfac_jax.value_grad_and_stats(merged)(params, tokens)
  _, _, want = kfac_jax.value_grad_and_stats(
    lambda model, tokens: cross_entropy(model(tokens), tokens)
  )(nnx.merge(graphdef, params), tokens)
  assert set(stats) == set(want) == {"mix"}
  jax.tree.map(np.testing.assert_array_equal, stats, want)


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(self.linear(h))


class Stacked(nnx.Module):
  """Three blocks stacked by nnx.vmap, run by nnx.scan."""

  def __init__(self, rngs: nnx.Rngs):

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.blocks = make(rngs)

  def __call__(self, x):

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(block, h):
      return block(h)

    return run(self.blocks, x)


def test_stacked_layers_are_refused_naming_the_model_form():
  """The probes cannot be sliced with the kernel when they do not ride in
  the model; the model-passing form slices them (tests/test_nnx_stacked.py)."""
  graphdef, params = nnx.split(Stacked(nnx.Rngs(0)), nnx.Param)
  loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)
  with pytest.raises(
    ValueError,
    match=r"'blocks/linear'.*\(3, 4, 4\).*Give "
    r"value_grad_and_stats the model.*skip_layers",
  ):
    kfac_jax.value_grad_and_stats(loss)(params, jnp.ones((2, 4)))
  _, _, stats = kfac_jax.value_grad_and_stats(
    lambda model, x: jnp.sum(model(x) ** 2)
  )(nnx.merge(graphdef, params), jnp.ones((2, 4)))
  assert set(stats) == {"blocks/linear"}


def test_the_callers_state_and_flax_classes_are_left_as_they_were():
  graphdef, params, x, y, merged_loss = problem("linear")
  methods = {cls: dict(vars(cls)) for cls in nnx_merge.ROUTED_METHODS}
  kfac_jax.value_grad_and_stats(merged_loss)(params, x, y)
  kfac_jax.trace_layers(merged_loss, params, x, y)
  for cls, before in methods.items():
    for method in nnx_merge.ROUTED_METHODS[cls]:
      assert vars(cls)[method] is before[method], (cls, method)
  variables = jax.tree.leaves(
    params, is_leaf=lambda v: isinstance(v, nnx.Variable)
  )
  assert variables and all(
    nnx_merge.TAG not in v.get_metadata() for v in variables
  )
  # A tagged kernel reaches its route only while a capture routes calls.
  tagged = nnx_merge.tagged(params, lambda *args, **kwargs: 1 / 0)
  logits = nnx.merge(graphdef, tagged)(x)
  np.testing.assert_array_equal(logits, nnx.merge(graphdef, params)(x))
