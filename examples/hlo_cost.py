"""Per-device work read from a compiled SPMD program (``compiled.as_text()``).

Every device runs the same program, so which work a device does shows in the
program only where it branches on the device: a ``conditional`` whose branch
index comes from ``partition-id`` (what ``lax.switch(lax.axis_index(...))``
inside ``shard_map`` compiles to) runs branch ``d`` on device ``d``. Any other
``conditional`` (``lax.cond`` on the step count) is resolved by ``path``:
``"max"`` takes its costliest branch (a decomposition step), ``"min"`` its
cheapest (a step with neither factor nor decomposition update).

Counted per device:

* decomposition FLOPs of LAPACK/cuSOLVER custom calls, with the textbook
  counts for a ``[d, d]`` matrix: symmetric eigendecomposition with vectors
  ``9·d³``, Cholesky ``d³/3``, triangular solve with ``d`` right-hand sides
  ``d³`` (times the batch of a vmapped call);
* collective bytes: the result bytes of every all-gather, all-reduce,
  reduce-scatter, all-to-all and collective-permute.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_SHAPE = re.compile(
  r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64|c64|c128)\[([\d,]*)\]"
)
_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)
_CALLED = re.compile(
  r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  result_type: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str


@dataclasses.dataclass(frozen=True)
class DeviceCost:
  decomposition_flops: float = 0.0
  collective_bytes: int = 0

  def __add__(self, other: DeviceCost) -> DeviceCost:
    return DeviceCost(
      self.decomposition_flops + other.decomposition_flops,
      self.collective_bytes + other.collective_bytes,
    )


def _split_balanced(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced parentheses in {text[:200]!r}")


def _parse_instruction(line: str) -> Instruction | None:
  match = _NAME.match(line)
  if not match:
    return None
  rest = line[match.end() :]
  if rest.startswith("("):
    end = _split_balanced(rest, 0)
    result_type, rest = rest[:end], rest[end:].lstrip()
  else:
    result_type, _, rest = rest.partition(" ")
  opcode, paren, rest = rest.partition("(")
  if not paren:
    return None
  end = _split_balanced("(" + rest, 0) - 1
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[: end - 1]))
  return Instruction(
    match.group(1), result_type, opcode.strip(), operands, rest[end:]
  )


def parse_computations(
  hlo_text: str,
) -> tuple[dict[str, dict[str, Instruction]], str]:
  """``({computation: {instruction: Instruction}}, entry name)``."""
  computations: dict[str, dict[str, Instruction]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = computations.setdefault(header.group(1), {})
      if line.startswith("ENTRY"):
        entry = header.group(1)
      continue
    if current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        current[instruction.name] = instruction
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _shapes(result_type: str) -> Iterator[tuple[str, tuple[int, ...]]]:
  for dtype, dims in _SHAPE.findall(result_type):
    yield dtype, tuple(int(d) for d in dims.split(",") if d)


def _decomposition_flops(instruction: Instruction) -> float:
  target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
  if instruction.opcode != "custom-call" or target is None:
    return 0.0
  name = target.group(1).lower()
  _, dims = next(_shapes(instruction.result_type), ("", ()))
  if len(dims) < 2:
    return 0.0
  batch, d = math.prod(dims[:-2]), dims[-1]
  if "syev" in name or "eigh" in name:
    return 9.0 * batch * d**3
  if "potrf" in name or "cholesky" in name:
    return batch * d**3 / 3
  if "trsm" in name or "triangular" in name:
    return float(batch * dims[-2] * d**2)
  return 0.0


def _collective_bytes(instruction: Instruction) -> int:
  if not any(instruction.opcode.startswith(c) for c in _COLLECTIVES):
    return 0
  if instruction.opcode.endswith("-done"):  # Async pairs: count the start.
    return 0
  return sum(
    _BYTES[dtype] * math.prod(dims)
    for dtype, dims in _shapes(instruction.result_type)
  )


def _depends_on_partition_id(
  computation: dict[str, Instruction], computations, name: str, depth: int = 0
) -> bool:
  instruction = computation.get(name)
  if instruction is None or depth > 6:
    return False
  if instruction.opcode in ("partition-id", "replica-id"):
    return True
  for called in _CALLED.findall(instruction.attributes):
    if any(
      i.opcode in ("partition-id", "replica-id")
      for i in computations.get(called, {}).values()
    ):
      return True
  return any(
    _depends_on_partition_id(computation, computations, operand, depth + 1)
    for operand in instruction.operands
  )


def per_device_costs(
  hlo_text: str, num_devices: int, path: str = "max"
) -> list[DeviceCost]:
  """The cost of one step on each device; see the module docstring."""
  if path not in ("max", "min"):
    raise ValueError(f"path must be 'max' or 'min'; got {path!r}")
  computations, entry = parse_computations(hlo_text)
  pick = max if path == "max" else min

  def cost(name: str, device: int) -> DeviceCost:
    total = DeviceCost()
    computation = computations.get(name, {})
    for instruction in computation.values():
      total += DeviceCost(
        _decomposition_flops(instruction), _collective_bytes(instruction)
      )
      branches = _BRANCHES.search(instruction.attributes)
      if instruction.opcode == "conditional":
        names = (
          [b.strip().lstrip("%") for b in branches.group(1).split(",")]
          if branches
          else _CALLED.findall(instruction.attributes)
        )
        if (
          len(names) == num_devices
          and instruction.operands
          and _depends_on_partition_id(
            computation, computations, instruction.operands[0]
          )
        ):
          total += cost(names[device], device)
        else:
          total += pick(
            (cost(b, device) for b in names),
            key=lambda c: (c.decomposition_flops, c.collective_bytes),
          )
        continue
      for called in _CALLED.findall(instruction.attributes):
        total += cost(called, device)
    return total

  return [cost(entry, device) for device in range(num_devices)]
