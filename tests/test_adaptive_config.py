"""The adaptive mode's settings and ``SplitLoss``: every invalid one refused
early, with the offending name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import reference
from tests.adaptive_problems import (
  SIGMOID_STEP_TERMS,
  adaptive_tx,
  run_steps,
  sigmoid_problem,
)

close = reference.assert_float32_close


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(kl_clip=0.01), ValueError, "kl_clip=None"),
    (
      dict(kl_clip=None, accumulation_steps=2),
      ValueError,
      "accumulation_steps",
    ),
    (
      dict(kl_clip=None, damping=optax.constant_schedule(1.0)),
      TypeError,
      "initial",
    ),
    (
      dict(kl_clip=None, damping=5000.0),
      ValueError,
      r"damping=5000.0.*\[min_damping=0.0001, max_damping=1000.0\]",
    ),
    (dict(kl_clip=None, damping=1e-5), ValueError, "min_damping"),
  ],
)
def test_incompatible_settings_are_rejected(kwargs, error, match):
  with pytest.raises(error, match=match):
    kfac_jax.scale_by_kfac(adaptive=kfac_jax.AdaptiveConfig(), **kwargs)


@pytest.mark.parametrize(
  "config, match",
  [
    (dict(min_damping=0.0), "min_damping"),
    (dict(min_damping=2.0, max_damping=1.0), "max_damping"),
    (dict(damping_adaptation_decay=1.0), "decay"),
    (dict(damping_adaptation_interval=0), "interval"),
    # 0 in float32: λ then reached 0 and updates stayed 0.
    (dict(min_damping=1e-50), "min_damping=1e-50 is below float32"),
    # inf in float32: λ reached it and every later update was zero.
    (dict(max_damping=1e39), "max_damping=1e\\+39 is past float32"),
    (dict(max_damping=float("nan")), "max_damping must be finite"),
    # ω = decay^interval was 1 in float32: λ never moved.
    (dict(damping_adaptation_decay=1 - 1e-9), "rounds to 1 in float32"),
    # Failed in the first jitted update, naming no field.
    (dict(damping_adaptation_interval=2**40), "interval must fit in int32"),
  ],
)
def test_invalid_adaptive_config(config, match):
  with pytest.raises(ValueError, match=match):
    kfac_jax.scale_by_kfac(
      kl_clip=None, adaptive=kfac_jax.AdaptiveConfig(**config)
    )


@pytest.mark.parametrize(
  "config",
  [
    dict(min_damping="1e-4"),
    dict(max_damping=None),
    dict(damping_adaptation_decay=None),
  ],
)
def test_adaptive_config_of_the_wrong_type_names_the_field(config):
  (name,) = config
  with pytest.raises(TypeError, match=f"AdaptiveConfig.{name} must be a real"):
    kfac_jax.scale_by_kfac(
      kl_clip=None, adaptive=kfac_jax.AdaptiveConfig(**config)
    )


def test_adaptive_config_class_instead_of_an_instance_says_so():
  with pytest.raises(TypeError, match=r"pass an instance, AdaptiveConfig\(\)"):
    kfac_jax.scale_by_kfac(kl_clip=None, adaptive=kfac_jax.AdaptiveConfig)


def test_adaptive_config_of_numpy_and_jax_scalars_trains_as_python_numbers():
  # 0-d arrays were refused ("must be a real number", "positive integer").
  params, batch, split, loss_fn = sigmoid_problem()
  python = dict(
    min_damping=1e-3,
    max_damping=100.0,
    damping_adaptation_decay=0.5,
    damping_adaptation_interval=2,
    use_momentum=True,
  )
  arrays = dict(
    min_damping=jnp.asarray(1e-3),
    max_damping=np.asarray(100.0),
    damping_adaptation_decay=np.float32(0.5),
    damping_adaptation_interval=np.asarray(2),
    use_momentum=jnp.asarray(True),
  )
  runs = [
    run_steps(adaptive_tx(**config), params, batch, split, loss_fn, 4)
    for config in (python, arrays)
  ]
  for (_, state, history), (_, other_state, other_history) in zip(
    runs[:1], runs[1:]
  ):
    assert float(state.quadratic_model.damping) != 1.0  # it adapted
    # At most one λ·ω a step over 4 steps, ω = decay² each time (2).
    close(
      other_state.quadratic_model.damping,
      state.quadratic_model.damping,
      terms=4 * 3,
    )
    # Each step's rounding (SIGMOID_STEP_TERMS) through K-FAC's conditioning
    # at the smallest λ (the configs' min_damping), carried by the next.
    condition = reference.kfac_condition(state.factors, 1e-3)
    for k, (step, other_step) in enumerate(zip(history, other_history)):
      scale = reference.largest(jax.tree.leaves(step[2]))
      for a, b in zip(jax.tree.leaves(step[2]), jax.tree.leaves(other_step[2])):
        close(
          a,
          b,
          terms=(k + 1) * SIGMOID_STEP_TERMS,
          condition=condition,
          scale=scale,
        )


def test_state_of_another_configuration_is_refused():
  params, batch, split, loss_fn = sigmoid_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  plain = kfac_jax.scale_by_kfac(kl_clip=None)
  adaptive, accumulating = (
    adaptive_tx(),
    kfac_jax.scale_by_kfac(accumulation_steps=4),
  )
  for tx, state, match in (
    (adaptive, plain.init(params), "lacks the quadratic_model"),
    (plain, adaptive.init(params), "has the quadratic_model"),
    (accumulating, plain.init(params), "lacks the accumulator"),
    (plain, accumulating.init(params), "has the accumulator"),
  ):
    extra = dict(split_loss=split) if tx is adaptive else {}
    with pytest.raises(ValueError, match=match):
      tx.update(grads, state, params, kfac_stats=stats, **extra)


def test_split_loss_given_to_a_transformation_built_without_adaptive():
  # It was silently ignored: the user likely meant the adaptive mode.
  params, batch, split, loss_fn = sigmoid_problem()
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  tx = kfac_jax.scale_by_kfac(kl_clip=None)
  with pytest.raises(ValueError, match="split_loss.*without adaptive"):
    tx.update(
      grads, tx.init(params), params, kfac_stats=stats, split_loss=split
    )


def test_update_without_split_loss_says_what_to_pass():
  params, batch, split, loss_fn = sigmoid_problem()
  tx = adaptive_tx()
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, *batch)
  with pytest.raises(ValueError, match="split_loss"):
    tx.update(grads, state, params, kfac_stats=stats)
  with pytest.raises(TypeError, match="SplitLoss"):
    tx.update(
      grads,
      state,
      params,
      kfac_stats=stats,
      split_loss=(split.outputs_fn, split.loss_fn),
    )


@pytest.mark.parametrize(
  "piece, malformed",
  [
    (
      "loss_fn",
      lambda split: split._replace(loss_fn=lambda o: jnp.sum(o, axis=-1)),
    ),  # per example
    (
      "loss_fn",
      lambda split: split._replace(loss_fn=lambda o: split.loss_fn(o)[None]),
    ),  # shape (1,)
    (
      "loss_fn",
      lambda split: split._replace(loss_fn=lambda o: jnp.sum(o > 0)),
    ),  # integer
    (
      "regularizer",
      lambda split: split._replace(regularizer=lambda p: jnp.ones(3)),
    ),
  ],
)
def test_a_malformed_split_loss_is_named(piece, malformed):
  # jax's own error ("Gradient only defined for scalar-output functions")
  # named no piece of the SplitLoss.
  params, batch, split, loss_fn = sigmoid_problem()
  with pytest.raises(
    ValueError, match=f"SplitLoss.{piece} must return a floating scalar"
  ):
    run_steps(adaptive_tx(), params, batch, malformed(split), loss_fn, 1)
