"""Probes: how a layer's inputs and output cotangents leave one backward pass.

Each captured call gets two zero arrays that the loss is differentiated with
respect to, besides the params:

* an output *perturbation*, added to the layer output: its gradient is
  ``dloss/d(output)``, the cotangent K-FAC's ``G`` needs;
* an input *probe*, whose "gradient" ``reveal_input`` defines to be the layer
  input (a ``custom_vjp`` identity): ``A`` needs the input, and a gradient is
  the one channel that crosses every JAX and Flax transformation (``nn.scan``
  stacks it on the layer axis like any parameter's gradient).

A shape-only first pass (``jax.eval_shape``) records each call (``Call``) so
the probes can be allocated; both front ends (Linen, NNX) share this module.
A layer in a loop that does not slice its params (an RNN cell) is read as
weight sharing over the loop's steps: ``loops``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.core
import jax.extend
import jax.extend.core
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from kfac_jax.capture.layers import LayerInfo, LayerSignature, skip_pattern
from kfac_jax.capture.statistics import LayerStatistics

if TYPE_CHECKING:
  # Annotation only: loops imports this module.
  from kfac_jax.capture.loops import TraceCheck

# One call's (input probe, output perturbation).
ProbePair = tuple[jax.Array, jax.Array]


@jax.custom_vjp
def reveal_input(
  outputs: jax.Array, inputs: jax.Array, probe: jax.Array
) -> jax.Array:
  """Identity in ``outputs``; the cotangent it hands ``probe`` is ``inputs``."""
  del inputs, probe
  return outputs


def _reveal_input_fwd(outputs, inputs, probe):
  del probe
  return outputs, inputs


def _reveal_input_bwd(inputs, output_cotangent):
  # The input's own gradient flows through the layer, not through here.
  return output_cotangent, jnp.zeros_like(inputs), inputs


reveal_input.defvjp(_reveal_input_fwd, _reveal_input_bwd)


def probe_inputs(inputs: jax.Array) -> jax.Array:
  """What the input probe reveals: the input, token ids as float32.

  A complex input is returned as it is, for ``record_call`` to refuse (a cast
  would drop its imaginary part).
  """
  if jnp.issubdtype(inputs.dtype, jnp.inexact):
    return inputs
  return inputs.astype(jnp.float32)


def apply_probes(
  outputs: jax.Array, inputs: jax.Array, probes: ProbePair
) -> jax.Array:
  """The layer output as the loss should see it: perturbed, input revealed."""
  input_probe, output_perturbation = probes
  return reveal_input(
    outputs + output_perturbation, probe_inputs(inputs), input_probe
  )


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a captured layer (per stack slice), from the shape pass.

  ``input_sharding``/``output_sharding``: the tensors' sharding when
  Explicit mesh axes shard them (``None`` otherwise): a probe must match the
  sharding of what its gradient will be.
  """

  signature: LayerSignature
  inputs: jax.ShapeDtypeStruct
  outputs: jax.ShapeDtypeStruct
  input_sharding: NamedSharding | None = None
  output_sharding: NamedSharding | None = None


def trace_state() -> Any:
  """An opaque token of the current trace: equal tokens, same trace.

  jax 0.11 moved ``jax.core.get_opaque_trace_state`` to ``jax.extend.core``;
  jax 0.9 has it only in ``jax.core``.
  """
  get_state = getattr(jax.extend.core, "get_opaque_trace_state", None)
  if get_state is None:
    get_state = jax.core.get_opaque_trace_state
  return get_state()


def batch_traced(array: Any) -> bool:
  """Whether ``array`` is a ``jax.vmap`` (or ``nn.vmap``) tracer.

  A layer applied under a ``vmap`` inside the loss, its params broadcast
  (``in_axes=None``), gets its probes broadcast too, so their gradients sum
  over the mapped axis: ``A`` would be ``(Σx)(Σx)ᵀ``. jax has no public test
  for a batching tracer; the class name holds on the supported versions
  (``tests/test_capture_transforms.py`` checks the refusal it backs).
  """
  return type(array).__name__ == "BatchTracer"


def batch_traces(array: Any) -> frozenset[int]:
  """The ``vmap``s mapping ``array``, as ids of their traces (nested vmaps
  wrap one ``BatchTracer`` in another; see ``batch_traced``).

  ``_trace`` and ``val`` are private to jax's batching interpreter;
  ``tests/test_nnx_stacked.py::test_a_per_example_vmap_inside_the_loss_is_refused_in_an_ensemble_too``
  guards the refusal that relies on them.
  """
  traces = set()
  while batch_traced(array):
    traces.add(id(array._trace))  # pylint: disable=protected-access
    array = array.val
  return frozenset(traces)


def vmap_traces(tree: Any) -> frozenset[int]:
  """The ``batch_traces`` of every leaf of ``tree``, together."""
  return frozenset().union(*map(batch_traces, jax.tree.leaves(tree)))


class CallCounter:
  """Numbers a layer's calls, within each trace or in program order.

  ``nn.scan`` traces its body twice (once to find broadcast outputs), with
  fresh module instances, so calls are numbered per (layer, trace): the same
  call gets the same number in both traces. NNX's lifted transforms trace
  their body once, so the NNX capture numbers calls in program order
  (``per_trace=False``): two ``nnx.scan``s of one stacked layer are two
  calls.
  """

  def __init__(self, per_trace: bool = True):
    self.per_trace = per_trace
    self.traces: dict[str, list[tuple[Any, int]]] = {}

  def next(self, name: str) -> int:
    trace = trace_state() if self.per_trace else None
    entries = self.traces.setdefault(name, [])
    for i, (seen, count) in enumerate(entries):
      if seen == trace:
        entries[i] = (seen, count + 1)
        return count
    entries.append((trace, 1))
    return 0


def explicit_sharding(array: jax.Array) -> NamedSharding | None:
  """``array``'s sharding if an Explicit mesh axis shards it, else ``None``."""
  sharding = jax.typeof(array).sharding
  spec = getattr(sharding, "spec", None)
  if spec is None or all(entry is None for entry in spec):
    return None
  return sharding


def make_call(
  signature: LayerSignature, inputs: jax.Array, outputs: jax.Array
) -> Call:
  return Call(
    signature,
    jax.ShapeDtypeStruct(inputs.shape, probe_inputs(inputs).dtype),
    jax.ShapeDtypeStruct(outputs.shape, outputs.dtype),
    explicit_sharding(inputs),
    explicit_sharding(outputs),
  )


def skip_advice(*names: str) -> str:
  """How to leave layers the capture refuses to the chained optimizer."""
  patterns = ", ".join(repr(skip_pattern(name)) for name in names)
  return (
    f"pass skip_layers=[{patterns}] to value_grad_and_stats, "
    "trace_layers and scale_by_kfac to leave "
    f"{'it' if len(names) == 1 else 'them'} to the chained optimizer"
  )


def warn_if_no_layers(
  caller: str, captured: Collection[str], skip: Sequence[re.Pattern[str]]
) -> None:
  """Warns when the capture found no layer: K-FAC would then do nothing,
  every parameter going to the chained optimizer as it is.

  Args:
    caller: the public function, named in the warning.
    captured: the names of the captured layers.
    skip: the compiled ``skip_layers``, named in the warning when given.
  """
  if captured:
    return
  reason = (
    "the loss called none of the layers the capture knows (Linen "
    "Dense, DenseGeneral, Conv, Embed; NNX Linear, LinearGeneral, "
    "Conv, Embed) on the params, model or nnx.State it was given"
  )
  if skip:
    patterns = ", ".join(repr(pattern.pattern) for pattern in skip)
    reason += f", or skip_layers [{patterns}] matched every one it called"
  # Stack: the user's call, api.py, the front end, here.
  warnings.warn(
    f"{caller} captured no layer: {reason}. scale_by_kfac would then "
    "precondition nothing, leaving every parameter to the chained "
    "optimizer.",
    stacklevel=4,
  )


def record_call(
  calls: dict[str, list[Call]], counter: CallCounter, name: str, call: Call
) -> None:
  """Adds ``call`` to ``calls[name]`` unless a repeated trace already did.

  Every call of a layer is read with its first call's signature (the
  factors' layout), so a call with another signature raises; so does a
  complex one (the probes would keep only the real part of its inputs).
  """
  if any(
    jnp.issubdtype(array.dtype, jnp.complexfloating)
    for array in (call.inputs, call.outputs)
  ):
    raise ValueError(
      f"value_grad_and_stats: layer {name!r} runs on complex numbers "
      f"(inputs {call.inputs.dtype}, outputs {call.outputs.dtype}), which "
      f"K-FAC's real factors do not describe; {skip_advice(name)}."
    )
  index = counter.next(name)
  layer_calls = calls.setdefault(name, [])
  if index == len(layer_calls):
    if layer_calls and call.signature != layer_calls[0].signature:
      raise ValueError(
        f"value_grad_and_stats: layer {name!r} is called with two "
        f"signatures, {layer_calls[0].signature} and then "
        f"{call.signature}; its factors need every call to contract the "
        "same input axes. A DenseGeneral with a positive axis applied to "
        "inputs of different ranks does this: reshape the inputs so every "
        f"call contracts the same trailing axes, or {skip_advice(name)}."
      )
    layer_calls.append(call)


def drop_attended(calls: dict[str, list[Call]], attended: set[str]) -> None:
  """Removes the ``Embed`` layers also called through ``attend`` from ``calls``.

  ``attend(q) = q Eᵀ`` uses the table as a dense kernel ``[features, vocab]``,
  whose Kronecker factors (``q``'s covariance, the logits' cotangents) are
  not the lookup's (token counts, the embeddings' cotangents), so the lookup
  alone would misdescribe the table's curvature: rows only ``attend`` reaches
  would be preconditioned as if they had none (their update ``∇/λ``). Left
  uncaptured, the table goes to the chained optimizer (``layers.find_layers``
  warns when ``precondition_embeddings`` asked for it).
  """
  for name in attended:
    calls.pop(name, None)


def zero_probes(
  calls: Sequence[Call], stack_shape: tuple[int, ...] = ()
) -> tuple[ProbePair, ...]:
  """Zero probes for each call, with the layer's stack axes in front."""

  def zeros(
    like: jax.ShapeDtypeStruct, sharding: NamedSharding | None
  ) -> jax.Array:
    shape = stack_shape + like.shape
    if sharding is None:
      return jnp.zeros(shape, like.dtype)
    spec = PartitionSpec(*(None,) * len(stack_shape), *sharding.spec)
    return jnp.zeros(shape, like.dtype, out_sharding=sharding.update(spec=spec))

  return tuple(
    (
      zeros(call.inputs, call.input_sharding),
      zeros(call.outputs, call.output_sharding),
    )
    for call in calls
  )


def statistics(
  calls: Mapping[str, Sequence[Call]],
  probe_grads: Mapping[str, Sequence[ProbePair]],
) -> dict[str, LayerStatistics]:
  """``{layer: LayerStatistics}`` from the probes' gradients."""
  return {
    name: LayerStatistics(
      signature=calls[name][0].signature,
      inputs=tuple(inputs for inputs, _ in probe_grads[name]),
      output_cotangents=tuple(cot for _, cot in probe_grads[name]),
    )
    for name in probe_grads
  }


def layer_info(
  name: str,
  path: tuple[Any, ...],
  kernel_shape: Sequence[int],
  signature: LayerSignature,
) -> LayerInfo:
  """A layer table entry from a captured call's signature."""
  return LayerInfo(
    name=name,
    path=path,
    kernel_shape=tuple(int(d) for d in kernel_shape),
    # A Flax layer holds a bias param exactly when its call adds one.
    has_bias=signature.has_bias,
    signature=signature,
  )


def is_eager(tree: Any) -> bool:
  """Whether the capture was called outside every JAX transformation, as far
  as its arguments tell: none of ``tree``'s leaves is a tracer."""
  return not any(
    isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree)
  )


def eager_context(eager: bool) -> contextlib.AbstractContextManager[Any]:
  """Where the capture traces the loss for a call made outside ``jit``: what
  does not depend on the params is computed as it is traced
  (``jax.ensure_compile_time_eval``), as ``jax.value_and_grad`` computes it
  eagerly, so a loss that hands such a value to NumPy (or branches on it in
  Python) traces as it runs."""
  return jax.ensure_compile_time_eval() if eager else contextlib.nullcontext()


def shape_pass(
  fun: Callable[..., Any],
  params: Any,
  args: Sequence[Any],
  kwargs: Mapping[str, Any],
  is_leaf: Callable[[Any], bool] | None = None,
  trace_check: TraceCheck | None = None,
) -> Any:
  """``jax.eval_shape`` of ``fun(params, args, kwargs)``.

  The ``jax.ShapeDtypeStruct`` leaves of ``args``/``kwargs`` (``trace_layers``
  takes them) are traced abstractly; every other leaf is passed as given,
  so Python flags (``train=False``) stay static. ``is_leaf``: subtrees kept
  whole (NNX objects: rebuilt, they would no longer be the model's own).
  ``trace_check``: reads the jaxpr of the calls ``fun`` marked with it.
  Called outside ``jit`` (``is_eager``), what does not depend on the params
  is computed as it is traced (``eager_context``).
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_leaf)
  abstract = [
    i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)
  ]

  def run(params, abstract_leaves):
    filled = list(leaves)
    for index, leaf in zip(abstract, abstract_leaves):
      filled[index] = leaf
    args, kwargs = jax.tree.unflatten(treedef, filled)
    return fun(params, args, kwargs)

  # What jax.eval_shape does, keeping the jaxpr for the TraceCheck.
  with eager_context(is_eager((params, args, kwargs))):
    traced = jax.jit(run).trace(params, [leaves[i] for i in abstract])
  if trace_check is not None:
    trace_check.read(traced.jaxpr.jaxpr)
  return traced.out_info


def split_output(out: Any, has_aux: bool, caller: str) -> tuple[Any, Any]:
  """``(loss, aux)`` of a loss function's output, checked."""
  if not has_aux:
    return out, None
  if not (isinstance(out, tuple) and len(out) == 2):
    raise ValueError(
      f"{caller}(has_aux=True): the function must return (loss, aux), got "
      f"{type(out).__name__}."
    )
  return out


def check_scalar(loss_shape: Any, caller: str) -> None:
  if getattr(loss_shape, "shape", None) != ():
    raise ValueError(
      f"{caller}: the function must return a scalar loss, got shape "
      f"{getattr(loss_shape, 'shape', type(loss_shape).__name__)}."
    )
  # As jax.grad: an integer loss has no gradient (it would come out zero).
  if not jnp.issubdtype(loss_shape.dtype, jnp.floating):
    raise TypeError(
      f"{caller}: the loss must be a real floating-point scalar; got dtype "
      f"{loss_shape.dtype}."
    )
