"""Bad configuration raises early, naming what to fix."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax import checkpoint
from kfac_jax.transform.config import KFACConfig


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(compute_method="cholesky"), ValueError, "compute_method='cholesky'"),
    (dict(damping=0.0), ValueError, "damping must be > 0"),
    (dict(damping=-1e-3), ValueError, "damping must be > 0"),
    # Subnormal in float32: XLA flushes it to 0.
    (dict(damping=1e-40), ValueError, "damping must be > 0 and a normal"),
    (dict(factor_decay=-0.1), ValueError, r"factor_decay must be in \[0, 1\]"),
    (dict(factor_decay=1.5), ValueError, r"factor_decay must be in \[0, 1\]"),
    (
      dict(factor_update_steps=0),
      ValueError,
      "factor_update_steps must be a positive",
    ),
    (
      dict(inv_update_steps=-2),
      ValueError,
      "inv_update_steps must be a positive",
    ),
    (
      dict(inv_update_steps=2.5),
      TypeError,
      "inv_update_steps must be an integer",
    ),
    (dict(kl_clip=-1.0), ValueError, "kl_clip must be > 0"),
    (
      dict(kl_clip=False),
      TypeError,
      "pass kl_clip=None to turn KL clipping off",
    ),
    (
      dict(learning_rate=float("nan")),
      ValueError,
      "learning_rate must be >= 0",
    ),
    (dict(learning_rate=-0.1), ValueError, "learning_rate must be >= 0"),
    (dict(damping="big"), TypeError, "damping must be a real number"),
    (dict(damping=True), TypeError, "damping must be a real number"),
    (
      dict(kl_clip=lambda step: True),
      TypeError,
      "kl_clip must be a real number",
    ),
    (
      dict(damping=lambda step: jnp.ones(2)),
      TypeError,
      r"damping must be a real scalar.*step 0",
    ),
    (dict(damping=optax.linear_schedule(-1.0, 1.0, 10)), ValueError, "step 0"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
    (dict(skip_layers=["(unclosed"]), ValueError, "invalid regex"),
    # "".split(",") of an empty setting: re.search matches it everywhere.
    (dict(skip_layers=""), ValueError, "empty pattern '' matches every layer"),
    (dict(skip_layers=["head", ""]), ValueError, "empty pattern"),
    (
      dict(layers=5),
      TypeError,
      "layers must be the table from kfac_jax.trace_layers",
    ),
    (dict(layers={"dense": (3, 4)}), TypeError, "layers must be the table"),
    (
      dict(factor_dtype=jnp.int32),
      ValueError,
      "factor_dtype must be a floating",
    ),
    # A running factor of activations ~300 overflowed float16 to inf.
    (
      dict(factor_dtype=jnp.float16),
      ValueError,
      "factor_dtype=float16 cannot hold the factors",
    ),
    # float16's range cannot hold (F + λI)⁻¹'s ~1/λ entries.
    (
      dict(inv_dtype=jnp.float16),
      ValueError,
      "inv_dtype=float16 cannot hold.*bfloat16",
    ),
    (
      dict(inv_dtype=jnp.float8_e4m3fn),
      ValueError,
      "inv_dtype=float8_e4m3fn cannot hold",
    ),
    (dict(inv_dtype=None), TypeError, "inv_dtype must be a floating dtype"),
    # float32's range but no mantissa, sign or zero: eye(2) stored as NaNs.
    (
      dict(inv_dtype=jnp.float8_e8m0fnu),
      ValueError,
      "inv_dtype=float8_e8m0fnu cannot store",
    ),
    (
      dict(factor_dtype=jnp.float8_e8m0fnu),
      ValueError,
      "factor_dtype=float8_e8m0fnu cannot store",
    ),
    # Rounded to bfloat16, a rank-deficient factor turned indefinite: 46 of
    # 50 Cholesky inverses were rejected, the layer left unpreconditioned.
    (
      dict(factor_dtype=jnp.bfloat16, compute_method="inverse"),
      ValueError,
      "factor_dtype=bfloat16 does not work with compute_method='inverse'",
    ),
    # Without 64-bit mode jax stored float32, with a generic warning.
    (
      dict(factor_dtype=jnp.float64),
      ValueError,
      "factor_dtype=float64 needs 64-bit mode",
    ),
    (
      dict(inv_dtype="float64"),
      ValueError,
      "inv_dtype=float64 needs 64-bit mode",
    ),
    # Said "must be >= 0 (as float32)" of a positive value past float32.
    (
      dict(learning_rate=1e39),
      ValueError,
      "learning_rate=1e\\+39 does not fit in float32",
    ),
    # Out of range and past float32: the range is what to fix.
    (dict(learning_rate=-1e39), ValueError, "learning_rate must be >= 0"),
    (
      dict(damping=float("inf")),
      ValueError,
      "damping must be > 0.*and finite; got inf",
    ),
    (dict(inv_update_steps=2**40), ValueError, "does not fit in int32"),
    (
      dict(inv_update_steps=optax.piecewise_constant_schedule(10, {5: 2.0})),
      TypeError,
      "optax's schedules return floats",
    ),
    # Accepted at construction; init then asked for a mesh.
    (dict(mesh_axes=""), TypeError, "non-empty names"),
    (dict(mesh_axes=("data", "")), TypeError, "non-empty names"),
    (
      dict(compute_eigenvalue_outer_product="no"),
      TypeError,
      "compute_eigenvalue_outer_product must be True or False",
    ),
    (
      dict(precondition_embeddings=1),
      TypeError,
      "precondition_embeddings must be True or False",
    ),
  ],
)
def test_bad_configuration(kwargs, error, match):
  with pytest.raises(error, match=match):
    kfac_jax.scale_by_kfac(**kwargs)


def test_numpy_and_jax_scalars_stand_for_their_values():
  # 0-d arrays of flags and of the fraction were refused ("must be a bool",
  # "a fraction in (0, 1]; got Array(0.5)").
  model = nn.Dense(3)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss_fn = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)

  def updates(**kwargs):
    tx = kfac_jax.scale_by_kfac(damping=0.1, **kwargs)
    state = tx.init(params)
    for _ in range(2):
      out, state = tx.update(grads, state, params, kfac_stats=stats)
    return out

  for python, arrays in [
    (
      dict(compute_eigenvalue_outer_product=False),
      dict(compute_eigenvalue_outer_product=jnp.asarray(False)),
    ),
    (
      dict(precondition_embeddings=False),
      dict(precondition_embeddings=np.bool_(False)),
    ),
    (
      dict(mesh_axes="data", grad_worker_fraction=0.5),
      dict(mesh_axes="data", grad_worker_fraction=jnp.asarray(0.5)),
    ),
  ]:
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
      jax.tree.map(
        np.testing.assert_array_equal, updates(**arrays), updates(**python)
      )
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
    lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
  )(params)
  with jax.set_mesh(jax.make_mesh((1,), ("data",))):
    tx = optax.inject_hyperparams(
      kfac_jax.scale_by_kfac, static_args=("accumulation_steps",)
    )(mesh_axes="data", grad_worker_fraction=0.5)
    state = tx.init(params)
    with pytest.raises(
      TypeError,
      match=r"static_args=\('grad_worker_fraction',"
      r"\)",
    ):
      jax.jit(lambda g, s: tx.update(g, s, params, kfac_stats=stats))(
        grads, state
      )
  with pytest.raises(
    TypeError,
    match=r"AdaptiveConfig.use_momentum.*"
    r"static_args=\('adaptive',\)",
  ):
    jax.jit(lambda flag: kfac_jax.AdaptiveConfig(use_momentum=flag).check())(
      jnp.asarray(True)
    )


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
    lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  )(params)

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


def test_a_skip_pattern_on_one_layer_params_names_the_class_names():
  # A top-level Dense: its params have no module path, so the warning shows
  # what a pattern can match there instead of an empty list of paths.
  model = nn.Dense(2)
  x = jnp.ones((3, 5))
  params = model.init(jax.random.key(0), x)["params"]
  _, grads, stats = kfac_jax.value_grad_and_stats(
    lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  )(params)
  tx = kfac_jax.scale_by_kfac(skip_layers=["^Conv"])
  with pytest.warns(
    UserWarning,
    match=r"class names such as \['Dense'\] "
    r"\(the params have no module paths",
  ):
    tx.update(grads, tx.init(params), params, kfac_stats=stats)


def test_a_bias_that_does_not_fit_its_kernel_is_refused():
  params = {"d": {"kernel": jnp.ones((5, 3)), "bias": jnp.ones(4)}}
  with pytest.raises(ValueError, match="bias"):
    kfac_jax.scale_by_kfac().init(params)


def test_a_table_traced_with_a_bias_refuses_params_without_one():
  x = jnp.ones((2, 5))
  with_bias = nn.Dense(3)
  table = kfac_jax.trace_layers(
    lambda p: jnp.sum(with_bias.apply({"params": p}, x)),
    with_bias.init(jax.random.key(0), x)["params"],
  )
  without = nn.Dense(3, use_bias=False).init(jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="Trace the table from the same params"):
    kfac_jax.scale_by_kfac(layers=table).init(without)


def test_a_class_name_skip_with_a_table_leaves_no_layer():
  # The table traced without the skip knows each layer's class: the same
  # state as when trace_layers got the skip too.
  model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
  x = jnp.ones((3, 5))
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  table = kfac_jax.trace_layers(loss, params)
  assert sorted(kfac_jax.scale_by_kfac(layers=table).init(params).factors) == [
    "layers_0",
    "layers_1",
  ]
  state = kfac_jax.scale_by_kfac(skip_layers=["Dense"], layers=table).init(
    params
  )
  assert not state.factors


def test_tree_map_params_gets_a_clear_error():
  # Failed with "Dict key mismatch" deep in optax: init on a placeholder
  # finds no layers.
  params = {"Dense_0": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)}}
  tx = optax.chain(
    kfac_jax.scale_by_kfac(learning_rate=0.1, damping=1e-3), optax.sgd(0.1)
  )
  with pytest.raises(
    TypeError, match="tree_map_params.*get_opt_state_partition_specs"
  ):
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
    with pytest.raises(
      TypeError, match=f"{name} must be a number, not a schedule"
    ):
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
  with pytest.raises(
    TypeError, match="chain_with must be an optax.*by keyword"
  ):
    kfac_jax.get_opt_state_partition_specs({}, 0.1)
  with pytest.raises(TypeError, match="tx must be an optax"):
    kfac_jax.get_opt_state_partition_specs({}, tx=optax.sgd)
  # optax.MultiSteps has init and update without being a
  # GradientTransformation: the README's accumulation chain passes it.
  params = {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}
  rest = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  specs = kfac_jax.get_opt_state_partition_specs(
    params, rest, accumulation_steps=2
  )
  tx = optax.chain(kfac_jax.scale_by_kfac(accumulation_steps=2), rest)
  assert jax.tree.structure(
    specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
  ) == jax.tree.structure(tx.init(params))


def test_a_strategy_without_mesh_axes_warns_that_it_is_ignored():
  # KAISA users pass grad_worker_fraction; without mesh_axes nothing is
  # distributed, which used to pass in silence.
  state = kfac_jax.scale_by_kfac().init(
    {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}
  )
  for kwargs, named in [
    (
      dict(grad_worker_fraction="mem_opt"),
      r"grad_worker_fraction=DistributedStrategy\.MEM_OPT given without "
      r"mesh_axes",
    ),
    (dict(grad_worker_fraction=0.5), r"grad_worker_fraction=0\.5 given"),
    (
      dict(
        grad_worker_fraction=kfac_jax.DistributedStrategy.HYBRID_OPT,
        assignment_strategy="memory",
      ),
      r"HYBRID_OPT and assignment_strategy=AssignmentStrategy\.MEMORY given",
    ),
  ]:
    with pytest.warns(UserWarning, match=named) as record:
      kfac_jax.scale_by_kfac(**kwargs)
    # Pointed at the caller's line, not the library's.
    assert record[0].filename == __file__, record[0].filename
    with pytest.warns(UserWarning, match=named):
      checkpoint.recompute_preconditioners(state, 0.1, **kwargs)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for kwargs in [
      dict(grad_worker_fraction="comm_opt"),
      dict(grad_worker_fraction=1),
      dict(assignment_strategy="COMPUTE"),
      dict(
        mesh_axes="data",
        grad_worker_fraction="mem_opt",
        assignment_strategy="memory",
      ),
    ]:
      kfac_jax.scale_by_kfac(**kwargs)


def test_partition_specs_reject_a_float16_inv_dtype():
  with pytest.raises(ValueError, match="inv_dtype=float16 cannot hold"):
    kfac_jax.get_opt_state_partition_specs({}, inv_dtype=jnp.float16)


def test_schedules_are_accepted():
  kfac_jax.scale_by_kfac(
    damping=optax.exponential_decay(1e-2, 100, 0.5),
    learning_rate=optax.cosine_decay_schedule(0.1, 1000),
    inv_update_steps=lambda step: jnp.where(step < 100, 1, 10),
  )
  # A warmup from 0, as optax's warmup schedules start.
  kfac_jax.kfac(
    optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 100), kl_clip=1e-3
  )
  kfac_jax.scale_by_kfac(
    learning_rate=0.0,
    inv_update_steps=lambda step: jnp.where(step < 100, 1, 10),
  )


def test_scale_by_kfac_signature_is_kfac_config_fields():
  """scale_by_kfac declares KFACConfig's fields as its keyword-only arguments
  (same names, order, defaults and annotations): the two cannot drift."""
  fields = [f for f in dataclasses.fields(KFACConfig) if f.init]
  parameters = list(
    inspect.signature(kfac_jax.scale_by_kfac).parameters.values()
  )
  assert [p.name for p in parameters] == [f.name for f in fields]
  for parameter, field in zip(parameters, fields, strict=True):
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, parameter.name
    assert parameter.annotation == field.type, parameter.name
    assert parameter.default == field.default, parameter.name
    assert type(parameter.default) is type(field.default), parameter.name
  with pytest.raises(TypeError):
    kfac_jax.scale_by_kfac(0.1)  # pyright: ignore[reportCallIssue]
  assert "learning_rate: the learning rate" in (
    kfac_jax.scale_by_kfac.__doc__ or ""
  )
  assert "Args: KFACConfig's." not in (kfac_jax.scale_by_kfac.__doc__ or "")
