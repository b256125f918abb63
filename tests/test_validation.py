"""Bad configuration and mismatched inputs raise early, naming what to fix."""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax import checkpoint


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(compute_method="cholesky"), ValueError, "compute_method='cholesky'"),
    (dict(damping=0.0), ValueError, "damping must be > 0"),
    (dict(damping=-1e-3), ValueError, "damping must be > 0"),
    # Subnormal in float32: XLA flushes it to 0.
    (dict(damping=1e-40), ValueError, "damping must be > 0 and a normal"),
    (dict(factor_decay=-0.1), ValueError, r"factor_decay must be in \[0, 1\]"),
    (dict(factor_decay=1.5), ValueError, r"factor_decay must be in \[0, 1\]"),
    (dict(factor_update_steps=0), ValueError, "factor_update_steps must be a positive"),
    (dict(inv_update_steps=-2), ValueError, "inv_update_steps must be a positive"),
    (dict(inv_update_steps=2.5), TypeError, "inv_update_steps must be an integer"),
    (dict(kl_clip=-1.0), ValueError, "kl_clip must be > 0"),
    (dict(kl_clip=False), TypeError, "pass kl_clip=None to turn KL clipping off"),
    (dict(learning_rate=float("nan")), ValueError, "learning_rate must be >= 0"),
    (dict(learning_rate=-0.1), ValueError, "learning_rate must be >= 0"),
    (dict(damping="big"), TypeError, "damping must be a real number"),
    (dict(damping=True), TypeError, "damping must be a real number"),
    (dict(kl_clip=lambda step: True), TypeError, "kl_clip must be a real number"),
    (dict(damping=lambda step: jnp.ones(2)), TypeError, r"damping must be a real scalar.*step 0"),
    (dict(damping=optax.linear_schedule(-1.0, 1.0, 10)), ValueError, "step 0"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
    (dict(skip_layers=["(unclosed"]), ValueError, "invalid regex"),
    # "".split(",") of an empty setting: re.search matches it everywhere.
    (dict(skip_layers=""), ValueError, "empty pattern '' matches every layer"),
    (dict(skip_layers=["head", ""]), ValueError, "empty pattern"),
    (dict(layers=5), TypeError, "layers must be the table from "
     "kfac_jax.trace_layers"),
    (dict(layers={"dense": (3, 4)}), TypeError, "layers must be the table"),
    (dict(factor_dtype=jnp.int32), ValueError, "factor_dtype must be a floating"),
    # A running factor of activations ~300 overflowed float16 to inf.
    (dict(factor_dtype=jnp.float16), ValueError, "factor_dtype=float16 cannot hold the factors"),
    # float16's range cannot hold (F + λI)⁻¹'s ~1/λ entries.
    (dict(inv_dtype=jnp.float16), ValueError, "inv_dtype=float16 cannot hold.*bfloat16"),
    (dict(inv_dtype=jnp.float8_e4m3fn), ValueError, "inv_dtype=float8_e4m3fn cannot hold"),
    (dict(inv_dtype=None), TypeError, "inv_dtype must be a floating dtype"),
    # float32's range but no mantissa, sign or zero: eye(2) stored as NaNs.
    (dict(inv_dtype=jnp.float8_e8m0fnu), ValueError, "inv_dtype=float8_e8m0fnu cannot store"),
    (dict(factor_dtype=jnp.float8_e8m0fnu), ValueError, "factor_dtype=float8_e8m0fnu cannot store"),
    # Rounded to bfloat16, a rank-deficient factor turned indefinite: 46 of
    # 50 Cholesky inverses were rejected, the layer left unpreconditioned.
    (dict(factor_dtype=jnp.bfloat16, compute_method="inverse"), ValueError,
     "factor_dtype=bfloat16 does not work with compute_method='inverse'"),
    # Without 64-bit mode jax stored float32, with a generic warning.
    (dict(factor_dtype=jnp.float64), ValueError, "factor_dtype=float64 needs 64-bit mode"),
    (dict(inv_dtype="float64"), ValueError, "inv_dtype=float64 needs 64-bit mode"),
    # Said "must be >= 0 (as float32)" of a positive value past float32.
    (dict(learning_rate=1e39), ValueError, "learning_rate=1e\\+39 does not fit in float32"),
    # Out of range and past float32: the range is what to fix.
    (dict(learning_rate=-1e39), ValueError, "learning_rate must be >= 0"),
    (dict(damping=float("inf")), ValueError, "damping must be > 0.*and finite; got inf"),
    (dict(inv_update_steps=2**40), ValueError, "does not fit in int32"),
    (dict(inv_update_steps=optax.piecewise_constant_schedule(10, {5: 2.0})),
     TypeError, "optax's schedules return floats"),
    # Accepted at construction; init then asked for a mesh.
    (dict(mesh_axes=""), TypeError, "non-empty names"),
    (dict(mesh_axes=("data", "")), TypeError, "non-empty names"),
    (dict(compute_eigenvalue_outer_product="no"), TypeError,
     "compute_eigenvalue_outer_product must be True or False"),
    (dict(precondition_embeddings=1), TypeError,
     "precondition_embeddings must be True or False"),
])
def test_bad_configuration(kwargs, error, match):
  with pytest.raises(error, match=match):
    kfac_jax.scale_by_kfac(**kwargs)


def test_numpy_and_jax_scalars_stand_for_their_values():
  # 0-d arrays of flags and of the fraction were refused ("must be a bool",
  # "a fraction in (0, 1]; got Array(0.5)").
  model = nn.Dense(3)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x)**2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)

  def updates(**kwargs):
    tx = kfac_jax.scale_by_kfac(damping=0.1, **kwargs)
    state = tx.init(params)
    for _ in range(2):
      out, state = tx.update(grads, state, params, kfac_stats=stats)
    return out

  for python, arrays in [
      (dict(compute_eigenvalue_outer_product=False),
       dict(compute_eigenvalue_outer_product=jnp.asarray(False))),
      (dict(precondition_embeddings=False),
       dict(precondition_embeddings=np.bool_(False))),
      (dict(mesh_axes="data", grad_worker_fraction=0.5),
       dict(mesh_axes="data", grad_worker_fraction=jnp.asarray(0.5)))]:
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
      jax.tree.map(np.testing.assert_array_equal, updates(**arrays),
                   updates(**python))
  with pytest.raises(TypeError, match="nesterov must be True or False"):
    kfac_jax.kfac(0.1, momentum=0.9, nesterov=jnp.asarray(2))
  kfac_jax.kfac(0.1, momentum=0.9, nesterov=jnp.asarray(True))


def test_traced_static_arguments_name_the_static_arg_to_give():
  # optax.inject_hyperparams hands numeric arguments as arrays: traced in a
  # jitted update, where grad_worker_fraction failed in .item() and an
  # AdaptiveConfig field named itself (not a static_args name).
  model = nn.Dense(3)
  x = jnp.ones((4, 2))
  params = model.init(jax.random.key(0), x)["params"]
  _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p: jnp.mean(model.apply({"params": p}, x)**2))(params)
  with jax.set_mesh(jax.make_mesh((1,), ("data",))):
    tx = optax.inject_hyperparams(
        kfac_jax.scale_by_kfac, static_args=("accumulation_steps",))(
            mesh_axes="data", grad_worker_fraction=0.5)
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"static_args=\('grad_worker_fraction',"
                       r"\)"):
      jax.jit(lambda g, s: tx.update(g, s, params, kfac_stats=stats))(grads,
                                                                      state)
  with pytest.raises(TypeError, match=r"AdaptiveConfig.use_momentum.*"
                     r"static_args=\('adaptive',\)"):
    jax.jit(lambda flag: kfac_jax.AdaptiveConfig(use_momentum=flag).check())(
        jnp.asarray(True))


def test_capture_arguments_are_checked_when_built():
  model = nn.Dense(3)
  x = jnp.ones((4, 2))
  params = model.init(jax.random.key(0), x)["params"]
  with pytest.raises(TypeError, match="fun must be the loss function"):
    kfac_jax.value_grad_and_stats(None)
  with pytest.raises(TypeError, match="fun must be the loss function"):
    kfac_jax.trace_layers(None, params)
  with pytest.raises(TypeError, match="has_aux must be True or False"):
    kfac_jax.value_grad_and_stats(lambda p: 0.0, has_aux="yes")
  kfac_jax.value_grad_and_stats(lambda p: 0.0, has_aux=jnp.asarray(False))
  # As jax.grad: the gradient of an integer loss came out all zeros.
  argmax = lambda p: jnp.argmax(model.apply({"params": p}, x))
  with pytest.raises(TypeError, match="floating-point scalar; got dtype int32"):
    kfac_jax.value_grad_and_stats(argmax)(params)


def test_a_skip_pattern_that_matches_no_module_warns():
  model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
  x = jnp.ones((3, 5))
  params = model.init(jax.random.key(0), x)["params"]
  _, grads, stats = kfac_jax.value_grad_and_stats(
      lambda p: jnp.sum(model.apply({"params": p}, x)**2))(params)

  def update(skip):
    tx = kfac_jax.scale_by_kfac(skip_layers=skip)
    return tx.update(grads, tx.init(params), params, kfac_stats=stats)[0]

  with pytest.warns(UserWarning, match="'layers_9' matches no module path"):
    update(["layers_1", "layers_9"])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # Paths, prefixes, and the captured layers' class (Dense: it skips both).
    updates = update(["layers_1$", "^layers", "^Dense$"])
  jax.tree.map(np.testing.assert_array_equal, updates, grads)


def test_a_bias_that_does_not_fit_its_kernel_is_refused():
  params = {"d": {"kernel": jnp.ones((5, 3)), "bias": jnp.ones(4)}}
  with pytest.raises(ValueError, match="bias"):
    kfac_jax.scale_by_kfac().init(params)


def test_a_table_traced_with_a_bias_refuses_params_without_one():
  x = jnp.ones((2, 5))
  with_bias = nn.Dense(3)
  table = kfac_jax.trace_layers(
      lambda p: jnp.sum(with_bias.apply({"params": p}, x)),
      with_bias.init(jax.random.key(0), x)["params"])
  without = nn.Dense(3, use_bias=False).init(jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="Trace the table from the same params"):
    kfac_jax.scale_by_kfac(layers=table).init(without)


def test_a_class_name_skip_with_a_table_leaves_no_layer():
  # The table traced without the skip knows each layer's class: the same
  # state as when trace_layers got the skip too.
  model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
  x = jnp.ones((3, 5))
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p: jnp.sum(model.apply({"params": p}, x)**2)
  table = kfac_jax.trace_layers(loss, params)
  assert sorted(kfac_jax.scale_by_kfac(layers=table).init(params).factors) == [
      "layers_0", "layers_1"]
  state = kfac_jax.scale_by_kfac(skip_layers=["Dense"], layers=table).init(
      params)
  assert not state.factors


def test_tree_map_params_gets_a_clear_error():
  # Failed with "Dict key mismatch" deep in optax: init on a placeholder
  # finds no layers.
  params = {"Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}}
  tx = optax.chain(kfac_jax.scale_by_kfac(learning_rate=0.1, damping=1e-3),
                   optax.sgd(0.1))
  with pytest.raises(TypeError, match="tree_map_params.*"
                     "get_opt_state_partition_specs"):
    optax.tree_utils.tree_map_params(tx, lambda p: p, tx.init(params))


def test_the_kfac_alias_refuses_the_adaptive_mode():
  # Its SGD multiplied the adaptive update by -lr: the loss went up.
  with pytest.raises(ValueError, match=r"kfac\(adaptive=...\).*scale_by_kfac"):
    kfac_jax.kfac(0.1, kl_clip=None, adaptive=kfac_jax.AdaptiveConfig())


# From 1 on the momentum buffer grows without bound; below 0 it flips sign
# every step.
@pytest.mark.parametrize("momentum", [1.0, 1.5, -0.1])
def test_the_kfac_alias_refuses_momentum_outside_zero_to_one(momentum):
  with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
    kfac_jax.kfac(0.1, momentum=momentum)
  kfac_jax.kfac(0.1, momentum=0.99)
  kfac_jax.kfac(0.1, momentum=0.0)


def test_the_kfac_alias_checks_weight_decay_and_momentum_kinds():
  # optax.sgd takes a number for momentum, and the alias's add_decayed_weights
  # stage is dropped or kept by the value: schedules are refused by name.
  for name in ("weight_decay", "momentum"):
    with pytest.raises(TypeError, match=f"{name} must be a number, not a "
                       "schedule"):
      kfac_jax.kfac(0.1, **{name: lambda count: 0.5})
  with pytest.raises(ValueError, match="weight_decay must be >= 0"):
    kfac_jax.kfac(0.1, weight_decay=-1e-4)
  kfac_jax.kfac(0.1, weight_decay=1e-4)


def test_the_kfac_alias_checks_nesterov():
  # Both were accepted: "yes" as true, and Nesterov silently dropped by
  # optax.sgd without momentum.
  with pytest.raises(TypeError, match="nesterov must be True or False"):
    kfac_jax.kfac(0.1, nesterov="yes")
  for momentum in (None, 0, 0.0):
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
      kfac_jax.kfac(0.1, momentum=momentum, nesterov=True)
  kfac_jax.kfac(0.1, momentum=0.9, nesterov=True)
  kfac_jax.kfac(0.1, momentum=None)


def test_partition_specs_take_scale_by_kfac_arguments_by_keyword():
  # The second positional argument is chain_with: a learning rate there
  # failed with "'float' object has no attribute 'init'".
  with pytest.raises(TypeError, match="chain_with must be an optax.*by "
                     "keyword"):
    kfac_jax.get_opt_state_partition_specs({}, 0.1)
  with pytest.raises(TypeError, match="tx must be an optax"):
    kfac_jax.get_opt_state_partition_specs({}, tx=optax.sgd)
  # optax.MultiSteps has init and update without being a
  # GradientTransformation: the README's accumulation chain passes it.
  params = {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}
  rest = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  specs = kfac_jax.get_opt_state_partition_specs(params, rest,
                                                 accumulation_steps=2)
  tx = optax.chain(kfac_jax.scale_by_kfac(accumulation_steps=2), rest)
  assert jax.tree.structure(specs, is_leaf=lambda s: isinstance(
      s, jax.sharding.PartitionSpec)) == jax.tree.structure(tx.init(params))


def test_a_strategy_without_mesh_axes_warns_that_it_is_ignored():
  # KAISA users pass grad_worker_fraction; without mesh_axes nothing is
  # distributed, which used to pass in silence.
  state = kfac_jax.scale_by_kfac().init({"kernel": jnp.ones((3, 2)),
                                         "bias": jnp.ones(2)})
  for kwargs, named in [
      (dict(grad_worker_fraction="mem_opt"),
       r"grad_worker_fraction=DistributedStrategy\.MEM_OPT given without "
       r"mesh_axes"),
      (dict(grad_worker_fraction=0.5), r"grad_worker_fraction=0\.5 given"),
      (dict(grad_worker_fraction=kfac_jax.DistributedStrategy.HYBRID_OPT,
            assignment_strategy="memory"),
       r"HYBRID_OPT and assignment_strategy=AssignmentStrategy\.MEMORY given")]:
    with pytest.warns(UserWarning, match=named) as record:
      kfac_jax.scale_by_kfac(**kwargs)
    # Pointed at the caller's line, not the library's.
    assert record[0].filename == __file__, record[0].filename
    with pytest.warns(UserWarning, match=named):
      checkpoint.recompute_preconditioners(state, 0.1, **kwargs)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for kwargs in [dict(grad_worker_fraction="comm_opt"),
                   dict(grad_worker_fraction=1),
                   dict(assignment_strategy="COMPUTE"),
                   dict(mesh_axes="data", grad_worker_fraction="mem_opt",
                        assignment_strategy="memory")]:
      kfac_jax.scale_by_kfac(**kwargs)


def test_partition_specs_reject_a_float16_inv_dtype():
  with pytest.raises(ValueError, match="inv_dtype=float16 cannot hold"):
    kfac_jax.get_opt_state_partition_specs({}, inv_dtype=jnp.float16)


def test_schedules_are_accepted():
  kfac_jax.scale_by_kfac(
      damping=optax.exponential_decay(1e-2, 100, 0.5),
      learning_rate=optax.cosine_decay_schedule(0.1, 1000),
      inv_update_steps=lambda step: jnp.where(step < 100, 1, 10))
  # A warmup from 0, as optax's warmup schedules start.
  kfac_jax.kfac(optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 100),
                kl_clip=1e-3)
  kfac_jax.scale_by_kfac(
      learning_rate=0.0,
      inv_update_steps=lambda step: jnp.where(step < 100, 1, 10))


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
      lambda p: jnp.sum(model.apply({"params": p}, x, **kwargs)**2))(params)


def test_a_complex_layer_is_refused_naming_it():
  """The probes kept only the real part of complex inputs, silently."""
  model = nn.Dense(3, dtype=jnp.complex64, param_dtype=jnp.complex64)
  x = (jnp.ones((4, 5)) + 2j * jnp.ones((4, 5))).astype(jnp.complex64)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(jnp.abs(model.apply({"params": p}, x))**2)
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
    tx.update({"Dense_0": grads["Dense_0"]}, tx.init(only_first), only_first,
              kfac_stats=stats)


def test_stats_shapes_disagree_with_params():
  model, x, params = _setup(hidden=6)
  other_model, _, other_params = _setup(hidden=8)
  _, grads, _ = _stats(model, params, x)
  _, _, other_stats = _stats(other_model, other_params, x)
  tx = kfac_jax.scale_by_kfac()
  with pytest.raises(ValueError, match=r"'Dense_0'.*output \(4, 8\) does not end in kernel out \(6,\)"):
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
  with pytest.warns(UserWarning, match="'Einsum_0'.*chained optimizer") as record:
    state = tx.init(params)
  assert len(record) == 1
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  np.testing.assert_array_equal(updates["Einsum_0"]["kernel"],
                                grads["Einsum_0"]["kernel"])
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
  loss_fn = lambda p: jnp.sum(linen.apply({"params": p}, x)**2)
  with pytest.raises(ValueError, match=r"layer '' \(Conv\) has a mask.*"
                     r"skip_layers=\['\^\$'\]"):
    kfac_jax.value_grad_and_stats(loss_fn)(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(
      loss_fn, skip_layers="^$")(params)
  assert not stats and float(jnp.abs(grads["kernel"][2]).max()) == 0

  class Masked(nnx.Module):

    def __init__(self):
      self.conv = nnx.Conv(2, 4, (3, 3), mask=mask, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.conv(x)

  model = Masked()
  with pytest.raises(ValueError, match=r"layer 'conv' \(Conv\) has a mask"):
    kfac_jax.value_grad_and_stats(lambda m: jnp.sum(m(x)**2))(model)


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
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x)**2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  with pytest.warns(UserWarning):
    stale_table = kfac_jax.trace_layers(lambda p: jnp.sum(x), params)
    tx = kfac_jax.scale_by_kfac(layers=stale_table)
    state = tx.init(params)
  with pytest.raises(ValueError, match=r"'Dense_0'.*the gradients have its "
                     r"kernel.*lack it.*trace_layers.*'\^Dense_0\$'"):
    tx.update(grads, state, params, kfac_stats=stats)
  for tx in [kfac_jax.scale_by_kfac(layers=kfac_jax.trace_layers(loss_fn,
                                                                  params)),
             kfac_jax.scale_by_kfac(skip_layers=["^Dense_0$"])]:
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
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x)**2)
  skip = ["^Conv$"]
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn,
                                                  skip_layers=skip)(params)
  assert list(stats) == ["head"]
  tx = kfac_jax.scale_by_kfac(skip_layers=skip)
  with pytest.raises(ValueError, match="'features'.*class.*skip it by path"):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)
  table = kfac_jax.trace_layers(loss_fn, params, skip_layers=skip)
  for tx, warned in [
      (kfac_jax.scale_by_kfac(skip_layers=skip + ["^features$"]),
       # Without a table the class pattern skips nothing here (the capture
       # left the Conv out): it says so.
       [r"'\^Conv\$' matches no module path of the params nor a class "
        "name"]),
      # The table tells the class-skipped layer from an unknown module: no
      # warning (it warned that the layer was not captured).
      (kfac_jax.scale_by_kfac(skip_layers=skip, layers=table), [])]:
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      state = tx.init(params)
      updates, _ = tx.update(grads, state, params, kfac_stats=stats)
    assert len(record) == len(warned), [str(w.message) for w in record]
    for w, pattern in zip(record, warned):
      assert re.search(pattern, str(w.message)), str(w.message)
    # The skipped layer's gradient passes through as it is.
    jax.tree.map(np.testing.assert_array_equal, updates["features"],
                 grads["features"])
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

  loss_fn = lambda model, x: jnp.sum(model(x)**2)
  model, x, skip = MLP(nnx.Rngs(0)), jnp.ones((8, 4)), ["^Linear$"]
  table = kfac_jax.trace_layers(loss_fn, model, x, skip_layers=skip)
  assert dict(table) == {} and table.skipped_classes == {
      "body": "Linear", "head": "Linear"}
  tx = kfac_jax.scale_by_kfac(layers=table, skip_layers=skip)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert not optimizer.opt_state.factors


@pytest.mark.parametrize("other, names", [
    (dict(compute_method="inverse"),
     r"holds \['EigenPreconditioner'\].*makes \['InversePreconditioner'\].*"
     "compute_method"),
    (dict(inv_dtype=jnp.bfloat16),
     r"stored as \['float32'\].*stores \['bfloat16'\].*inv_dtype"),
    (dict(compute_eigenvalue_outer_product=False),
     "compute_eigenvalue_outer_product"),
])
def test_a_state_of_another_configuration_names_what_differs(other, names):
  # The message listed every possible cause instead of the one that differs.
  model = nn.Dense(3)
  x = jnp.ones((4, 5))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p: jnp.sum(model.apply({"params": p}, x)**2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  state = kfac_jax.scale_by_kfac().init(params)
  with pytest.raises(ValueError, match="not the ones this transformation "
                     f"makes: .*{names}"):
    kfac_jax.scale_by_kfac(**other).update(grads, state, params,
                                           kfac_stats=stats)
