"""Greedy assignment of layers to devices (KAISA's ``KAISAAssignment``)."""

from __future__ import annotations

from collections.abc import Mapping

from kfac_jax.distribution.strategy import AssignmentStrategy


def layer_cost(
  activation_dim: int, gradient_dim: int, assignment: AssignmentStrategy
) -> int:
  """``dA³ + dG³`` (decomposition work) or ``dA² + dG²`` (result memory)."""
  power = 3 if assignment is AssignmentStrategy.COMPUTE else 2
  return activation_dim**power + gradient_dim**power


def assign_layers(
  costs: Mapping[str, int], num_devices: int, group_size: int = 1
) -> dict[str, int]:
  """Largest layer first, each to the least-loaded group, then member.

  Layers are first spread over the ``num_devices // group_size`` groups
  (devices ``j·g … j·g + g − 1``), which balances what each group keeps, and
  then each group's layers over its ``g`` members, which balances who
  decomposes what. Both factors of a layer go to the same device (KAISA's
  colocated factors), so its preconditioned gradient needs nothing from
  other devices. Ties go to the lower layer name and index, so every process
  agrees.

  Returns:
    ``{layer: device index in [0, num_devices)}``.
  """
  group_of = _greedy(costs, num_devices // group_size)
  owner = {}
  for group in range(num_devices // group_size):
    members = _greedy(
      {n: c for n, c in costs.items() if group_of[n] == group}, group_size
    )
    owner.update({n: group * group_size + m for n, m in members.items()})
  return owner


def _greedy(costs: Mapping[str, int], bins: int) -> dict[str, int]:
  """Largest first, each to the bin with the least load so far (LPT)."""
  loads = [0] * bins
  chosen = {}
  for name in sorted(costs, key=lambda n: (-costs[n], n)):
    target = min(range(bins), key=lambda b: (loads[b], b))
    chosen[name] = target
    loads[target] += costs[name]
  return chosen
