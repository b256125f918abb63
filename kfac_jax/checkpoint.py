"""Checkpoints of K-FAC optimizer states with ``orbax.checkpoint``.

``save(directory, tree)`` writes any pytree that holds ``ScaleByKFACState``s
(the state alone, an optax chain's state, or a whole
``{"params": ..., "opt_state": ...}``) to a new directory;
``restore(directory, target)`` reads it back bit for bit, placing every array
with the sharding of the matching ``target`` leaf. The target is abstract, so a
state saved on one mesh restores onto another mesh or onto one device::

  with jax.set_mesh(mesh):
    target = jax.eval_shape(lambda: {"params": params,
                                     "opt_state": tx.init(params)})
    restored = kfac_jax.checkpoint.restore(path, target)

On Explicit axes ``eval_shape`` gives every leaf its sharding (over the
abstract mesh; ``restore`` places it on the mesh set then); leaves without
one are restored replicated over the mesh set, or onto the default device
when none is. ``get_opt_state_partition_specs`` gives the state's specs for
an explicit target (a ``mesh_axes`` state's rows must be sharded over its
axes on Explicit axes).

``save(..., include_preconditioners=False)`` leaves the eigenbases/inverses
out: they are a function of the factors, and for a layer with ``dA`` inputs and
``dG`` outputs they take ``dA² + dG² (+ dA·dG)`` numbers beside the factors'
``dA² + dG²``. ``restore`` then returns every K-FAC state with
``preconditioners=None``; ``recompute_preconditioners`` decomposes the restored
factors again before the next update (what KAISA does on load).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from kfac_jax import hyperparameters as hp
from kfac_jax.capture.layers import path_key_name
from kfac_jax.distribution.placement import ShardedPreconditioners
from kfac_jax.distribution.sharding import using_mesh
from kfac_jax.factors.running import factor_dims
from kfac_jax.hyperparameters import ComputeMethod, ScalarOrSchedule
from kfac_jax.transform import boxing, quadratic_model
from kfac_jax.transform.config import KFACConfig
from kfac_jax.transform.state import (
  ScaleByKFACState,
  decomposition_counts,
  with_counts,
)
from kfac_jax.transform.step import guarded_decomposition

_KeyPath = tuple[str, ...]


def _is_kfac_state(node: Any) -> bool:
  return isinstance(node, ScaleByKFACState)


def _map_kfac_states(
  fn: Callable[[_KeyPath, ScaleByKFACState], Any],
  tree: Any,
  caller: str | None = None,
) -> Any:
  """Replaces every ``ScaleByKFACState`` in ``tree`` by ``fn(path, state)``.

  With ``caller`` named, a tree without one raises: ``fn`` would silently do
  nothing (Flax NNX's ``nnx.state(optimizer)`` flattens the state into dicts
  of variables).
  """
  found = []

  def visit(path: Sequence[Any], node: Any) -> Any:
    if not _is_kfac_state(node):
      return node
    found.append(path)
    return fn(_key_path(path), node)

  result = jax.tree_util.tree_map_with_path(visit, tree, is_leaf=_is_kfac_state)
  if caller is not None and not found:
    raise ValueError(
      f"checkpoint.{caller}: the tree holds no kfac_jax.ScaleByKFACState. "
      "Pass the optimizer state as optax returns it; with Flax NNX, "
      "nnx.pure(optimizer.opt_state) (nnx.as_pure from flax 0.12.12 on; "
      "nnx.state(optimizer) flattens it)."
    )
  return result


def save(
  directory: epath.PathLike, tree: Any, *, include_preconditioners: bool = True
) -> None:
  """Writes ``tree`` to ``directory`` (which must not exist yet) and waits.

  Every process of a multi-process program calls it with the same
  ``directory`` (Orbax writes each array's shards from the processes that
  hold them and synchronises them).

  Args:
    directory: the checkpoint directory, any path Orbax takes: a local path
      (made absolute, as Orbax requires), a ``gs://`` URL, an
      ``etils.epath.Path``.
    tree: a pytree of arrays holding any number of ``ScaleByKFACState``s.
    include_preconditioners: ``False`` stores each K-FAC state with
      ``preconditioners=None``; restore it with ``recompute_preconditioners``.
  """
  if not include_preconditioners:
    tree = _map_kfac_states(
      lambda _, s: s._replace(preconditioners=None),
      tree,
      "save(include_preconditioners=False)",
    )
  # Leaving the context waits for the (asynchronous) save to be committed.
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(_path(directory), tree)


def restore(directory: epath.PathLike, target: Any) -> Any:
  """Reads the tree saved in ``directory`` onto the structure of ``target``.

  Args:
    directory: a directory written by ``save`` (any path Orbax takes, as
      there); every process of a multi-process program calls ``restore``.
    target: the tree to restore into, e.g. ``jax.eval_shape`` of the saved
      tree, with the same structure, shapes and layers. Its leaves are
      ``jax.ShapeDtypeStruct``s or arrays; each restored array gets the leaf's
      sharding and dtype (values are cast when it is not the saved dtype;
      with the saved dtypes the restore is bit for bit). A sharding over an
      abstract mesh is placed on the mesh set by ``jax.set_mesh``; a leaf
      without one goes replicated over that mesh, or, when none is set, to
      the default device of each process (its first local device).

  Returns:
    The restored tree. K-FAC states saved without preconditioners, or whose
    target has ``preconditioners=None`` (the saved ones are then not read),
    come back with ``preconditioners=None``: ``recompute_preconditioners``
    makes them, e.g. for another device count or strategy. Packed rows
    saved before states had a ``layout_fingerprint`` come back with
    fingerprint −1, which no layout has: the next ``update`` decomposes them
    again.

  Raises:
    ValueError: a leaf is sharded over an abstract mesh other than the
      mesh set (or none is set); a K-FAC state of ``target`` has no saved
      counterpart at the same place, or registers other layers than it (the
      message lists the missing and the extra ones); an array has another shape
      than the saved one (the message lists them); Orbax's own ValueError when
      the rest of the structure disagrees.
    FileNotFoundError: ``directory`` does not exist.
  """
  directory = _path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(
      f"checkpoint.restore: no checkpoint directory at {str(directory)!r} (the "
      "path given to checkpoint.save)."
    )
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.metadata(directory).item_metadata.tree
  # Saved arrays the target leaves out: only preconditioners (read partially).
  partial = False
  # {path of a K-FAC state: its fingerprint's restore spec}, for rows saved
  # before ShardedPreconditioners had a layout_fingerprint.
  unfingerprinted = {}

  def match_saved(path: _KeyPath, state: ScaleByKFACState) -> ScaleByKFACState:
    nonlocal partial
    saved_state = _saved_node(saved, path, directory)
    _check_layers(
      path, set(state.factors), set(saved_state["factors"] or {}), directory
    )
    saved_preconditioners = saved_state["preconditioners"]
    # A state saved without preconditioners has None there; Orbax restores
    # only onto a target of the saved structure.
    if saved_preconditioners is None:
      state = state._replace(preconditioners=None)
    elif state.preconditioners is None:
      partial = True  # Dropped: recompute_preconditioners makes them again.
    elif isinstance(state.preconditioners, ShardedPreconditioners) and (
      isinstance(saved_preconditioners, dict)
      and "layout_fingerprint" not in saved_preconditioners
    ):
      partial = True
      unfingerprinted[path] = _abstract(
        path, state.preconditioners.layout_fingerprint
      )
      state = state._replace(
        preconditioners=state.preconditioners._replace(layout_fingerprint=None)
      )
    _check_fields(path, saved_state, state, directory)
    return state

  target = _map_kfac_states(match_saved, target)
  # Checked here: Orbax notices a wrong shape only while reading, and leaves
  # its unfinished reads to be garbage-collected.
  _check_saved_shapes(saved, target, directory)
  target = jax.tree_util.tree_map_with_path(_abstract, target)
  if not partial:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(directory, target)
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(
      directory,
      args=ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
      ),
    )

  def stale_fingerprint(
    path: _KeyPath, state: ScaleByKFACState
  ) -> ScaleByKFACState:
    if path not in unfingerprinted:
      return state
    # No layout fingerprint is negative: the next update decomposes them.
    spec = unfingerprinted[path]
    preconditioners = state.preconditioners
    assert isinstance(preconditioners, ShardedPreconditioners)  # packed rows
    return state._replace(
      preconditioners=preconditioners._replace(
        layout_fingerprint=jax.device_put(np.int32(-1), spec.sharding)
      )
    )

  return _map_kfac_states(stale_fingerprint, restored)


def recompute_preconditioners(
  tree: Any,
  damping: ScalarOrSchedule,
  *,
  mesh: jax.sharding.Mesh | None = None,
  **kwargs: Any,
) -> Any:
  """Decomposes the factors of every K-FAC state in ``tree`` again.

  Each state's factors go through the decomposition ``update`` makes on a
  decomposition step (the same placement: one device, or spread over
  ``mesh_axes`` of ``mesh``, or of the mesh set by ``jax.set_mesh``), with
  ``λ = damping(state.count)`` (a state of the adaptive mode uses its own
  λ, ``state.quadratic_model.damping``): the preconditioners the next update
  would make if it were a decomposition step, without its factor update.
  Pass the arguments given to ``scale_by_kfac`` so they have the structure,
  layout and dtypes its ``update`` expects; since they do not depend on the
  saved layout, this is also how a state moves to another strategy or device
  count. As in ``update``, a decomposition that comes out non-finite is
  discarded and counted in ``rejected_decompositions``; with no previous one
  to keep, the layer gets the preconditioner of identity factors that
  ``init`` makes. EKFAC's ``eigenvalue_scales`` are kept as they are: they
  sit in the bases of the last decomposition, which the recomputed ones
  differ from by the factor updates since (the next refresh carries them
  on).

  Args:
    tree: a pytree holding ``ScaleByKFACState``s, e.g. from ``restore``; their
      ``preconditioners`` may be ``None``.
    damping: λ, constant or schedule of the step count, > 0. At a count
      where a schedule is out of range every block keeps the identity's
      preconditioner and is counted in ``rejected_decompositions``, as
      ``update`` would reject its decomposition.
    mesh: the ``jax.sharding.Mesh`` to decompose on (that of ``mesh_axes``),
      for a call outside ``with jax.set_mesh(mesh):``. ``None``: the
      context's mesh.
    **kwargs: the other ``scale_by_kfac`` arguments, validated as there; the
      preconditioners follow ``compute_method``,
      ``compute_eigenvalue_outer_product``, ``inv_dtype``, ``mesh_axes``,
      ``grad_worker_fraction``, ``assignment_strategy`` and
      ``decomposition_batch_size``. With ``adaptive``, an adaptive state's λ
      is clipped into ``[min_damping, max_damping]`` first, as ``update``
      clips it (a corrupted or out-of-range λ; NaN becomes ``max_damping``);
      without it the state's λ is used as it is.

  Returns:
    ``tree`` with every K-FAC state's ``preconditioners`` (and
    ``rejected_decompositions``) replaced; in a tree of Flax-boxed params
    (``nn.with_logical_partitioning``) the packed rows boxed as ``init``
    boxes them.

  Raises:
    ValueError: ``tree`` holds no K-FAC state; ``mesh`` is not the
      context's; as ``scale_by_kfac`` for the other arguments.
  """
  if kwargs.get("adaptive") is not None:
    kwargs.setdefault("kl_clip", None)  # The adaptive mode has none.
  config = KFACConfig(damping=damping, **kwargs)
  # An adaptive state's λ is absolute, whatever the default damping_mode.
  adaptive_config = config
  if config.relative_damping and kwargs.get("damping_mode") is None:
    adaptive_config = KFACConfig(
      damping=damping, **{**kwargs, "damping_mode": "absolute"}
    )
  decompose_all = jax.jit(
    functools.partial(_decompose_all, config, adaptive_config)
  )
  # A tree of Flax-boxed params keeps its packed rows boxed, as init boxed
  # them (kfac_jax.transform.boxing); its other boxed parts pass through.
  boxed = boxing.has_boxes(tree)

  def recompute(_, state: ScaleByKFACState) -> ScaleByKFACState:
    state = decompose_all(state)
    if not boxed:
      return state
    return state._replace(
      preconditioners=boxing.box_rows(state.preconditioners, config.mesh_axes)
    )

  with using_mesh(mesh, "recompute_preconditioners", abstract_ok=False):
    return _map_kfac_states(recompute, tree, "recompute_preconditioners")


def _decompose_all(
  config: KFACConfig, adaptive_config: KFACConfig, state: ScaleByKFACState
) -> ScaleByKFACState:
  """``state`` with its factors decomposed again (``guarded_decomposition``),
  under ``adaptive_config`` (absolute λ) if it is the adaptive mode's."""
  dims = factor_dims(state.factors)
  is_adaptive = state.quadratic_model is not None
  if is_adaptive:
    config = adaptive_config
    if config.relative_damping:
      raise ValueError(
        "recompute_preconditioners(damping_mode='relative'): the state is "
        "the adaptive mode's, whose λ is absolute; pass damping_mode=None "
        "or 'absolute'."
      )
  if config.adaptive is not None and not is_adaptive:
    raise ValueError(
      "recompute_preconditioners(adaptive=...): the state is not the "
      "adaptive mode's (no quadratic_model); drop adaptive, and pass the "
      "damping it was trained with."
    )
  model = state.quadratic_model
  if model is None:
    damping = config.damping(state.count)
  elif config.adaptive is None:
    damping = model.damping
  else:
    damping = quadratic_model.clip_damping(model.damping, config.adaptive)
  placement = config.placement
  preconditioners, counts = guarded_decomposition(
    placement,
    dims,
    state.factors,
    placement.init(dims),
    decomposition_counts(state),
    damping,
    None if is_adaptive else hp.all_valid(state.count, config.damping),
    is_adaptive and config.compute_method is ComputeMethod.INVERSE,
  )
  return with_counts(state._replace(preconditioners=preconditioners), counts)


def _abstract(path: Sequence[Any], leaf: Any) -> jax.ShapeDtypeStruct:
  """The restore spec of one target leaf, on concrete devices.

  Orbax places arrays on devices: a sharding over an abstract mesh (what
  ``jax.eval_shape`` gives under ``jax.set_mesh`` with Explicit axes) is put
  on the mesh set now. A leaf without a sharding goes replicated over that
  mesh (a jitted step under it takes no array from outside it), or to the
  default device when no mesh is set.
  """
  mesh = jax.sharding.get_mesh()
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    # jax.devices()[0] is process 0's device: other processes hold no shard
    # of such an array, and Orbax cannot restore it there.
    sharding = (
      jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      if mesh.empty
      else NamedSharding(mesh, PartitionSpec())
    )
  elif isinstance(sharding, NamedSharding) and isinstance(
    sharding.mesh, jax.sharding.AbstractMesh
  ):
    if mesh.empty or mesh.abstract_mesh != sharding.mesh:
      raise ValueError(
        "checkpoint.restore: the target's "
        f"{_describe_path(_key_path(path))} is "
        f"sharded over an abstract mesh ({sharding.mesh}), as jax.eval_shape "
        "gives it under jax.set_mesh, but "
        + (
          "no mesh is set now"
          if mesh.empty
          else f"the mesh set now is another ({mesh.abstract_mesh})"
        )
        + ". Call restore under `with jax.set_mesh(mesh):` of the mesh the "
        "target was made under."
      )
    sharding = NamedSharding(mesh, sharding.spec)
  return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)


def _path(directory: epath.PathLike) -> epath.Path:
  """``directory`` as Orbax's path type; a relative local path made
  absolute (``gs://`` URLs are absolute already)."""
  path = epath.Path(directory)
  return path if path.is_absolute() else path.absolute()


def _saved_node(
  saved: Any, path: _KeyPath, directory: epath.Path
) -> dict[str, Any]:
  """The saved K-FAC state at ``path`` in Orbax's metadata tree.

  The metadata tree has dicts for mappings and NamedTuples (keyed by field
  name) and lists for sequences.
  """
  node = saved
  for key in path:
    if isinstance(node, dict):
      node = node.get(key)
    elif (
      isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node)
    ):
      node = node[int(key)]
    else:
      node = None
  if not isinstance(node, dict) or not {"factors", "preconditioners"} <= set(
    node
  ):
    raise ValueError(
      f"The checkpoint at {directory} has no K-FAC state at "
      f"{_describe_path(path)}, where the target has one."
    )
  return node


def _check_layers(
  path: _KeyPath,
  target_layers: set[str],
  saved_layers: set[str],
  directory: epath.Path,
) -> None:
  missing = sorted(target_layers - saved_layers)
  extra = sorted(saved_layers - target_layers)
  if missing or extra:
    raise ValueError(
      f"The K-FAC state at {_describe_path(path)} in {directory} registers "
      "other layers than the target: missing from the checkpoint: "
      f"{missing}; in "
      f"the checkpoint but not the target: {extra}. Restore onto a target "
      "made by tx.init with the params (and skip_layers) of the saved run."
    )


def _check_fields(
  path: _KeyPath,
  saved_state: Any,
  state: ScaleByKFACState,
  directory: epath.Path,
) -> None:
  """The saved K-FAC state and the target's must have the same arrays.

  Orbax fills a target array that the checkpoint holds as ``None`` (an eigen
  state saved with ``compute_eigenvalue_outer_product=False`` has no
  ``damped_inverse``) with ``None``, silently; the update then failed.
  """
  saved_leaves = {
    _key_path(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(saved_state)[0]
  }
  if state.preconditioners is None:  # Not read (restore drops them).
    saved_leaves = {p for p in saved_leaves if p[0] != "preconditioners"}
  target_leaves = {
    _key_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
  }
  missing = sorted("/".join(p) for p in target_leaves - saved_leaves)
  extra = sorted("/".join(p) for p in saved_leaves - target_leaves)
  if missing or extra:
    raise ValueError(
      f"The K-FAC state at {_describe_path(path)} in {directory} has other "
      f"arrays than the target: missing from the checkpoint: {missing}; in "
      f"the checkpoint but not the target: {extra}. Restore onto a target "
      "made by tx.init of a transformation with the saved run's "
      "compute_method, compute_eigenvalue_outer_product, adaptive and "
      "accumulation_steps."
      + (
        ""
        if not any(p.startswith("preconditioners") for p in missing + extra)
        else " A state moves between mesh_axes (packed rows) and one device, "
        "or between methods, by its factors: restore onto a target with "
        "preconditioners=None, then call recompute_preconditioners under "
        "the new settings."
      )
    )


def _check_saved_shapes(saved: Any, target: Any, directory: epath.Path) -> None:
  """Every target leaf with a saved counterpart must have its shape."""
  saved_shapes = {
    _key_path(path): tuple(leaf.shape)
    for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]
    if getattr(leaf, "shape", None) is not None
  }
  mismatched = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
    key = _key_path(path)
    shape = saved_shapes.get(key)
    if shape is not None and shape != tuple(np.shape(leaf)):
      mismatched.append(
        f"{_describe_path(key)}: saved {shape}, target {tuple(np.shape(leaf))}"
      )
  if mismatched:
    # Packed preconditioner rows change shape with the device count and
    # strategy; the factors do not.
    hint = (
      ""
      if not any("preconditioners/rows" in m for m in mismatched)
      else " A distributed state moves to another device count or strategy "
      "by its factors: restore onto a target with "
      "preconditioners=None, then call recompute_preconditioners under "
      "the new mesh."
    )
    raise ValueError(
      f"The checkpoint at {directory} has other shapes than the target: "
      f"{'; '.join(mismatched)}.{hint}"
    )


def _key_path(path: Sequence[Any]) -> _KeyPath:
  return tuple(path_key_name(k) for k in path)


def _describe_path(path: _KeyPath) -> str:
  return "/".join(path) if path else "the root"
