"""Greedy assignment of layers to devices (KAISA's ``KAISAAssignment``)."""

from __future__ import annotations

from collections.abc import Mapping

from kfac_jax.distribution.strategy import AssignmentStrategy


def layer_cost(activation_dim: int, gradient_dim: int,
               assignment: AssignmentStrategy) -> int:
  """``dA³ + dG³`` (decomposition work) or ``dA² + dG²`` (result memory)."""
  power = 3 if assignment is AssignmentStrategy.COMPUTE else 2
  return activation_dim**power + gradient_dim**power


def assign_layers(costs: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Largest layer first, each to the device with the least load so far.

  Both factors of a layer go to the same device (KAISA's colocated factors),
  so its preconditioned gradient needs nothing from other devices. Ties go
  to the lower layer name and device index, so every process agrees.

  Returns:
    ``{layer: device index in [0, num_devices)}``.
  """
  loads = [0] * num_devices
  owner = {}
  for name in sorted(costs, key=lambda n: (-costs[n], n)):
    device = min(range(num_devices), key=lambda d: (loads[d], d))
    owner[name] = device
    loads[device] += costs[name]
  return owner
