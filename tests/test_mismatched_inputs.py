"""Inputs that do not fit the transformation (missing or mismatched stats, a
state of other params or settings, layers the table lacks) raise early,
naming what to fix."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax


class TwoLayers(nn.Module):
  hidden: int = 6

  @nn.compact
  def __call__(self, x, use_second=True):
    x = nn.Dense(self.hidden)(x)
    return nn.Dense(3)(x) if use_second else x[:, :3]


def _setup(hidden=6):
  model = TwoLayers(hidden)
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  return model, x, params


def _stats(model, params, x, **kwargs):
  return kfac_jax.value_grad_and_stats(
    lambda p: jnp.sum(model.apply({"params": p}, x, **kwargs) ** 2)
  )(params)


def test_a_complex_layer_is_refused_naming_it():
  """The probes kept only the real part of complex inputs, silently."""
  model = nn.Dense(3, dtype=jnp.complex64, param_dtype=jnp.complex64)
  x = (jnp.ones((4, 5)) + 2j * jnp.ones((4, 5))).astype(jnp.complex64)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(jnp.abs(model.apply({"params": p}, x)) ** 2)
  with pytest.raises(ValueError, match="layer ''.*complex.*skip_layers"):
    kfac_jax.value_grad_and_stats(loss_fn)(params)


def test_missing_stats_argument():
  model, x, params = _setup()
  tx = kfac_jax.scale_by_kfac()
  _, grads, _ = _stats(model, params, x)
  with pytest.raises(ValueError, match="kfac_stats"):
    tx.update(grads, tx.init(params), params)


def test_stats_missing_a_layer_name_it_and_suggest_skip_layers():
  model, x, params = _setup()
  tx = kfac_jax.scale_by_kfac()
  _, grads, stats = _stats(model, params, x, use_second=False)
  with pytest.raises(ValueError, match="'Dense_1'.*skip_layers"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)
  # The suggested fix works.
  tx = kfac_jax.scale_by_kfac(skip_layers=["Dense_1"])
  tx.update(grads, tx.init(params), params, kfac_stats=stats)


def test_stats_with_a_layer_the_state_lacks():
  model, x, params = _setup()
  _, grads, stats = _stats(model, params, x)
  only_first = {"Dense_0": params["Dense_0"]}
  tx = kfac_jax.scale_by_kfac()
  with pytest.raises(ValueError, match="'Dense_1'.*no kernel"):
    tx.update(
      {"Dense_0": grads["Dense_0"]},
      tx.init(only_first),
      only_first,
      kfac_stats=stats,
    )


def test_stats_shapes_disagree_with_params():
  model, x, params = _setup(hidden=6)
  other_model, _, other_params = _setup(hidden=8)
  _, grads, _ = _stats(model, params, x)
  _, _, other_stats = _stats(other_model, other_params, x)
  tx = kfac_jax.scale_by_kfac()
  with pytest.raises(
    ValueError,
    match=r"'Dense_0'.*output \(4, 8\) does not end in kernel out \(6,\)",
  ):
    tx.update(grads, tx.init(params), params, kfac_stats=other_stats)


def test_state_from_other_params():
  model, x, params = _setup(hidden=6)
  _, _, other_params = _setup(hidden=8)
  _, grads, stats = _stats(model, params, x)
  tx = kfac_jax.scale_by_kfac()
  with pytest.raises(ValueError, match="'Dense_0'.*re-run tx.init"):
    tx.update(grads, tx.init(other_params), params, kfac_stats=stats)


def test_errors_raise_at_trace_time_under_jit():
  model, x, params = _setup()
  tx = kfac_jax.scale_by_kfac()
  _, grads, stats = _stats(model, params, x, use_second=False)
  step = jax.jit(lambda g, s, st: tx.update(g, s, kfac_stats=st))
  with pytest.raises(ValueError, match="Dense_1"):
    step(grads, tx.init(params), stats)


def test_grouped_conv_without_layer_table_points_to_trace_layers():
  model = nn.Conv(4, (3, 3), feature_group_count=2)
  x = jnp.ones((2, 5, 5, 4))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x))
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  tx = kfac_jax.scale_by_kfac()
  with pytest.raises(ValueError, match="2 groups.*trace_layers.*skip_layers"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)
  # With the table the same update goes through.
  tx = kfac_jax.scale_by_kfac(layers=kfac_jax.trace_layers(loss_fn, params))
  updates, _ = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, grads)


def test_untraced_kernel_is_skipped_with_one_warning():
  """A kernel the capture does not know (nn.Einsum) is left to the chain."""

  class WithEinsum(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(3)(x)
      return nn.Einsum((3, 2), "bi,ij->bj")(x)

  model = WithEinsum()
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  # Without a table the Einsum kernel looks like a Dense one with no stats.
  tx = kfac_jax.scale_by_kfac()
  with pytest.raises(ValueError, match="'Einsum_0'.*skip_layers"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)
  tx = kfac_jax.scale_by_kfac(layers=kfac_jax.trace_layers(loss_fn, params))
  with pytest.warns(
    UserWarning, match="'Einsum_0'.*chained optimizer"
  ) as record:
    state = tx.init(params)
  assert len(record) == 1
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  np.testing.assert_array_equal(
    updates["Einsum_0"]["kernel"], grads["Einsum_0"]["kernel"]
  )
  assert list(state.factors) == ["Dense_0"]


def test_a_masked_conv_is_refused_and_can_be_skipped():
  """A conv mask (PixelCNN's) zeroes kernel entries that A's input rows still
  cover: the update moved the masked entries (max 355 against 2644 on the
  live ones) and gave the live ones the Schur complement of A."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  mask = jnp.ones((3, 3, 2, 4)).at[2].set(0.0)
  x = jnp.ones((2, 5, 5, 2))
  linen = nn.Conv(4, (3, 3), mask=mask)
  params = linen.init(jax.random.key(0), x)["params"]
  loss_fn = lambda p: jnp.sum(linen.apply({"params": p}, x) ** 2)
  with pytest.raises(
    ValueError,
    match=r"layer '' \(Conv\) has a mask.*"
    r"skip_layers=\['\^\$'\]",
  ):
    kfac_jax.value_grad_and_stats(loss_fn)(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn, skip_layers="^$")(
    params
  )
  assert not stats and float(jnp.abs(grads["kernel"][2]).max()) == 0

  class Masked(nnx.Module):
    def __init__(self):
      self.conv = nnx.Conv(2, 4, (3, 3), mask=mask, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.conv(x)

  model = Masked()
  with pytest.raises(ValueError, match=r"layer 'conv' \(Conv\) has a mask"):
    kfac_jax.value_grad_and_stats(lambda m: jnp.sum(m(x) ** 2))(model)


def test_stats_of_a_layer_the_table_lacks_name_the_table():
  """A table traced from another loss (here one that never calls the model)
  lacks a layer the gradients have: the error said the gradients lacked its
  kernel. It names the table, and both suggested fixes work."""

  class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(x)

  model = Head()
  x = jnp.ones((8, 4))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  with pytest.warns(UserWarning):
    stale_table = kfac_jax.trace_layers(lambda p: jnp.sum(x), params)
    tx = kfac_jax.scale_by_kfac(layers=stale_table)
    state = tx.init(params)
  with pytest.raises(
    ValueError,
    match=r"'Dense_0'.*the gradients have its "
    r"kernel.*lack it.*trace_layers.*'\^Dense_0\$'",
  ):
    tx.update(grads, state, params, kfac_stats=stats)
  for tx in [
    kfac_jax.scale_by_kfac(layers=kfac_jax.trace_layers(loss_fn, params)),
    kfac_jax.scale_by_kfac(skip_layers=["^Dense_0$"]),
  ]:
    tx.update(grads, tx.init(params), params, kfac_stats=stats)


def test_class_name_skip_without_a_table_says_to_skip_by_path():
  """A class-name pattern given to the capture too leaves a named layer
  without stats, which scale_by_kfac (paths only, no table) cannot explain by
  itself; the error says so, and both suggested fixes work."""

  class Named(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(4, (3,), name="features")(x).reshape(x.shape[0], -1)
      return nn.Dense(2, name="head")(x)

  model = Named()
  x = jnp.ones((2, 5, 3))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  skip = ["^Conv$"]
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn, skip_layers=skip)(
    params
  )
  assert list(stats) == ["head"]
  tx = kfac_jax.scale_by_kfac(skip_layers=skip)
  with pytest.raises(ValueError, match="'features'.*class.*skip it by path"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)
  table = kfac_jax.trace_layers(loss_fn, params, skip_layers=skip)
  for tx, warned in [
    (
      kfac_jax.scale_by_kfac(skip_layers=skip + ["^features$"]),
      # Without a table the class pattern skips nothing here (the capture
      # left the Conv out): it says so.
      [
        r"'\^Conv\$' matches no module path of the params nor a class "
        "name"
      ],
    ),
    # The table tells the class-skipped layer from an unknown module: no
    # warning (it warned that the layer was not captured).
    (kfac_jax.scale_by_kfac(skip_layers=skip, layers=table), []),
  ]:
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      state = tx.init(params)
      updates, _ = tx.update(grads, state, params, kfac_stats=stats)
    assert len(record) == len(warned), [str(w.message) for w in record]
    for w, pattern in zip(record, warned):
      assert re.search(pattern, str(w.message)), str(w.message)
    # The skipped layer's gradient passes through as it is.
    jax.tree.map(
      np.testing.assert_array_equal, updates["features"], grads["features"]
    )
  # Skipped by class in trace_layers alone: the warning names the class.
  with pytest.warns(UserWarning, match=r"'features'.*class name \(Conv\)"):
    kfac_jax.scale_by_kfac(layers=table).init(params)


def test_nnx_class_name_skip_with_the_table_does_not_warn():
  """The README's setup, one skip list for trace_layers, scale_by_kfac and
  value_grad_and_stats, naming NNX's class: no warning, plain gradients."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.body = nnx.Linear(4, 5, rngs=rngs)
      self.head = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.tanh(self.body(x)))

  loss_fn = lambda model, x: jnp.sum(model(x) ** 2)
  model, x, skip = MLP(nnx.Rngs(0)), jnp.ones((8, 4)), ["^Linear$"]
  table = kfac_jax.trace_layers(loss_fn, model, x, skip_layers=skip)
  assert dict(table) == {} and table.skipped_classes == {
    "body": "Linear",
    "head": "Linear",
  }
  tx = kfac_jax.scale_by_kfac(layers=table, skip_layers=skip)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert not optimizer.opt_state.factors


@pytest.mark.parametrize(
  "other, names",
  [
    (
      dict(compute_method="inverse"),
      r"holds \['EigenPreconditioner'\].*makes \['InversePreconditioner'\].*"
      "compute_method",
    ),
    (
      dict(inv_dtype=jnp.bfloat16),
      r"stored as \['float32'\].*stores \['bfloat16'\].*inv_dtype",
    ),
    (
      dict(compute_eigenvalue_outer_product=False),
      "compute_eigenvalue_outer_product",
    ),
  ],
)
def test_a_state_of_another_configuration_names_what_differs(other, names):
  # The message listed every possible cause instead of the one that differs.
  model = nn.Dense(3)
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  state = kfac_jax.scale_by_kfac(compute_method="eigen").init(params)
  with pytest.raises(
    ValueError, match=f"not the ones this transformation makes: .*{names}"
  ):
    kfac_jax.scale_by_kfac(**{"compute_method": "eigen", **other}).update(
      grads, state, params, kfac_stats=stats
    )
