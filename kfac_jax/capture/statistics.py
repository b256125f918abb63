"""What the capture hands the optimizer: layers' inputs and output cotangents.

``value_grad_and_stats`` returns ``{layer_name: LayerStatistics}``. The arrays
are the raw tensors of each call of the layer, so the factors
(``factors.batch``) are only computed on steps that update them.
"""

from __future__ import annotations

import dataclasses

import jax

from kfac_jax.capture.layers import EMBEDDING, KERNEL

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerStatistics:
  """The tensors of every call of one layer in one forward/backward pass.

  Attributes:
    signature: static description of the layer (pytree metadata).
    inputs: one array per call, ``[*stack, *batch, in]`` (dense),
      ``[*stack, *batch, *spatial, in]`` (conv), any layout whose
      ``input_axes`` are contracted (``DenseGeneral``), or the integer token
      ids ``[*stack, *batch]`` (``Embed``).
    output_cotangents: one array per call, the gradient of the loss with
      respect to the layer output, ``[*stack, *batch, *output]`` or
      ``[*stack, *batch, *out_spatial, out]``.
  """

  signature: LayerSignature = dataclasses.field(metadata=dict(static=True))
  inputs: tuple[jax.Array, ...]
  output_cotangents: tuple[jax.Array, ...]
