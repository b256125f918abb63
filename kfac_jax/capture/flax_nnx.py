"""Capture from an unmodified Flax NNX model.

NNX has no method interceptors, so the capture works on a private copy of the
model: the loss runs on ``nnx.merge(nnx.split(model))``, whose ``nnx.Linear``,
``nnx.LinearGeneral``, ``nnx.Conv`` and ``nnx.Embed`` instances are switched to
a subclass that applies the call's probes (``capture.probes``) to the output of
that Flax class's call (under a user subclass's own ``__call__``). The user's
model object is never modified; state the loss updates on the copy (batch
statistics, RNG counters) is written back to it, as ``nnx.value_and_grad`` does;
so is that of the NNX objects among the loss's other arguments.

Each captured layer's probes are set on the copy as ``Probes``, a
``Param``, so a lifted transform that slices the params (``nnx.scan`` over
layers stacked by ``nnx.vmap``) slices them too, and the layer is captured
with its stack axes; one that passes them whole (``nnx.remat``, ``nnx.jit``,
``nnx.cond``) passes the probes whole too. A layer in a loop that does not
slice its params (an RNN cell broadcast over ``nnx.scan`` steps) shares its
weights over the steps (``loops``); one that carries them
(``nnx.fori_loop`` over the model) is refused with an error naming it.

Given the params' ``nnx.State`` instead of the model, for a loss that merges
it (``model = nnx.merge(graphdef, params)``), the capture cannot copy the
model: ``nnx_merge`` reaches the layers the loss builds through their
Variables, and the probes reach each call from the capture, whole. A layer
whose kernel a lifted transform slices is then refused, naming the model
form, which slices its probes with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from kfac_jax.capture import layers, loops, nnx_merge, signatures
from kfac_jax.capture import probes as probes_lib
from kfac_jax.capture.layers import LayerSignature
from kfac_jax.capture.probes import ProbePair
from kfac_jax.capture.statistics import LayerStatistics

# Module classes whose calls are captured. Subclasses count too.
CAPTURED_MODULES: tuple[type[nnx.Module], ...] = (
  nnx.Linear,
  nnx.LinearGeneral,
  nnx.Conv,
  nnx.Embed,
)

# hook(name, inputs, outputs, signature, module) -> outputs as the loss sees
# them; ``module`` is the called instance (sliced inside a lifted transform).
Hook = Callable[
  [str, jax.Array, jax.Array, LayerSignature, nnx.Module], jax.Array
]
# Compiled skip_layers patterns.
Skip = tuple[re.Pattern[str], ...]


class Probes(nnx.Param):
  """One probe array of a captured layer, set on the capture's private copy
  (an ``nnx.List`` of them: each call's input probe, then its output
  perturbation), stack axes in front.

  A ``Param``, so that a lifted transform mapping the params (``nnx.scan``
  over stacked layers, ``nnx.vmap`` over an ensemble) slices the probes as it
  slices the kernel, and a scanned layer's inputs and cotangents come out
  stacked on the layer axis (as Linen's ``nn.scan`` does with ``PROBES``).
  """


# The attribute holding a captured layer's ``Probes`` on the private copy.
PROBES = "kfac_probes"

# NNX objects (modules, nnx.Rngs, nnx.List): flax 0.12 exports the test only
# from its graph module. NNX modules are also jax pytrees, so flattening an
# argument tree must stop at them (tests/test_nnx_transforms.py, the argument
# tests).
_is_graph_node = nnx.graph.is_graph_node


def _signature(
  module: nnx.Module,
  module_type: str,
  name: str,
  inputs: jax.Array,
  stack_ndim: int,
) -> LayerSignature | None:
  """What the capture records about a call; ``None`` for an unsupported one."""
  if isinstance(module, nnx.Conv):
    return signatures.conv_signature(module_type, module, name, stack_ndim)
  if isinstance(module, nnx.Embed):
    return signatures.embed_signature(
      module_type, module.num_embeddings, stack_ndim
    )
  if isinstance(module, nnx.LinearGeneral):
    if module.batch_axis:
      return None  # its kernel carries batch axes: not a Kronecker layer.
    return signatures.dense_signature(
      module_type,
      module.use_bias,
      inputs,
      module.axis,
      module.out_features,
      stack_ndim,
    )
  assert isinstance(module, nnx.Linear)  # the last of CAPTURED_MODULES
  return signatures.dense_signature(
    module_type, module.use_bias, inputs, stack_ndim=stack_ndim
  )


def _stack_ndim(
  name: str,
  module: nnx.Module,
  kernel_shape: tuple[int, ...],
  inner_shape: tuple[int, ...],
) -> int:
  """How many leading axes a lifted transform sliced off the layer's kernel
  (``kernel_shape`` outside, ``inner_shape`` where it runs)."""
  stack_ndim = len(kernel_shape) - len(inner_shape)
  if stack_ndim < 0 or kernel_shape[stack_ndim:] != inner_shape:
    raise ValueError(
      f"value_grad_and_stats: NNX layer {name!r} ({type(module).__name__}) "
      f"has kernel {kernel_shape} in the model but {inner_shape} where it "
      "runs: a lifted transform (nnx.scan, nnx.vmap) slices it on an axis "
      "other than the leading ones. Create the stacked layers with "
      "out_axes=0 and run them with in_axes=0 (nnx.vmap's and nnx.scan's "
      f"defaults), or {probes_lib.skip_advice(name)}."
    )
  return stack_ndim


def _instrument(
  model: nnx.Module,
  capture: _Capture,
  probes: Mapping[str, tuple[ProbePair, ...]],
) -> None:
  """Routes every captured module call of ``model`` (a private copy) through
  ``capture`` and sets each layer's ``probes`` on it (``PROBES``). Layers
  that ``capture.skip`` matches are left as they are.

  A layer whose kernel a lifted transform slices (``nnx.scan`` over stacked
  layers) is captured with its stack axes.
  """
  for path, module in nnx.iter_modules(model):
    if not isinstance(module, CAPTURED_MODULES) or layers.is_skipped_layer(
      path, type(module).__name__, capture.skip
    ):
      continue
    name = layers.layer_name(path)
    key = layers.EMBEDDING if isinstance(module, nnx.Embed) else layers.KERNEL
    # nnx.Module guards __setattr__; the copy may change class freely.
    object.__setattr__(module, "__class__", _probed_class(type(module)))
    # Static (in the copy's graphdef), so a lifted transform's own copy of
    # the module carries it too.
    setattr(
      module,
      _CAPTURE,
      _LayerCapture(name, key, tuple(getattr(module, key).shape), capture),
    )
    if name in probes:
      # One Variable per array, so a loss reading every Param's value
      # (an L2 term over nnx.iter_graph) reads arrays.
      setattr(
        module,
        PROBES,
        nnx.List([Probes(array) for pair in probes[name] for array in pair]),
      )


# The attribute holding a captured layer's ``_LayerCapture`` on the copy.
_CAPTURE = "kfac_capture"


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity
class _Capture:
  """One pass's capture: where its calls go, and what it records.

  Attributes:
    hook: every captured call's outputs go through it.
    skip: layers it leaves alone.
    attended: it adds each ``Embed`` called through ``attend``.
    outer_vmaps: the vmaps around the loss, which map each call's probes
      too; a layer under one inside the loss that maps its inputs but not
      its kernel is refused.
    trace_check: the shape pass's, which marks each call and is told its
      stack axes, for the checks after the pass (an RNN cell broadcast over
      ``nnx.scan`` steps is refused there); ``None`` in the real pass.
    merged: the loss merges the State (``nnx_merge``): the probes reach the
      calls whole, so a layer whose kernel is sliced is refused.
    skipped_classes: with ``merged``, it records ``{layer: class name}`` of
      the layers ``skip`` matches by class name only (``trace_layers``).
  """

  hook: Hook
  skip: Skip
  attended: set[str]
  outer_vmaps: frozenset[int]
  trace_check: loops.TraceCheck | None
  merged: bool
  skipped_classes: dict[str, str]

  def scope(self, name: str) -> contextlib.AbstractContextManager[None]:
    """The shape pass's marker of a call of layer ``name`` (none after)."""
    if self.trace_check is None:
      return contextlib.nullcontext()
    return self.trace_check.scope(name)


@dataclasses.dataclass(frozen=True, eq=False)
class _LayerCapture:
  """What a probed layer's call needs: its name, kernel and ``_Capture``."""

  name: str
  key: str
  kernel_shape: tuple[int, ...]
  capture: _Capture


@functools.cache
def _probed_class(cls: type[nnx.Module]) -> type[nnx.Module]:
  """``cls`` with its Flax class's ``__call__`` (and ``attend``) routed
  through the layer's ``_LayerCapture``.

  One class per ``cls``, made once: every new ``nnx.Module`` subclass stays
  in Flax's graph registry for good, so a class per call leaked.
  """
  # The Flax class whose call is the linear layer; a subclass may wrap it.
  base = next(c for c in cls.__mro__ if c in CAPTURED_MODULES)

  def call(self, inputs, *args, **kwargs):
    return _captured_call(
      base.__call__, self, getattr(self, _CAPTURE), inputs, *args, **kwargs
    )

  methods: dict[str, Callable[..., Any]] = {"__call__": call}
  if issubclass(base, nnx.Embed):

    def attend(self, query, *args, **kwargs):
      layer = getattr(self, _CAPTURE)
      layer.capture.attended.add(layer.name)
      return nnx.Embed.attend(self, query, *args, **kwargs)

    methods["attend"] = attend
  probed = type(base.__name__, (base,), methods)
  # Between a subclass and its Flax class in the method order, so that a
  # subclass overriding __call__ (2 * super().__call__(x)) is probed at the
  # Flax call, the linear layer, not at its own output.
  return probed if cls is base else type(cls.__name__, (cls, probed), {})


def _captured_call(
  flax_call: Callable[..., Any],
  module: nnx.Module,
  layer: _LayerCapture,
  inputs: Any,
  *args: Any,
  **kwargs: Any,
) -> Any:
  """``flax_call`` (the Flax class's ``__call__``) of a probed layer, its
  outputs through the hook."""
  capture, name = layer.capture, layer.name
  with capture.scope(name):
    outputs = flax_call(module, inputs, *args, **kwargs)
  stack_ndim = _stack_ndim(
    name, module, layer.kernel_shape, tuple(getattr(module, layer.key).shape)
  )
  if capture.merged and stack_ndim:
    raise ValueError(
      f"value_grad_and_stats: NNX layer {name!r} "
      f"({type(module).__name__}) runs on a slice of its kernel "
      f"{layer.kernel_shape} (stacked layers run by nnx.scan or "
      "nnx.vmap) in a loss that merges the nnx.State it is given: the "
      "capture's probes reach such a layer only through the model. Give "
      "value_grad_and_stats the model, fun(model, *args) called with "
      "nnx.merge(graphdef, params) (its gradients are the same "
      f"nnx.State), or {probes_lib.skip_advice(name)}."
    )
  signature = _signature(
    module, type(module).__name__, name, inputs, stack_ndim
  )
  if signature is None:
    return outputs
  kernel = getattr(module, layer.key).get_value()
  if (
    (probes_lib.batch_traces(inputs) | probes_lib.batch_traces(outputs))
    - probes_lib.batch_traces(kernel)
    - capture.outer_vmaps
  ):
    raise ValueError(
      f"value_grad_and_stats: NNX layer {name!r} runs under a "
      "jax.vmap (or nnx.vmap) inside the loss that maps its inputs but "
      "broadcasts its params, so its captured inputs and cotangents "
      "would be summed over the mapped axis. Apply it to the whole "
      "batch (Flax layers take leading batch axes), vmap outside "
      f"value_grad_and_stats, or {probes_lib.skip_advice(name)}."
    )
  if capture.trace_check is not None:
    capture.trace_check.allow(
      name, layer.kernel_shape[:stack_ndim], kernel, capture.outer_vmaps
    )
  return capture.hook(name, inputs, outputs, signature, module)


def _model_param(path: tuple[Any, ...], value: Any) -> bool:
  """Filter of a joint ``nnx.split((model, *argument_objects))``: the
  model's ``nnx.Param``s, the ones differentiated (``nnx.value_and_grad``'s
  ``argnums=0``); on the private copy, its ``Probes`` too (not written
  back)."""
  return path[0] == 0 and isinstance(value, nnx.Param)


def _merged_route(
  capture: _Capture,
  tag: nnx_merge.Tag,
  method: str,
  flax_method: Callable[..., Any],
  module: nnx.Module,
  *args: Any,
  **kwargs: Any,
) -> Any:
  """``nnx_merge``'s route of a layer the loss built from the State:
  captured as ``_instrument``'s copies are, unless ``capture.skip`` matches
  it."""
  path, key = tag.path[:-1], tag.path[-1]
  name, module_type = layers.layer_name(path), type(module).__name__
  if layers.is_skipped_layer(path, module_type, capture.skip):
    if layers.class_skipped(path, module_type, capture.skip):
      capture.skipped_classes[name] = module_type
    return flax_method(module, *args, **kwargs)
  if method == "attend":
    capture.attended.add(name)
    return flax_method(module, *args, **kwargs)
  inputs, args = (args[0], args[1:]) if args else (kwargs.pop("inputs"), ())
  return _captured_call(
    flax_method,
    module,
    _LayerCapture(name, key, tag.shape, capture),
    inputs,
    *args,
    **kwargs,
  )


def _differentiated(first: nnx.Module | nnx.State) -> nnx.State:
  """What the loss is differentiated with respect to: the model's Params, or
  the State a merging loss is given."""
  if isinstance(first, nnx.Module):
    return nnx.state(first, nnx.Param)
  return first


def _run(
  fun: Callable[..., Any],
  first: nnx.Module | nnx.State,
  skip: Skip,
  args,
  kwargs,
  attended: set[str] | None = None,
  trace_check: loops.TraceCheck | None = None,
  skipped_classes: dict[str, str] | None = None,
) -> tuple[Callable[..., tuple[Any, Any]], tuple[Any, ...]]:
  """``(run, objects)``: ``run(params, hook, probes) -> (fun output, updated
  state)`` on private copies of ``objects``, the NNX objects among the
  arguments (an ``nnx.Rngs`` for dropout, a second model) and, when
  ``first`` is the model, the model (``_instrument``'d). When ``first`` is
  the State, the loss is given a tagged copy of it (``nnx_merge``).

  The objects are split together, so that one shared by the model and an
  argument (a model keeping the ``nnx.Rngs`` it is also given) stays one
  object in the copy.
  """
  merged = not isinstance(first, nnx.Module)
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_graph_node)
  node_indices = [i for i, leaf in enumerate(leaves) if _is_graph_node(leaf)]
  objects: tuple[Any, ...] = (() if merged else (first,)) + tuple(
    leaves[i] for i in node_indices
  )
  differentiated = nnx.Nothing if merged else _model_param
  graphdef, _, rest = nnx.split(objects, differentiated, ...)

  def run(params, hook, probes):
    # Variables may only be updated in the trace that made them: rebuild the
    # other ones (batch statistics, RNG counters) in this one.
    copies = nnx.merge(
      graphdef,
      nnx.State({} if merged else {0: params}),
      jax.tree.map(lambda v: v, rest),
    )
    filled = list(leaves)
    for index, copy in zip(node_indices, copies[0 if merged else 1 :]):
      filled[index] = copy
    copy_args, copy_kwargs = jax.tree.unflatten(treedef, filled)
    capture = _Capture(
      hook,
      skip,
      set() if attended is None else attended,
      # vmaps around the loss: they map its arguments or params.
      probes_lib.vmap_traces((params, leaves)),
      trace_check,
      merged,
      {} if skipped_classes is None else skipped_classes,
    )
    if merged:
      with nnx_merge.routed():
        out = fun(
          nnx_merge.tagged(params, functools.partial(_merged_route, capture)),
          *copy_args,
          **copy_kwargs,
        )
    else:
      _instrument(copies[0], capture, probes)
      out = fun(copies[0], *copy_args, **copy_kwargs)
    return out, nnx.state(copies, nnx.Not(differentiated))

  return run, objects


def _shape_pass(fun, first, skip, args, kwargs):
  """``(calls, out_shape, skipped_classes, shared)`` of the loss
  (``skipped_classes`` recorded only when it merges the State; ``shared``:
  the layers whose weights a loop shares over its steps, ``loops``)."""
  counter = probes_lib.CallCounter(per_trace=False)
  calls: dict[str, list[probes_lib.Call]] = {}

  def record(name, inputs, outputs, signature, module):
    del module
    probes_lib.record_call(
      calls, counter, name, probes_lib.make_call(signature, inputs, outputs)
    )
    return outputs

  attended: set[str] = set()
  skipped_classes: dict[str, str] = {}
  trace_check = loops.TraceCheck()

  def shape_run(params, args, kwargs):
    run, _ = _run(
      fun, first, skip, args, kwargs, attended, trace_check, skipped_classes
    )
    return run(params, record, {})

  out_shape, _ = probes_lib.shape_pass(
    shape_run,
    _differentiated(first),
    args,
    kwargs,
    is_leaf=_is_graph_node,
    trace_check=trace_check,
  )
  trace_check.check()
  loops.check_shared(trace_check.shared, calls)
  probes_lib.drop_attended(calls, attended)
  return calls, out_shape, skipped_classes, trace_check.shared


def _kernels(
  first: nnx.Module | nnx.State, calls: Mapping[str, Sequence[probes_lib.Call]]
) -> dict[str, tuple[tuple[Any, ...], nnx.Variable]]:
  """``{layer: (module path, kernel)}`` of the captured layers, from the
  model's modules or the State's paths."""
  if isinstance(first, nnx.Module):
    found = {
      (layers.layer_name(path), key): (tuple(path), variable)
      for path, module in nnx.iter_modules(first)
      for key in (layers.KERNEL, layers.EMBEDDING)
      if isinstance(variable := getattr(module, key, None), nnx.Variable)
    }
  else:
    found = {
      (layers.layer_name(path[:-1]), path[-1]): (tuple(path[:-1]), variable)
      for path, variable in nnx.to_flat_state(first)
    }
  return {
    name: found[name, layer_calls[0].signature.kernel_key]
    for name, layer_calls in calls.items()
  }


def trace_layers(
  fun: Callable[..., Any],
  skip: Skip,
  first: nnx.Module | nnx.State,
  *args: Any,
  **kwargs: Any,
) -> layers.TracedLayers:
  """NNX front end of ``kfac_jax.trace_layers``: ``first`` is the model, or
  the State the loss merges."""
  calls, _, skipped_classes, _ = _shape_pass(fun, first, skip, args, kwargs)
  if isinstance(first, nnx.Module):
    skipped_classes = {
      layers.layer_name(path): type(module).__name__
      for path, module in nnx.iter_modules(first)
      if isinstance(module, CAPTURED_MODULES)
      and layers.class_skipped(path, type(module).__name__, skip)
    }
  probes_lib.warn_if_no_layers("trace_layers", calls, skip)
  return layers.TracedLayers(
    {
      name: probes_lib.layer_info(
        name, path, kernel.shape, calls[name][0].signature
      )
      for name, (path, kernel) in _kernels(first, calls).items()
    },
    skipped_classes,
  )


def value_grad_and_stats(
  fun: Callable[..., Any],
  has_aux: bool,
  skip: Skip,
  first: nnx.Module | nnx.State,
  *args: Any,
  **kwargs: Any,
) -> tuple[Any, Any, dict[str, LayerStatistics]]:
  """NNX front end of ``kfac_jax.value_grad_and_stats``, for one call.

  ``first`` is the model (the gradients: an ``nnx.State`` of its
  ``nnx.Param``s, as ``nnx.value_and_grad`` gives them; its other state is
  updated), or a State that the loss merges (the gradients: of its
  structure, as ``jax.value_and_grad`` gives them).
  """
  caller = "value_grad_and_stats"
  calls, out_shape, _, shared = _shape_pass(fun, first, skip, args, kwargs)
  probes_lib.check_scalar(
    probes_lib.split_output(out_shape, has_aux, caller)[0], caller
  )
  probes_lib.warn_if_no_layers(caller, calls, skip)
  probes = {
    name: probes_lib.zero_probes(
      calls[name], tuple(kernel.shape[: calls[name][0].signature.stack_ndim])
    )
    for name, (_, kernel) in _kernels(first, calls).items()
  }

  run, objects = _run(fun, first, skip, args, kwargs)

  def primal(params, probes):
    counter = probes_lib.CallCounter(per_trace=False)

    def apply(name, inputs, outputs, signature, module):
      del signature
      if name not in probes:  # not captured (probes_lib.drop_attended)
        return outputs
      index = counter.next(name)
      # The module's own, sliced where a lifted transform sliced the kernel;
      # in a loss that merges the State, the capture's (_merged_route).
      variables = getattr(module, PROBES, None)
      pair = (
        probes[name][index]
        if variables is None
        else (
          variables[2 * index].get_value(),
          variables[2 * index + 1].get_value(),
        )
      )
      call = calls[name][index]
      if (pair[0].shape, pair[1].shape) != (
        call.inputs.shape,
        call.outputs.shape,
      ):
        raise ValueError(
          f"value_grad_and_stats: NNX layer {name!r}'s probes reach its "
          f"call with shapes {pair[0].shape}, {pair[1].shape}, not its "
          f"input's and output's {call.inputs.shape}, "
          f"{call.outputs.shape}: a lifted transform slices its kernel "
          "but not its probes (kfac_jax.capture.flax_nnx.Probes, an "
          "nnx.Param), e.g. a StateAxes that picks the kernel by path. "
          "Give the Probes type the kernel's axis, or "
          f"{probes_lib.skip_advice(name)}."
        )
      return probes_lib.apply_probes(outputs, inputs, pair)

    out, new_state = run(params, apply, probes)
    loss, aux = probes_lib.split_output(out, has_aux, caller)
    return loss, (aux, new_state)

  loss, (aux, new_state), grads, probe_grads = loops.probed_vjp(
    primal,
    _differentiated(first),
    probes,
    calls,
    shared,
    probes_lib.is_eager((_differentiated(first), args, kwargs)),
  )
  nnx.update(objects, new_state)
  value = (loss, aux) if has_aux else loss
  return value, grads, probes_lib.statistics(calls, probe_grads)
