"""Every layer kind against float64 NumPy: convolutions of all shapes,
DenseGeneral/attention projections, scanned layers (against the unrolled model).

Each case runs one K-FAC step through ``trace_layers`` +
``value_grad_and_stats`` + ``scale_by_kfac`` and compares, per Kronecker block,
the running factors and the preconditioned gradient with
``reference.KFACReference`` fed by an explicit loop im2col / reshape in NumPy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax.preconditioning.gradient_matrix import to_matrix
from tests import reference

DAMPING = 0.01
DECAY = 0.5
close = reference.assert_float32_close


def _kfac_step(model: nn.Module, params, x: np.ndarray, weights: np.ndarray):
  """One K-FAC step; returns (outputs, table, state, updates)."""
  loss_fn = lambda p: reference.squared_weighted_loss(
    model.apply({"params": p}, x), weights
  )
  table = kfac_jax.trace_layers(loss_fn, params)
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    factor_decay=DECAY,
    kl_clip=None,
    layers=table,
    damping_mode="absolute",
    compute_method="eigen",
  )
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  updates, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  return model.apply({"params": params}, x), table, state, updates


def _reference_blocks(
  patches: np.ndarray,
  kernel: np.ndarray,
  bias: np.ndarray | None,
  groups: int,
  weights: np.ndarray,
):
  """NumPy forward and per-group LayerTensors of a conv / dense layer.

  ``patches: [B, *positions, features]`` for the whole input (features in
  ``(*window, in)`` order, group-major over ``in``); ``kernel: [*window,
  in/g, out]``.
  """
  *window, in_per_group, out = kernel.shape
  window_size = int(np.prod(window))
  positions = int(np.prod(patches.shape[1:-1]))
  by_tap = patches.reshape(
    patches.shape[:-1] + (window_size, groups, in_per_group)
  )
  o = out // groups
  outputs, blocks = [], []
  for j in range(groups):
    rows = by_tap[..., j, :].reshape(-1, window_size * in_per_group)
    k = kernel.reshape(-1, out)[:, j * o : (j + 1) * o]
    y = rows @ k + (0 if bias is None else bias[j * o : (j + 1) * o])
    outputs.append(y)
  y = np.concatenate(outputs, axis=-1)  # [B·positions, out]
  dy = y * weights.reshape(-1, out) ** 2
  for j in range(groups):
    rows = by_tap[..., j, :].reshape(-1, window_size * in_per_group)
    if bias is not None:
      rows = np.concatenate([rows, np.ones((len(rows), 1))], axis=1)
    grad_rows = dy[:, j * o : (j + 1) * o]
    blocks.append(
      reference.LayerTensors(
        rows / positions, grad_rows / positions, rows.T @ grad_rows
      )
    )
  return y, blocks


def _check_blocks(
  layer_name: str, table, state, updates, blocks: list[reference.LayerTensors]
) -> None:
  layer = table[layer_name]
  names = layer.block_names
  assert len(names) == len(blocks)
  ref = reference.KFACReference(
    damping=DAMPING, factor_decay=DECAY, learning_rate=1.0, kl_clip=None
  )
  expected = ref.update([dict(zip(names, blocks))])
  node = updates
  for key in layer.path:
    node = node[key]
  matrices = np.asarray(to_matrix(node, layer, jnp.float32))
  condition = reference.kfac_condition(
    {name: ref.factors[name] for name in names}, DAMPING
  )
  for i, name in enumerate(names):
    a, g = ref.factors[name]
    rows, width = blocks[i].activation_rows.shape
    dims = blocks[i].gradient.shape
    # The float32 roundings (reference.assert_float32_close's ``terms``): a
    # cotangent y·W² carries the forward's dot (``width``), the bias and
    # ·W², squared in G; then the sum over the rows, / rows, and the mix.
    factor_terms = 2 * (width + 3) + rows + 3
    close(
      state.factors[name].activation_factor,
      a,
      terms=factor_terms,
      scale=reference.running_factor_scale(a, DECAY),
      err_msg=name,
    )
    close(
      state.factors[name].gradient_factor,
      g,
      terms=factor_terms,
      scale=reference.running_factor_scale(g, DECAY),
      err_msg=name,
    )
    # P: the factors' roundings, the gradient's (the cotangents' and the
    # sum over the rows) and the eigh's (to dA² + dG², test_batched),
    # through K-FAC's conditioning.
    tolerance = dict(
      terms=factor_terms + width + 3 + rows + dims[0] ** 2 + dims[1] ** 2,
      condition=condition,
      err_msg=name,
    )
    close(matrices[i], expected[name], **tolerance)
    # The exact Kronecker system: vec(P) = (A ⊗ G + λI)⁻¹ vec(∇), row-major.
    gradient = blocks[i].gradient
    dense = np.linalg.solve(
      np.kron(a, g) + DAMPING * np.eye(len(a) * len(g)), gradient.reshape(-1)
    ).reshape(gradient.shape)
    close(matrices[i], dense, **tolerance)


class Wrapped(nn.Module):
  """Puts the layer under test at path "layer"."""

  layer: nn.Module

  def __call__(self, x):
    return self.layer(x)


CONV_CASES = {
  "1d_same_strided_dilated": dict(
    shape=(2, 11, 3),
    features=4,
    kernel_size=(3,),
    strides=2,
    padding="SAME",
    kernel_dilation=2,
  ),
  "1d_causal": dict(
    shape=(2, 9, 2),
    features=3,
    kernel_size=(3,),
    padding="CAUSAL",
    kernel_dilation=2,
  ),
  "2d_explicit_input_dilation_grouped": dict(
    shape=(2, 5, 4, 4),
    features=6,
    kernel_size=(2, 3),
    padding=((1, 2), (0, 1)),
    input_dilation=2,
    feature_group_count=2,
  ),
  "2d_depthwise_circular": dict(
    shape=(2, 5, 5, 4),
    features=8,
    kernel_size=(3, 3),
    padding="CIRCULAR",
    feature_group_count=4,
  ),
  "2d_reflect_no_bias": dict(
    shape=(2, 6, 5, 3),
    features=4,
    kernel_size=(3, 2),
    padding="REFLECT",
    use_bias=False,
  ),
  "3d_valid_strided": dict(
    shape=(2, 4, 5, 4, 2),
    features=3,
    kernel_size=(2, 2, 2),
    strides=(1, 2, 1),
    padding="VALID",
  ),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_blocks_match_loop_im2col(case):
  options = dict(CONV_CASES[case])
  shape = options.pop("shape")
  rank = len(options["kernel_size"])
  conv = nn.Conv(name="layer", **options)
  model = Wrapped(conv)
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape).astype(np.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  out_shape = jax.eval_shape(lambda: model.apply({"params": params}, x)).shape
  weights = rng.uniform(0.5, 1.5, size=out_shape).astype(np.float32)
  outputs, table, state, updates = _kfac_step(model, params, x, weights)

  as_tuple = lambda v, d=1: (
    (v,) * rank if isinstance(v, int) else tuple(v or (d,) * rank)
  )
  patches = reference.im2col_nd(
    x.astype(np.float64),
    options["kernel_size"],
    as_tuple(options.get("strides", 1)),
    options["padding"],
    as_tuple(options.get("input_dilation", 1)),
    as_tuple(options.get("kernel_dilation", 1)),
  )
  kernel = np.asarray(params["layer"]["kernel"], np.float64)
  bias = params["layer"].get("bias")
  groups = options.get("feature_group_count", 1)
  y, blocks = _reference_blocks(
    patches,
    kernel,
    None if bias is None else np.asarray(bias, np.float64),
    groups,
    weights.astype(np.float64),
  )
  # The NumPy im2col reproduces Flax's convolution, so it is the same layer:
  # each output a dot of ``width`` products and the bias, within that many
  # roundings of |patches|·|kernel| + |bias|.
  magnitudes, _ = _reference_blocks(
    np.abs(patches),
    np.abs(kernel),
    None if bias is None else np.abs(np.asarray(bias, np.float64)),
    groups,
    weights.astype(np.float64),
  )
  width = blocks[0].activation_rows.shape[1]
  close(
    np.asarray(outputs).reshape(y.shape), y, terms=width + 1, scale=magnitudes
  )
  assert table["layer"].groups == groups
  _check_blocks("layer", table, state, updates, blocks)


def test_dense_general_contracts_its_axes():
  model = Wrapped(nn.DenseGeneral(features=(3, 2), axis=(-2, -1), name="layer"))
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  weights = rng.uniform(0.5, 1.5, size=(2, 3, 3, 2)).astype(np.float32)
  outputs, table, state, updates = _kfac_step(model, params, x, weights)
  layer = table["layer"]
  assert (layer.contracted_shape, layer.output_shape) == ((4, 5), (3, 2))
  assert (layer.activation_dim, layer.gradient_dim) == (21, 6)
  # A DenseGeneral is a Dense on the flattened contracted/output axes.
  rows = x.astype(np.float64).reshape(6, 1, 20)
  kernel = np.asarray(params["layer"]["kernel"], np.float64).reshape(20, 6)
  bias = np.asarray(params["layer"]["bias"], np.float64).reshape(6)
  y, blocks = _reference_blocks(
    rows, kernel, bias, 1, weights.astype(np.float64).reshape(6, 6)
  )
  # Dots of 20 and the bias, within that many roundings of |x|·|W| + |b|.
  magnitudes = np.abs(rows.reshape(6, 20)) @ np.abs(kernel) + np.abs(bias)
  close(np.asarray(outputs).reshape(6, 6), y, terms=20 + 1, scale=magnitudes)
  _check_blocks("layer", table, state, updates, blocks)


def test_attention_projections_are_preconditioned():
  """MultiHeadDotProductAttention's projections.

  q/k/v [in, heads, head_dim], out [heads, head_dim, out].
  """

  class SelfAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, name="attention"
      )(x)

  model = SelfAttention()
  rng = np.random.default_rng(2)
  x = rng.normal(size=(3, 5, 6)).astype(np.float32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  weights = rng.uniform(0.5, 1.5, size=(3, 5, 6)).astype(np.float32)
  _, table, state, updates = _kfac_step(model, params, x, weights)
  assert {
    n: (info.contracted_shape, info.output_shape) for n, info in table.items()
  } == {
    "attention/query": ((6,), (2, 4)),
    "attention/key": ((6,), (2, 4)),
    "attention/value": ((6,), (2, 4)),
    "attention/out": ((2, 4), (6,)),
  }
  # q, k and v see the layer input x: A = ½I + ½ cov([x, 1]).
  rows = np.concatenate([x.reshape(15, 6), np.ones((15, 1))], 1).astype(
    np.float64
  )
  for name in ("query", "key", "value"):
    expected = DECAY * np.eye(7) + (1 - DECAY) * reference.cov(rows)
    # The sum over 15 rows, / 15, the mix.
    close(
      state.factors[f"attention/{name}"].activation_factor,
      expected,
      terms=15 + 1 + 2,
      scale=reference.running_factor_scale(expected, DECAY),
    )
  for name in table:
    node = updates["attention"][name.split("/")[1]]
    assert (
      node["kernel"].shape
      == params["attention"][name.split("/")[1]]["kernel"].shape
    )
    assert not np.allclose(node["kernel"], 0)


class Block(nn.Module):
  """Grouped conv -> tanh -> Dense: a layer body with two captured layers."""

  @nn.compact
  def __call__(self, x, _):
    h = jnp.tanh(nn.Conv(4, (3,), feature_group_count=2, name="conv")(x))
    return jnp.tanh(nn.Dense(4, name="dense")(h)), None


class Scanned(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    body = nn.remat(Block) if self.remat else Block
    scanned = nn.scan(
      body, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, _ = scanned(name="layers")(x, None)
    return x


class Unrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x, _ = Block(name=f"layers_{i}")(x, None)
    return x


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_model_matches_unrolled(remat):
  rng = np.random.default_rng(3)
  x = rng.normal(size=(4, 6, 4)).astype(np.float32)
  target = rng.normal(size=(4, 6, 4)).astype(np.float32)
  scanned, unrolled = Scanned(remat=remat), Unrolled()
  scanned_params = scanned.init(jax.random.PRNGKey(0), x)["params"]
  unrolled_params = {
    f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], scanned_params["layers"])
    for i in range(3)
  }

  def run(model, params):
    loss_fn = lambda p: jnp.mean((model.apply({"params": p}, x) - target) ** 2)
    tx = optax.chain(
      kfac_jax.scale_by_kfac(
        damping=DAMPING,
        kl_clip=0.01,
        layers=kfac_jax.trace_layers(loss_fn, params),
      ),
      optax.sgd(0.1, momentum=0.9),
    )
    state = tx.init(params)
    step = jax.jit(lambda p, s: _train_step(loss_fn, tx, p, s))
    for _ in range(3):
      params, state, updates = step(params, state)
    return updates, state

  scanned_updates, scanned_state = run(scanned, scanned_params)
  unrolled_updates, unrolled_state = run(unrolled, unrolled_params)
  # Each of the 3 steps: the three blocks' contractions (conv 3·2, dense 4)
  # forward and backward, the kernels' sums and the factors' over 4 × 6
  # rows, the eigh (to 7², test_batched); through K-FAC's conditioning.
  tolerance = dict(
    terms=3 * (2 * 3 * (3 * 2 + 4) + 24 + 24 + 7**2),
    condition=reference.kfac_condition(unrolled_state[0].factors, DAMPING),
  )
  for i in range(3):
    scale = reference.largest(jax.tree.leaves(unrolled_updates[f"layers_{i}"]))
    jax.tree.map(
      lambda a, b, i=i, scale=scale: close(a[i], b, scale=scale, **tolerance),
      scanned_updates["layers"],
      unrolled_updates[f"layers_{i}"],
    )
  # One factor pair per slice (and per group): 3 x (2 conv groups + 1 dense).
  kfac_state = scanned_state[0]
  assert len(kfac_state.factors) == 9
  for i in range(3):
    for j in range(2):
      close(
        kfac_state.factors[f"layers/conv[{2 * i + j}]"].activation_factor,
        unrolled_state[0].factors[f"layers_{i}/conv[{j}]"].activation_factor,
        **tolerance,
      )


def test_a_scanned_model_in_a_loop_of_its_own_length_is_refused():
  """nn.scan over 3 stacked layers, applied in a lax.scan over 3
  micro-batches that closes over the params: the loop matches the stack
  axis's length, but that axis is the inner scan's, so the outer loop slices
  nothing and would sum the micro-batches' probes."""
  rng = np.random.default_rng(10)
  micro_batches = jnp.asarray(rng.normal(size=(3, 4, 6, 4)), jnp.float32)
  model = Scanned()
  params = model.init(jax.random.PRNGKey(0), micro_batches[0])["params"]

  def loss_fn(params):
    def one(total, x):
      return total + jnp.sum(model.apply({"params": params}, x) ** 2), None

    return jax.lax.scan(one, 0.0, micro_batches)[0]

  with pytest.raises(ValueError, match="runs inside a loop of 3 steps"):
    kfac_jax.value_grad_and_stats(loss_fn)(params)


def _train_step(loss_fn, tx, params, state):
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  return optax.apply_updates(params, updates), state, updates


def test_a_cell_broadcast_over_scan_steps_is_read_per_step_or_skipped():
  """An RNN-style cell shares its params over the steps: each step's input
  and output cotangent, stacked after the example axis ([B, T, ·]), as an
  unrolled jax loop gives them. Skipped, it goes to the chained optimizer."""

  class Cell(nn.Module):
    @nn.compact
    def __call__(self, carry, x):
      carry = jnp.tanh(nn.Dense(3, name="dense")(carry) + x)
      return carry, carry

  class RNN(nn.Module):
    @nn.compact
    def __call__(self, xs):
      scan = nn.scan(
        Cell,
        variable_broadcast="params",
        split_rngs={"params": False},
        in_axes=0,
        out_axes=0,
      )
      _, ys = scan(name="cell")(jnp.zeros((2, 3)), xs)
      return nn.Dense(2, name="head")(ys)

  model = RNN()
  xs = jnp.asarray(np.random.default_rng(7).normal(size=(5, 2, 3)), jnp.float32)
  params = model.init(jax.random.PRNGKey(0), xs)["params"]
  params = jax.tree.map(lambda p: p + 0.1, params)  # biases non-zero too
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, xs) ** 2)

  def unrolled(shift):
    """The loss unrolled in Python, ``shift[t]`` added to the cell's Dense
    output at step t: ``(loss, the Dense's inputs [T, B, 3])``."""
    cell, head = params["cell"]["dense"], params["head"]
    h, inputs, ys = jnp.zeros((2, 3)), [], []
    for t in range(5):
      inputs.append(h)
      h = jnp.tanh(h @ cell["kernel"] + cell["bias"] + shift[t] + xs[t])
      ys.append(h)
    out = jnp.stack(ys) @ head["kernel"] + head["bias"]
    return jnp.sum(out**2), jnp.stack(inputs)

  cotangents, inputs = jax.grad(unrolled, has_aux=True)(jnp.zeros((5, 2, 3)))
  _, _, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  layer = stats["cell/dense"]
  assert kfac_jax.trace_layers(loss_fn, params)["cell/dense"].stack_ndim == 0
  # 5 cell steps (a dot of 3, + x, tanh), the head's dot of 3, the sum over
  # 5 × 2 × 2 outputs; the cotangents, backward through as many.
  forward = 5 * (3 + 2) + 3 + 20
  close(layer.inputs[0], jnp.swapaxes(inputs, 0, 1), terms=forward)
  close(
    layer.output_cotangents[0],
    jnp.swapaxes(cotangents, 0, 1),
    terms=2 * forward,
  )

  skip = ["^cell"]
  table = kfac_jax.trace_layers(loss_fn, params, skip_layers=skip)
  loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn, skip_layers=skip)(
    params
  )
  assert list(table) == list(stats) == ["head"]
  close(loss, loss_fn(params), terms=forward)
  jax.tree.map(
    lambda a, b: close(a, b, terms=2 * forward + 10),
    grads,
    jax.grad(loss_fn)(params),
  )
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING, kl_clip=None, layers=table, skip_layers=skip
  )
  updates, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  assert list(state.factors) == ["head"]
  jax.tree.map(np.testing.assert_array_equal, updates["cell"], grads["cell"])
  assert not np.array_equal(updates["head"]["kernel"], grads["head"]["kernel"])


def test_partition_specs_follow_the_layer_table():
  """get_opt_state_partition_specs(params, layers=...) has tx.init's blocks."""
  x = jnp.ones((4, 6, 4))
  model = Scanned()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  table = kfac_jax.trace_layers(
    lambda p: jnp.sum(model.apply({"params": p}, x)), params
  )
  specs = kfac_jax.get_opt_state_partition_specs(params, layers=table)
  state = kfac_jax.scale_by_kfac(layers=table).init(params)
  assert sorted(specs.factors) == sorted(state.factors)
  assert len(state.factors) == 9
  assert jax.tree.structure(specs.preconditioners) == jax.tree.structure(
    jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state.preconditioners)
  )


def test_decomposition_in_batches_equals_all_at_once():
  """lax.map over batches of 2 of the 9 scanned blocks = one vmap of all."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(4, 6, 4)), jnp.float32)
  model = Scanned()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  table = kfac_jax.trace_layers(loss_fn, params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  results = []
  for batch_size in (None, 2):
    tx = kfac_jax.scale_by_kfac(
      layers=table,
      compute_method="inverse",
      decomposition_batch_size=batch_size,
    )
    results.append(
      jax.jit(lambda g, s, st, tx=tx: tx.update(g, s, kfac_stats=st))(
        grads, tx.init(params), stats
      )
    )
  # The same Cholesky inverses of the same factors, mapped otherwise: each
  # within 3·(7 + 1) roundings (the largest factor is 7 wide) through
  # K-FAC's conditioning (the default λ, 1e-3); the factors themselves are
  # the same sums.
  condition = reference.kfac_condition(results[1][1].factors, 1e-3)
  jax.tree.map(
    lambda a, b: close(a, b, terms=3 * (7 + 1), condition=condition),
    results[0],
    results[1],
  )
  with pytest.raises(ValueError, match="decomposition_batch_size"):
    kfac_jax.scale_by_kfac(decomposition_batch_size=0)


class DenseBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(4, name="dense")(x))


class RematScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat_scan(DenseBlock, lengths=(2, 2))(name="layers")(x)


def test_remat_scan_has_two_stack_axes_and_matches_unrolled():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
  model = RematScanned()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  table = kfac_jax.trace_layers(loss_fn, params)
  ((name, layer),) = table.items()
  assert layer.stack_shape == (2, 2) and layer.num_blocks == 4

  kernels = params[name.split("/")[0]]
  for key in name.split("/")[1:]:
    kernels = kernels[key]
  slices = [
    jax.tree.map(lambda a, i=i, j=j: a[i, j], kernels)
    for i in range(2)
    for j in range(2)
  ]

  def unrolled_loss(p):
    h = x
    for k in range(4):
      h = jnp.tanh(h @ p[k]["kernel"] + p[k]["bias"])
    return jnp.sum(h**2)

  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    kl_clip=None,
    layers=table,
    damping_mode="absolute",
    compute_method="eigen",
  )
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  updates, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  # Reference: the same 4 dense layers unrolled, each its own Kronecker block.
  expected_grads = jax.grad(unrolled_loss)(slices)
  inputs, cotangents = [], []
  h = x
  for k in range(4):
    inputs.append(h)
    h = jnp.tanh(h @ slices[k]["kernel"] + slices[k]["bias"])
  cotangent = 2 * h
  for k in reversed(range(4)):
    out = jnp.tanh(inputs[k] @ slices[k]["kernel"] + slices[k]["bias"])
    cotangents.insert(0, cotangent * (1 - out**2))
    cotangent = cotangents[0] @ slices[k]["kernel"].T
  ref = reference.KFACReference(
    damping=DAMPING, factor_decay=0.95, learning_rate=1.0, kl_clip=None
  )
  rows = [
    np.concatenate([np.asarray(a, np.float64), np.ones((5, 1))], 1)
    for a in inputs
  ]
  tensors = {
    f"b{k}": reference.LayerTensors(
      rows[k],
      np.asarray(cotangents[k], np.float64),
      np.concatenate(
        [expected_grads[k]["kernel"], expected_grads[k]["bias"][None]]
      ).astype(np.float64),
    )
    for k in range(4)
  }
  expected = ref.update([tensors])
  node = updates
  for key in layer.path:
    node = node[key]
  matrices = np.asarray(to_matrix(node, layer, jnp.float32))
  # Both sides' inputs and cotangents are float32: four layers (a dot of 4,
  # the bias, tanh) forward and back, squared in the factors, with their
  # sums over 5 rows; P adds the eigh's (5² + 4²), through K-FAC's
  # conditioning.
  factor_terms = 2 * 2 * 4 * (4 + 2) + 5 + 3
  condition = reference.kfac_condition(ref.factors, DAMPING)
  for k in range(4):
    close(
      matrices[k],
      expected[f"b{k}"],
      terms=factor_terms + 5**2 + 4**2,
      condition=condition,
    )
    factor = ref.factors[f"b{k}"][0]
    close(
      state.factors[f"{name}[{k}]"].activation_factor,
      factor,
      terms=factor_terms,
      scale=reference.running_factor_scale(factor, 0.95),
    )


def test_block_states_round_trip_through_orbax(tmp_path):
  """State keys of blocks (``layers/conv[3]``) survive an orbax checkpoint."""
  from kfac_jax import checkpoint  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(np.random.default_rng(7).normal(size=(4, 6, 4)), jnp.float32)
  model = Scanned()
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  tx = optax.chain(
    kfac_jax.scale_by_kfac(layers=kfac_jax.trace_layers(loss_fn, params)),
    optax.sgd(0.1),
  )
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  _, state = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  checkpoint.save(tmp_path / "state", state)
  restored = checkpoint.restore(tmp_path / "state", tx.init(params))
  assert "layers/conv[5]" in restored[0].factors
  jax.tree.map(np.testing.assert_array_equal, restored, state)
