"""Sharding constraints that keep K-FAC's state where its specs say.

With ``params_partition_specs`` the gradients and updates follow the
params' specs (``constrain_to_params``), the factors stay replicated
(``replicate``) and the preconditioners follow
``placement.partition_specs`` (``pin_to_specs``), as
``get_opt_state_partition_specs`` gives them; without it each is the
identity.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

from kfac_jax.distribution import sharding
from kfac_jax.distribution.layout import Dims
from kfac_jax.transform.config import KFACConfig


def constrain_to_params(config: KFACConfig, tree: Any) -> Any:
  """``tree`` (params-shaped) constrained to ``params_partition_specs``."""
  if config.params_partition_specs is None:
    return tree
  return sharding.constrain_like_params(tree, config.params_partition_specs)


def replicate(config: KFACConfig, tree: Any) -> Any:
  """``tree`` pinned replicated, as factors are (with sharded kernels the
  factor products would otherwise follow them)."""
  if config.params_partition_specs is None:
    return tree
  return jax.tree.map(
    lambda x: sharding.constrain(x, PartitionSpec(), ()), tree
  )


def pin_to_specs(
  config: KFACConfig, factors: Any, preconditioners: Any, dims: Dims
) -> tuple[Any, Any]:
  """Factors replicated, preconditioners as ``placement.partition_specs``.

  With sharded kernels and no ``mesh_axes`` nothing else pins them: the
  in-place preconditioning of a sharded kernel pulled its preconditioner,
  the decomposition and the running factors onto the kernel's sharding,
  off ``get_opt_state_partition_specs`` (a donated step then compiled
  twice), or into shardings XLA could not lay out.
  """
  if config.params_partition_specs is None:
    return factors, preconditioners
  place = lambda spec, x: sharding.constrain(x, spec, ())
  is_spec = lambda x: isinstance(x, PartitionSpec)
  preconditioners = jax.tree.map(
    place,
    config.placement.partition_specs(dims),
    preconditioners,
    is_leaf=is_spec,
  )
  return replicate(config, factors), preconditioners
