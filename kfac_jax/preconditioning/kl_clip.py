"""KL clipping (KAISA): bound the step's predicted change of the model output."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def kl_clip_scale(preconditioned: Sequence[jax.Array],
                  gradients: Sequence[jax.Array], learning_rate: jax.Array,
                  kl_clip: jax.Array) -> jax.Array:
  """``ν = min(1, √(kl_clip / |vg|))`` with ``vg = lr² Σ_layers Σ(P ⊙ ∇)``.

  ``ν = 1`` when ``vg = 0`` (nothing to clip).
  """
  # vdot, not sum(p * g): on XLA:CPU the latter is a materialized product
  # and a windowed tree reduction per layer; a dot is one kernel.
  vg = learning_rate**2 * sum(
      jnp.vdot(p.astype(jnp.float32), g.astype(jnp.float32),
               precision=lax.Precision.HIGHEST)
      for p, g in zip(preconditioned, gradients))
  vg = jnp.abs(vg)
  safe_vg = jnp.where(vg > 0, vg, 1.0)
  return jnp.where(vg > 0, jnp.minimum(1.0, jnp.sqrt(kl_clip / safe_vg)), 1.0)
