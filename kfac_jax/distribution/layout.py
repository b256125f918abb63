"""Where each layer's preconditioner lives on the mesh: a static packing.

Layers of different sizes cannot share one stacked array, so every device
holds one flat *row* of the preconditioner state, ``[n, g·S]`` sharded over the
mesh axes (row ``d`` on device ``d``). A layer's preconditioner (every leaf of
its ``EigenPreconditioner``/``InversePreconditioner``, raveled) sits in the
*segment* ``[S]`` of the device that decomposes it, and the row of every
device of a group is its ``g`` members' segments side by side::

  row of device d = segment[j·g] ‖ segment[j·g + 1] ‖ … ‖ segment[j·g + g − 1],
  j = d // g.

So a layer owned by device ``c`` is found in the row of every device of group
``c // g`` at ``(c % g)·S + offset``. Everything here is Python-side and
depends only on the layers' sizes and ``(n, g)``, so ``init``, ``update`` and
``get_opt_state_partition_specs`` agree on it without storing it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
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
    segment_size: S, elements of one device's segment (the largest load).
    gradient_offset: ``{layer: start}`` of its preconditioned gradient in its
      owner's gradient segment (used when ``g < n``).
    gradient_segment_size: elements of one device's gradient segment.
    templates: ``{layer: preconditioner of ShapeDtypeStructs}`` to unpack.
  """

  num_devices: int
  group_size: int
  owner: Mapping[str, int]
  offset: Mapping[str, int]
  size: Mapping[str, int]
  segment_size: int
  gradient_offset: Mapping[str, int]
  gradient_segment_size: int
  templates: Mapping[str, Any]

  @property
  def row_size(self) -> int:
    return self.group_size * self.segment_size

  def owned(self, device: int) -> list[str]:
    """The layers ``device`` decomposes, in segment order."""
    return sorted((n for n, d in self.owner.items() if d == device),
                  key=self.offset.__getitem__)

  def row_offset(self, name: str) -> int:
    """Start of ``name`` in the row of any device of its group."""
    return (self.owner[name] % self.group_size) * self.segment_size + self.offset[name]

  def first_of_group(self, name: str) -> int:
    """The lowest device whose row holds ``name``."""
    return self.owner[name] // self.group_size * self.group_size


def make_layout(dims: Dims, init_preconditioner, num_devices: int,
                group_size: int,
                assignment: AssignmentStrategy) -> ShardedLayout:
  """Assigns layers to devices (greedy, KAISA) and packs their segments.

  Args:
    dims: ``{layer: (activation_dim, gradient_dim)}``.
    init_preconditioner: ``(dA, dG) -> Preconditioner`` (the method's init),
      only traced for shapes.
    num_devices: n.
    group_size: g, a divisor of n.
    assignment: what the greedy assignment balances.
  """
  return _make_layout(tuple(sorted(dims.items())), init_preconditioner,
                      num_devices, group_size, assignment)


@functools.lru_cache(maxsize=64)
def _make_layout(dims: tuple[tuple[str, tuple[int, int]], ...],
                 init_preconditioner, num_devices: int, group_size: int,
                 assignment: AssignmentStrategy) -> ShardedLayout:
  owner = assign_layers(
      {name: layer_cost(*d, assignment) for name, d in dims}, num_devices)
  templates = {
      name: jax.eval_shape(functools.partial(init_preconditioner, *d))
      for name, d in dims
  }
  size = {
      name: sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(t))
      for name, t in templates.items()
  }
  offset, gradient_offset = {}, {}
  loads, gradient_loads = [0] * num_devices, [0] * num_devices
  for name, (activation_dim, gradient_dim) in dims:
    device = owner[name]
    offset[name], loads[device] = loads[device], loads[device] + size[name]
    gradient_offset[name] = gradient_loads[device]
    gradient_loads[device] += activation_dim * gradient_dim
  return ShardedLayout(
      num_devices=num_devices,
      group_size=group_size,
      owner=owner,
      offset=offset,
      size=size,
      segment_size=max(loads),
      gradient_offset=gradient_offset,
      gradient_segment_size=max(gradient_loads),
      templates=templates)


def pack(tree: Any) -> jax.Array:
  """All leaves of ``tree`` raveled and concatenated: ``[elements]``."""
  return jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])


def unpack(vector: jax.Array, template: Any) -> Any:
  """Inverse of ``pack`` given a tree of ``ShapeDtypeStruct``s."""
  leaves, treedef = jax.tree.flatten(template)
  out, start = [], 0
  for leaf in leaves:
    count = math.prod(leaf.shape)
    out.append(vector[start:start + count].reshape(leaf.shape))
    start += count
  return jax.tree.unflatten(treedef, out)


def fill_segment(pieces: list[jax.Array], length: int,
                 dtype: jnp.dtype) -> jax.Array:
  """``pieces`` concatenated and zero-padded to ``[length]``."""
  used = sum(p.shape[0] for p in pieces)
  padding = [jnp.zeros((length - used,), dtype)] if length > used else []
  if not pieces and not padding:
    return jnp.zeros((0,), dtype)
  return jnp.concatenate([p.astype(dtype) for p in pieces] + padding)
