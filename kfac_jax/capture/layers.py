"""Registered layers: what K-FAC knows about a layer and its Kronecker blocks.

A layer is *registered* when its params hold a ``kernel`` and optionally a
``bias`` under one module path. Its kernel's axes are read as
``[*stack, *contracted, *output]``:

* ``stack``: leading layer axes added by ``nn.scan``/``nn.remat_scan`` (one
  independent layer per slice);
* ``contracted``: the axes multiplied with the input: ``(in,)`` for ``Dense``,
  ``(*window, in / groups)`` for ``Conv``, the input's ``axis`` for
  ``DenseGeneral``;
* ``output``: the output features, ``(out,)`` or ``DenseGeneral``'s
  ``features``; the bias is ``[*stack, *output]``.

An ``Embed`` table ``embedding: [*stack, vocab, features]`` is the kernel of a
dense layer on one-hot inputs: its A is diagonal (token frequencies), kept as
a dense ``[vocab, vocab]`` matrix. It is preconditioned only on request
(``scale_by_kfac(precondition_embeddings=True)``), see there.

A convolution with ``feature_group_count = g`` maps each group of ``in / g``
input channels to its own ``out / g`` output channels, so its curvature is
block diagonal over the groups. Each stack slice and each group is one
Kronecker *block* with its own ``A: [activation_dim, activation_dim]``,
``activation_dim = prod(contracted) + has_bias``, and
``G: [gradient_dim, gradient_dim]``, ``gradient_dim = prod(output) / g``.

From the params alone, a kernel ``[*window, in, out]`` is a plain ``Dense`` or
``Conv`` (no stack, one group). Scanned layers, grouped convolutions and
``DenseGeneral`` need the layer table that ``trace_layers`` reads off the loss
function.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

KERNEL = "kernel"
BIAS = "bias"
EMBEDDING = "embedding"

# Flax's canonical padding: a lax padding string, "CIRCULAR"/"REFLECT"/"CAUSAL",
# or explicit (low, high) pairs per spatial dimension.
Padding = str | tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
  """Static hyper-parameters of a convolution, as the layer applied them.

  Attributes:
    window: kernel spatial size ``(kh, kw, ...)``.
    strides: window strides, one per spatial dimension.
    padding: Flax's canonical padding (see ``Padding``).
    input_dilation: lhs dilation, one per spatial dimension.
    kernel_dilation: rhs dilation, one per spatial dimension.
    feature_group_count: grouped convolution factor (1 for a plain conv).
  """

  window: tuple[int, ...]
  strides: tuple[int, ...]
  padding: Padding
  input_dilation: tuple[int, ...]
  kernel_dilation: tuple[int, ...]
  feature_group_count: int = 1


@dataclasses.dataclass(frozen=True)
class LayerSignature:
  """Static identity of a captured layer: how its call reads its kernel.

  The stats carry it alone, so it holds all that the factors need. It is
  also the one description of how the kernel's axes read: a layer table's
  ``LayerInfo`` holds the traced signature and derives its stack,
  contracted and group axes, class name and kernel entry from it.

  Attributes:
    module_type: the Flax class name (``"Dense"``, ``"Conv"``); ``skip_layers``
      patterns are matched against it.
    has_bias: whether the layer added a bias.
    conv: the convolution geometry, ``None`` for a dense layer.
    input_axes: dense layers: the input axes contracted with the kernel,
      negative (``(-1,)`` for ``Dense``; ``DenseGeneral``'s ``axis``).
    output_ndim: dense layers: number of output feature axes (``len(features)``
      of ``DenseGeneral``).
    stack_ndim: leading layer axes of the captured tensors (``nn.scan``).
    num_embeddings: an ``Embed`` lookup's vocabulary size (its inputs are
      token ids, carried as float32), else ``None``.
  """

  module_type: str
  has_bias: bool
  conv: ConvGeometry | None = None
  input_axes: tuple[int, ...] = (-1,)
  output_ndim: int = 1
  stack_ndim: int = 0
  num_embeddings: int | None = None

  @property
  def contracted_ndim(self) -> int:
    """Kernel axes contracted with the input (a conv's window and channels)."""
    if self.conv is not None:
      return len(self.conv.window) + 1
    if self.num_embeddings is not None:
      return 1
    return len(self.input_axes)

  @property
  def groups(self) -> int:
    return 1 if self.conv is None else self.conv.feature_group_count

  @property
  def kernel_key(self) -> str:
    """The params entry holding the layer's kernel."""
    return EMBEDDING if self.num_embeddings is not None else KERNEL


@dataclasses.dataclass(frozen=True)
class LayerInfo:
  """Static description of one registered layer: its params and its call.

  The params give where the layer sits and its kernel's shape; how the
  kernel's axes read (stack, contracted, groups) is the traced call's, the
  ``signature`` that ``value_grad_and_stats`` also carries in the layer's
  stats. Without one (a layer read from its params alone), the kernel is a
  ``Dense``/``Conv`` ``[*window, in, out]``: no stack, one group.

  Attributes:
    name: module path joined with ``/`` (``"encoder/Dense_0"``).
    path: the module path as a tuple of keys into the params tree (strings,
      or integers for an NNX list).
    kernel_shape: ``[*stack, *contracted, *output]``.
    has_bias: whether the params hold a bias ``[*stack, *output]`` beside the
      kernel; the call's ``signature.has_bias`` (A's bias row) must agree,
      which ``find_layers`` and ``update`` check.
    signature: the layer's call as ``trace_layers`` traced it, or ``None``
      when read from the params alone.
  """

  name: str
  path: tuple[Any, ...]
  kernel_shape: tuple[int, ...]
  has_bias: bool
  signature: LayerSignature | None = None

  @property
  def stack_ndim(self) -> int:
    """Number of leading layer (``nn.scan``) axes of the kernel."""
    return 0 if self.signature is None else self.signature.stack_ndim

  @property
  def groups(self) -> int:
    """Convolution ``feature_group_count``."""
    return 1 if self.signature is None else self.signature.groups

  @property
  def module_type(self) -> str | None:
    """The traced Flax class name (``skip_layers`` patterns match it)."""
    return None if self.signature is None else self.signature.module_type

  @property
  def kernel_key(self) -> str:
    """The params entry of the kernel (``"embedding"`` for an ``Embed``)."""
    return KERNEL if self.signature is None else self.signature.kernel_key

  @property
  def stack_shape(self) -> tuple[int, ...]:
    """The kernel's leading layer axes (``nn.scan``'s), ``()`` for one
    layer."""
    return self.kernel_shape[: self.stack_ndim]

  @property
  def contracted_shape(self) -> tuple[int, ...]:
    """The kernel axes contracted with the input (all but the last when read
    from the params alone)."""
    count = (
      len(self.kernel_shape) - 1
      if self.signature is None
      else self.signature.contracted_ndim
    )
    return self.kernel_shape[self.stack_ndim : self.stack_ndim + count]

  @property
  def output_shape(self) -> tuple[int, ...]:
    """The kernel's output axes, after the contracted ones."""
    return self.kernel_shape[self.stack_ndim + len(self.contracted_shape) :]

  @property
  def activation_dim(self) -> int:
    """The size of each block's A, ``prod(contracted)`` plus one for the
    bias."""
    return math.prod(self.contracted_shape) + int(self.has_bias)

  @property
  def gradient_dim(self) -> int:
    """The size of each block's G, the output features per group."""
    return math.prod(self.output_shape) // self.groups

  @property
  def num_blocks(self) -> int:
    """``prod(stack) * groups`` independent Kronecker blocks."""
    return math.prod(self.stack_shape) * self.groups

  @property
  def block_names(self) -> tuple[str, ...]:
    """The state's keys of the blocks, the layer name or ``name[i]`` for
    several.

    ``i = stack_index * groups + group``, with the stack index flattened in
    row-major order.
    """
    if self.num_blocks == 1:
      return (self.name,)
    return tuple(f"{self.name}[{i}]" for i in range(self.num_blocks))


# {layer name: LayerInfo}, as ``find_layers`` and ``trace_layers`` return it.
LayerTable = Mapping[str, LayerInfo]


class TracedLayers(dict):
  """``trace_layers``' table: ``{layer name: LayerInfo}``, a dict.

  Attributes:
    skipped_classes: ``{layer name: Flax class name}`` of the captured
      modules that ``trace_layers``' ``skip_layers`` matched by class name
      only. Their kernels are not in the table; ``find_layers`` reads this to
      tell them from kernels of modules the capture does not know.
  """

  def __init__(
    self, layers: Mapping[str, LayerInfo], skipped_classes: Mapping[str, str]
  ):
    super().__init__(layers)
    self.skipped_classes = dict(skipped_classes)


def class_skipped(
  path: tuple[Any, ...], module_type: str, skip: Sequence[re.Pattern[str]]
) -> bool:
  """Whether ``skip`` leaves the layer out by its class name alone."""
  return matches_any(skip, module_type) and not is_skipped_path(path, skip)


def blocks_of(layers: LayerTable) -> dict[str, tuple[int, int]]:
  """``{block name: (activation_dim, gradient_dim)}`` over all layers."""
  return {
    block: (layer.activation_dim, layer.gradient_dim)
    for layer in layers.values()
    for block in layer.block_names
  }


def within_factor_size(
  layers: LayerTable, max_factor_dim: int | None
) -> tuple[dict[str, LayerInfo], frozenset[str]]:
  """``layers`` split by the size of their Kronecker factors.

  Args:
    layers: ``{name: LayerInfo}``.
    max_factor_dim: the largest ``activation_dim`` (``[in+1, in+1]`` for a
      Dense with bias) and ``gradient_dim`` (``[out, out]``) kept; ``None``:
      no limit.

  Returns:
    ``(kept, left_out)``: the layers whose A and G are both at most
    ``max_factor_dim`` on a side (in ``layers``' order), and the names of
    the others.
  """
  if max_factor_dim is None:
    return dict(layers), frozenset()
  fits = lambda layer: (
    max(layer.activation_dim, layer.gradient_dim) <= max_factor_dim
  )
  kept = {name: layer for name, layer in layers.items() if fits(layer)}
  return kept, frozenset(layers) - frozenset(kept)


def path_key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def layer_name(path: Sequence[Any]) -> str:
  return "/".join(map(path_key_name, path))


def skip_pattern(name: str) -> str:
  """A ``skip_layers`` regex matching exactly the layer ``name`` (``"^$"``
  for a root layer, whose name ``''`` would match every layer)."""
  return f"^{re.escape(name)}$"


def matches_any(patterns: Sequence[re.Pattern[str]], *texts: str) -> bool:
  """Whether any pattern ``re.search``-matches any of ``texts``."""
  return any(p.search(t) for p in patterns for t in texts)


def compile_patterns(
  skip_layers: Sequence[str] | str | None,
) -> tuple[re.Pattern[str], ...]:
  """Compiles ``skip_layers`` regexes, naming the bad one on error."""
  if skip_layers is None:
    return ()
  if isinstance(skip_layers, str):
    skip_layers = (skip_layers,)
  if not isinstance(skip_layers, (list, tuple)):
    raise TypeError(
      "skip_layers must be a regex string or a list/tuple of them; got "
      f"{skip_layers!r} ({type(skip_layers).__name__})."
    )
  compiled = []
  for pattern in skip_layers:
    if not isinstance(pattern, str):
      raise TypeError(
        f"skip_layers must hold regex strings, got {pattern!r} "
        f"({type(pattern).__name__})."
      )
    if not pattern:
      # ``"".split(",")`` of an empty setting gives [""], which re.search
      # matches in every name: K-FAC would silently be off everywhere.
      raise ValueError(
        "skip_layers: the empty pattern '' matches every layer, which "
        "would leave no layer preconditioned; drop it (an empty setting "
        "split on ',' gives ['']), or pass '.*' to skip every layer on "
        "purpose."
      )
    try:
      compiled.append(re.compile(pattern))
    except re.error as e:
      raise ValueError(f"skip_layers: invalid regex {pattern!r}: {e}.") from e
  return tuple(compiled)


def is_skipped_path(
  path: tuple[Any, ...], skip: Sequence[re.Pattern[str]]
) -> bool:
  # A skipped module hides everything under it: test every prefix of the path
  # (the root layer's path is empty: test its empty name).
  prefixes = [path[:i] for i in range(1, len(path) + 1)] or [()]
  return any(matches_any(skip, layer_name(prefix)) for prefix in prefixes)


def is_skipped_layer(
  path: tuple[Any, ...], module_type: str, skip: Sequence[re.Pattern[str]]
) -> bool:
  """Whether ``skip`` matches the layer's path (or a module's above it) or
  its Flax class name."""
  return is_skipped_path(path, skip) or matches_any(skip, module_type)


def find_layers(
  params: Any,
  skip: Sequence[re.Pattern[str]] = (),
  table: LayerTable | None = None,
  warn_untraced: bool = False,
  include_embeddings: bool = False,
) -> dict[str, LayerInfo]:
  """Registered layers of a params tree, keyed by module path.

  Every mapping holding an array ``kernel`` of rank >= 2 is a layer, unless its
  path (or the path of a module above it) matches a ``skip`` pattern.

  Args:
    params: the model's params (``variables["params"]``), arrays or
      ``jax.ShapeDtypeStruct``s.
    skip: compiled ``skip_layers`` patterns.
    table: the layer table from ``trace_layers``. With it, each layer's
      structure comes from the table, and a kernel the table lacks (a module
      the capture does not know, e.g. ``nn.Einsum``) is left to the chained
      optimizer. Without it, every kernel is a ``Dense``/``Conv``
      ``[*window, in, out]``.
    warn_untraced: warn once per kernel that the table lacks.
    include_embeddings: register the table's ``Embed`` layers too.

  Returns:
    ``{name: LayerInfo}`` in params-tree order.
  """
  layers: dict[str, LayerInfo] = {}
  masked: set[str] = set()  # withheld by optax.masked/multi_transform

  def visit(node: Any, path: tuple[str, ...]) -> None:
    if _is_masked(node):
      masked.add(layer_name(path))
      return
    if not isinstance(node, Mapping):
      return
    name = layer_name(path)
    key = KERNEL
    if include_embeddings and table is not None:
      if name in table:
        key = table[name].kernel_key
      elif warn_untraced:
        _warn_untraced_embedding(name, path, node, skip)
    kernel = node.get(key)
    if _is_masked(kernel):
      masked.add(name)
      return  # the chain gives K-FAC no part of this layer
    if (
      kernel is not None
      and not isinstance(kernel, Mapping)
      and len(kernel.shape) >= 2
      and not is_skipped_path(path, skip)
    ):
      if _is_masked(node.get(BIAS)):
        raise ValueError(
          f"Layer {name!r}: its bias is masked out of K-FAC's part of the "
          "chain (optax.masked, optax.multi_transform) but not its kernel. "
          "K-FAC preconditions them together (A has the bias row): mask "
          "both or neither."
        )
      layer = LayerInfo(
        name=name,
        path=path,
        kernel_shape=tuple(int(d) for d in kernel.shape),
        has_bias=node.get(BIAS) is not None,
      )
      if table is not None:
        layer = _from_table(table, layer, warn_untraced, skip)
      if layer is not None and not matches_any(skip, layer.module_type or ""):
        _check_bias(layer, node.get(BIAS))
        layers[name] = layer
    for key, child in node.items():
      visit(child, path + (key,))

  visit(params, ())
  if table is not None:
    missing = sorted(
      set(table)
      - set(layers)
      - {
        n
        for n, info in table.items()
        if is_skipped_layer(info.path, info.module_type or "", skip)
        or (info.kernel_key != KERNEL and not include_embeddings)
        or any(n == m or n.startswith(m + "/") or not m for m in masked)
      }
    )
    if missing:
      raise ValueError(
        f"The layer table has layers {missing} that the params lack. Trace "
        "the table (kfac_jax.trace_layers) from the same model and params; "
        "layers left out of the optimized params on purpose (frozen by "
        "nnx.Optimizer's wrt filter, or a params subset) go in "
        "skip_layers, given to trace_layers as well."
      )
  return layers


def warn_unmatched_skips(
  params: Any, skip: Sequence[re.Pattern[str]], class_names: Collection[str]
) -> None:
  """Warns once per ``skip`` pattern that matches no module path of
  ``params`` nor any of ``class_names`` (the captured layers' Flax
  classes): it skips nothing, likely a typo.

  Called without a layer table only: with one, a pattern may name a layer
  that ``trace_layers`` left out and the params lack (frozen by
  ``nnx.Optimizer``'s ``wrt``), as the table's error advises. Params the
  chain withholds in part (an ``optax.MaskedNode`` for a module hides the
  paths below it) get no warning either.
  """
  names: set[str] = set()
  withheld = False

  def visit(node: Any, path: tuple[str, ...]) -> None:
    nonlocal withheld
    if _is_masked(node):
      withheld = True
    elif isinstance(node, Mapping):
      names.add(layer_name(path))
      for key, child in node.items():
        visit(child, path + (key,))

  visit(params, ())
  if withheld:
    return
  modules = sorted(names - {""})
  # Params that are one layer's own (a top-level nn.Dense) have no module
  # path to show: the class names are all a pattern can match there.
  searched = (
    f"paths such as {modules[:3]}"
    if modules
    else f"class names such as {sorted(class_names)[:3]} (the params "
    "have no module paths: they are one layer's)"
  )
  for pattern in skip:
    if not matches_any((pattern,), *names, *class_names):
      warnings.warn(
        f"skip_layers pattern {pattern.pattern!r} matches no module path of "
        "the params nor a class name of the captured layers, so it skips "
        f"nothing. Patterns are searched (re.search) in {searched}.",
        stacklevel=3,
      )


def _is_masked(leaf: Any) -> bool:
  """Whether ``leaf`` stands for a parameter the chain withholds
  (``optax.MaskedNode`` in ``optax.masked``/``multi_transform``)."""
  return (
    leaf is not None
    and not isinstance(leaf, Mapping)
    and not hasattr(leaf, "shape")
  )


def is_masked_layer(params: Any, path: tuple[str, ...]) -> bool:
  """Whether the layer at ``path`` is masked out of ``params`` (its kernel
  withheld by the chain).

  optax takes mask and label trees that are prefixes of the params, and then
  withholds a whole module (or more) as one placeholder: one on the path
  masks the layer too. (``update`` asks only about Dense/Conv stats: Embed
  stats are layers only through ``find_layers``, which sees a withheld
  table itself.)
  """
  nodes, reached = _nodes_on_path(params, path)
  if any(_is_masked(node) for node in nodes):
    return True
  return (
    reached
    and isinstance(nodes[-1], Mapping)
    and _is_masked(nodes[-1].get(KERNEL))
  )


def has_kernel(params: Any, path: tuple[str, ...]) -> bool:
  """Whether ``params`` holds a kernel at the layer ``path``."""
  nodes, reached = _nodes_on_path(params, path)
  return reached and isinstance(nodes[-1], Mapping) and KERNEL in nodes[-1]


def _nodes_on_path(
  params: Any, path: tuple[str, ...]
) -> tuple[list[Any], bool]:
  """The nodes from ``params`` down ``path`` (stopping at a masked node or
  where the path leaves the tree), and whether the walk reached its end."""
  nodes = [params]
  for key in path:
    node = nodes[-1]
    if _is_masked(node) or not isinstance(node, Mapping):
      return nodes, False
    # Layer names join the path's keys as strings; NNX lists key by int.
    keys = {str(k): k for k in node}
    if key not in keys:
      return nodes, False
    nodes.append(node[keys[key]])
  return nodes, True


def _warn_untraced_embedding(
  name: str,
  path: tuple[str, ...],
  node: Mapping[str, Any],
  skip: Sequence[re.Pattern[str]],
) -> None:
  table = node.get(EMBEDDING)
  if (
    table is None
    or isinstance(table, Mapping)
    or len(table.shape) < 2
    or KERNEL in node
    or is_skipped_path(path, skip)
  ):
    return
  warnings.warn(
    f"Embedding {name!r} {tuple(table.shape)} was not captured by "
    "kfac_jax.trace_layers, so precondition_embeddings leaves it to the "
    "chained optimizer: an Embed also called through attend (tied output "
    "weights) is not captured, since its lookup's factors do not describe "
    "that use (nor is an Embed the loss never calls). Add it to "
    "skip_layers to silence this warning.",
    stacklevel=4,
  )


def _from_table(
  table: LayerTable,
  layer: LayerInfo,
  warn_untraced: bool,
  skip: Sequence[re.Pattern[str]],
) -> LayerInfo | None:
  traced = table.get(layer.name)
  if traced is None:
    skipped_class = getattr(table, "skipped_classes", {}).get(layer.name)
    if skipped_class is not None and matches_any(skip, skipped_class):
      return None  # Skipped by class here as in trace_layers.
    if warn_untraced:
      why = (
        f"trace_layers skipped it by its class name ({skipped_class})"
        if skipped_class is not None
        else "its module was not captured by kfac_jax.trace_layers (captured: "
        "Linen Dense, DenseGeneral without batch_dims and Conv; NNX "
        "Linear, LinearGeneral and Conv; and their subclasses)"
      )
      warnings.warn(
        f"Layer {layer.name!r} has a kernel {layer.kernel_shape} but "
        f"{why}. K-FAC leaves it to the chained optimizer; pass the same "
        "skip_layers to trace_layers and scale_by_kfac, or add its path "
        f"({skip_pattern(layer.name)!r}) to skip_layers, to silence this "
        "warning.",
        stacklevel=4,
      )
    return None
  if (traced.kernel_shape, traced.has_bias) != (
    layer.kernel_shape,
    layer.has_bias,
  ):
    raise ValueError(
      f"Layer {layer.name!r}: the layer table has kernel "
      f"{traced.kernel_shape} (bias={traced.has_bias}) but the params have "
      f"{layer.kernel_shape} (bias={layer.has_bias}). Trace the table from "
      "the same params."
    )
  return traced


def _check_bias(layer: LayerInfo, bias: Any) -> None:
  expected = layer.stack_shape + layer.output_shape
  if bias is not None and tuple(bias.shape) != expected:
    raise ValueError(
      f"Layer {layer.name!r}: bias shape {tuple(bias.shape)} does not match "
      f"the kernel {layer.kernel_shape}, which needs a bias {expected}. If "
      "the module is not a Dense/Conv [..., in, out], pass the layer table "
      "(layers=kfac_jax.trace_layers(loss_fn, params, ...)); otherwise add "
      "it to skip_layers to leave it to the chained optimizer."
    )


def get_layer_params(params: Any, layer: LayerInfo) -> Mapping[str, Any]:
  """The ``{"kernel", "bias"?}`` mapping of one layer inside a params tree."""
  node = params
  for key in layer.path:
    node = node[key]
  return node
