"""The state's scaling in the Kronecker eigenbasis, step by step.

With ``eigenvalue_correction`` (EKFAC's ``S``, ``preconditioning.ekfac``) or
``second_moment_decay`` (the gradient's ``v``,
``preconditioning.second_moment``) the eigen method divides the rotated
gradient by a ``[dA, dG]`` scaling kept in the state
(``eigenvalue_scales``) in place of ``outer(d_A, d_G)``. Each step carries
it into the step's eigenbases, then updates it: ``S`` from the batch's
rows on factor steps, ``v`` from the gradient every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax import finite
from kfac_jax import hyperparameters as hp
from kfac_jax.preconditioning import ekfac, second_moment
from kfac_jax.preconditioning.eigen import EigenPreconditioner
from kfac_jax.preconditioning.methods import Preconditioner
from kfac_jax.transform.config import KFACConfig
from kfac_jax.transform.state import ScaleByKFACState

if TYPE_CHECKING:
  from kfac_jax.transform.step import StepInputs

Blocks = dict[str, jax.Array]


def eigenbases(
  preconditioners: Mapping[str, Preconditioner],
) -> Mapping[str, EigenPreconditioner]:
  """``preconditioners`` as the eigen method's, which EKFAC's are: it needs
  that method (``KFACConfig`` checks), which a placement's type does not
  carry."""
  return cast(Mapping[str, EigenPreconditioner], preconditioners)


def eigenbasis_scaling(
  config: KFACConfig,
  state: ScaleByKFACState,
  inputs: StepInputs,
  bases: Mapping[str, EigenPreconditioner],
  gradients: Blocks,
  decomposition_step: jax.Array,
) -> tuple[Blocks, Blocks]:
  """The state's scaling in the eigenbasis after this step (EKFAC's ``S``
  or the gradient's ``v``), and what ``precondition`` divides by in place of
  ``outer(d_A, d_G)``: ``S``, or ``√v̂`` (``second_moment``)."""
  carried = carried_scales(config, state, inputs, bases, decomposition_step)
  decay = config.second_moment_decay
  if decay is None:
    scales = update_scales(config, state, inputs, bases, carried)
    return scales, scales
  new = {
    b: second_moment.update_moment(
      carried[b], gradients[b], bases[b], decay(state.count)
    )
    for b in gradients
  }
  # A non-finite gradient (or a scheduled β out of range) leaves v as it was.
  ok = finite.all_finite(new)
  decay_ok = hp.all_valid(state.count, decay)
  if decay_ok is not None:
    ok = ok & decay_ok
  moments = {
    b: (jnp.where(ok, new[b], v) if b in new else v) for b, v in carried.items()
  }
  return moments, {
    b: second_moment.root_mean_square(v, decay(state.count), state.count)
    for b, v in moments.items()
  }


def carried_scales(
  config: KFACConfig,
  state: ScaleByKFACState,
  inputs: StepInputs,
  bases: Mapping[str, EigenPreconditioner],
  decomposition_step: jax.Array,
) -> Blocks:
  """The state's ``S`` (or ``v``) in ``bases``, the active blocks'
  eigenbases after this step's decomposition, on every device
  (``Placement.replicated``).

  On decomposition steps it is carried from the state's eigenbases into
  these (``ekfac.reproject``); a non-finite one (a corrupted restore), or a
  state packed in another layout (whose old bases cannot be read), restarts
  there: ``S`` from K-FAC's ``outer(d_A, d_G)``, ``v`` from 0.
  """
  dims, active_blocks = inputs.dims, inputs.active_blocks
  # The state carries S or v (init made it, checks.py checks).
  assert state.eigenvalue_scales is not None
  current = dict(state.eigenvalue_scales)
  stale = config.placement.stale(dims, state.preconditioners)
  refresh = decomposition_step if stale is None else decomposition_step | stale

  def restart(b: str) -> jax.Array:
    if config.eigenvalue_correction:
      return ekfac.kfac_scales(bases[b])
    return jnp.zeros_like(current[b])

  def reprojected():
    old = eigenbases(
      config.placement.replicated(dims, state.preconditioners, active_blocks)
    )
    carried = dict(current)
    for b in active_blocks:
      moved = ekfac.reproject(current[b], old[b], bases[b])
      keep = jnp.isfinite(jnp.sum(moved))
      if stale is not None:
        keep = keep & ~stale
      carried[b] = jnp.where(keep, moved, restart(b))
    return carried

  return lax.cond(refresh, reprojected, lambda: current)


def update_scales(
  config: KFACConfig,
  state: ScaleByKFACState,
  inputs: StepInputs,
  bases: Mapping[str, EigenPreconditioner],
  scales: Blocks,
) -> Blocks:
  """EKFAC's running ``S`` after this step (``preconditioning.ekfac``).

  ``scales``: ``S`` in ``bases``, this step's (``carried_scales``). On factor
  steps it is averaged with the batch's, ``S ← d·S + (1 − d)·S_batch``; a
  batch with NaN/Inf (or a scheduled ``d`` out of range) is left out, as it
  is from the factors, and so is an accumulated batch on a state of another
  layout (its micro-batches were summed in the old bases).
  """
  count, batch_scales = state.count, inputs.batch_scales
  stale = config.placement.stale(inputs.dims, state.preconditioners)
  factor_step = count % config.factor_update_steps(count) == 0

  if batch_scales is None:  # a step without statistics (NO_STATS)
    return scales

  def averaged():
    new = batch_scales(bases)
    ok = finite.all_finite(new)
    if stale is not None and config.accumulation_steps > 1:
      ok = ok & ~stale
    decay_ok = hp.all_valid(count, config.factor_decay)
    if decay_ok is not None:
      ok = ok & decay_ok
    decay = config.factor_decay(count)
    return {
      b: (jnp.where(ok, decay * s + (1 - decay) * new[b], s) if b in new else s)
      for b, s in scales.items()
    }

  return lax.cond(factor_step, averaged, lambda: scales)
