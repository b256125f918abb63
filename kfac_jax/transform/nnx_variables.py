"""Flax NNX ``Variable``s in optax trees: read as their values, results given
back in the caller's containers.

Flax's functional API hands optax the ``nnx.State`` of ``nnx.split(model,
nnx.Param)``, whose leaves are ``nnx.Param`` variables. jax flattens a
``Variable`` to its value under a ``.value`` key, so a layer's kernel sits
at ``layer/kernel/value``: ``scale_by_kfac`` reads such trees through
``values`` (``layer/kernel``) and hands its results back through ``like``,
in the containers the caller passed, as ``optax.adam`` returns updates of
the gradients' type. (``nnx.Optimizer`` passes bare arrays already.)
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


def _is_variable(node: Any) -> bool:
  return isinstance(node, nnx.Variable)


def _has_variables(tree: Any) -> bool:
  return any(map(_is_variable, jax.tree.leaves(tree, is_leaf=_is_variable)))


def values(tree: Any) -> Any:
  """``tree`` with each NNX ``Variable`` replaced by its value.

  Other nodes (``nnx.State``, dicts, ``optax.MaskedNode``) are kept; a tree
  without variables is returned as it is.

  Examples:
    >>> from flax import nnx
    >>> state = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Param)
    >>> type(state["kernel"]).__name__, type(values(state)["kernel"]).__name__
    ('Param', 'ArrayImpl')
  """
  if not _has_variables(tree):
    return tree
  return jax.tree.map(
    lambda node: node.get_value() if _is_variable(node) else node,
    tree,
    is_leaf=_is_variable,
  )


def like(reference: Any, result: Any) -> Any:
  """``result``, shaped as ``values(reference)``, in ``reference``'s
  containers: each of its ``Variable``s rebuilt (type and metadata) around
  the array at its place, as ``jax.grad`` rebuilds them.

  Raises:
    ValueError: ``result`` is not shaped as ``values(reference)``.
  """
  if not _has_variables(reference):
    return result
  expected = jax.tree.structure(values(reference))
  if jax.tree.structure(result) != expected:
    raise ValueError(
      "kfac_jax: a result does not have the structure of the values of "
      f"the NNX variables it stands for: {jax.tree.structure(result)} "
      f"against {expected}."
    )
  return jax.tree.unflatten(
    jax.tree.structure(reference), jax.tree.leaves(result)
  )
