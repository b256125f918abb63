"""``get_opt_state_partition_specs``: shardings of the optimizer state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec

from kfac_jax.distribution.sharding import check_params_specs, using_mesh
from kfac_jax.transform import boxing
from kfac_jax.transform import state as state_lib
from kfac_jax.transform.config import KFACConfig
from kfac_jax.transform.scale_by_kfac import transformation
from kfac_jax.transform.state import ScaleByKFACState


def get_opt_state_partition_specs(
  params: Any,
  chain_with: optax.GradientTransformation | None = None,
  *,
  tx: optax.GradientTransformation | None = None,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  logical_axis_rules: boxing.LogicalRules | None = None,
  **kwargs: Any,
) -> Any:
  """``PartitionSpec``s of ``tx.init(params)``, computed without allocating.

  ``tx`` is ``scale_by_kfac(**kwargs)``, or ``optax.chain(scale_by_kfac(
  **kwargs), chain_with)`` when the rest of the chain is given (as
  distributed_kron's helper covers its whole chain), or any transformation
  given as ``tx`` whose state holds the state of ``scale_by_kfac(**kwargs)``
  for these params (``kfac_jax.kfac(...)``). The mesh is the one ``init``
  and ``update`` run under: ``mesh=``, or that of ``jax.set_mesh``::

    specs = kfac_jax.get_opt_state_partition_specs(
        params, chain_with=optax.sgd(0.1, momentum=0.9), mesh=mesh,
        **kfac_kwargs)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                             is_leaf=lambda x: isinstance(x, PartitionSpec))
    with jax.set_mesh(mesh):
      opt_state = jax.jit(tx.init, out_shardings=shardings)(params)

  (on Explicit axes, inside the context, the specs alone do as
  ``out_shardings``).

  K-FAC factors and counters are replicated; the preconditioners follow the
  distribution strategy (``ShardedPreconditioners.rows`` over ``mesh_axes``);
  every params-shaped part of the state (accumulated gradients, momentum,
  Adam moments, ...) follows ``params_partition_specs`` (replicated when not
  given); any other array is replicated.

  Params boxed with Flax's partitioning metadata (``nn.with_partitioning``,
  ``nn.with_logical_partitioning``) give the state's boxes instead: the
  params-shaped parts are boxed like the params, and their specs are the
  boxes' axis names, logical names mapped to mesh axes by
  ``logical_axis_rules``; the specs are the mesh-axis form of
  ``nn.get_partition_spec(jax.eval_shape(tx.init, params))``.

  Args:
    params: the params, or their ``jax.eval_shape``.
    chain_with: the transformation chained after ``scale_by_kfac``.
    tx: instead of ``chain_with``, the whole transformation.
    mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) ``mesh_axes`` and
      ``params_partition_specs`` name axes of, for a call outside ``with
      jax.set_mesh(mesh):``. ``None``: the context's mesh.
    logical_axis_rules: with params boxed by ``nn.with_logical_partitioning``,
      Flax's ``(logical name, mesh axes)`` rules. ``None``: each box's own
      rules, or those of an enclosing ``nn.logical_axis_rules``.
    **kwargs: the ``scale_by_kfac`` arguments (those ``tx`` was built with,
      at least the ones that shape its state and layout).

  Raises:
    ValueError: as ``scale_by_kfac`` and its ``init``, e.g. a mesh axis not
      in the mesh, or a ``grad_worker_fraction`` that does not divide it;
      ``chain_with`` and ``tx`` both given; a K-FAC state in ``tx``'s that
      ``scale_by_kfac(**kwargs)`` would not make; a ``mesh`` other than the
      context's; ``logical_axis_rules`` without boxed params, or logically
      partitioned params without rules.
    TypeError: ``chain_with``, ``tx`` or ``mesh`` of another kind.
  """
  with using_mesh(mesh, "get_opt_state_partition_specs"):
    return _partition_specs(params, chain_with, tx, logical_axis_rules, kwargs)


def _partition_specs(
  params: Any,
  chain_with: optax.GradientTransformation | None,
  tx: optax.GradientTransformation | None,
  rules: boxing.LogicalRules | None,
  kwargs: dict[str, Any],
) -> Any:
  """``get_opt_state_partition_specs`` under its mesh."""
  for name, value in (("chain_with", chain_with), ("tx", tx)):
    # Duck-typed: optax.MultiSteps and other optax objects have init and
    # update without being GradientTransformations.
    if value is not None and not (
      callable(getattr(value, "init", None))
      and callable(getattr(value, "update", None))
    ):
      # e.g. get_opt_state_partition_specs(params, 0.1): a learning rate
      # meant for scale_by_kfac lands in chain_with.
      raise TypeError(
        f"get_opt_state_partition_specs: {name} must be an optax "
        f"transformation (with init and update); got {value!r}. Pass the "
        "scale_by_kfac arguments by keyword (learning_rate=..., "
        "damping=...)."
      )
  config = KFACConfig(**kwargs)
  kfac_tx = transformation(config)
  given_tx = tx is not None
  if not given_tx:
    tx = kfac_tx if chain_with is None else optax.chain(kfac_tx, chain_with)
  elif chain_with is not None:
    raise ValueError(
      "get_opt_state_partition_specs: pass chain_with (the "
      "rest of a chain after scale_by_kfac) or tx (the whole "
      "transformation), not both."
    )
  boxed = boxing.has_boxes(params)
  if rules is not None and not boxed:
    raise ValueError(
      "get_opt_state_partition_specs: logical_axis_rules given, but the "
      "params hold no Flax partitioning boxes (nn.LogicallyPartitioned from "
      "nn.with_logical_partitioning) for them to apply to. Pass the params "
      "as model.init returns them, or their PartitionSpecs as "
      "params_partition_specs."
    )
  params_specs = config.params_partition_specs
  params_specs = check_params_specs(
    boxing.unbox(params),
    jax.tree.map(lambda _: None, boxing.unbox(params))
    if params_specs is None
    else params_specs,
  )

  shapes = jax.eval_shape(tx.init, params)
  is_state = lambda node: isinstance(node, ScaleByKFACState)
  # The params-shaped parts are left out of the comparison: in a chain that
  # masks part of the params (optax.multi_transform) they are masked too.
  comparable = lambda state: state_lib.shapes_and_dtypes(
    state_lib.without_params_shaped(state)
  )
  expected = (
    comparable(jax.eval_shape(kfac_tx.init, params)) if given_tx else None
  )
  for state in jax.tree.leaves(shapes, is_leaf=is_state):
    if given_tx and is_state(state) and comparable(state) != expected:
      raise ValueError(
        "get_opt_state_partition_specs: tx holds a K-FAC state that "
        "scale_by_kfac(**kwargs) would not make (another accumulation, "
        "adaptive mode, compute_method, dtype or layer set): pass the "
        "scale_by_kfac arguments tx was built with."
      )
  if boxed:  # The state is boxed where it is params-shaped.
    return boxing.partition_specs(shapes, rules)
  specs_of = _params_specs_of(params, params_specs)

  def spec_of(node: Any) -> Any:
    if isinstance(node, ScaleByKFACState):
      return state_lib.state_partition_specs(node, config.placement, specs_of)
    specs = specs_of(node)
    return PartitionSpec() if specs is None else specs

  return jax.tree.map(
    spec_of,
    shapes,
    is_leaf=lambda node: (
      isinstance(node, ScaleByKFACState)
      or (node is not None and specs_of(node) is not None)
    ),
  )


def _params_specs_of(
  params: Any, params_specs: Any
) -> Callable[[Any], Any | None]:
  """``node -> its specs`` for nodes shaped like ``params``, else ``None``.

  A params-shaped node (momentum, Adam moments, accumulated gradients) holds
  an array of each params leaf's shape at the same path, or, in a chain that
  withholds part of the params (``optax.masked``, ``multi_transform``), an
  ``optax.MaskedNode`` in place of some of them (a whole module at once when
  the mask is a prefix of the params); it gets each leaf's spec and keeps
  the ``MaskedNode``s.
  """
  is_spec = lambda x: isinstance(x, PartitionSpec)
  # One spec per array: a spec may stand for a node holding one array (an
  # nnx.Param of nnx.state).
  leaf_specs = jax.tree.map(
    lambda spec, node: jax.tree.map(lambda _: spec, node),
    params_specs,
    params,
    is_leaf=is_spec,
  )
  paths, _ = jax.tree_util.tree_flatten_with_path(params)
  shapes = {path: leaf.shape for path, leaf in paths}
  specs = dict(
    jax.tree_util.tree_flatten_with_path(leaf_specs, is_leaf=is_spec)[0]
  )
  is_masked = lambda x: isinstance(x, optax.MaskedNode)

  def specs_of(node: Any) -> Any | None:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=is_masked
    )
    found, covered = [], 0
    for path, leaf in leaves:
      if is_masked(leaf):
        found.append(leaf)
        covered += sum(p[: len(path)] == path for p in shapes)
      elif shapes.get(path) == getattr(leaf, "shape", None):
        found.append(specs[path])
        covered += 1
      else:
        return None
    if covered != len(shapes) or len(found) == 0 or all(map(is_masked, found)):
      return None
    return jax.tree_util.tree_unflatten(treedef, found)

  return specs_of
