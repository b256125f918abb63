"""Linen layers under transforms inside the loss (vmap, scan, loops, remat,
retraced jits): captured per call or slice where the statistics can be told
apart, refused with the layer's name where they cannot."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from tests import reference

close = reference.assert_float32_close


class TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="out")(jnp.tanh(nn.Dense(4, name="hidden")(x)))


# reference.assert_float32_close's ``terms`` for TwoDense on
# _two_dense_setup's data: hidden's dot of 3 and out's of 4, the loss's sum
# or mean over 6 × 2 outputs; its gradients and cotangents, backward and the
# kernels' sums over 6 examples.
TWO_DENSE_FORWARD = 3 + 4 + 12


TWO_DENSE_GRADIENT = 2 * TWO_DENSE_FORWARD + 6


def _two_dense_setup(seed=0):
  model = TwoDense()
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
  params = model.init(jax.random.PRNGKey(seed), x)["params"]
  return model, x, y, params


@pytest.mark.parametrize("retrace", ["cond", "grad"])
def test_a_linen_model_traced_twice_in_the_loss_is_refused_naming_why(retrace):
  # Per-trace call numbering cannot tell the two traces' calls apart; the
  # message blamed only nn.scan and RNN cells.
  model, x, y, params = _two_dense_setup()
  apply = lambda p: model.apply({"params": p}, x)

  def loss_fn(params):
    if retrace == "cond":
      out = jax.lax.cond(x[0, 0] > 0, apply, lambda p: -apply(p), params)
    else:
      inner = jax.grad(lambda p: jnp.sum(apply(p)))(params)
      out = apply(params) + 0.0 * jnp.sum(inner["out"]["bias"])
    return 0.5 * jnp.mean((out - y) ** 2)

  with pytest.raises(
    ValueError,
    match="runs in 2 separate traces.*lax.cond.*jax.grad.*skip_layers",
  ):
    kfac_jax.value_grad_and_stats(loss_fn)(params)


def test_a_vmap_inside_the_loss_over_broadcast_params_is_refused():
  # Broadcast probes would sum each layer's rows over the mapped axis.
  model, x, y, params = _two_dense_setup()

  def per_example(params, xi, yi):
    return 0.5 * jnp.sum((model.apply({"params": params}, xi) - yi) ** 2)

  def loss_fn(params, x, y):
    return jnp.mean(jax.vmap(per_example, in_axes=(None, 0, 0))(params, x, y))

  with pytest.raises(ValueError, match="'hidden' runs under a jax.vmap"):
    kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)


class _ScanBody(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(4, name="dense")(h)), None


class _Lifted(nn.Module):
  """A Dense inside a lifted transform: scanned, remat'ed or an ensemble."""

  lift: str
  params_axis: int = 0

  @nn.compact
  def __call__(self, x):
    if self.lift == "scan":
      return nn.scan(
        _ScanBody,
        variable_axes={"params": self.params_axis},
        split_rngs={"params": True},
        length=3,
      )(name="layers")(x, None)[0]
    if self.lift == "remat":
      return nn.remat(nn.Dense)(4, name="dense")(x)
    return nn.vmap(
      nn.Dense,
      in_axes=None,
      out_axes=0,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      axis_size=2,
    )(4, name="ensemble")(x)


@pytest.mark.parametrize("lift", ["scan", "remat", "vmap"])
def test_a_vmap_inside_the_loss_over_a_lifted_layer_is_refused(lift):
  # Inside the lifted transform the layer's inputs are its own tracers, not
  # the loss's vmap's: the refusal once missed it, and A and G came out
  # summed over the mapped axis (relative errors of 5 to 17).
  model = _Lifted(lift)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(params):
    return jnp.mean(
      jax.vmap(lambda xi: model.apply({"params": params}, xi))(x) ** 2
    )

  with pytest.raises(ValueError, match="runs under a jax.vmap"):
    kfac_jax.value_grad_and_stats(loss_fn)(params)
  # Over the whole batch the same model is captured.
  _, _, stats = kfac_jax.value_grad_and_stats(
    lambda params: jnp.mean(model.apply({"params": params}, x) ** 2)
  )(params)
  assert len(stats) == 1


def test_scanned_params_on_another_axis_are_refused_naming_the_layer():
  # Kernel [in, length, out]: read as stacked on its leading axis it once
  # gave a wrong table, then a TypeError naming no layer.
  model = _Lifted("scan", params_axis=1)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  assert params["layers"]["dense"]["kernel"].shape == (4, 3, 4)
  loss_fn = lambda params: jnp.mean(model.apply({"params": params}, x) ** 2)
  for capture in (
    lambda: kfac_jax.trace_layers(loss_fn, params),
    lambda: kfac_jax.value_grad_and_stats(loss_fn)(params),
  ):
    with pytest.raises(
      ValueError, match=r"'layers/dense'.*variable_axes=\{'params': 0\}"
    ):
      capture()


def test_scanned_params_on_another_axis_are_refused_by_their_bias():
  # Scanned 3 times over axis 1, the kernel (3, 3, 3, 4, 4) still reads as
  # (3, 3, 4, 4) stacked on its leading axis; the bias (4, 3) does not. The
  # error came later, telling to pass the layer table (which was passed).

  class Body(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return nn.Conv(4, (3, 3), name="conv")(h), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(
        Body, variable_axes={"params": 1}, split_rngs={"params": True}, length=3
      )(name="layers")(x, None)[0]

  model = Scanned()
  x = jnp.ones((2, 6, 6, 4))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  assert params["layers"]["conv"]["kernel"].shape == (3, 3, 3, 4, 4)
  loss_fn = lambda params: jnp.mean(model.apply({"params": params}, x) ** 2)
  for capture in (
    lambda: kfac_jax.trace_layers(loss_fn, params),
    lambda: kfac_jax.value_grad_and_stats(loss_fn)(params),
  ):
    with pytest.raises(
      ValueError, match=r"'layers/conv'.*variable_axes=\{'params': 0\}"
    ):
      capture()


# Mapped outside, every model's probes are its own: no refusal, and each
# model's statistics equal those of its own call. With the data mapped too
# (each model its own batch) the shape pass once refused it as a vmap inside
# the loss over broadcast params.
@pytest.mark.parametrize("data_mapped", [False, True])
def test_a_vmap_around_value_grad_and_stats_matches_each_model_alone(
  data_mapped,
):
  model, x0, y0, params0 = _two_dense_setup(0)
  _, x1, y1, params1 = _two_dense_setup(1)
  if not data_mapped:
    x1, y1 = x0, y0

  def loss_fn(params, x, y):
    return 0.5 * jnp.mean(
      jnp.sum((model.apply({"params": params}, x) - y) ** 2, -1)
    )

  capture = kfac_jax.value_grad_and_stats(loss_fn)
  stack = lambda a, b: jax.tree.map(lambda u, v: jnp.stack([u, v]), a, b)
  data = (stack(x0, x1), stack(y0, y1)) if data_mapped else (x0, y0)
  in_axes = (0, 0, 0) if data_mapped else (0, None, None)
  _, grads, stats = jax.vmap(capture, in_axes=in_axes)(
    stack(params0, params1), *data
  )
  for index, (params, x, y) in enumerate(
    ((params0, x0, y0), (params1, x1, y1))
  ):
    _, grads_alone, stats_alone = capture(params, x, y)
    for name in ("hidden", "out"):
      close(
        grads[name]["kernel"][index],
        grads_alone[name]["kernel"],
        terms=TWO_DENSE_GRADIENT,
      )
    reference.assert_member_stats(
      stats, index, stats_alone, terms=TWO_DENSE_GRADIENT
    )


def test_a_jax_vmap_ensemble_in_the_loss_is_captured_per_member():
  """Stacked params and per-member data mapped together inside the loss (an
  ensemble): each member's inputs and cotangents, stacked, as the dense
  computation gives; a vmap that maps the params is no broadcast."""
  model = nn.Dense(3)
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(2, 4, 5)), jnp.float32)  # [member, N, in]
  stacked = jax.vmap(lambda key: model.init(key, x[0])["params"])(
    jax.random.split(jax.random.PRNGKey(0), 2)
  )
  loss_fn = lambda params: jnp.sum(
    jnp.sin(jax.vmap(lambda p, xm: model.apply({"params": p}, xm))(params, x))
  )
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(stacked)
  outputs = (
    jnp.einsum("eni,eio->eno", x, stacked["kernel"]) + stacked["bias"][:, None]
  )
  (layer,) = stats.values()
  assert layer.signature.stack_ndim == 1
  np.testing.assert_array_equal(layer.inputs[0], x)
  # The outputs' dot of 5 and the bias (6 roundings of |outputs|, moving
  # the cosine by as much), and cos's own.
  close(
    layer.output_cotangents[0],
    jnp.cos(outputs),
    terms=6 + 1,
    scale=max(1.0, float(jnp.abs(outputs).max())),
  )


def test_a_layer_called_with_inputs_by_keyword_is_captured_as_positionally():

  class Keyword(nn.Module):
    @nn.compact
    def __call__(self, x):
      hidden = jnp.tanh(nn.Dense(4, name="hidden")(inputs=x))
      return nn.Dense(2, name="out")(inputs=hidden)

  model, x, y, params = _two_dense_setup()
  loss = lambda m: lambda p: jnp.mean((m.apply({"params": p}, x) - y) ** 2)
  _, _, by_keyword = kfac_jax.value_grad_and_stats(loss(Keyword()))(params)
  _, _, positional = kfac_jax.value_grad_and_stats(loss(model))(params)
  assert sorted(by_keyword) == ["hidden", "out"]
  for name in ("hidden", "out"):
    for a, b in zip(
      (*by_keyword[name].inputs, *by_keyword[name].output_cotangents),
      (*positional[name].inputs, *positional[name].output_cotangents),
    ):
      np.testing.assert_array_equal(a, b)


def test_params_applied_other_than_at_the_root_are_refused_naming_the_layer():
  # The model applied to a subtree of the params it was given: the layer's
  # kernel is not where its path says, which once failed with an
  # AttributeError on None.
  model, x, _, params = _two_dense_setup()
  loss_fn = lambda wrapped: jnp.mean(
    model.apply({"params": wrapped["model"]}, x) ** 2
  )
  with pytest.raises(
    ValueError,
    match=r"'hidden' \(Dense\) has no kernel at "
    r"params\['hidden', 'kernel'\].*root of the 'params'",
  ):
    kfac_jax.value_grad_and_stats(loss_fn)({"model": params})


def _looped_loss(loop, model, x, y):
  """The loss of ``model`` over two micro-batches of ``x`` and ``y``, summed
  by ``loop`` with the params closed over."""
  xs, ys = x.reshape(2, -1, x.shape[-1]), y.reshape(2, -1, y.shape[-1])

  def micro_loss(params, xb, yb):
    return 0.5 * jnp.sum((model.apply({"params": params}, xb) - yb) ** 2)

  def loss_fn(params):
    if loop == "scan":
      return jax.lax.scan(
        lambda total, b: (total + micro_loss(params, *b), None), 0.0, (xs, ys)
      )[0]
    if loop == "map":
      return jnp.sum(jax.lax.map(lambda b: micro_loss(params, *b), (xs, ys)))
    if loop == "fori_loop":  # static bounds: a scan
      return jax.lax.fori_loop(
        0, 2, lambda i, total: total + micro_loss(params, xs[i], ys[i]), 0.0
      )
    return jax.lax.while_loop(  # "while_loop"
      lambda c: c[0] < 2,
      lambda c: (c[0] + 1, c[1] + micro_loss(params, xs[c[0]], ys[c[0]])),
      (0, 0.0),
    )[1]

  return loss_fn


@pytest.mark.parametrize("loop", ["scan", "map", "fori_loop"])
def test_a_loop_closing_over_the_params_is_read_per_step(loop):
  # Every step once got the same probes: each layer's inputs and cotangents
  # came out summed over the micro-batches, A = (x₁ + x₂)(x₁ + x₂)ᵀ. Now the
  # loop's steps are a weight-sharing axis ([B, steps, ·]), holding exactly
  # the rows of the batch captured without the loop.
  model, x, y, params = _two_dense_setup()
  loss_fn = _looped_loss(loop, model, x, y)
  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  whole_loss = lambda p: 0.5 * jnp.sum((model.apply({"params": p}, x) - y) ** 2)
  _, _, whole = kfac_jax.value_grad_and_stats(whole_loss)(params)
  assert sorted(stats) == sorted(whole) == ["hidden", "out"]
  for name, layer in stats.items():
    for looped, alone in (
      (layer.inputs[0], whole[name].inputs[0]),
      (layer.output_cotangents[0], whole[name].output_cotangents[0]),
    ):
      # Row n of micro-batch m is row m·3 + n of the batch: same values,
      # computed by the same ops on the same rows.
      close(
        np.swapaxes(np.asarray(looped), 0, 1).reshape(alone.shape),
        alone,
        terms=TWO_DENSE_GRADIENT,
      )
  expected_loss, expected_grads = jax.value_and_grad(loss_fn)(params)
  close(loss, expected_loss, terms=TWO_DENSE_FORWARD)
  jax.tree.map(
    lambda a, b: close(a, b, terms=TWO_DENSE_GRADIENT), grads, expected_grads
  )


def test_a_layer_in_a_while_loop_is_refused_and_can_be_skipped():
  # A while_loop's length is unknown to the shape pass: its steps cannot be
  # given probes of their own. One error lists both layers.
  model, x, y, params = _two_dense_setup()
  loss_fn = _looped_loss("while_loop", model, x, y)
  for capture in (
    lambda: kfac_jax.trace_layers(loss_fn, params),
    lambda: kfac_jax.value_grad_and_stats(loss_fn)(params),
  ):
    with pytest.raises(
      ValueError,
      match="layers 'hidden', 'out' runs inside "
      r"a loop of unknown length.*skip_layers=\['\^hidden\$', "
      r"'\^out\$'\]",
    ):
      capture()
  # Skipped, the layers go to the chained optimizer; the value stays jax's
  # (a while_loop has no reverse-mode gradient to compare).
  skip = ["^hidden$", "^out$"]
  with pytest.warns(UserWarning, match="captured no layer.*skip_layers"):
    assert not kfac_jax.trace_layers(loss_fn, params, skip_layers=skip)


def test_a_root_layer_in_a_loop_is_read_per_step_a_reused_trace_refused():
  # The model is the layer (its name ''): its marker held no hex digits and
  # was never read, so both went unnoticed, the inputs summed as x₁ + x₂.
  model = nn.Dense(3)
  x = jnp.arange(16.0).reshape(4, 4) / 16
  params = model.init(jax.random.key(0), x)["params"]
  looped = _looped_loss("scan", model, x, jnp.ones((4, 3)))
  _, _, stats = kfac_jax.value_grad_and_stats(looped)(params)
  np.testing.assert_array_equal(
    np.swapaxes(np.asarray(stats[""].inputs[0]), 0, 1).reshape(x.shape), x
  )
  jitted_apply = jax.jit(model.apply)
  twice = lambda params: jnp.sum(
    jitted_apply({"params": params}, x) * jitted_apply({"params": params}, -x)
  )
  with pytest.raises(ValueError, match="trace jax reused"):
    kfac_jax.value_grad_and_stats(twice)(params)


def test_a_loss_calling_a_layer_more_often_than_in_the_shape_pass():
  # The capture traces the loss twice (shapes, then values): a Python-side
  # change between the traces gave an IndexError.
  model, x, y, params = _two_dense_setup()
  traces = []

  def drifting(params):
    traces.append(None)
    out = model.apply({"params": params}, x)
    if len(traces) > 1:
      out = out + model.apply({"params": params}, x)
    return 0.5 * jnp.sum((out - y) ** 2)

  with pytest.raises(
    ValueError, match="called more often than in the shape pass"
  ):
    kfac_jax.value_grad_and_stats(drifting)(params)


def test_a_loop_of_one_step_is_no_loop():
  model, x, y, params = _two_dense_setup()
  looped = lambda params: jax.lax.scan(
    lambda total, b: (
      total
      + 0.5 * jnp.sum((model.apply({"params": params}, b[0]) - b[1]) ** 2),
      None,
    ),
    0.0,
    (x[None], y[None]),
  )[0]
  plain = lambda params: (
    0.5 * jnp.sum((model.apply({"params": params}, x) - y) ** 2)
  )
  _, _, stats = kfac_jax.value_grad_and_stats(looped)(params)
  _, _, expected = kfac_jax.value_grad_and_stats(plain)(params)
  for name in ("hidden", "out"):
    for field in ("inputs", "output_cotangents"):
      looped_value = getattr(stats[name], field)[0]
      expected_value = getattr(expected[name], field)[0]
      assert looped_value.shape == expected_value.shape
      close(looped_value, expected_value, terms=TWO_DENSE_GRADIENT)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    return jnp.tanh(nn.Dense(4, name="dense")(h))


def test_a_lax_scan_over_a_stacked_params_tree_captures_each_layer():
  # The loop slices the params, and with them the probes injected beside
  # the kernel: each step's rows stay apart, stacked on the layer axis.
  block = _Block()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  stacked = jax.vmap(lambda key: block.init(key, x)["params"])(
    jax.random.split(jax.random.PRNGKey(0), 3)
  )

  def loss_fn(stacked):
    h, _ = jax.lax.scan(
      lambda h, params: (block.apply({"params": params}, h), None), x, stacked
    )
    return jnp.sum(h**2)

  table = kfac_jax.trace_layers(loss_fn, stacked)
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(stacked)
  # One description: the table reads the kernel by the call's signature.
  assert table["dense"].signature == stats["dense"].signature
  assert table["dense"].stack_ndim == 1

  kernel, bias = stacked["dense"]["kernel"], stacked["dense"]["bias"]

  def unrolled(perturbations):  # the same three layers, by hand
    h, inputs = x, []
    for i in range(3):
      inputs.append(h)
      h = jnp.tanh(h @ kernel[i] + bias[i] + perturbations[i])
    return jnp.sum(h**2), jnp.stack(inputs)

  _, vjp, inputs = jax.vjp(unrolled, jnp.zeros((3, 6, 4)), has_aux=True)
  (cotangents,) = vjp(1.0)
  # Three layers of a dot of 4, the bias and tanh forward; backward, and
  # the sum over 6 × 4 outputs.
  close(stats["dense"].inputs[0], inputs, terms=3 * (4 + 2))
  close(
    stats["dense"].output_cotangents[0], cotangents, terms=2 * 3 * (4 + 2) + 24
  )


def test_a_scanned_layer_in_a_further_loop_is_refused():
  model = _Lifted("scan")
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda params: jnp.sum(
    jax.lax.map(
      lambda xb: jnp.sum(model.apply({"params": params}, xb) ** 2),
      x.reshape(2, 3, 4),
    )
  )
  with pytest.raises(
    ValueError,
    match="'layers/dense' runs inside a loop "
    r"of 2 steps.*stack axes \(3,\)",
  ):
    kfac_jax.value_grad_and_stats(loss_fn)(params)


def test_a_loop_is_matched_to_a_stack_axis_of_its_length():
  # A length-1 nn.scan is no loop, but its stack axis once let the closed
  # over fori_loop of 3 steps around it pass: rows summed over the steps.
  class OneLayerScan(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(
        _ScanBody,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=1,
      )(name="layers")(x, None)[0]

  model = OneLayerScan()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda params: jnp.sum(
    jax.lax.fori_loop(0, 3, lambda i, h: model.apply({"params": params}, h), x)
    ** 2
  )
  with pytest.raises(
    ValueError,
    match="'layers/dense' runs inside a loop "
    r"of 3 steps.*stack axes \(1,\)",
  ):
    kfac_jax.value_grad_and_stats(loss_fn)(params)


def test_a_jit_split_by_a_gradient_inside_the_loss_is_no_reused_trace():
  # jax.grad in the loss splits a fresh jit's program into a forward and a
  # backward copy, both with the call's marker: that was taken for reuse.
  model, x, y, params = _two_dense_setup()

  def loss_fn(params):
    inner = lambda x: jnp.sum(
      jax.jit(lambda x: model.apply({"params": params}, x))(x)
    )
    return jnp.sum(jax.grad(inner)(x) ** 2)

  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  assert set(stats) == {"hidden", "out"}
  # The loss is itself a gradient's (x's: TWO_DENSE_GRADIENT) sum of
  # squares over 6 × 3; its gradient goes back through both.
  jax.tree.map(
    lambda a, b: close(a, b, terms=2 * (TWO_DENSE_GRADIENT + 18)),
    grads,
    jax.grad(loss_fn)(params),
  )


def test_a_trace_jax_reuses_is_refused():
  # Called twice, a jitted apply ran its cached trace the second time, out
  # of the capture's sight: both calls shared one set of probes, and each
  # layer's input came out as x₁ + x₂. Traced again by a later capture, the
  # cached trace hid its layers from it.
  model, x, y, params = _two_dense_setup()
  jitted_apply = jax.jit(model.apply)
  twice = lambda params: jnp.sum(
    (jitted_apply({"params": params}, x) - jitted_apply({"params": params}, -x))
    ** 2
  )
  with pytest.raises(
    ValueError,
    match="layers 'hidden', 'out' run in a "
    "function whose trace jax reused.*inside the loss.*"
    r"skip_layers=\['\^hidden\$', '\^out\$'\]",
  ):
    kfac_jax.value_grad_and_stats(twice)(params)
  jitted_apply = jax.jit(model.apply)  # a new trace cache
  once = lambda params: jnp.sum((jitted_apply({"params": params}, x) - y) ** 2)
  kfac_jax.trace_layers(once, params)
  with pytest.raises(
    ValueError, match="'hidden', 'out' run in a function whose trace jax reused"
  ):
    kfac_jax.value_grad_and_stats(once)(params)
  # A function made in the loss is traced afresh by every capture.
  fresh = lambda params: jnp.sum(
    (jax.checkpoint(lambda x: model.apply({"params": params}, x))(x) - y) ** 2
  )
  plain = lambda params: jnp.sum((model.apply({"params": params}, x) - y) ** 2)
  _, _, expected = kfac_jax.value_grad_and_stats(plain)(params)
  for _ in range(2):
    _, _, stats = kfac_jax.value_grad_and_stats(fresh)(params)
    for name in ("hidden", "out"):
      for got, want in zip(
        (*stats[name].inputs, *stats[name].output_cotangents),
        (*expected[name].inputs, *expected[name].output_cotangents),
      ):
        close(got, want, terms=TWO_DENSE_GRADIENT)
