"""Capture of layer inputs and output cotangents from an unmodified Flax model.

``value_grad_and_stats(loss_fn)`` is a drop-in for ``jax.value_and_grad``. While
``loss_fn`` runs, ``nn.intercept_methods`` sees every ``nn.Dense``/``nn.Conv``
call: it records the layer input and adds a zero *perturbation* to the layer
output. Differentiating the loss with ``jax.vjp`` with respect to the params and
the perturbations gives, in the same backward pass, the gradients and
``dloss/d(output)`` of every call: the cotangents K-FAC's ``G`` factor needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax.linen import linear as flax_linear
import jax
import jax.numpy as jnp

from kfac_jax.capture import layers
from kfac_jax.capture.statistics import ConvGeometry, LayerSignature, LayerStatistics

# Module classes whose calls are captured. Subclasses count too.
CAPTURED_MODULES: tuple[type[nn.Module], ...] = (nn.Dense, nn.Conv)


def _broadcast(value: int | tuple[int, ...] | None, rank: int) -> tuple[int, ...]:
  if value is None:
    return (1,) * rank
  if isinstance(value, int):
    return (value,) * rank
  return tuple(int(v) for v in value)


def _signature(module: nn.Module) -> LayerSignature:
  module_type = type(module).__name__
  if isinstance(module, nn.Conv):
    kernel_size = module.kernel_size
    window = ((int(kernel_size),) if isinstance(kernel_size, int) else
              tuple(int(k) for k in kernel_size))
    rank = len(window)
    padding = flax_linear.canonicalize_padding(module.padding, rank)
    if not isinstance(padding, str):
      padding = tuple((int(lo), int(hi)) for lo, hi in padding)
    geometry = ConvGeometry(
        window=window,
        strides=_broadcast(module.strides, rank),
        padding=padding,
        input_dilation=_broadcast(module.input_dilation, rank),
        kernel_dilation=_broadcast(module.kernel_dilation, rank),
        feature_group_count=int(module.feature_group_count))
    return LayerSignature(module_type, bool(module.use_bias), geometry)
  return LayerSignature(module_type, bool(module.use_bias))


@dataclasses.dataclass
class _Recorder:
  """Interceptor state for one trace of the loss function.

  With ``perturbations=None`` it only records output shapes (the shape pass);
  otherwise it adds ``perturbations[name][call]`` to each captured output and
  records the inputs.
  """

  perturbations: dict[str, list[jax.Array]] | None = None
  output_shapes: dict[str, list[jax.ShapeDtypeStruct]] = dataclasses.field(
      default_factory=dict)
  inputs: dict[str, list[jax.Array]] = dataclasses.field(default_factory=dict)
  signatures: dict[str, LayerSignature] = dataclasses.field(
      default_factory=dict)

  def __call__(self, next_fun: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any],
               context: nn.module.InterceptorContext) -> Any:
    module = context.module
    if context.method_name != "__call__" or not isinstance(
        module, CAPTURED_MODULES):
      return next_fun(*args, **kwargs)
    inputs = args[0] if args else kwargs["inputs"]
    outputs = next_fun(*args, **kwargs)
    name = layers.layer_name(module.path)
    call_index = len(self.inputs.setdefault(name, []))
    self.inputs[name].append(inputs)
    self.signatures[name] = _signature(module)
    if self.perturbations is None:
      self.output_shapes.setdefault(name, []).append(
          jax.ShapeDtypeStruct(outputs.shape, outputs.dtype))
      return outputs
    return outputs + self.perturbations[name][call_index]


def value_grad_and_stats(
    fun: Callable[..., Any],
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, dict[str, LayerStatistics]]]:
  """Like ``jax.value_and_grad(fun, has_aux)``, plus K-FAC layer statistics.

  Args:
    fun: ``fun(params, *args, **kwargs) -> scalar loss`` (or
      ``(loss, aux)`` with ``has_aux``); it may call ``model.apply`` any number
      of times. Gradients are taken with respect to ``params``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function returning ``(value, grads, stats)``, with ``value`` being
    ``(loss, aux)`` when ``has_aux``. ``stats`` maps each captured layer's
    module path (``"encoder/Dense_0"``) to its ``LayerStatistics``: the input and
    the loss's output cotangent of every call of the layer.
  """

  def value_grads_and_stats(params: Any, *args: Any, **kwargs: Any):

    def traced(recorder: _Recorder, params: Any) -> Any:
      with nn.intercept_methods(recorder):
        out = fun(params, *args, **kwargs)
      if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
          raise ValueError(
              "value_grad_and_stats(has_aux=True): the function must return "
              f"(loss, aux), got {type(out).__name__}.")
        return out
      return out, None

    # Shape pass: which layers run, how often, and their output shapes. Only
    # traced (no FLOPs), so the perturbations below can be allocated exactly.
    shape_recorder = _Recorder()
    loss_shape, _ = jax.eval_shape(lambda p: traced(shape_recorder, p), params)
    if getattr(loss_shape, "shape", None) != ():
      raise ValueError(
          "value_grad_and_stats: the function must return a scalar loss, got "
          f"shape {getattr(loss_shape, 'shape', type(loss_shape).__name__)}.")
    perturbations = {
        name: [jnp.zeros(s.shape, s.dtype) for s in shapes]
        for name, shapes in shape_recorder.output_shapes.items()
    }

    recorder = _Recorder(perturbations=perturbations)

    def primal(params, perturbations):
      recorder.perturbations = perturbations
      recorder.inputs = {}
      loss, aux = traced(recorder, params)
      return loss, (aux, recorder.inputs)

    loss, vjp_fn, (aux, inputs) = jax.vjp(
        primal, params, perturbations, has_aux=True)
    grads, cotangents = vjp_fn(jnp.ones_like(loss))
    stats = {
        name: LayerStatistics(
            signature=recorder.signatures[name],
            inputs=tuple(inputs[name]),
            output_cotangents=tuple(cotangents[name]))
        for name in inputs
    }
    value = (loss, aux) if has_aux else loss
    return value, grads, stats

  return value_grads_and_stats
