"""KAISA's distribution strategies, resolved against a device mesh.

With ``n`` devices on the K-FAC mesh axes and ``grad_worker_fraction`` f, every
layer's decomposition is computed by one device and its result (eigenbasis or
inverse) is kept by a *group* of ``g = f·n`` devices (KAISA's gradient
workers). ``COMM_OPT`` (f = 1): every device keeps every result and
preconditions every layer locally. ``MEM_OPT`` (f = 1/n): only the computing
device keeps it and shares the preconditioned gradient every step.
``HYBRID_OPT`` (f = 1/2) and other fractions lie in between.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import warnings
from collections.abc import Sequence

import jax

from kfac_jax.hyperparameters import parse_enum, static_scalar


class DistributedStrategy(enum.Enum):
  """Named gradient-worker fractions (KAISA): 1, 1/2 and 1/n."""

  COMM_OPT = "comm_opt"
  HYBRID_OPT = "hybrid_opt"
  MEM_OPT = "mem_opt"


class AssignmentStrategy(enum.Enum):
  """What the greedy layer assignment balances: a factor's ``dim³``/``dim²``."""

  COMPUTE = "compute"
  MEMORY = "memory"


@dataclasses.dataclass(frozen=True)
class DistributionConfig:
  """Checked distribution arguments of ``scale_by_kfac`` (mesh not yet known).

  Attributes:
    mesh_axes: mesh axis names the second-order work is spread over.
    grad_worker_fraction: a ``DistributedStrategy`` or a float in (0, 1].
    assignment: what the layer assignment balances.
  """

  mesh_axes: tuple[str, ...]
  grad_worker_fraction: DistributedStrategy | float
  assignment: AssignmentStrategy


def make_config(
  mesh_axes: str | Sequence[str] | None,
  grad_worker_fraction: DistributedStrategy | float | str,
  assignment_strategy: AssignmentStrategy | str,
) -> DistributionConfig | None:
  """Validates the arguments; ``None`` when ``mesh_axes`` is ``None``.

  Without ``mesh_axes`` a strategy other than the defaults (``COMM_OPT``,
  ``"compute"``) has nothing to act on: it warns, as the likely cause is a
  forgotten ``mesh_axes``.
  """
  fraction = _parse_fraction(grad_worker_fraction)
  assignment = parse_enum(
    AssignmentStrategy, "assignment_strategy", assignment_strategy
  )
  if mesh_axes is None:
    ignored = [
      f"{name}={_describe(value)}"
      for name, value, default in (
        (
          "grad_worker_fraction",
          fraction,
          fraction in (DistributedStrategy.COMM_OPT, 1.0),
        ),
        (
          "assignment_strategy",
          assignment,
          assignment is AssignmentStrategy.COMPUTE,
        ),
      )
      if not default
    ]
    if ignored:
      warnings.warn(
        f"{' and '.join(ignored)} given without mesh_axes: ignored, every "
        "device computes and keeps every layer's preconditioner. Pass "
        "mesh_axes=... (the mesh axis names to spread the second-order "
        "work over) to distribute it, or leave them at their defaults.",
        stacklevel=6,
      )
    return None
  axes = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
  if (
    not isinstance(axes, Sequence)
    or not axes
    or not all(isinstance(a, str) and a for a in axes)
    or len(set(axes)) != len(axes)
  ):
    raise TypeError(
      "mesh_axes must be a mesh axis name or a non-empty sequence of "
      f"distinct non-empty names (e.g. ('data', 'fsdp')); got "
      f"{mesh_axes!r}."
    )
  return DistributionConfig(
    mesh_axes=tuple(axes), grad_worker_fraction=fraction, assignment=assignment
  )


def group_size(
  config: DistributionConfig,
  mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh,
) -> tuple[int, int]:
  """``(n, g)``: devices on ``config.mesh_axes`` and devices per group.

  Raises:
    ValueError: an axis is not in ``mesh``, or ``f·n`` is not a whole divisor
      of ``n``.
  """
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  unknown = [a for a in config.mesh_axes if a not in sizes]
  if unknown:
    raise ValueError(
      f"mesh_axes {list(config.mesh_axes)}: {unknown} not in the mesh, whose "
      f"axes are {dict(sizes)}. Name axes of the mesh given to jax.set_mesh."
    )
  n = math.prod(sizes[a] for a in config.mesh_axes)
  fraction = config.grad_worker_fraction
  if fraction is DistributedStrategy.COMM_OPT or n == 1:
    return n, n
  if fraction is DistributedStrategy.MEM_OPT:
    return n, 1
  if fraction is DistributedStrategy.HYBRID_OPT:
    fraction = 0.5
  g = round(fraction * n)
  if abs(fraction * n - g) > 1e-9 or g < 1 or n % g:
    divisors = ", ".join(f"{d}/{n}" for d in range(1, n + 1) if n % d == 0)
    raise ValueError(
      f"grad_worker_fraction={config.grad_worker_fraction!r} on {n} devices "
      f"(mesh_axes {list(config.mesh_axes)}) gives groups of "
      f"{fraction * n:g} devices; f·n must be a whole divisor of {n} "
      f"(f in {{{divisors}}})."
    )
  return n, g


def _describe(value: enum.Enum | float) -> str:
  if isinstance(value, enum.Enum):
    return f"{type(value).__name__}.{value.name}"
  return f"{value:g}"


def _parse_fraction(value: object) -> DistributedStrategy | float:
  if isinstance(value, (DistributedStrategy, str)):
    return parse_enum(DistributedStrategy, "grad_worker_fraction", value)
  value = static_scalar("grad_worker_fraction", value)
  if (
    isinstance(value, numbers.Real)
    and not isinstance(value, bool)
    and 0 < float(value) <= 1
  ):  # NaN fails both comparisons.
    return float(value)
  raise ValueError(
    f"grad_worker_fraction must be a kfac_jax.DistributedStrategy or a "
    f"fraction in (0, 1]; got {value!r}."
  )
