"""Where preconditioners are computed and kept: one device, or a mesh.

A ``Placement`` is the part of ``scale_by_kfac`` that changes with the
distribution strategy: the preconditioner state's layout, the decomposition
step and the preconditioning of every step.

* ``local_placement``: ``{layer: Preconditioner}``; every decomposition runs
  where the program runs, batched by factor size (``batched``).
* ``mesh_placement``: KAISA's strategies on the mesh set with
  ``jax.set_mesh``. The state is ``ShardedPreconditioners(rows [n, R],
  layout_fingerprint)``, rows sharded over the K-FAC mesh axes (``layout``).
  Inside ``shard_map`` each device decomposes only the layers assigned to it
  (a ``lax.switch`` on its index), and the results reach the other ``g − 1``
  devices of its group by one ``all_gather`` at decomposition steps. Each
  step, with ``g = n`` every device preconditions every layer from its own
  row (no second-order communication); with ``g < n`` each layer's owner
  preconditions it and the preconditioned gradients are all-gathered.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from kfac_jax import finite
from kfac_jax.distribution import layout as layout_lib
from kfac_jax.distribution.layout import Dims, ShardedLayout
from kfac_jax.distribution.sharding import constrain, context_mesh
from kfac_jax.distribution.strategy import DistributionConfig, group_size
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import batched
from kfac_jax.preconditioning.gradient_matrix import FactoredGradient
from kfac_jax.preconditioning.methods import Method, Preconditioner


class ShardedPreconditioners(NamedTuple):
  """All layers' preconditioners packed per device (see ``layout``).

  Attributes:
    rows: ``[n, R]`` in the storage dtype; row ``d`` lives on device ``d``
      of the K-FAC mesh axes and holds the preconditioners of its group.
    layout_fingerprint: ``ShardedLayout.fingerprint`` of the packing the rows
      were written in (int32 scalar, replicated). Another strategy, device
      assignment or version can pack the same ``[n, R]`` differently; a state
      restored under one is told apart by it (``Placement.stale``).
  """

  rows: jax.Array
  layout_fingerprint: jax.Array


class Placement(NamedTuple):
  """How the preconditioner state is laid out, computed and applied.

  Attributes:
    init: ``dims -> state`` of identity factors' preconditioners.
    decompose: ``(dims, factors, previous, λ) -> (state, counts)``:
      decomposes ``factors`` (a subset of the layers), keeps ``previous`` for
      the others and for any decomposition that comes out non-finite;
      ``counts`` (``DecompositionCounts``) counts those and the eigh
      fallbacks. A stale ``previous`` is not read: the identity's
      preconditioners stand in for it.
    precondition: ``(dims, state, {layer: ∇ [dA, dG]}, λ, sharded) ->
      {layer: P}``, float32. Layers in ``sharded`` (``{layer: mesh axes}``,
      kernels sharded over those axes) are preconditioned in place, sharded
      (``precondition_in_place``); the others come out replicated.
    per_layer: ``(dims, state) -> {layer: Preconditioner}``: inspection of
      a concrete state (host arrays for a sharded one).
    partition_specs: ``dims -> PartitionSpec`` tree of the state.
    stale: ``(dims, state) ->`` whether the state was packed in another
      layout (a traced bool), or ``None`` for a layout that cannot be stale
      (``{layer: Preconditioner}``). A stale state must be decomposed before
      it preconditions anything.
    replicated: ``(dims, state, names) -> {layer: Preconditioner}``: those
      layers' preconditioners on every device (the state itself on one
      device; on a mesh one all-gather from the owners unless ``g = n``),
      for work that needs every basis everywhere (EKFAC).
    precondition_replicated: ``({layer: Preconditioner}, {layer: ∇}, λ,
      sharded) -> {layer: P}`` from preconditioners every device holds
      (``replicated``'s), each device computing every layer.
  """

  init: Callable[[Dims], Any]
  decompose: Callable[
    [Dims, Mapping[str, LayerFactors], Any, jax.Array],
    tuple[Any, DecompositionCounts],
  ]
  precondition: Callable[
    [
      Dims,
      Any,
      Mapping[str, jax.Array | FactoredGradient],
      jax.Array,
      Mapping[str, tuple[str, ...]],
    ],
    dict[str, jax.Array],
  ]
  per_layer: Callable[[Dims, Any], dict[str, Preconditioner]]
  partition_specs: Callable[[Dims], Any]
  stale: Callable[[Dims, Any], jax.Array | None]
  replicated: Callable[[Dims, Any, Sequence[str]], dict[str, Preconditioner]]
  precondition_replicated: Callable[
    [
      Mapping[str, Preconditioner],
      Mapping[str, jax.Array | FactoredGradient],
      jax.Array,
      Mapping[str, tuple[str, ...]],
    ],
    dict[str, jax.Array],
  ]


class DecompositionCounts(NamedTuple):
  """What a decomposition step counts (int32 scalars).

  Attributes:
    rejected: decompositions that came out non-finite and were discarded.
    fallbacks: factors whose subspace refresh drifted too far and were
      decomposed by ``eigh`` instead (``preconditioning.subspace``).
  """

  rejected: jax.Array
  fallbacks: jax.Array


def no_counts() -> DecompositionCounts:
  return DecompositionCounts(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))


def decompose_checked(
  method: Method,
  factors: Mapping[str, LayerFactors],
  previous: Mapping[str, Preconditioner],
  damping: jax.Array,
) -> tuple[dict[str, Preconditioner], DecompositionCounts]:
  """Decomposes ``factors`` batched by size; non-finite ones keep ``previous``.

  A method's ``prepare`` (relative damping) transforms the factors and λ
  first; one with a ``warm_start`` refines ``previous``'s eigenbases, and its
  ``finish`` runs per factor (``Method``).
  """
  if method.prepare is not None:
    factors, damping = method.prepare(factors, damping)
  warm = None
  if method.warm_start is not None:
    warm = {name: method.warm_start(previous[name]) for name in factors}
  decomposed = batched.decompose_layers(
    factors,
    method.factor_fn,
    damping,
    batch_size=method.decomposition_batch_size,
    crop=method.crop,
    each_on=method.decompose_each_on,
    warm=warm,
  )
  candidates, counts = {}, no_counts()
  finish = method.finish
  for name, pair in decomposed.items():
    if finish is not None:
      assert warm is not None  # a method that finishes warm-starts (subspace)
      finished = [
        finish(factor, results, start)
        for factor, results, start in zip(factors[name], pair, warm[name])
      ]
      pair = tuple(results for results, _ in finished)
      counts = counts._replace(
        fallbacks=counts.fallbacks + sum(fell_back for _, fell_back in finished)
      )
    activation_results, gradient_results = pair
    candidates[name] = method.assemble(
      activation_results, gradient_results, damping
    )
  ok = method.are_finite(list(candidates.values()))
  new = {
    name: method.keep(flag, candidate, previous[name])
    for flag, (name, candidate) in zip(ok, candidates.items())
  }
  counts = counts._replace(
    rejected=counts.rejected + sum((~flag).astype(jnp.int32) for flag in ok)
  )
  return new, counts


def local_placement(method: Method) -> Placement:
  """Every preconditioner computed and kept where the program runs."""

  def init(dims: Dims) -> dict[str, Preconditioner]:
    return {name: method.init(*d) for name, d in dims.items()}

  def decompose(dims, factors, previous, damping):
    del dims
    new, counts = decompose_checked(method, factors, previous, damping)
    return {**previous, **new}, counts

  def partition_specs(dims: Dims) -> Any:
    return jax.tree.map(
      lambda _: PartitionSpec(), jax.eval_shape(lambda: init(dims))
    )

  each = functools.partial(precondition_each, method)
  return Placement(
    init,
    decompose,
    precondition=lambda dims, state, *args: each(state, *args),
    per_layer=lambda dims, state: dict(state),
    partition_specs=partition_specs,
    stale=lambda dims, state: None,
    replicated=lambda dims, state, names: {n: state[n] for n in names},
    precondition_replicated=each,
  )


def precondition_each(
  method: Method,
  preconditioners: Mapping[str, Preconditioner],
  gradients: Mapping[str, jax.Array | FactoredGradient],
  damping: jax.Array,
  sharded: Mapping[str, tuple[str, ...]],
) -> dict[str, jax.Array]:
  """``P`` of every gradient from its layer's preconditioner at hand (a
  sharded kernel's in place, ``precondition_in_place``)."""
  preconditioned = {}
  for name, gradient in gradients.items():
    if name in sharded:
      # Sharded kernels keep the dense form (stats_blocks.factored_gradients).
      assert not isinstance(gradient, FactoredGradient), name
      preconditioned[name] = precondition_in_place(
        method, preconditioners[name], gradient, damping, sharded[name]
      )
    else:
      preconditioned[name] = method.precondition(
        preconditioners[name], gradient, damping
      )
  return preconditioned


def mesh_placement(method: Method, config: DistributionConfig) -> Placement:
  """KAISA's strategies over ``config.mesh_axes`` of the mesh in context."""
  axes = config.mesh_axes
  # Not (axes, None): the same layout, but update's outputs carry this form
  # and jit's cache tells the two apart (a donated step compiled twice).
  rows_spec = PartitionSpec(axes)

  def layout(dims: Dims) -> ShardedLayout:
    n, g = group_size(config, context_mesh(axes))
    return layout_lib.make_layout(dims, method.init, n, g, config.assignment)

  def init(dims: Dims) -> ShardedPreconditioners:
    plan = layout(dims)
    dtype = _dtype(plan)
    group_rows = [
      layout_lib.fill_segment(
        [
          layout_lib.pack(method.init(*dims[name]))
          for device in plan.members(group)
          for name in plan.owned(device)
        ],
        plan.row_size,
        dtype,
      )
      for group in range(plan.num_devices // plan.group_size)
    ]
    rows = jnp.stack(
      [group_rows[d // plan.group_size] for d in range(plan.num_devices)]
    )
    return ShardedPreconditioners(
      constrain(rows, rows_spec, axes), fingerprint(plan)
    )

  def fingerprint(plan: ShardedLayout) -> jax.Array:
    return constrain(
      jnp.asarray(plan.fingerprint, jnp.int32), PartitionSpec(), axes
    )

  def stale(dims: Dims, preconditioners: ShardedPreconditioners) -> jax.Array:
    return preconditioners.layout_fingerprint != layout(dims).fingerprint

  def decompose(dims, factors, previous, damping):
    plan = layout(dims)
    if plan.segment_size == 0:  # No layers: nothing to decompose (nor gather).
      return ShardedPreconditioners(
        previous.rows, fingerprint(plan)
      ), no_counts()
    rows, counts = _decompose_rows(
      method,
      axes,
      plan,
      dims,
      factors,
      previous.rows,
      damping,
      stale(dims, previous),
    )
    return ShardedPreconditioners(rows, fingerprint(plan)), counts

  def precondition(dims, preconditioners, gradients, damping, sharded):
    plan = layout(dims)
    in_place = [name for name in gradients if name in sharded]
    out = {}
    if in_place:
      out.update(
        precondition_each(
          method,
          _fetch_replicated(axes, plan, preconditioners.rows, in_place),
          {name: gradients[name] for name in in_place},
          damping,
          sharded,
        )
      )
    gathered = {n: x for n, x in gradients.items() if n not in sharded}
    if gathered:
      out.update(
        _precondition_gathered(
          method, axes, plan, preconditioners.rows, gathered, damping
        )
      )
    return out

  def per_layer(dims, preconditioners):
    plan = layout(dims)
    if int(preconditioners.layout_fingerprint) != plan.fingerprint:
      raise ValueError(
        "These preconditioners were packed in another layout (another "
        "strategy, assignment_strategy or device count than the one given "
        "here): their rows cannot be read. The next update decomposes them "
        "again; checkpoint.recompute_preconditioners does so now."
      )
    rows = jax.device_get(
      preconditioners.rows
    )  # Inspection of a concrete state.
    return {
      name: _read(
        rows[plan.first_of_group(name)], plan.row_offset(name), plan, name
      )
      for name in dims
    }

  def partition_specs(dims: Dims) -> ShardedPreconditioners:
    layout(dims)  # Validates the axes and the fraction against the mesh.
    # ShardedPreconditioners types its leaves as arrays; the spec tree
    # reuses it with a PartitionSpec at each leaf.
    specs: Any = (rows_spec, PartitionSpec())
    return ShardedPreconditioners(*specs)

  def replicated(dims, preconditioners, names):
    if not names:
      return {}
    return _fetch_replicated(
      axes, layout(dims), preconditioners.rows, list(names)
    )

  return Placement(
    init,
    decompose,
    precondition,
    per_layer,
    partition_specs,
    stale,
    replicated,
    functools.partial(precondition_each, method),
  )


def _decompose_rows(
  method: Method,
  axes: tuple[str, ...],
  plan: ShardedLayout,
  dims: Dims,
  factors: Mapping[str, LayerFactors],
  rows: jax.Array,
  damping: jax.Array,
  is_stale: jax.Array,
) -> tuple[jax.Array, DecompositionCounts]:
  """The decomposition step's rows and counts on the mesh.

  Each device decomposes the layers assigned to it (a ``lax.switch`` on its
  index; a ``stale`` row's blocks start from the identity's) and its
  group's members' segments are all-gathered into the group's row.
  """
  n, g, size = plan.num_devices, plan.group_size, plan.segment_size

  def device_branch(device: int):
    names = [name for name in plan.owned(device) if name in factors]

    def branch(factors, row, damping, is_stale):
      # A stale row holds other layers at these offsets.
      old = {
        name: finite.select(
          ~is_stale,
          _read(row, plan.row_offset(name), plan, name),
          method.init(*dims[name]),
        )
        for name in plan.owned(device)
      }
      new, counts = decompose_checked(
        method, {name: factors[name] for name in names}, old, damping
      )
      pieces = [
        layout_lib.pack(new.get(name, old[name])) for name in plan.owned(device)
      ]
      return layout_lib.fill_segment(pieces, size, row.dtype), counts

    return branch

  def group_branch(group: int):
    # The group's row: its members' segments, each cut to its load.

    def branch(gathered):
      return layout_lib.fill_segment(
        [
          gathered[m * size : m * size + plan.load[m]]
          for m in plan.members(group)
        ],
        plan.row_size,
        gathered.dtype,
      )

    return branch

  def body(factors, rows, damping, is_stale):
    row = rows[0]
    device = lax.axis_index(axes)
    segment, counts = lax.switch(
      device,
      [device_branch(d) for d in range(n)],
      factors,
      row,
      damping,
      is_stale,
    )
    counts = lax.psum(counts, axes)
    if g == 1:
      row = segment[: plan.row_size]
    else:
      gathered = lax.all_gather(segment, axes, tiled=True)
      groups = [group_branch(j) for j in range(n // g)]
      row = (
        groups[0](gathered)
        if len(groups) == 1
        else lax.switch(device // g, groups, gathered)
      )
    return row[None], counts

  rows_spec = PartitionSpec(axes)
  return _manual(
    body,
    in_specs=(PartitionSpec(), rows_spec, PartitionSpec(), PartitionSpec()),
    out_specs=(rows_spec, PartitionSpec()),
    axes=axes,
  )(_replicated(factors, axes), rows, damping, is_stale)


def _fetch_replicated(
  axes: tuple[str, ...],
  plan: ShardedLayout,
  rows: jax.Array,
  names: Sequence[str],
) -> dict[str, Preconditioner]:
  """``names``' preconditioners on every device (a gather unless ``g = n``)."""

  def body(rows):
    row = rows[0]
    if plan.group_size == plan.num_devices:
      return {
        name: _read(row, plan.row_offset(name), plan, name) for name in names
      }
    shared = _share_from_owners(
      axes,
      plan,
      {name: plan.size[name] for name in names},
      lambda name: row[plan.row_offset(name) :][: plan.size[name]],
      row.dtype,
    )
    return {
      name: layout_lib.unpack(shared[name], plan.templates[name])
      for name in names
    }

  return _manual(
    body, in_specs=PartitionSpec(axes), out_specs=PartitionSpec(), axes=axes
  )(rows)


def _precondition_gathered(
  method: Method,
  axes: tuple[str, ...],
  plan: ShardedLayout,
  rows: jax.Array,
  gradients: Mapping[str, jax.Array | FactoredGradient],
  damping: jax.Array,
) -> dict[str, jax.Array]:
  """Replicated ``P`` of replicated gradients (see the module docstring)."""

  def body(rows, gradients, damping):
    row = rows[0]
    apply = lambda name: method.precondition(
      _read(row, plan.row_offset(name), plan, name), gradients[name], damping
    )
    if plan.group_size == plan.num_devices:  # Every device holds every layer.
      return {name: apply(name) for name in gradients}
    shared = _share_from_owners(
      axes,
      plan,
      {name: g.size for name, g in gradients.items()},
      apply,
      jnp.float32,
    )
    return {
      name: shared[name].reshape(g.shape) for name, g in gradients.items()
    }

  return _manual(
    body,
    in_specs=(PartitionSpec(axes), PartitionSpec(), PartitionSpec()),
    out_specs=PartitionSpec(),
    axes=axes,
  )(rows, _replicated(gradients, axes), damping)


def _replicated(
  arrays: Mapping[str, Any], axes: tuple[str, ...]
) -> dict[str, Any]:
  """``arrays`` replicated over the whole mesh, for a ``_manual`` body.

  ``in_specs=P()`` replicates only over the manual ``axes``. An input left
  sharded over another (Auto) axis, as a row-sharded kernel's backward pass
  leaves its neighbours' gradients, gets collectives over that axis inside
  each device's ``lax.switch`` branch, and the branches differ across
  ``axes``: XLA then waits on collectives the other devices never reach
  (on CPU, an abort after its 40 s rendezvous timeout).
  """
  return jax.tree.map(
    lambda x: constrain(x, PartitionSpec(), axes), dict(arrays)
  )


def _manual(
  body: Callable[..., Any], in_specs: Any, out_specs: Any, axes: tuple[str, ...]
) -> Callable[..., Any]:
  """``body`` under ``jax.shard_map``, manual over ``axes`` only.

  Jitted: jax 0.9 runs a ``shard_map`` manual over a subset of the mesh's
  axes only inside ``jit`` (an update called eagerly failed); inside a
  traced step the ``jit`` is inlined. ``check_vma=False``: rows are
  replicated within groups by construction, which the replication checker
  cannot see through ``lax.switch``.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if any(
    kind == jax.sharding.AxisType.Auto and name not in axes
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
  ):
    # Inside, XLA still places arrays over the other Auto axes and may shard
    # them there (rows resharded for a row-sharded kernel's preconditioning
    # propagate back into the body): collectives over those axes inside the
    # per-device branches would wait on devices in other branches. Pinned
    # replicated over them, the branches hold no collectives.
    pin = lambda tree: jax.tree.map(
      lambda x: lax.with_sharding_constraint(x, PartitionSpec()), tree
    )
    unpinned = body
    body = lambda *args: pin(unpinned(*pin(args)))
  return jax.jit(
    jax.shard_map(
      body,
      in_specs=in_specs,
      out_specs=out_specs,
      axis_names=set(axes),
      check_vma=False,
    )
  )


def precondition_in_place(
  method: Method,
  preconditioner: Preconditioner,
  gradient: jax.Array,
  damping: jax.Array,
  axes: tuple[str, ...],
) -> jax.Array:
  """``P`` of a gradient sharded over ``axes``, never gathered whole.

  Before a product over the rows of ``∇ [dA, dG]`` its columns are sharded,
  and before one over its columns its rows, so every product is local and
  each device holds ``1/k`` of the gradient throughout (``k`` = the axes'
  devices), at the price of an all-to-all per product. Both dimensions are
  zero-padded to multiples of ``k`` first (the preconditioner with zero
  rows/columns, which leaves the padding zero), since XLA reshards an uneven
  dimension by gathering it. ``P`` comes out with its columns (the kernel's
  output features) sharded.
  """
  mesh = context_mesh(axes)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  k = math.prod(sizes[a] for a in axes)
  activation_dim, gradient_dim = gradient.shape
  padded = {d: d + -d % k for d in (activation_dim, gradient_dim)}
  pad = lambda x: jnp.pad(x, [(0, padded[d] - d) for d in x.shape])

  def reshard(x: jax.Array, axis: int) -> jax.Array:
    spec = PartitionSpec(None, axes) if axis == 0 else PartitionSpec(axes, None)
    return constrain(x, spec, axes)

  result = method.precondition(
    jax.tree.map(pad, preconditioner), pad(gradient), damping, reshard
  )
  return reshard(result, 0)[:activation_dim, :gradient_dim]


def _share_from_owners(
  axes: tuple[str, ...],
  plan: ShardedLayout,
  sizes: Mapping[str, int],
  compute: Callable[[str], jax.Array],
  dtype: jnp.dtype,
) -> dict[str, jax.Array]:
  """In ``shard_map``: each layer's ``compute(name)`` from its owner, on all.

  Every device computes only the layers it owns (a ``lax.switch`` on its
  index), packs them into a segment and one ``all_gather`` shares all
  segments. Returns ``{name: raveled result}``, the same on every device.
  """
  names = list(sizes)
  offsets, loads = layout_lib.pack_by_owner(
    names, plan.owner, sizes, plan.num_devices
  )
  size = max(loads)
  branches = [
    lambda d=d: layout_lib.fill_segment(
      [compute(name).ravel() for name in names if plan.owner[name] == d],
      size,
      dtype,
    )
    for d in range(plan.num_devices)
  ]
  gathered = lax.all_gather(
    lax.switch(lax.axis_index(axes), branches), axes, tiled=True
  )
  return {
    name: gathered[plan.owner[name] * size + offsets[name] :][: sizes[name]]
    for name in names
  }


def _read(
  row: jax.Array, start: int, plan: ShardedLayout, name: str
) -> Preconditioner:
  return layout_lib.unpack(
    row[start : start + plan.size[name]], plan.templates[name]
  )


def _dtype(plan: ShardedLayout) -> jnp.dtype:
  dtypes = {
    leaf.dtype for t in plan.templates.values() for leaf in jax.tree.leaves(t)
  }
  return dtypes.pop() if len(dtypes) == 1 else jnp.float32
