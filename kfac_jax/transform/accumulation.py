"""Gradient accumulation: ``accumulation_steps`` micro-batches per step.

Each call adds the micro-batch's gradients and (on factor steps) batch
factors to the ``AccumulatorState``; the k-th emits the optimizer step on
their means and resets the sums, the others emit zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import ekfac
from kfac_jax.transform import eigenbasis_scaling as scaling_lib
from kfac_jax.transform import pinning, step
from kfac_jax.transform.config import KFACConfig
from kfac_jax.transform.state import AccumulatorState, ScaleByKFACState


def accumulate(
  config: KFACConfig,
  state: ScaleByKFACState,
  grads: Any,
  inputs: step.StepInputs,
) -> tuple[Any, ScaleByKFACState]:
  """One micro-batch: its sums added, and the optimizer step on the last.

  Args:
    config: the transformation's configuration (``accumulation_steps > 1``).
    state: the state, with its ``accumulator``.
    grads: the micro-batch's gradients.
    inputs: as in ``step.optimizer_step``: its ``batch_factors`` (not
      ``None``) give the micro-batch's factors of the active blocks; with
      ``eigenvalue_correction`` its ``batch_scales`` give the micro-batch's
      EKFAC ``S_batch`` in the given eigenbases, summed in the state's bases
      (which change only at the optimizer step) and carried into the step's
      new ones there.

  Returns:
    The updates (zeros before the last micro-batch) and the new state.
  """
  accumulator = state.accumulator
  # accumulation_steps > 1: init made the accumulator (checks.py checks).
  assert accumulator is not None
  batch_factors, batch_scales = inputs.batch_factors, inputs.batch_scales
  # The step has statistics: check_no_stats refuses NO_STATS here.
  assert batch_factors is not None
  batch_blocks = inputs.active_blocks
  factor_step = state.count % config.factor_update_steps(state.count) == 0
  # Off factor steps the sums are not used; adding zeros keeps the factor
  # computation inside the cond.
  zeros = lambda sums: {
    b: jax.tree.map(jnp.zeros_like, sums[b]) for b in batch_blocks
  }
  batch = lax.cond(
    factor_step, batch_factors, lambda: zeros(accumulator.factors)
  )
  scale_sums = accumulator.scales
  # The state's eigenbases on every device (``Placement.replicated``).
  state_bases = lambda: scaling_lib.eigenbases(
    config.placement.replicated(
      inputs.dims, state.preconditioners, batch_blocks
    )
  )
  if batch_scales is not None:
    sums = accumulator.scales
    assert sums is not None  # EKFAC: init made the sums of S_batch
    batch_s = lax.cond(
      factor_step,
      lambda: batch_scales(state_bases()),
      lambda: zeros(sums),
    )
    scale_sums = pinning.replicate(
      config,
      {b: s + batch_s[b] if b in batch_s else s for b, s in sums.items()},
    )
  # Pinned: G's sums followed a sharded kernel's sharding, off the specs.
  factor_sums = pinning.replicate(
    config,
    {
      block: (
        LayerFactors(*(s + b for s, b in zip(sums, batch[block])))
        if block in batch
        else sums
      )
      for block, sums in accumulator.factors.items()
    },
  )
  gradient_sums = pinning.constrain_to_params(
    config,
    jax.tree.map(
      lambda s, g: s + g.astype(s.dtype), accumulator.gradients, grads
    ),
  )

  def emit():
    # The micro-batches summed: accumulation_steps, unless the state came
    # from a larger accumulation_steps (emitted at once, see below).
    k = (accumulator.micro_step + 1).astype(jnp.float32)
    mean_grads = jax.tree.map(
      lambda s, g: (s / k.astype(s.dtype)).astype(g.dtype), gradient_sums, grads
    )
    # Each micro-batch's cotangents are those of its own mean loss, k
    # times the concatenated batch's: its G is k² times that batch's.
    mean_factors = {
      b: LayerFactors(
        factor_sums[b].activation_factor / k,
        factor_sums[b].gradient_factor / k**3,
      )
      for b in batch_blocks
    }

    def mean_scales(bases):
      # S_batch is quadratic in the cotangents, as G is.
      assert scale_sums is not None  # batch_scales given: EKFAC's sums
      old = state_bases()
      return {
        b: ekfac.reproject(scale_sums[b] / k**3, old[b], bases[b])
        for b in batch_blocks
      }

    new_updates, new_state = step.optimizer_step(
      config,
      state,
      mean_grads,
      inputs._replace(
        batch_factors=lambda: mean_factors,
        factored=None,
        batch_scales=None if batch_scales is None else mean_scales,
      ),
    )
    reset = AccumulatorState(
      micro_step=jnp.zeros([], jnp.int32),
      gradients=optax.tree.zeros_like(gradient_sums),
      factors=pinning.replicate(
        config, jax.tree.map(jnp.zeros_like, factor_sums)
      ),
      scales=jax.tree.map(jnp.zeros_like, scale_sums),
    )
    return new_updates, new_state._replace(accumulator=reset)

  def hold():
    held = AccumulatorState(
      accumulator.micro_step + 1, gradient_sums, factor_sums, scale_sums
    )
    return optax.tree.zeros_like(grads), state._replace(accumulator=held)

  # ">=": a micro_step past the last (a state from a larger
  # accumulation_steps that a traced update could not refuse) emits at once
  # rather than holding forever.
  return lax.cond(
    accumulator.micro_step >= config.accumulation_steps - 1, emit, hold
  )
