"""What the capture hands the optimizer: layers' inputs and output cotangents.

``value_grad_and_stats`` returns ``{layer_name: LayerStatistics}``. The arrays
are the raw tensors of each call of the layer, so the factors
(``factors.batch``) are only computed on steps that update them.
"""

from __future__ import annotations

import dataclasses

import jax

from kfac_jax.capture.layers import LayerSignature


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
