"""Capture from an unmodified Flax Linen model, through its params.

While the loss runs, ``nn.intercept_methods`` sees every ``nn.Dense``,
``nn.DenseGeneral``, ``nn.Conv`` and ``nn.Embed`` call. Each call's probes
(``capture.probes``) are *injected into the params* beside the layer's kernel
(entry ``PROBES``) and read back by the interceptor with ``get_variable``, so
they cross ``nn.scan``/``nn.remat``/``nn.remat_scan`` exactly as the kernel
does: a scanned layer's probes are sliced per step and its inputs and
cotangents come out stacked on the layer axis.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from kfac_jax.capture import layers, loops, signatures
from kfac_jax.capture import probes as probes_lib
from kfac_jax.capture.layers import LayerSignature
from kfac_jax.capture.statistics import LayerStatistics

# Module classes whose calls are captured. Subclasses count too.
CAPTURED_MODULES: tuple[type[nn.Module], ...] = (
  nn.Dense,
  nn.DenseGeneral,
  nn.Conv,
  nn.Embed,
)

# The params entry injected beside a captured layer's kernel: one
# (input probe, output perturbation) pair per call.
PROBES = "__kfac_probes__"


def _signature(
  module: nn.Module, name: str, inputs: jax.Array, stack_ndim: int
) -> LayerSignature | None:
  """What the capture records about a call; ``None`` for an unsupported one."""
  module_type = type(module).__name__
  if isinstance(module, nn.Conv):
    return signatures.conv_signature(module_type, module, name, stack_ndim)
  if isinstance(module, nn.Embed):
    return signatures.embed_signature(
      module_type, module.num_embeddings, stack_ndim
    )
  if isinstance(module, nn.DenseGeneral):
    # Flax takes an int for one axis (batch_dims=0 is axis 0).
    if isinstance(module.batch_dims, int) or module.batch_dims:
      return None  # its kernel carries batch axes: not a Kronecker layer.
    return signatures.dense_signature(
      module_type,
      module.use_bias,
      inputs,
      module.axis,
      module.features,
      stack_ndim,
    )
  return signatures.dense_signature(
    module_type, module.use_bias, inputs, stack_ndim=stack_ndim
  )


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
  node = tree
  for key in path:
    if not isinstance(node, Mapping) or key not in node:
      return None
    node = node[key]
  return node


def _captured_call(context: nn.module.InterceptorContext) -> bool:
  return context.method_name == "__call__" and isinstance(
    context.module, CAPTURED_MODULES
  )


@dataclasses.dataclass
class _Nesting:
  """Which captured calls hold another call of the same module.

  A subclass of a captured layer that overrides ``__call__`` (``2 *
  super().__call__(x)``) is intercepted twice per use: its own call and,
  inside it, the base class's. Only the innermost is the linear layer whose
  input and output K-FAC needs; the calls around it are left alone.
  """

  # module path -> per open call, whether a call of it ran inside.
  open: dict[tuple[str, ...], list[bool]] = dataclasses.field(
    default_factory=dict
  )

  def call(self, path: tuple[str, ...], next_fun, args, kwargs):
    """``(outputs, innermost)`` of ``next_fun(*args, **kwargs)``."""
    stack = self.open.setdefault(path, [])
    if stack:
      stack[-1] = True
    stack.append(False)
    try:
      outputs = next_fun(*args, **kwargs)
    finally:
      held_another = stack.pop()
    return outputs, not held_another


@dataclasses.dataclass
class _ShapeRecorder:
  """Interceptor of the shape pass: which layers run, how, and how often."""

  params: Any
  skip: tuple[re.Pattern[str], ...] = ()  # compiled skip_layers
  # The vmaps around the loss (mapping its params or arguments): they map
  # each call's probes too, so a layer's inputs may carry them.
  outer_vmaps: frozenset[int] = frozenset()
  nesting: _Nesting = dataclasses.field(default_factory=_Nesting)
  counter: probes_lib.CallCounter = dataclasses.field(
    default_factory=probes_lib.CallCounter
  )
  calls: dict[str, list[probes_lib.Call]] = dataclasses.field(
    default_factory=dict
  )
  trace_check: loops.TraceCheck = dataclasses.field(
    default_factory=loops.TraceCheck
  )
  paths: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  # Embed layers also called through attend (tied output weights).
  attended: set[str] = dataclasses.field(default_factory=set)
  # {layer: class name} of the captured modules skip matched by class alone.
  skipped_classes: dict[str, str] = dataclasses.field(default_factory=dict)

  # Whether the model.apply running now is under a jax.vmap in the loss that
  # broadcasts its params: then every captured layer inside, lifted
  # (nn.scan/nn.remat/nn.vmap) or not, sums its rows over the mapped axis.
  # Inside a lifted transform the layer's own inputs are that transform's
  # tracers, not the vmap's, so the per-layer check below cannot see it.
  vmapped_apply: bool = False

  def __call__(self, next_fun, args, kwargs, context):
    if context.module.path:
      return self._intercept(next_fun, args, kwargs, context)
    previous = self.vmapped_apply  # the root module: a model.apply
    params = context.module.variables.get("params", {})
    self.vmapped_apply = bool(
      probes_lib.vmap_traces((args, kwargs)) - self.outer_vmaps
    ) and not any(probes_lib.batch_traced(x) for x in jax.tree.leaves(params))
    try:
      return self._intercept(next_fun, args, kwargs, context)
    finally:
      self.vmapped_apply = previous

  def _intercept(self, next_fun, args, kwargs, context):
    if isinstance(context.module, nn.Embed) and context.method_name == "attend":
      self.attended.add(layers.layer_name(tuple(context.module.path)))
    if not _captured_call(context):
      return next_fun(*args, **kwargs)
    module = context.module
    inputs = args[0] if args else kwargs["inputs"]
    path = tuple(module.path)
    if layers.is_skipped_layer(path, type(module).__name__, self.skip):
      if layers.class_skipped(path, type(module).__name__, self.skip):
        self.skipped_classes[layers.layer_name(path)] = type(module).__name__
      return next_fun(*args, **kwargs)  # no probes: the real pass skips it
    name = layers.layer_name(path)
    with self.trace_check.scope(name):
      outputs, innermost = self.nesting.call(path, next_fun, args, kwargs)
    if not innermost:
      return outputs
    key = layers.EMBEDDING if isinstance(module, nn.Embed) else layers.KERNEL
    kernel = _lookup(self.params, path + (key,))
    inner_kernel = module.get_variable("params", key)
    if kernel is None or inner_kernel is None:
      raise ValueError(
        f"value_grad_and_stats: layer {name!r} ({type(module).__name__}) has "
        f"no {key} at params{[*path, key]}. The loss must apply the model "
        "with the params it is given as the root of the 'params' "
        "collection (model.apply({'params': params}, ...))."
      )
    # Lifted transforms (nn.scan) slice leading kernel axes off inside.
    stack_ndim = len(kernel.shape) - len(inner_kernel.shape)
    # A slice on another axis can still leave the kernel's shape (a scan of
    # length 3 over axis 1 of a (3, 3, 3, 4, 4) kernel), not the bias's.
    bias = _lookup(self.params, path + ("bias",))
    inner_bias = (
      module.get_variable("params", "bias") if bias is not None else None
    )
    pairs = [(key, kernel, inner_kernel)] + (
      [] if inner_bias is None else [("bias", bias, inner_bias)]
    )
    if stack_ndim < 0 or any(
      tuple(outer.shape[stack_ndim:]) != tuple(inner.shape)
      for _, outer, inner in pairs
    ):
      outer_shapes = " and ".join(
        f"{entry} {tuple(outer.shape)}" for entry, outer, _ in pairs
      )
      inner_shapes = " and ".join(
        f"{entry} {tuple(inner.shape)}" for entry, _, inner in pairs
      )
      raise ValueError(
        f"value_grad_and_stats: layer {name!r} ({type(module).__name__}) "
        f"has {outer_shapes} in the params but {inner_shapes} where it "
        "runs: a lifted transform (nn.scan, nn.vmap) slices it on an axis "
        "other than the leading ones. Lift it with "
        "variable_axes={'params': 0}, or "
        f"{probes_lib.skip_advice(name)}."
      )
    signature = _signature(module, name, inputs, stack_ndim)
    if signature is not None and (
      self.vmapped_apply
      or (
        signature.stack_ndim == 0
        and probes_lib.vmap_traces((inputs, outputs)) - self.outer_vmaps
      )
    ):
      raise ValueError(
        f"value_grad_and_stats: layer {name!r} runs under a jax.vmap (or "
        "nn.vmap) inside the loss with its params broadcast, so its "
        "captured inputs and cotangents would be summed over the mapped "
        "axis. Apply the model to the whole batch (Flax layers take "
        "leading batch axes), vmap outside value_grad_and_stats, or "
        f"{probes_lib.skip_advice(name)}."
      )
    if signature is not None:
      probes_lib.record_call(
        self.calls,
        self.counter,
        name,
        probes_lib.make_call(signature, inputs, outputs),
      )
      self.trace_check.allow(
        name,
        kernel.shape[:stack_ndim],
        inner_kernel,
        probes_lib.batch_traces(kernel),
      )
      self.paths[name] = path
    return outputs

  def kernel(self, name: str) -> Any:
    key = self.calls[name][0].signature.kernel_key
    return _lookup(self.params, self.paths[name] + (key,))

  def check_traces(self) -> None:
    """Each ``nn.scan`` level traces its body twice (see ``CallCounter``):
    a layer under k of them, stacked or sharing its weights over the steps
    (``trace_check.shared``), may run in 2**k traces, no more."""
    refused = {}
    for name, traces in self.counter.traces.items():
      levels = self.calls[name][0].signature.stack_ndim + int(
        name in self.trace_check.shared
      )
      if len(traces) > 2**levels:
        refused[name] = len(traces)
    if refused:
      names = ", ".join(
        f"layer {name!r} runs in {count} separate traces"
        for name, count in sorted(refused.items())
      )
      raise ValueError(
        f"value_grad_and_stats: {names}, so its calls cannot be told "
        "apart. This happens with a model applied in more than one branch "
        "of a lax.cond or lax.switch, or also under a jax.grad (or another "
        "transformation that traces it again) inside the loss; or a "
        "lifted (scanned/remat) layer applied more than once: twice in one "
        "model.apply, in more than one model.apply per loss, or an RNN "
        "cell run by two nn.scan/nn.RNN calls. Apply it once per loss, or "
        f"{probes_lib.skip_advice(*sorted(refused))}."
      )

  def stack_shape(self, name: str) -> tuple[int, ...]:
    stack_ndim = self.calls[name][0].signature.stack_ndim
    return tuple(self.kernel(name).shape[:stack_ndim])


@dataclasses.dataclass
class _ProbeRecorder:
  """Interceptor of the real pass: applies each call's injected probes."""

  nesting: _Nesting = dataclasses.field(default_factory=_Nesting)
  counter: probes_lib.CallCounter = dataclasses.field(
    default_factory=probes_lib.CallCounter
  )

  def __call__(self, next_fun, args, kwargs, context):
    if not _captured_call(context):
      return next_fun(*args, **kwargs)
    module = context.module
    inputs = args[0] if args else kwargs["inputs"]
    outputs, innermost = self.nesting.call(
      tuple(module.path), next_fun, args, kwargs
    )
    if not innermost:
      return outputs
    layer_probes = module.get_variable("params", PROBES)
    if layer_probes is None:
      return outputs  # not captured (see _signature)
    name = layers.layer_name(module.path)
    index = self.counter.next(name)
    if index >= len(layer_probes):
      raise ValueError(
        f"value_grad_and_stats: layer {name!r} was called more often than "
        f"in the shape pass ({len(layer_probes)} calls). The loss must call "
        "the same layers on every trace."
      )
    return probes_lib.apply_probes(outputs, inputs, layer_probes[index])


def _inject(params: Any, path: tuple[str, ...], value: Any) -> Any:
  """``params`` with ``value`` at ``path + (PROBES,)``; copies only the path."""
  if not path:
    return {**params, PROBES: value}
  return {**params, path[0]: _inject(params[path[0]], path[1:], value)}


def _shape_pass(
  fun: Callable[..., Any], params: Any, skip, args, kwargs
) -> tuple[_ShapeRecorder, Any]:
  recorder = _ShapeRecorder(
    params, skip, probes_lib.vmap_traces((params, args, kwargs))
  )

  def traced(params, args, kwargs):
    with nn.intercept_methods(recorder):
      return fun(params, *args, **kwargs)

  out_shape = probes_lib.shape_pass(
    traced, params, args, kwargs, trace_check=recorder.trace_check
  )
  recorder.trace_check.check()  # finds the layers shared over loop steps
  recorder.check_traces()
  loops.check_shared(recorder.trace_check.shared, recorder.calls)
  probes_lib.drop_attended(recorder.calls, recorder.attended)
  return recorder, out_shape


def trace_layers(
  fun: Callable[..., Any],
  skip: tuple[re.Pattern[str], ...],
  params: Any,
  *args: Any,
  **kwargs: Any,
) -> layers.TracedLayers:
  """Linen front end of ``kfac_jax.trace_layers``."""
  recorder, _ = _shape_pass(fun, params, skip, args, kwargs)
  probes_lib.warn_if_no_layers("trace_layers", recorder.calls, skip)
  return layers.TracedLayers(
    {
      name: probes_lib.layer_info(
        name,
        recorder.paths[name],
        recorder.kernel(name).shape,
        calls[0].signature,
      )
      for name, calls in recorder.calls.items()
    },
    recorder.skipped_classes,
  )


def value_grad_and_stats(
  fun: Callable[..., Any],
  has_aux: bool,
  skip: tuple[re.Pattern[str], ...],
  params: Any,
  *args: Any,
  **kwargs: Any,
) -> tuple[Any, Any, dict[str, LayerStatistics]]:
  """Linen front end of ``kfac_jax.value_grad_and_stats``, for one call."""
  caller = "value_grad_and_stats"
  shapes, out_shape = _shape_pass(fun, params, skip, args, kwargs)
  probes_lib.check_scalar(
    probes_lib.split_output(out_shape, has_aux, caller)[0], caller
  )
  probes_lib.warn_if_no_layers(caller, shapes.calls, skip)
  probes = {
    name: probes_lib.zero_probes(calls, shapes.stack_shape(name))
    for name, calls in shapes.calls.items()
  }

  def primal(params, probes):
    for name, layer_probes in probes.items():
      params = _inject(params, shapes.paths[name], layer_probes)
    with nn.intercept_methods(_ProbeRecorder()):
      return probes_lib.split_output(
        fun(params, *args, **kwargs), has_aux, caller
      )

  loss, aux, grads, probe_grads = loops.probed_vjp(
    primal,
    params,
    probes,
    shapes.calls,
    shapes.trace_check.shared,
    probes_lib.is_eager((params, args, kwargs)),
  )
  value = (loss, aux) if has_aux else loss
  return value, grads, probes_lib.statistics(shapes.calls, probe_grads)
