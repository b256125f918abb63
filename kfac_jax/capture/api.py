"""The capture's public entry points, for Flax Linen params and NNX models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from kfac_jax.capture import flax_linen, flax_nnx
from kfac_jax.capture.layers import TracedLayers, compile_patterns
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.hyperparameters import static_bool
from kfac_jax.transform import boxing


def _front_end(params_or_model: Any):
  """The capture of the model's Flax API, from what the loss is given: an
  NNX model, or the nnx.State a loss merges into one (capture/nnx_merge.py),
  else Linen params."""
  if isinstance(params_or_model, (nnx.Module, nnx.State)):
    return flax_nnx
  return flax_linen


def value_grad_and_stats(
  fun: Callable[..., Any],
  has_aux: bool = False,
  skip_layers: Sequence[str] | str | None = None,
) -> Callable[..., tuple[Any, Any, dict[str, LayerStatistics]]]:
  """Like ``jax.value_and_grad(fun, has_aux)``, plus K-FAC layer statistics.

  Linen: ``fun(params, *args, **kwargs)`` applies the model with ``params`` as
  its ``'params'`` collection (any number of ``model.apply`` calls; layers
  inside ``nn.scan``/``nn.remat`` included); params boxed with Flax's
  partitioning metadata (``nn.with_logical_partitioning``,
  ``nn.with_partitioning``) reach ``fun`` as their arrays, and their
  gradients come back in the same boxes, as ``jax.value_and_grad`` gives
  them. NNX: ``fun(model, *args,
  **kwargs)`` with an ``nnx.Module``, as given to ``nnx.value_and_grad``; the
  gradients are then an ``nnx.State`` of its ``nnx.Param``s. NNX objects
  among the arguments (an ``nnx.Rngs`` for dropout) have their state updates
  written back; only the model is differentiated and captured. Layers
  stacked by ``nnx.vmap`` and run by ``nnx.scan`` are included. Or, as in
  Flax's functional idiom, ``fun(params, *args, **kwargs)`` with the
  ``nnx.State`` of ``nnx.split(model, nnx.Param)``, which ``fun`` merges
  (``nnx.merge(graphdef, params)``); the gradients come back in that State.
  Stacked layers then need the model form (an error names them).

  A layer applied at every step of a loop that closes over its params (an
  RNN cell under ``nn.RNN``, ``nn.scan`` or ``nnx.scan``) shares its weights
  over the steps: its stats carry each step's inputs and cotangents, the
  steps after the example axis. Called outside ``jit``, what does not depend
  on the params is concrete, as under ``jax.value_and_grad``.

  Captured layers: Linen ``Dense``, ``DenseGeneral`` (without
  ``batch_dims``), ``Conv`` and ``Embed``; NNX ``Linear``, ``LinearGeneral``,
  ``Conv`` and ``Embed``; and their subclasses. An ``Embed`` also called
  through ``attend`` (tied output weights) is not captured.

  Args:
    fun: the loss, returning a scalar (or ``(loss, aux)`` with ``has_aux``).
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    skip_layers: regexes, as ``scale_by_kfac``'s (module path, or a module
      above it, or the Flax class name): matching layers are not captured.
      For a layer the capture refuses (an RNN cell's loop under ``nn.remat``
      or in another loop, a layer an NNX lifted transform runs unsliced), with
      the same patterns given to ``trace_layers`` and ``scale_by_kfac``, which
      then leave it to the chained optimizer.

  Returns:
    A function of ``(params_or_model, *args, **kwargs)`` returning
    ``(value, grads, stats)``, with ``value`` being ``(loss, aux)`` when
    ``has_aux``. ``stats`` maps each captured layer's module path
    (``"encoder/Dense_0"``) to its ``LayerStatistics``: the input and the
    loss's output cotangent of every call of the layer, stacked on the layer
    axes of a scanned layer, with a loop's steps after the example axis for
    a layer the loop shares (``[B, T, …]``).
  """

  _check_callable(fun, "value_grad_and_stats")
  has_aux = static_bool("value_grad_and_stats: has_aux", has_aux)
  skip = compile_patterns(skip_layers)

  def value_grads_and_stats(params_or_model: Any, *args: Any, **kwargs: Any):
    front_end = _front_end(params_or_model)
    value, grads, stats = front_end.value_grad_and_stats(
      fun, has_aux, skip, _unboxed(front_end, params_or_model), *args, **kwargs
    )
    if front_end is flax_linen:  # The gradients in the params' boxes.
      grads = boxing.like(params_or_model, grads)
    # A capture of no layer warns in the front end (probes.warn_if_no_layers).
    return value, grads, stats

  return value_grads_and_stats


def trace_layers(
  fun: Callable[..., Any],
  params_or_model: Any,
  *args: Any,
  skip_layers: Sequence[str] | str | None = None,
  **kwargs: Any,
) -> TracedLayers:
  """The layer table of a loss function, for ``scale_by_kfac(layers=...)``.

  Traces ``fun(params_or_model, *args, **kwargs)`` once for shapes only (no
  FLOPs) and describes each captured layer: its stack axes (``nn.scan``),
  contracted axes (``DenseGeneral``'s ``axis``) and convolution groups, which
  its params alone cannot tell. Pass the same table to
  ``get_opt_state_partition_specs``.

  Args:
    fun: the loss function given to ``value_grad_and_stats``.
    params_or_model: Linen params (arrays or ``jax.ShapeDtypeStruct``s), an
      NNX model, or the ``nnx.State`` that ``fun`` merges.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``s).
    skip_layers: as for ``value_grad_and_stats``: matching layers are left
      out of the table.
    **kwargs: example keyword arguments.

  Returns:
    ``{layer name: LayerInfo}`` (a dict; its ``skipped_classes`` lets
    ``scale_by_kfac`` given the same ``skip_layers`` leave the layers skipped
    by class name without a warning).
  """
  _check_callable(fun, "trace_layers")
  front_end = _front_end(params_or_model)
  return front_end.trace_layers(
    fun,
    compile_patterns(skip_layers),
    _unboxed(front_end, params_or_model),
    *args,
    **kwargs,
  )


def _unboxed(front_end: Any, params_or_model: Any) -> Any:
  """Linen params without Flax's partitioning boxes
  (``nn.with_logical_partitioning``): the capture reads the kernels' shapes
  and puts its probes beside them, and ``model.apply`` takes the arrays as
  it takes the boxes. An NNX model is given as it is."""
  if front_end is not flax_linen:
    return params_or_model
  return boxing.unbox(params_or_model)


def _check_callable(fun: Any, caller: str) -> None:
  if not callable(fun):
    raise TypeError(
      f"{caller}: fun must be the loss function (a callable); got {fun!r}."
    )
