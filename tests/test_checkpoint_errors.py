"""Checkpoints that cannot be restored or used as asked (a missing directory,
other layers or settings, left-out preconditioners) raise, naming what to
do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kfac_jax
from kfac_jax import checkpoint
from tests.checkpoint_problems import DAMPING, MLP, batches, make_training


def test_recompute_validates_its_configuration():
  with pytest.raises(ValueError, match="damping must be > 0"):
    checkpoint.recompute_preconditioners({}, 0.0)
  with pytest.raises(ValueError, match="compute_method='svd'"):
    checkpoint.recompute_preconditioners({}, 1e-3, compute_method="svd")
  with pytest.raises(ValueError, match="inv_dtype must be a floating"):
    checkpoint.recompute_preconditioners({}, 1e-3, inv_dtype=jnp.int8)
  # "no" was taken as True, None as False (refused only at the next update).
  for flag in ("no", None):
    with pytest.raises(
      TypeError, match="compute_eigenvalue_outer_product must be True or False"
    ):
      checkpoint.recompute_preconditioners(
        {}, 1e-3, compute_eigenvalue_outer_product=flag
      )
  with pytest.raises(TypeError, match="AdaptiveConfig"):
    checkpoint.recompute_preconditioners({}, 1e-3, adaptive=0.95)
  # An adaptive config for a state of the plain mode was silently ignored.
  params, _, _ = make_training()
  state = kfac_jax.scale_by_kfac().init(params)
  with pytest.raises(ValueError, match="not the adaptive mode's"):
    checkpoint.recompute_preconditioners(
      state, DAMPING, adaptive=kfac_jax.AdaptiveConfig()
    )


def test_restore_from_a_missing_directory_names_it(tmp_path):
  # Raised AttributeError: 'NoneType' object has no attribute 'tree'.
  params, _, _ = make_training()
  target = jax.eval_shape(kfac_jax.scale_by_kfac().init, params)
  with pytest.raises(
    FileNotFoundError, match="no checkpoint directory at .*missing"
  ):
    checkpoint.restore(tmp_path / "missing", target)


def test_a_tree_without_a_kfac_state_is_refused_where_it_would_do_nothing(
  tmp_path,
):
  # nnx.state(optimizer) flattens the state into dicts: preconditioners
  # were saved anyway and recompute returned the tree unchanged.
  flattened = {
    "opt": {
      "factors": {"d": jnp.eye(2)},
      "preconditioners": {"d": jnp.eye(2)},
      "count": jnp.zeros([], jnp.int32),
    }
  }
  with pytest.raises(
    ValueError,
    match="no kfac_jax.ScaleByKFACState.*"
    r"nnx.pure\(optimizer.opt_state\)",
  ):
    checkpoint.save(tmp_path / "ckpt", flattened, include_preconditioners=False)
  with pytest.raises(
    ValueError, match="recompute_preconditioners: the tree holds no"
  ):
    checkpoint.recompute_preconditioners(flattened, 1e-3)


def test_restoring_other_layers_lists_missing_and_extra(tmp_path):
  params, tx, _ = make_training()
  saved = {"params": params, "opt_state": tx.init(params)}
  checkpoint.save(tmp_path / "ckpt", saved)
  other_params, other_tx, _ = make_training(MLP(head="classifier"))
  target = jax.eval_shape(
    lambda: {"params": other_params, "opt_state": other_tx.init(other_params)}
  )
  with pytest.raises(ValueError) as error:
    checkpoint.restore(tmp_path / "ckpt", target)
  message = str(error.value)
  assert "opt_state/0" in message
  assert "missing from the checkpoint: ['classifier']" in message
  assert "in the checkpoint but not the target: ['head']" in message

  # Same layers, other shapes.
  narrower_params, narrower_tx, _ = make_training(MLP(hidden=4))
  target = jax.eval_shape(
    lambda: {
      "params": narrower_params,
      "opt_state": narrower_tx.init(narrower_params),
    }
  )
  with pytest.raises(ValueError) as error:
    checkpoint.restore(tmp_path / "ckpt", target)
  message = str(error.value)
  assert "params/hidden/kernel: saved (5, 8), target (5, 4)" in message
  assert (
    "opt_state/0/factors/head/activation_factor: saved (9, 9), target (5, 5)"
  ) in message


def test_restoring_another_configuration_names_the_arrays(tmp_path):
  """Saved without the outer product (no ``damped_inverse``), restored onto
  a target with it: Orbax filled the target's arrays with None silently,
  and the update failed on them."""
  params, tx, _ = make_training(
    compute_method="eigen", compute_eigenvalue_outer_product=False
  )
  saved = {"params": params, "opt_state": tx.init(params)}
  checkpoint.save(tmp_path / "ckpt", saved)
  _, other_tx, _ = make_training(compute_method="eigen")
  target = jax.eval_shape(
    lambda: {"params": params, "opt_state": other_tx.init(params)}
  )
  with pytest.raises(
    ValueError,
    match=(
      r"opt_state/0.*missing from the checkpoint: "
      r"\['preconditioners/head/damped_inverse', "
      r"'preconditioners/hidden/damped_inverse'\].*"
      "compute_eigenvalue_outer_product.*preconditioners=None"
    ),
  ):
    checkpoint.restore(tmp_path / "ckpt", target)


def test_update_without_fitting_preconditioners_points_to_recompute(tmp_path):
  params, tx, step = make_training()
  state = tx.init(params)
  checkpoint.save(tmp_path / "ckpt", state, include_preconditioners=False)
  restored = checkpoint.restore(
    tmp_path / "ckpt", jax.eval_shape(lambda: state)
  )
  x, y = next(batches())
  with pytest.raises(
    ValueError, match="no preconditioners.*recompute_preconditioners"
  ):
    step(params, restored, x, y)
  # Recomputed for another method than the transformation's.
  other = checkpoint.recompute_preconditioners(
    restored, DAMPING, compute_method="eigen"
  )
  with pytest.raises(
    ValueError, match="compute_method.*recompute_preconditioners"
  ):
    step(params, other, x, y)
  step(params, checkpoint.recompute_preconditioners(restored, DAMPING), x, y)


def test_restoring_without_a_saved_kfac_state_is_a_value_error(tmp_path):
  params, tx, _ = make_training()
  checkpoint.save(tmp_path / "ckpt", {"params": params})
  target = jax.eval_shape(
    lambda: {"params": params, "opt_state": tx.init(params)}
  )
  with pytest.raises(ValueError, match="no K-FAC state at opt_state/0"):
    checkpoint.restore(tmp_path / "ckpt", target)
