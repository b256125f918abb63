"""RNN cells: a cell applied at every time step shares its weights over the
steps, so its Dense layers are captured with one row per example and step.

Against a float64 NumPy LSTM unrolled over the time steps, with its backward
pass written out by hand (``_lstm_reference``): each step's inputs and output
cotangents are the captured stats (step axis after the example axis), the
factors are KFAC-expand's over the ``B·T`` rows or KFAC-reduce's over the
``B`` examples, and the update is K-FAC's (``reference.KFACReference``), not a
rescaled gradient. A cell the capture cannot read raises one error for all
its layers.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfac_jax
from kfac_jax.preconditioning.gradient_matrix import to_matrix
from tests import reference

close = reference.assert_float32_close
B, T, IN, HIDDEN, OUT = 3, 4, 3, 5, 2
DAMPING, DECAY = 0.01, 0.5
GATES = "ifgo"  # Flax's LSTMCell: input, forget, cell (tanh), output gates
CELL_LAYERS = tuple(f"{kind}{gate}" for kind in "ih" for gate in GATES)

# float32 roundings of a captured tensor (``assert_float32_close``'s terms).
# One step forward: a gate's two dots (IN and HIDDEN terms), the bias and the
# sum, its sigmoid/tanh (counted as 4), then c and h (4 more, tanh's 4). The
# forward of step t carries those of every step before it.
STEP_FORWARD = IN + HIDDEN + 2 + 4 + 8
# One step backward: the head's dot (OUT), h's cotangent from the four gates
# (4·HIDDEN), and the gates' and c's products (about 12).
STEP_BACKWARD = OUT + 4 * HIDDEN + 12
INPUT_TERMS = T * STEP_FORWARD
COTANGENT_TERMS = T * (STEP_FORWARD + STEP_BACKWARD) + 2


class LinenLSTM(nn.Module):
  """``nn.RNN`` over an ``nn.LSTMCell`` on ``[B, T, IN]``, a Dense head on
  every step's hidden state."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(OUT, name="head")(nn.RNN(nn.LSTMCell(HIDDEN))(x))


def _sigmoid(z):
  return 1 / (1 + np.exp(-z))


def _lstm_reference(
  cell: dict, head: dict, x: np.ndarray, targets: np.ndarray
) -> dict[str, tuple]:
  """The float64 unrolled LSTM with loss ``½ Σ (out − y)² / B``:
  ``{layer: (inputs [B, T, ·], output cotangents [B, T, ·])}``."""
  h, c = np.zeros((B, HIDDEN)), np.zeros((B, HIDDEN))
  steps = []
  for t in range(T):
    z = {
      gate: x[:, t] @ cell["i" + gate]["kernel"]
      + h @ cell["h" + gate]["kernel"]
      + cell["h" + gate]["bias"]
      for gate in GATES
    }
    act = {
      gate: np.tanh(z[gate]) if gate == "g" else _sigmoid(z[gate])
      for gate in GATES
    }
    new_c = act["f"] * c + act["i"] * act["g"]
    new_h = act["o"] * np.tanh(new_c)
    steps.append(dict(h=h, c=c, act=act, new_c=new_c, new_h=new_h))
    h, c = new_h, new_c
  hidden = np.stack([s["new_h"] for s in steps], axis=1)
  d_out = (hidden @ head["kernel"] + head["bias"] - targets) / B
  d_z = {gate: [None] * T for gate in GATES}
  d_h_next, d_c_next = np.zeros((B, HIDDEN)), np.zeros((B, HIDDEN))
  for t in reversed(range(T)):
    s, act = steps[t], steps[t]["act"]
    d_h = d_out[:, t] @ head["kernel"].T + d_h_next
    tanh_c = np.tanh(s["new_c"])
    d_c = d_c_next + d_h * act["o"] * (1 - tanh_c**2)
    d_act = dict(
      i=d_c * act["g"], f=d_c * s["c"], g=d_c * act["i"], o=d_h * tanh_c
    )
    for gate in GATES:
      slope = 1 - act[gate] ** 2 if gate == "g" else act[gate] * (1 - act[gate])
      d_z[gate][t] = d_act[gate] * slope
    d_c_next = d_c * act["f"]
    d_h_next = sum(
      d_z[gate][t] @ cell["h" + gate]["kernel"].T for gate in GATES
    )
  previous = np.stack([s["h"] for s in steps], axis=1)
  tensors = {"head": (hidden, d_out)}
  for gate in GATES:
    cotangents = np.stack(d_z[gate], axis=1)  # both of a gate's layers'
    tensors["LSTMCell_0/i" + gate] = (x, cotangents)
    tensors["LSTMCell_0/h" + gate] = (previous, cotangents)
  return tensors


def _linen_problem(seed: int = 0):
  """``(params, loss_fn, expected, x, targets)``: the Linen LSTM's params
  (random, biases too: Flax starts them at zero), its loss, and the
  reference's ``{layer: (inputs, cotangents)}`` (``_lstm_reference``)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, T, IN))
  targets = rng.normal(size=(B, T, OUT))
  model = LinenLSTM()
  params = model.init(jax.random.key(seed), jnp.asarray(x, jnp.float32))[
    "params"
  ]
  params = jax.tree.map(
    lambda p: jnp.asarray(0.5 * rng.normal(size=p.shape), jnp.float32), params
  )

  def loss_fn(params):
    outputs = model.apply({"params": params}, jnp.asarray(x, jnp.float32))
    return 0.5 * jnp.sum((outputs - targets) ** 2) / B

  as64 = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
  expected = _lstm_reference(as64["LSTMCell_0"], as64["head"], x, targets)
  return params, loss_fn, expected, x, targets


def _with_ones(rows: np.ndarray) -> np.ndarray:
  return np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)


def _check_stats(stats, expected) -> None:
  assert sorted(stats) == sorted(expected)
  for name, (inputs, cotangents) in expected.items():
    layer = stats[name]
    assert len(layer.inputs) == 1  # one call, its steps stacked
    close(layer.inputs[0], inputs, terms=INPUT_TERMS, err_msg=name)
    close(
      layer.output_cotangents[0],
      cotangents,
      terms=COTANGENT_TERMS,
      err_msg=name,
    )


def test_an_lstm_cells_stats_are_each_steps_inputs_and_cotangents():
  params, loss_fn, expected, _, _ = _linen_problem()
  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  _check_stats(stats, expected)
  # The gradients are jax's: the probes' loop does not change the loss.
  expected_loss, expected_grads = jax.value_and_grad(loss_fn)(params)
  close(loss, expected_loss, terms=COTANGENT_TERMS)
  jax.tree.map(
    lambda a, b: close(a, b, terms=COTANGENT_TERMS + B * T),
    grads,
    expected_grads,
  )
  # The table describes the cell's layers as plain Dense layers.
  table = kfac_jax.trace_layers(loss_fn, params)
  for name in CELL_LAYERS:
    layer = table["LSTMCell_0/" + name]
    assert layer.signature == stats["LSTMCell_0/" + name].signature
    assert layer.stack_ndim == 0


def _nnx_name(name: str) -> str:
  """The NNX model's path of a Linen layer (NNX spells ``if`` ``if_``)."""
  if name == "head":
    return name
  layer = name.removeprefix("LSTMCell_0/")
  return "rnn/cell/" + ("if_" if layer == "if" else layer)


def test_an_nnx_lstm_is_captured_as_the_linen_one():
  params, _, expected, x, targets = _linen_problem(seed=1)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.rnn = nnx.RNN(nnx.LSTMCell(IN, HIDDEN, rngs=rngs))
      self.head = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
      return self.head(self.rnn(x))

  model = Model(nnx.Rngs(0))
  for name in expected:  # the Linen model's params
    layer, linen = model, params
    for key in _nnx_name(name).split("/"):
      layer = getattr(layer, key)
    for key in name.split("/"):
      linen = linen[key]
    layer.kernel.set_value(linen["kernel"])
    if "bias" in linen:
      layer.bias.set_value(linen["bias"])

  def loss_fn(model):
    outputs = model(jnp.asarray(x, jnp.float32))
    return 0.5 * jnp.sum((outputs - targets) ** 2) / B

  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(model)
  assert sorted(stats) == sorted(map(_nnx_name, expected))
  _check_stats({name: stats[_nnx_name(name)] for name in expected}, expected)


@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_an_lstm_cells_factors_share_its_weights_over_the_steps(weight_sharing):
  params, loss_fn, expected, _, _ = _linen_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  tx = kfac_jax.scale_by_kfac(
    factor_decay=0.0, kl_clip=None, weight_sharing=weight_sharing
  )
  _, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  for name in CELL_LAYERS:
    inputs, cotangents = expected["LSTMCell_0/" + name]
    if name.startswith("h"):  # the recurrent layers carry the bias
      inputs = _with_ones(inputs)
    if weight_sharing == "expand":  # a row per example and step
      rows, grad_rows = inputs.reshape(B * T, -1), cotangents.reshape(B * T, -1)
      count = B * T
    else:  # a row per example: the steps' mean input, summed cotangents
      rows, grad_rows = inputs.mean(axis=1), cotangents.sum(axis=1)
      count = B + T
    factors = state.factors["LSTMCell_0/" + name]
    close(
      factors.activation_factor,
      reference.cov(rows),
      terms=2 * INPUT_TERMS + count + 1,
      err_msg=name,
    )
    close(
      factors.gradient_factor,
      reference.cov(grad_rows),
      terms=2 * COTANGENT_TERMS + count + 1,
      scale=np.abs(grad_rows).max() ** 2,
      err_msg=name,
    )


def test_an_lstm_is_preconditioned_not_rescaled():
  params, loss_fn, expected, _, _ = _linen_problem()
  table = kfac_jax.trace_layers(loss_fn, params)
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    factor_decay=DECAY,
    kl_clip=None,
    layers=table,
    compute_method="eigen",
    damping_mode="absolute",
  )

  @jax.jit
  def step(params, state):
    _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
    return tx.update(grads, state, params, kfac_stats=stats)

  updates, _ = step(params, tx.init(params))
  blocks = {}
  for name, (inputs, cotangents) in expected.items():
    rows = inputs.reshape(B * T, -1)
    if name == "head" or "/h" in name:
      rows = _with_ones(rows)
    grad_rows = cotangents.reshape(B * T, -1)
    blocks[name] = reference.LayerTensors(rows, grad_rows, rows.T @ grad_rows)
  ref = reference.KFACReference(
    damping=DAMPING, factor_decay=DECAY, learning_rate=1.0, kl_clip=None
  )
  directions = ref.update([blocks])
  condition = reference.kfac_condition(ref.factors, DAMPING)
  for name, direction in directions.items():
    layer = table[name]
    node = updates
    for key in layer.path:
      node = node[key]
    update = np.asarray(to_matrix(node, layer, jnp.float32))[0]
    width, out = direction.shape
    # The factors' roundings (the cotangents' twice, the sum over the rows),
    # the gradient's and the eigh's (to width² + out², test_batched), through
    # K-FAC's conditioning.
    terms = (
      (2 * COTANGENT_TERMS + B * T + 1)
      + (COTANGENT_TERMS + B * T)
      + (width**2 + out**2)
    )
    tolerance = terms * condition * reference.EPS32 * np.abs(direction).max()
    close(update, direction, terms=terms, condition=condition, err_msg=name)
    # Not the gradient rescaled: what is left of the direction once its
    # best multiple of the gradient is taken out is far past the tolerance.
    gradient = blocks[name].gradient
    residual = (
      direction
      - (np.vdot(direction, gradient) / np.vdot(gradient, gradient)) * gradient
    )
    assert np.abs(residual).max() > 10 * tolerance, name


class _RematLSTM(nn.Module):
  """The cell's loop under nn.remat: not at the top of the loss."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(OUT, name="head")(nn.remat(nn.RNN)(nn.LSTMCell(HIDDEN))(x))


def test_a_cell_the_capture_cannot_read_raises_one_error_for_all_its_layers():
  x = jnp.ones((B, T, IN))
  model = _RematLSTM()
  params = model.init(jax.random.key(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  layers = ", ".join(f"'LSTMCell_0/{name}'" for name in sorted(CELL_LAYERS))
  message = (
    f"in module 'LSTMCell_0', each of layers {layers} runs inside a "
    f"loop of {T} steps.*remat.*"
    r"skip_layers=\['\^LSTMCell_0\$'\]"
  )
  for capture in (
    lambda: kfac_jax.trace_layers(loss_fn, params),
    lambda: kfac_jax.value_grad_and_stats(loss_fn)(params),
  ):
    with pytest.raises(ValueError, match=message):
      capture()
  # The advice, followed once, leaves the whole cell to the chained
  # optimizer.
  _, _, stats = kfac_jax.value_grad_and_stats(
    loss_fn, skip_layers=["^LSTMCell_0$"]
  )(params)
  assert sorted(stats) == ["head"]


def test_a_loop_that_carries_the_params_is_refused():
  # Params carried unchanged are loop constants to jax (a scan moves them
  # there): read per step. Params the loop changes (an inner optimization
  # loop) carry the probes with them, changed too: refused.
  model = nn.Dense(4)
  x = jnp.ones((B, 4))
  params = model.init(jax.random.key(0), x)["params"]

  def carrying(change):
    def step(carry, _):
      params, h = carry
      h = jnp.tanh(model.apply({"params": params}, h))
      return (jax.tree.map(change, params), h), None

    return lambda params: jnp.sum(
      jax.lax.scan(step, (params, x), length=T)[0][1] ** 2
    )

  _, _, stats = kfac_jax.value_grad_and_stats(carrying(lambda p: p))(params)
  assert stats[""].inputs[0].shape == (B, T, 4)
  with pytest.raises(
    ValueError,
    match="layer '' runs inside a loop that "
    "passes its params.*as a carry.*skip_layers",
  ):
    kfac_jax.value_grad_and_stats(carrying(lambda p: 0.9 * p))(params)


def test_a_loop_over_micro_batches_gives_the_whole_batchs_expand_factors():
  # A lax.scan over micro-batches closing over the params is weight sharing
  # over its steps too: under KFAC-expand its rows are the whole batch's.
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2 * B, IN)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(2 * B, OUT)), jnp.float32)
  model = nn.Dense(OUT)
  params = model.init(jax.random.key(3), x)["params"]

  def micro_loss(params, xb, yb):
    return 0.5 * jnp.sum((model.apply({"params": params}, xb) - yb) ** 2)

  def looped(params):
    batches = (x.reshape(2, B, IN), y.reshape(2, B, OUT))
    return jax.lax.scan(
      lambda total, b: (total + micro_loss(params, *b), None), 0.0, batches
    )[0]

  _, _, stats = kfac_jax.value_grad_and_stats(looped)(params)
  _, _, whole = kfac_jax.value_grad_and_stats(lambda p: micro_loss(p, x, y))(
    params
  )
  (layer,), (alone,) = stats.values(), whole.values()
  # [B, steps, ·]: example n of micro-batch m is row m·B + n of the batch.
  for looped_value, value in (
    (layer.inputs[0], alone.inputs[0]),
    (layer.output_cotangents[0], alone.output_cotangents[0]),
  ):
    np.testing.assert_array_equal(
      np.swapaxes(np.asarray(looped_value), 0, 1).reshape(value.shape), value
    )
