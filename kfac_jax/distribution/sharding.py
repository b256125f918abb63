"""Meshes and shardings: the mesh ``scale_by_kfac`` runs under, and arrays
constrained to ``PartitionSpec``s (the params' specs, replicated factors).

``using_mesh`` enters the mesh a ``mesh=`` argument names (or checks the
context's); ``check_params_specs`` matches ``params_partition_specs`` to the
params (an ``nnx.State``'s Variables, ``optax.MaskedNode``s of a chain that
withholds some params).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec


def context_mesh(axes: tuple[str, ...]) -> jax.sharding.AbstractMesh:
  """The mesh of ``jax.set_mesh``; a clear error when there is none."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(
      f"scale_by_kfac with mesh_axes or params_partition_specs (mesh axes "
      f"{list(axes)}) needs a mesh: call init and update inside `with "
      "jax.set_mesh(mesh):` (mesh = jax.make_mesh(...)), and "
      "get_opt_state_partition_specs and recompute_preconditioners there "
      "or with mesh=mesh."
    )
  return mesh


def using_mesh(
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None,
  caller: str,
  abstract_ok: bool = True,
) -> contextlib.AbstractContextManager[Any]:
  """The context in which ``caller`` runs given ``mesh=``.

  ``None``: the context's mesh (``jax.set_mesh``), if any, as it is.
  A ``Mesh`` is set for the call (an ``AbstractMesh`` too where
  ``abstract_ok``: enough to lay out shapes), so that shardings can be built
  before entering the context. Given both, they must be the same mesh.

  Raises:
    TypeError: ``mesh`` is not a mesh (of the kind allowed).
    ValueError: the context holds another mesh than ``mesh`` (other axes,
      sizes or axis types, or the same ones over other devices).
  """
  if mesh is None:
    return contextlib.nullcontext()
  kinds = (
    (jax.sharding.Mesh, jax.sharding.AbstractMesh)
    if abstract_ok
    else (jax.sharding.Mesh,)
  )
  if not isinstance(mesh, kinds):
    raise TypeError(
      f"{caller}: mesh must be a jax.sharding.Mesh (jax.make_mesh(...))"
      f"{' or its AbstractMesh' if abstract_ok else ''}, or None for the "
      f"mesh of jax.set_mesh; got {type(mesh).__name__}."
    )
  abstract = (
    mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
  )
  context = jax.sharding.get_abstract_mesh()
  concrete = jax.sharding.get_mesh()
  if not context.empty and (
    context != abstract
    or (
      isinstance(mesh, jax.sharding.Mesh)
      and not concrete.empty
      and concrete != mesh
    )
  ):
    held = concrete if not concrete.empty else context
    raise ValueError(
      f"{caller}: mesh={_describe_mesh(mesh)} is not the mesh set by "
      f"jax.set_mesh, {_describe_mesh(held)}. Pass the context's mesh, or "
      "leave mesh=None inside the context."
    )
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


def _describe_mesh(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> str:
  """Axes, sizes and kinds; a concrete mesh's devices too (two meshes of
  one shape differ by them)."""
  axes = ", ".join(
    f"{name!r}: {size} {kind.name}"
    for name, size, kind in zip(
      mesh.axis_names, mesh.axis_sizes, mesh.axis_types
    )
  )
  if isinstance(mesh, jax.sharding.Mesh):
    return f"Mesh({axes}; device ids {mesh.device_ids.ravel().tolist()})"
  return f"AbstractMesh({axes})"


def named_axes(spec: PartitionSpec) -> list[str]:
  """The mesh axes a spec names (``None`` and ``UNCONSTRAINED`` name none)."""
  return [
    name
    for entry in spec
    for name in (
      (entry,)
      if isinstance(entry, str)
      else entry
      if isinstance(entry, tuple)
      else ()
    )
  ]


def constrain(
  x: jax.Array, spec: PartitionSpec, axes: tuple[str, ...]
) -> jax.Array:
  """Places ``x`` as ``spec`` on the context mesh, Explicit or Auto axes.

  On Explicit axes the sharding is part of the type and ``reshard`` moves the
  data; on Auto axes ``with_sharding_constraint`` does. The axes ``spec``
  names decide (a mesh may mix both kinds); a spec naming both raises.
  """
  mesh = context_mesh(axes)
  named = named_axes(spec)
  explicit = {
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == jax.sharding.AxisType.Explicit
  }
  if not named:  # Replicated: the mesh's own kind of placement.
    if len(explicit) == len(mesh.axis_names):
      return jax.sharding.reshard(x, spec)
    return lax.with_sharding_constraint(x, spec)
  if all(name in explicit for name in named):
    return jax.sharding.reshard(x, spec)
  if not any(name in explicit for name in named):
    return lax.with_sharding_constraint(x, spec)
  raise ValueError(
    f"kfac_jax cannot place an array as {spec}: it names Explicit and Auto "
    "mesh axes together. Give mesh_axes and params_partition_specs axes "
    "of one kind per spec (jax.make_mesh(..., axis_types=...))."
  )


def constrain_like_params(tree: Any, params_specs: Any) -> Any:
  """Each array of a params-shaped ``tree`` placed as its params spec."""
  specs = check_params_specs(tree, params_specs)
  return jax.tree.map(
    lambda spec, node: jax.tree.map(lambda x: constrain(x, spec, ()), node),
    specs,
    tree,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def check_params_specs(params: Any, params_specs: Any) -> Any:
  """``params_specs`` with ``None`` leaves as ``P()``; must fit ``params``.

  A spec stands for one array: a leaf of ``params``, or a node holding one
  array (an ``nnx.Param`` of ``nnx.state``, as ``nnx.Optimizer`` hands
  ``init``, where ``update`` gets the bare arrays). Where ``params`` hold no
  array (an ``optax.MaskedNode``, ``None``) the result holds that node.
  """
  is_spec = lambda x: isinstance(x, PartitionSpec) or x is None
  specs = _specs_of_held(params_specs, params)
  is_partition_spec = lambda x: isinstance(x, PartitionSpec)
  try:
    arrays = jax.tree.map(
      lambda _, node: len(jax.tree.leaves(node)),
      specs,
      params,
      is_leaf=is_partition_spec,
    )
  except ValueError:
    arrays = None
  if arrays is None or any(count != 1 for count in jax.tree.leaves(arrays)):
    raise ValueError(
      "params_partition_specs must have the structure of the params, with "
      "a PartitionSpec (or None) per array; got "
      f"{jax.tree.structure(params_specs, is_leaf=is_spec)} for params "
      f"{jax.tree.structure(params)}."
    )
  mesh = jax.sharding.get_abstract_mesh()
  for (path, leaf), spec in zip(
    jax.tree_util.tree_flatten_with_path(params)[0],
    jax.tree.leaves(specs, is_leaf=is_partition_spec),
  ):
    if len(spec) > jnp.ndim(leaf):
      raise ValueError(
        f"params_partition_specs at {jax.tree_util.keystr(path)}: {spec} "
        f"has more entries than the array's {jnp.ndim(leaf)} dimensions."
      )
    missing = [a for a in named_axes(spec) if a not in mesh.axis_names]
    if not mesh.empty and missing:
      raise ValueError(
        f"params_partition_specs at {jax.tree_util.keystr(path)}: {spec} "
        f"names {missing}, not axes of the mesh, whose axes are "
        f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}."
      )
  return specs


def _specs_of_held(params_specs: Any, params: Any) -> Any:
  """``params_specs`` with ``None`` specs as ``P()``, and the params' own
  node where they hold no array: ``optax.MaskedNode``s where a chain
  withholds them (``optax.multi_transform``, ``optax.masked``; a whole
  module at once when the mask is a prefix; ``nnx.Optimizer`` wraps each
  in its ``nnx.Param``), or ``None``.

  Specs and params are walked a level at a time; where their structures part,
  the specs are left as given for ``check_params_specs`` to report.
  """
  is_masked = lambda node: isinstance(node, optax.MaskedNode)
  held = jax.tree.leaves(params, is_leaf=is_masked)
  # nnx.Optimizer wraps them: Param(MaskedNode()).
  if params is None or (held and all(map(is_masked, held))):
    return params
  if params_specs is None:
    return PartitionSpec()
  if isinstance(params_specs, PartitionSpec):
    return params_specs
  children = lambda tree: jax.tree_util.tree_flatten(
    tree, is_leaf=lambda node: node is not tree
  )
  spec_children, spec_def = children(params_specs)
  param_children, param_def = children(params)
  if spec_def != param_def:
    return params_specs
  return jax.tree_util.tree_unflatten(
    spec_def,
    [
      _specs_of_held(spec, node)
      for spec, node in zip(spec_children, param_children)
    ],
  )
