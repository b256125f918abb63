"""Where each layer's preconditioner lives on the mesh: a static packing.

Layers of different sizes cannot share one stacked array, so every device
holds one flat *row* of the preconditioner state, ``[n, R]`` sharded over the
mesh axes (row ``d`` on device ``d``). A layer's preconditioner (every leaf of
its ``EigenPreconditioner``/``InversePreconditioner``, raveled) is computed
into the *segment* ``[S]`` of the device that owns it (S = the largest
device load), and kept in the row of every device of the owner's group
(devices ``j·g … j·g + g − 1``, ``j = owner // g``). A group's row holds its
members' layers back to back, member by member, with no padding between
them, so ``R`` is the largest group load: every layer for COMM_OPT (``g =
n``, exactly the replicated size), the device's own layers for MEM_OPT.

Everything here is Python-side and depends only on the layers' sizes,
``(n, g)`` and the assignment strategy, so ``init``, ``update`` and
``get_opt_state_partition_specs`` agree on it without storing it. The state
stores only its ``fingerprint``: a state restored under another layout can
have the same ``[n, R]`` with the layers at other offsets.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax.distribution.assignment import assign_layers, layer_cost
from kfac_jax.distribution.strategy import AssignmentStrategy

# {layer: (activation_dim, gradient_dim)}.
Dims = Mapping[str, tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
  """The static packing of all layers' preconditioners on ``n`` devices.

  Attributes:
    num_devices: n, devices on the K-FAC mesh axes.
    group_size: g, devices that keep each layer's preconditioner.
    owner: ``{layer: device}`` that decomposes it (and, when ``g < n``,
      preconditions its gradient).
    offset: ``{layer: start}`` of its packed preconditioner in its owner's
      segment.
    size: ``{layer: elements}`` of its packed preconditioner.
    load: elements each device owns, ``[n]``.
    segment_size: S, elements of one device's segment (the largest load).
    row_size: R, elements of one row (the largest group load).
    templates: ``{layer: preconditioner of ShapeDtypeStructs}`` to unpack.
    fingerprint: a checksum of ``(n, g)`` and every layer's owner, offset and
      size, in ``[0, 2³¹)`` (an int32 in the state).
  """

  num_devices: int
  group_size: int
  owner: Mapping[str, int]
  offset: Mapping[str, int]
  size: Mapping[str, int]
  load: tuple[int, ...]
  segment_size: int
  row_size: int
  templates: Mapping[str, Any]
  fingerprint: int

  def owned(self, device: int) -> list[str]:
    """The layers ``device`` decomposes, in segment order."""
    return sorted(
      (n for n, d in self.owner.items() if d == device),
      key=self.offset.__getitem__,
    )

  def members(self, group: int) -> range:
    return range(group * self.group_size, (group + 1) * self.group_size)

  def member_start(self, device: int) -> int:
    """Where ``device``'s layers start in its group's row."""
    first = device // self.group_size * self.group_size
    return sum(self.load[first:device])

  def row_offset(self, name: str) -> int:
    """Start of ``name`` in the row of every device of its group."""
    return self.member_start(self.owner[name]) + self.offset[name]

  def first_of_group(self, name: str) -> int:
    """The lowest device whose row holds ``name``."""
    return self.owner[name] // self.group_size * self.group_size


def make_layout(
  dims: Dims,
  init_preconditioner,
  num_devices: int,
  group_size: int,
  assignment: AssignmentStrategy,
) -> ShardedLayout:
  """Assigns layers to devices (greedy, KAISA) and packs their segments.

  Args:
    dims: ``{layer: (activation_dim, gradient_dim)}``.
    init_preconditioner: ``(dA, dG) -> Preconditioner`` (the method's init),
      only traced for shapes.
    num_devices: n.
    group_size: g, a divisor of n.
    assignment: what the greedy assignment balances.
  """
  return _make_layout(
    tuple(sorted(dims.items())),
    init_preconditioner,
    num_devices,
    group_size,
    assignment,
  )


@functools.lru_cache(maxsize=64)
def _make_layout(
  dims: tuple[tuple[str, tuple[int, int]], ...],
  init_preconditioner,
  num_devices: int,
  group_size: int,
  assignment: AssignmentStrategy,
) -> ShardedLayout:
  owner = assign_layers(
    {name: layer_cost(*d, assignment) for name, d in dims},
    num_devices,
    group_size,
  )
  templates = {
    name: jax.eval_shape(functools.partial(init_preconditioner, *d))
    for name, d in dims
  }
  size = {
    name: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(t))
    for name, t in templates.items()
  }
  names = [name for name, _ in dims]
  offset, loads = pack_by_owner(names, owner, size, num_devices)
  return ShardedLayout(
    num_devices=num_devices,
    group_size=group_size,
    owner=owner,
    offset=offset,
    size=size,
    load=tuple(loads),
    segment_size=max(loads),
    row_size=max(
      sum(loads[start : start + group_size])
      for start in range(0, num_devices, group_size)
    ),
    templates=templates,
    fingerprint=zlib.crc32(
      repr(
        (
          num_devices,
          group_size,
          [(name, owner[name], offset[name], size[name]) for name in names],
        )
      ).encode()
    )
    & 0x7FFFFFFF,
  )


def pack_by_owner(
  names: Sequence[str],
  owner: Mapping[str, int],
  sizes: Mapping[str, int],
  num_devices: int,
) -> tuple[dict[str, int], list[int]]:
  """Back-to-back offsets of ``names`` within their owners' segments.

  Returns ``({name: offset}, [elements per device])``.
  """
  offsets, loads = {}, [0] * num_devices
  for name in names:
    device = owner[name]
    offsets[name], loads[device] = loads[device], loads[device] + sizes[name]
  return offsets, loads


def pack(tree: Any) -> jax.Array:
  """All leaves of ``tree`` raveled and concatenated: ``[elements]``."""
  return jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])


def unpack(vector: jax.Array, template: Any) -> Any:
  """Inverse of ``pack`` given a tree of ``ShapeDtypeStruct``s."""
  leaves, treedef = jax.tree.flatten(template)
  out, start = [], 0
  for leaf in leaves:
    count = math.prod(leaf.shape)
    out.append(vector[start : start + count].reshape(leaf.shape))
    start += count
  return jax.tree.unflatten(treedef, out)


def fill_segment(
  pieces: list[jax.Array], length: int, dtype: jnp.dtype
) -> jax.Array:
  """``pieces`` concatenated and zero-padded to ``[length]``."""
  used = sum(p.shape[0] for p in pieces)
  padding = [jnp.zeros((length - used,), dtype)] if length > used else []
  if not pieces and not padding:
    return jnp.zeros((0,), dtype)
  return jnp.concatenate([p.astype(dtype) for p in pieces] + padding)
