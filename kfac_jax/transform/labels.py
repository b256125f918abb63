"""``kfac_labels``: K-FAC's params and the rest, for ``optax.partition``."""

from __future__ import annotations

from typing import Any

import jax

from kfac_jax.capture.layers import BIAS, path_key_name
from kfac_jax.transform import boxing
from kfac_jax.transform.config import KFACConfig


def kfac_labels(
  params: Any,
  *,
  kfac_label: str = "kfac",
  other_label: str = "other",
  **kwargs: Any,
) -> Any:
  """Labels each leaf of ``params`` by whether K-FAC preconditions it.

  The kernel and bias of every layer ``scale_by_kfac(**kwargs)``
  preconditions get ``kfac_label``; every other leaf (embeddings,
  normalization scales, layers ``skip_layers`` or ``max_factor_dim`` leave
  out) gets ``other_label``. With ``optax.partition`` the rest goes to a
  first-order optimizer of its own rather than through K-FAC's chain
  unpreconditioned, as ``optax.contrib.muon`` leaves the params it does not
  orthogonalize to Adam:

  >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, kfac_jax
  >>> model = nn.Sequential([nn.Embed(10, 4), nn.LayerNorm(), nn.Dense(3)])
  >>> params = model.init(jax.random.key(0), jnp.zeros(2, jnp.int32))
  >>> labels = kfac_jax.kfac_labels(params["params"])
  >>> labels["layers_2"], labels["layers_1"]["scale"]
  ({'bias': 'kfac', 'kernel': 'kfac'}, 'other')
  >>> tx = optax.partition(
  ...     {"kfac": kfac_jax.kfac(0.1), "other": optax.adamw(1e-3)}, labels)

  Args:
    params: the params ``tx.init`` gets (arrays, ``jax.eval_shape``
      structs, or Flax-boxed).
    kfac_label: the label of K-FAC's leaves.
    other_label: the label of the others.
    **kwargs: the ``scale_by_kfac`` arguments that choose its layers
      (``layers``, ``skip_layers``, ``max_factor_dim``,
      ``precondition_embeddings``); any other is accepted and checked.

  Returns:
    A tree of the structure of ``params`` holding the labels.
  """
  layers, _ = KFACConfig(**kwargs).find_layers(boxing.unbox(params))
  preconditioned = {
    (*map(path_key_name, layer.path), key)
    for layer in layers.values()
    for key in (layer.kernel_key, BIAS)
  }
  lengths = {len(names) for names in preconditioned}

  def label(path: Any, _: Any) -> str:
    # A prefix: a boxed leaf's path goes on into its box.
    names = tuple(map(path_key_name, path))
    if any(names[:n] in preconditioned for n in lengths):
      return kfac_label
    return other_label

  return jax.tree_util.tree_map_with_path(label, params)
