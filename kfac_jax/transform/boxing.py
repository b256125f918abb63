"""Flax partitioning boxes in optax trees: unboxed for K-FAC, kept for the user.

Flax Linen params made with ``nn.with_logical_partitioning`` or
``nn.with_partitioning`` hold each annotated array in a box
(``nn.LogicallyPartitioned``, ``nn.Partitioned``: ``flax.core.meta``'s
``AxisMetadata``) that carries its axis names. jax differentiates through
the boxes and optax's ``tree_map``-built states keep them, so a program
shards everything from ``nn.get_partition_spec`` of its trees and its
logical axis rules. K-FAC reads kernel shapes and layer paths, so its entry
points take the arrays (``unbox``) and hand their results back in the
caller's boxes (``like``); ``init`` boxes the params-shaped parts of its
state as the params and its packed preconditioner rows as the mesh axes
they are spread over (``box_state``), so that the whole state shards from
its boxes as well.

The rows' box names mesh axes, not logical ones (an ``nn.Partitioned``):
``mesh_axes`` for their first dimension. Flax's ``nn.logical_to_mesh``
passes an entry of several axes through unchanged (only string entries are
logical names), so ``nn.logical_to_mesh_sharding(nn.get_partition_spec(
opt_state), mesh, rules)`` places them over ``mesh_axes`` whatever the
user's rules are; a single axis is a string there (``PartitionSpec`` makes
one-axis tuples strings), which the rules must map to itself.
``get_opt_state_partition_specs(logical_axis_rules=...)`` reads the box
types (``partition_specs``), and needs neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from flax.core import meta
from flax.linen import spmd
from jax.sharding import PartitionSpec

from kfac_jax.distribution.placement import ShardedPreconditioners
from kfac_jax.transform.state import ScaleByKFACState

# Flax's logical axis rules: (logical name, mesh axis or axes or None) pairs.
LogicalRules = Sequence[tuple[str, str | Sequence[str] | None]]


def is_box(node: Any) -> bool:
  """Whether ``node`` is a Flax metadata box (``flax.core.meta.AxisMetadata``).

  NNX ``Variable``s are not boxes: ``nnx_variables`` reads those.
  """
  return isinstance(node, meta.AxisMetadata)


def has_boxes(tree: Any) -> bool:
  """Whether any node of ``tree`` is a Flax metadata box."""
  return any(map(is_box, jax.tree.leaves(tree, is_leaf=is_box)))


def _content(box: meta.AxisMetadata) -> Any:
  """What ``box`` holds, without the sharding constraint that ``Partitioned``
  puts on it under a global mesh: K-FAC only reads the arrays, which are
  already where the caller placed them."""
  if isinstance(box, meta.Partitioned):
    return box.unbox(apply_constraint=False)
  return box.unbox()


def unbox(tree: Any) -> Any:
  """``tree`` with every box replaced by its contents (boxes in boxes too).

  A tree without boxes is returned as it is.

  Examples:
    >>> import flax.linen as nn, jax.numpy as jnp
    >>> boxed = {"kernel": nn.LogicallyPartitioned(jnp.ones((2, 3)),
    ...                                            ("embed", "mlp"))}
    >>> type(unbox(boxed)["kernel"]).__name__
    'ArrayImpl'
  """
  if not has_boxes(tree):
    return tree
  return jax.tree.map(
    lambda node: unbox(_content(node)) if is_box(node) else node,
    tree,
    is_leaf=is_box,
  )


def like(reference: Any, result: Any) -> Any:
  """``result``, shaped as ``unbox(reference)``, in ``reference``'s boxes.

  Each box of ``reference`` is rebuilt (type and metadata) around the
  subtree of ``result`` at its place, as ``jax.grad`` rebuilds them.

  Raises:
    ValueError: ``result`` is not shaped as ``unbox(reference)``.
  """
  if not has_boxes(reference):
    return result
  expected = jax.tree.structure(unbox(reference))
  if jax.tree.structure(result) != expected:
    raise ValueError(
      "kfac_jax: a result does not have the structure of the Flax-boxed "
      f"tree it stands for: {jax.tree.structure(result)} against "
      f"{expected}."
    )

  def rebox(node: Any, value: Any) -> Any:
    if not is_box(node):
      return value
    return node.replace_boxed(like(_content(node), value))

  return jax.tree.map(rebox, reference, result, is_leaf=is_box)


def box_rows(
  preconditioners: Any, mesh_axes: str | Sequence[str] | None
) -> Any:
  """Packed preconditioner rows in an ``nn.Partitioned`` over ``mesh_axes``.

  ``nn.get_partition_spec`` then gives them the spec their placement lays
  them out with, ``PartitionSpec(mesh_axes)``; per-layer preconditioners
  (no ``mesh_axes``) are replicated, unboxed.
  """
  if not isinstance(preconditioners, ShardedPreconditioners) or is_box(
    preconditioners.rows
  ):
    return preconditioners
  assert mesh_axes is not None  # packed rows are spread over mesh_axes
  axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
  rows = preconditioners.rows
  names = (axes,) + (None,) * (rows.ndim - 1)
  # Flax types a box's names as one axis each; an entry of several mesh
  # axes passes through nn.logical_to_mesh unchanged (see above).
  boxed = meta.Partitioned(rows, names)  # pyright: ignore[reportArgumentType]
  return preconditioners._replace(rows=boxed)


def box_state(
  state: ScaleByKFACState, params: Any, mesh_axes: str | Sequence[str] | None
) -> ScaleByKFACState:
  """``state`` of boxed ``params``: its params-shaped parts (accumulated
  gradients, the adaptive mode's previous update) in the params' boxes, its
  packed rows boxed by ``box_rows``; factors and counters, replicated, stay
  arrays."""
  accumulator, model = state.accumulator, state.quadratic_model
  return state._replace(
    accumulator=None
    if accumulator is None
    else accumulator._replace(gradients=like(params, accumulator.gradients)),
    quadratic_model=None
    if model is None
    else model._replace(previous_update=like(params, model.previous_update)),
    preconditioners=box_rows(state.preconditioners, mesh_axes),
  )


def boxed_transformation(
  tx: optax.GradientTransformationExtraArgs,
  mesh_axes: str | Sequence[str] | None,
) -> optax.GradientTransformationExtraArgs:
  """``tx`` (``scale_by_kfac``'s on arrays) for trees that may hold boxes.

  ``init`` of boxed params gives a state boxed by ``box_state``; ``update``
  reads the arrays of its boxed arguments and returns the updates and state
  in the boxes it was given. Trees without boxes pass through unchanged.
  """

  def init(params: Any) -> Any:
    state = tx.init(unbox(params))
    if not has_boxes(params):
      return state
    # tx is scale_by_kfac's, whose state optax types as a generic ArrayTree.
    return box_state(state, params, mesh_axes)  # pyright: ignore[reportArgumentType]

  def update(
    updates: Any, state: Any, params: Any = None, **extra_args: Any
  ) -> tuple[Any, Any]:
    new_updates, new_state = tx.update(
      unbox(updates), unbox(state), unbox(params), **extra_args
    )
    return like(updates, new_updates), like(state, new_state)

  return optax.GradientTransformationExtraArgs(init, update)


def partition_specs(tree: Any, rules: LogicalRules | None) -> Any:
  """Mesh ``PartitionSpec``s of a boxed tree (arrays or their shapes).

  A ``nn.LogicallyPartitioned`` box's logical names go through ``rules``
  (or, without them, the box's own rules, or those of an enclosing
  ``nn.logical_axis_rules``); an ``nn.Partitioned`` box names mesh axes;
  any other array is replicated. Entries that are tuples of mesh axes (the
  packed rows' ``box_rows``) pass through.

  Raises:
    ValueError: a ``nn.LogicallyPartitioned`` box and no rules from any of
      the three sources.
  """

  def spec(node: Any) -> PartitionSpec | None:
    if isinstance(node, spmd.LogicallyPartitioned):
      node_rules = (
        rules
        if rules is not None
        else (node.rules or nn.get_logical_axis_rules())
      )
      if not node_rules:
        raise ValueError(
          "get_opt_state_partition_specs: the params hold "
          f"nn.LogicallyPartitioned boxes (axis names {node.names}) and no "
          "logical axis rules map those names to mesh axes. Pass "
          "logical_axis_rules=[(logical name, mesh axis), ...], or call it "
          "inside `with nn.logical_axis_rules(rules):`."
        )
      # The user's rules, passed on as given (Flax types a rule's mesh axes
      # as a string, a tuple or None; ours admit any sequence).
      return spmd.logical_to_mesh_axes(node.names, node_rules)  # pyright: ignore[reportArgumentType]
    if isinstance(node, meta.Partitioned):
      return node.get_partition_spec()
    if is_box(node):  # Another kind of box: what it holds is replicated.
      node = unbox(node)
    return None if node is None else PartitionSpec()

  return jax.tree.map(spec, tree, is_leaf=is_box)
