"""Registered layers: what K-FAC knows about a layer from its parameters alone.

A layer is *registered* when its parameters hold a ``kernel`` of shape
``[*window, in, out]`` (``window`` empty for a dense layer) and optionally a
``bias`` of shape ``[out]`` under the same module path. Its gradient is viewed
as the matrix ``[kernel.reshape(prod(window)*in, out); bias]`` of shape
``[activation_dim, gradient_dim]``, and its curvature as ``A ⊗ G`` with
``A: [activation_dim, activation_dim]`` and ``G: [gradient_dim, gradient_dim]``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

KERNEL = "kernel"
BIAS = "bias"


@dataclasses.dataclass(frozen=True)
class LayerInfo:
  """Static description of one registered layer, derived from its params.

  Attributes:
    name: module path joined with ``/`` (``"encoder/Dense_0"``).
    path: the module path as a tuple of keys into the params tree.
    kernel_shape: ``[*window, in, out]``.
    has_bias: whether a ``bias`` ``[out]`` sits beside the kernel.
  """

  name: str
  path: tuple[str, ...]
  kernel_shape: tuple[int, ...]
  has_bias: bool

  @property
  def activation_dim(self) -> int:
    """Size of A: ``prod(window) * in`` plus one for the bias."""
    return math.prod(self.kernel_shape[:-1]) + int(self.has_bias)

  @property
  def gradient_dim(self) -> int:
    """Size of G: the number of output features."""
    return self.kernel_shape[-1]


def path_key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def layer_name(path: Sequence[str]) -> str:
  return "/".join(path)


def matches_any(patterns: Sequence[re.Pattern[str]], *texts: str) -> bool:
  """Whether any pattern ``re.search``-matches any of ``texts``."""
  return any(p.search(t) for p in patterns for t in texts)


def compile_patterns(skip_layers: Sequence[str] | str | None) -> tuple[re.Pattern[str], ...]:
  """Compiles ``skip_layers`` regexes, naming the bad one on error."""
  if skip_layers is None:
    return ()
  if isinstance(skip_layers, str):
    skip_layers = (skip_layers,)
  if not isinstance(skip_layers, (list, tuple)):
    raise TypeError(
        "skip_layers must be a regex string or a list/tuple of them; got "
        f"{skip_layers!r} ({type(skip_layers).__name__}).")
  compiled = []
  for pattern in skip_layers:
    if not isinstance(pattern, str):
      raise TypeError(
          f"skip_layers must hold regex strings, got {pattern!r} "
          f"({type(pattern).__name__}).")
    try:
      compiled.append(re.compile(pattern))
    except re.error as e:
      raise ValueError(f"skip_layers: invalid regex {pattern!r}: {e}.") from e
  return tuple(compiled)


def is_skipped_path(path: tuple[str, ...],
                     skip: Sequence[re.Pattern[str]]) -> bool:
  # A skipped module hides everything under it: test every prefix of the path
  # (the root layer's path is empty: test its empty name).
  prefixes = [path[:i] for i in range(1, len(path) + 1)] or [()]
  return any(matches_any(skip, layer_name(prefix)) for prefix in prefixes)


def find_layers(params: Any,
                skip: Sequence[re.Pattern[str]] = ()) -> dict[str, LayerInfo]:
  """Registered layers of a params tree, keyed by module path.

  Every mapping holding an array ``kernel`` of rank >= 2 is a layer, unless its
  path (or the path of a module above it) matches a ``skip`` pattern.

  Args:
    params: the model's params (``variables["params"]``), arrays or
      ``jax.ShapeDtypeStruct``s.
    skip: compiled ``skip_layers`` patterns.

  Returns:
    ``{name: LayerInfo}`` in params-tree order.
  """
  layers: dict[str, LayerInfo] = {}

  def visit(node: Any, path: tuple[str, ...]) -> None:
    if not isinstance(node, Mapping):
      return
    kernel = node.get(KERNEL)
    if kernel is not None and not isinstance(kernel, Mapping) and len(
        kernel.shape) >= 2:
      if is_skipped_path(path, skip):
        return
      bias = node.get(BIAS)
      kernel_shape = tuple(int(d) for d in kernel.shape)
      if bias is not None and tuple(bias.shape) != kernel_shape[-1:]:
        raise ValueError(
            f"Layer {layer_name(path)!r}: bias shape {tuple(bias.shape)} does "
            f"not match the kernel's output size {kernel_shape[-1]}. K-FAC "
            "needs bias [out] beside kernel [..., in, out]; add the layer to "
            "skip_layers to leave it to the chained optimizer.")
      layers[layer_name(path)] = LayerInfo(
          name=layer_name(path),
          path=path,
          kernel_shape=kernel_shape,
          has_bias=bias is not None)
    for key, child in node.items():
      visit(child, path + (path_key_name(key),))

  visit(params, ())
  return layers


def get_layer_params(params: Any, layer: LayerInfo) -> Mapping[str, Any]:
  """The ``{"kernel", "bias"?}`` mapping of one layer inside a params tree."""
  node = params
  for key in layer.path:
    node = node[key]
  return node
