"""KL clipping (KAISA): bounds the step's predicted change of the output."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kfac_jax.linalg import tree_inner_products


def kl_clip_scale(
  preconditioned: Sequence[jax.Array],
  gradients: Sequence[jax.Array],
  rate: jax.Array,
  kl_clip: jax.Array,
) -> jax.Array:
  """``ν = min(1, √(kl_clip / |vg|))`` with ``vg = r² Σ_layers Σ(P ⊙ ∇)``.

  ``r`` (``rate``) is the factor the step applies to ``P``: KAISA's learning
  rate, or with the chained momentum μ, ``lr / (1 − μ)``, the step it
  settles at. ``ν = 1`` when ``vg = 0`` (nothing to clip).

  Args:
    preconditioned: the layers' ``P`` ``[dA, dG]``.
    gradients: the layers' ``∇``, in the same order.
    rate: ``r``, a scalar ≥ 0.
    kl_clip: κ > 0.

  Returns:
    ``ν``, a float32 scalar in (0, 1].
  """
  vg = (
    rate**2
    * tree_inner_products((list(preconditioned), list(gradients)), [(0, 1)])[0]
  )
  vg = jnp.abs(vg)
  safe_vg = jnp.where(vg > 0, vg, 1.0)
  return jnp.where(vg > 0, jnp.minimum(1.0, jnp.sqrt(kl_clip / safe_vg)), 1.0)
