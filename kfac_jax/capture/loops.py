"""Layers in loops: the checks of the shape pass's jaxpr, and weight sharing
over a loop's steps (an RNN cell).

A loop that slices a layer's stacked params (``nn.scan``/``nnx.scan`` over
layers) slices the probes injected beside them too, so each slice's rows come
out stacked on the layer axis. A loop that does not (an RNN cell whose params
``nn.RNN``, ``nn.scan`` or ``nnx.scan`` broadcasts over the time steps; a
``lax.scan`` closing over the params) would give every step the same probes,
whose gradients sum over the steps: ``A`` would be ``(Σₜaₜ)(Σₜaₜ)ᵀ``. Such a
layer is a layer whose weights are shared over the steps, so its probes are
moved from the loop's constants to the values it scans: ``probed_vjp``
traces the loss to a jaxpr, gives each such call's probes a leading axis of
the loop's length, and rewrites that loop (a ``scan`` equation) to slice them
per step. Its inputs and cotangents then come out per step, the step axis
placed after the example axis (``[B, T, …]``), where ``factors.batch`` reads
it as a weight-sharing axis: one row per example and step (KFAC-expand), or
one per example (KFAC-reduce).

Only a scan at the top of the loss, holding the layer's call directly, is
rewritten; ``TraceCheck`` refuses the rest with one error listing every
layer: a ``while_loop``, a loop inside another loop or under ``jax.jit``,
``remat`` or ``cond``, a stacked layer in a further loop, and (from
``probed_vjp``) a loop that changes the params it carries (params carried
unchanged are loop constants to jax, read as closed over).
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from kfac_jax.capture import probes as probes_lib
from kfac_jax.capture.probes import Call

# An equation holding a sub-jaxpr around a call: (primitive name, steps), the
# steps of a scan, None for a while loop, 1 for anything else.
Frame = tuple[str, int | None]


def _loop_steps(frames: Sequence[Frame]) -> tuple[int | None, ...]:
  """The lengths of the loops among ``frames`` (None: a while loop); a scan
  of one step is no loop."""
  return tuple(
    steps
    for primitive, steps in frames
    if primitive == "while"
    or (primitive == "scan" and steps is not None and steps > 1)
  )


def _unmatched(
  loops: Sequence[int | None], stack: Sequence[int]
) -> list[int | None]:
  """The loops, outer first, left once each stack axis of its length has been
  taken by one: those that slice nothing of the layer's params."""
  axes, left = list(stack), []
  for length in loops:
    if length in axes:
      axes.remove(length)
    else:
      left.append(length)
  return left


class TraceCheck:
  """Checks the shape pass's jaxpr for what the interceptors, which see a call
  only while it is traced, cannot see.

  *Loops.* A layer called in the body of a ``lax.scan``, ``lax.map`` or
  ``fori_loop``/``while_loop`` whose params the loop does not slice (closed
  over or carried: an RNN cell, a loop over micro-batches) gets the same
  probes at every step. A loop that slices stacked params slices the
  probes too, along one of the layer's stack axes (one that no ``vmap``
  inside the loss slices, such as an ``nnx.vmap`` ensemble's). A loop left
  over is weight sharing over its steps (``probed_vjp``) when it is one scan
  at the top of the loss, holding the call directly, around a layer with no
  stack axes left (``shared``); any other is refused. (A loop as long as a
  stack axis that slices it by other means, ``stack[i]`` inside a loop over
  as many micro-batches, is not told apart.)

  *Reused traces.* ``jax.jit``, ``jax.checkpoint`` and ``nn.jit`` cache a
  function's trace: called again (twice in one loss, or by a later capture)
  it runs its cached program without tracing, so the capture would merge or
  miss its layers' calls. A cached program shows as one sub-jaxpr object
  held by two equations, or as another check's markers.

  The shape pass runs each call under a ``jax.named_scope`` naming this
  check and the layer (``scope``) and reports its stack axes (``allow``);
  ``read`` walks the traced jaxpr (an equation's name stack is relative to
  the equation holding its sub-jaxpr); ``check`` raises for either problem.
  """

  _instances = itertools.count()

  def __init__(self):
    self.id = next(TraceCheck._instances)
    self.stacks: dict[str, tuple[int, ...]] = {}
    # Per layer, the equations around each of its calls, outer first.
    self.sites: dict[str, set[tuple[Frame, ...]]] = {}
    self.walked: set[int] = set()  # ids of the sub-jaxprs read
    self.reused: dict[str, None] = {}  # ordered set
    # The layers with a call that shares its weights over a loop's steps,
    # found by ``check``.
    self.shared: set[str] = set()

  @contextlib.contextmanager
  def scope(self, name: str) -> Iterator[None]:
    """Marks the equations of one call of layer ``name``."""
    with jax.named_scope(f"__kfac_{self.id}_{name.encode().hex()}__"):
      yield

  def allow(
    self,
    name: str,
    stack_shape: Sequence[int],
    kernel: Any,
    outside: frozenset[int],
  ) -> None:
    """Records a call of ``name``, whose kernel has ``stack_shape`` in the
    loss's params and is ``kernel`` where it runs: the vmaps mapping it,
    less those ``outside`` the loss (the ``batch_traces`` of its arguments),
    sliced its leading stack axes, which loops then cannot."""
    vmapped = len(probes_lib.batch_traces(kernel) - outside)
    self.stacks[name] = tuple(stack_shape[vmapped:])

  def read(
    self,
    jaxpr: jax.extend.core.Jaxpr,
    frames: tuple[Frame, ...] = (),
    reused: bool = False,
  ) -> None:
    """Records the equations around each marked call, and the layers with
    calls in a sub-jaxpr met twice (``reused``) or marked by another check."""
    for eqn in jaxpr.eqns:
      for check, name in re.findall(
        r"__kfac_(\d+)_([0-9a-f]*)__", str(eqn.source_info.name_stack)
      ):
        try:
          name = bytes.fromhex(name).decode()
        except ValueError:
          continue  # a module named like a marker, not one
        if reused or int(check) != self.id:
          self.reused[name] = None
        self.sites.setdefault(name, set()).add(frames)
      primitive = eqn.primitive.name
      steps = (
        eqn.params["length"]
        if primitive == "scan"
        else None
        if primitive == "while"
        else 1
      )
      for sub_jaxpr in _sub_jaxprs(eqn.params.values()):
        seen = id(sub_jaxpr) in self.walked
        self.walked.add(id(sub_jaxpr))
        self.read(sub_jaxpr, frames + ((primitive, steps),), reused or seen)

  def check(self) -> None:
    """Raises for a reused trace or a loop the capture cannot read; records
    the layers whose weights a loop shares (``shared``)."""
    if self.reused:
      raise ValueError(
        "value_grad_and_stats: layers "
        f"{', '.join(map(repr, sorted(self.reused)))} "
        "run in a function whose trace jax reused (a jax.jit, "
        "jax.checkpoint or nn.jit function called twice in the loss, or "
        "already traced by an earlier capture): the capture sees a call "
        "only while it is traced, so it would merge or miss their calls. "
        "Apply the model plainly in the loss and jit the whole training "
        "step, create the jitted/checkpointed function inside the loss (a "
        "new one per call), or "
        f"{probes_lib.skip_advice(*sorted(self.reused))}."
      )
    refused: dict[str, str] = {}
    for name, stack in self.stacks.items():
      for frames in sorted(self.sites.get(name, ()), key=str):
        loops = _loop_steps(frames)
        left = _unmatched(loops, stack)
        if not left:
          continue
        if (
          not stack
          and len(frames) == 1
          and frames[0][0] == "scan"
          and left == [frames[0][1]]
        ):
          self.shared.add(name)
          continue
        steps = (
          "of unknown length (a while_loop)"
          if left[0] is None
          else f"of {left[0]} steps"
        )
        around = ", ".join(
          primitive
          if steps is None or steps == 1
          else f"{primitive} of {steps} steps"
          for primitive, steps in frames
        )
        refused[name] = (
          f"inside a loop {steps} (stack axes {stack}; the "
          f"loops' lengths {loops}; the equations around, "
          f"outermost first: {around})"
        )
    if refused:
      raise _loop_error(refused)


def _enclosing(name: str) -> str:
  """The module holding layer ``name`` (``"LSTMCell_0"`` for
  ``"LSTMCell_0/ii"``; ``""`` for a layer at the root)."""
  return name.rpartition("/")[0]


def _loop_error(refused: Mapping[str, str]) -> ValueError:
  """One error for every layer whose loop the capture cannot read
  (``refused``: ``{layer: where it runs}``), grouped by the module holding
  them (an RNN cell's layers, together)."""
  groups: dict[tuple[str, str], list[str]] = {}
  for name in sorted(refused):
    groups.setdefault((_enclosing(name), refused[name]), []).append(name)
  described = "; ".join(
    (f"in module {module!r}, " if module else "")
    + ("layer " if len(names) == 1 else "each of layers ")
    + ", ".join(map(repr, names))
    + " runs "
    + where
    for (module, where), names in groups.items()
  )
  modules = sorted({module for module, _ in groups if module})
  skip = modules + [name for name in sorted(refused) if not _enclosing(name)]
  return ValueError(
    f"value_grad_and_stats: {described}. A loop that does not slice a "
    "layer's params (closed over, or carried) gives every step the same "
    "probes; the capture reads it as weight sharing over its steps (an "
    "RNN cell: one row per example and step) only for a scan of known "
    "length (nn.RNN, nn.scan, nnx.scan, jax.lax.scan, lax.map, a fori_loop "
    "with static bounds) that closes over the params, at the top of the "
    "loss (not inside another loop, nor under jax.jit, remat or cond) and "
    "around layers whose params it does not slice. Apply such a loop at "
    "the top of the loss, unroll it (micro-batches: one "
    "value_grad_and_stats each, with kfac_jax's gradient accumulation), or "
    f"{probes_lib.skip_advice(*skip)}."
  )


def _sub_jaxprs(values: Any) -> Iterator[jax.extend.core.Jaxpr]:
  """The jaxprs among an equation's params (a scan's body, cond's branches,
  a remat's or a jit's)."""
  for value in values:
    if isinstance(value, jax.extend.core.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
      yield value
    elif isinstance(value, (tuple, list)):
      yield from _sub_jaxprs(value)


def check_shared(
  shared: Collection[str], calls: Mapping[str, Sequence[Call]]
) -> None:
  """Refuses a convolution whose weights a loop shares: ``factors.batch``
  reads a convolution's tensors as ``[B, *spatial, C]``, with no axis for
  the steps."""
  convolutions = sorted(
    name for name in shared if calls[name][0].signature.conv is not None
  )
  if convolutions:
    raise ValueError(
      f"value_grad_and_stats: convolutions {convolutions} run at every "
      "step of a loop that shares their params (a convolutional RNN "
      "cell); the capture reads weight sharing over a loop's steps for "
      "dense layers and embeddings only. Unroll the loop, or "
      f"{probes_lib.skip_advice(*convolutions)}."
    )


# A probe array's place among the probes: (layer, call, 0 input / 1 output).
ProbeKey = tuple[str, int, int]


def probed_vjp(
  primal: Callable[[Any, Any], tuple[jax.Array, Any]],
  params: Any,
  probes: Mapping[str, Any],
  calls: Mapping[str, Sequence[Call]],
  shared: Collection[str],
  eager: bool,
) -> tuple[jax.Array, Any, Any, Any]:
  """``(loss, aux, grads, probe_grads)`` of ``primal(params, probes) ->
  (loss, aux)``, differentiated by ``jax.vjp``.

  The calls of the ``shared`` layers in a loop over steps (``TraceCheck``)
  get their probes per step: ``primal`` is traced to a jaxpr whose loops
  slice them (module docstring), and their gradients come out with the steps
  after the example axis.

  Args:
    primal: the loss with its probes applied.
    params: what the loss is differentiated with respect to.
    probes: ``{layer: ((input probe, output perturbation), ...)}``, per call.
    calls: the shape pass's calls, whose signatures place the step axis.
    shared: the layers with calls in a loop over steps.
    eager: whether the capture was called outside ``jit``
      (``probes.eager_context``).

  Raises:
    ValueError: a ``shared`` layer's probes do not reach its loop as a
      constant (a loop that changes the params it carries).
  """
  if not any(name in probes for name in shared):
    loss, vjp_fn, aux = jax.vjp(primal, params, probes, has_aux=True)
    grads, probe_grads = vjp_fn(jnp.ones_like(loss))
    return loss, aux, grads, probe_grads
  run, stacked, steps = _sliced_per_step(primal, params, probes, shared, eager)
  loss, vjp_fn, aux = jax.vjp(run, params, stacked, has_aux=True)
  grads, probe_grads = vjp_fn(jnp.ones_like(loss))
  return loss, aux, grads, _steps_after_examples(probe_grads, steps, calls)


def _sliced_per_step(
  primal: Callable[[Any, Any], tuple[jax.Array, Any]],
  params: Any,
  probes: Mapping[str, Any],
  shared: Collection[str],
  eager: bool,
) -> tuple[
  Callable[[Any, Any], tuple[jax.Array, Any]], Any, dict[ProbeKey, int]
]:
  """``(run, stacked, steps)``: ``run(params, stacked)`` is ``primal`` with
  each probe that a loop held as a constant given one slice per step of
  ``stacked`` (``probes`` with those stacked), ``steps`` their
  ``{ProbeKey: loop length}``."""
  flat, treedef = jax.tree.flatten((params, probes))
  keys: list[ProbeKey] = [
    (path[0].key, path[1].idx, path[2].idx)
    for path, _ in jax.tree_util.tree_flatten_with_path(probes)[0]
  ]
  first = len(flat) - len(keys)  # the params' leaves come first

  def flat_primal(*leaves):
    return primal(*jax.tree.unflatten(treedef, leaves))

  with probes_lib.eager_context(eager):
    closed, out_shape = jax.make_jaxpr(flat_primal, return_shape=True)(*flat)
  jaxpr = closed.jaxpr
  index = {var: i for i, var in enumerate(jaxpr.invars) if i >= first}
  uses: dict[Any, int] = {}
  for atom in itertools.chain(
    (atom for eqn in jaxpr.eqns for atom in eqn.invars), jaxpr.outvars
  ):
    if isinstance(atom, jax.extend.core.Var):
      uses[atom] = uses.get(atom, 0) + 1
  scans: dict[int, Callable[[Sequence[Any]], list[Any]]] = {}
  steps: dict[ProbeKey, int] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "scan" or eqn.params["length"] <= 1:
      continue
    moved = set()  # positions of the constants to slice per step
    for position, atom in enumerate(eqn.invars[: _scan_counts(eqn.params)[0]]):
      i = index.get(atom) if isinstance(atom, jax.extend.core.Var) else None
      if i is None or keys[i - first][0] not in shared or uses[atom] != 1:
        continue
      flat[i] = _stacked_zeros(flat[i], eqn.params["length"])
      steps[keys[i - first]] = eqn.params["length"]
      moved.add(position)
    if moved:
      scans[k] = _slicing_scan(eqn.params, moved)
  _check_all_sliced(shared, keys, steps)
  out_tree = jax.tree.structure(out_shape)

  def run(params, stacked):
    return jax.tree.unflatten(
      out_tree, _evaluate(closed, jax.tree.leaves((params, stacked)), scans)
    )

  return run, jax.tree.unflatten(treedef, flat)[1], steps


def _scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """``(constants, carries)`` of a ``scan`` equation's operands (then the
  values it scans): jax 0.12 groups them in a flat tree, ``ft_in``."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def _slicing_scan(
  params: Mapping[str, Any], moved: Collection[int]
) -> Callable[[Sequence[Any]], list[Any]]:
  """A ``scan`` equation of ``params`` as a function of its operands, with
  the constants at the ``moved`` positions given stacked, one slice per
  step: the body reads the same per-step values."""
  num_consts, num_carry = _scan_counts(params)
  body = jax.extend.core.jaxpr_as_fun(params["jaxpr"])

  def call(operands: Sequence[Any]) -> list[Any]:
    consts = list(operands[:num_consts])
    carry = list(operands[num_consts : num_consts + num_carry])
    xs = list(operands[num_consts + num_carry :])

    def step(carry, x):
      xs_t, moved_t = x
      step_consts = [
        moved_t[i] if i in moved_t else c for i, c in enumerate(consts)
      ]
      outs = list(body(*step_consts, *carry, *xs_t))
      return outs[:num_carry], outs[num_carry:]

    carry, ys = jax.lax.scan(
      step,
      carry,
      (xs, {i: consts[i] for i in moved}),
      length=params["length"],
      reverse=params["reverse"],
      unroll=params["unroll"],
    )
    return [*carry, *ys]

  return call


def _evaluate(
  closed: Any,
  args: Sequence[Any],
  replaced: Mapping[int, Callable[[Sequence[Any]], list[Any]]],
) -> list[Any]:
  """``jax.extend.core.jaxpr_as_fun(closed)(*args)``, with the equations at
  the indices of ``replaced`` computed by their function of the operands."""
  jaxpr = closed.jaxpr
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))

  def read(atom):
    if isinstance(atom, jax.extend.core.Literal):
      return atom.val
    return env[atom]

  for k, eqn in enumerate(jaxpr.eqns):
    operands = [read(atom) for atom in eqn.invars]
    with eqn.ctx.manager:  # the equation's context, as jax's eval_jaxpr
      if k in replaced:
        outs = replaced[k](operands)
      else:
        outs = eqn.primitive.bind(
          *operands, **eqn.primitive.get_bind_params(eqn.params)
        )
        if not eqn.primitive.multiple_results:
          outs = [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(atom) for atom in jaxpr.outvars]


def _stacked_zeros(like: jax.Array, steps: int) -> jax.Array:
  """Zeros of ``like``'s type with a leading axis of ``steps`` (unsharded)."""
  shape = (steps,) + tuple(like.shape)
  sharding = probes_lib.explicit_sharding(like)
  if sharding is None:
    return jnp.zeros(shape, like.dtype)
  return jnp.zeros(
    shape,
    like.dtype,
    out_sharding=sharding.update(
      spec=jax.sharding.PartitionSpec(None, *sharding.spec)
    ),
  )


def _check_all_sliced(
  shared: Collection[str],
  keys: Sequence[ProbeKey],
  steps: Mapping[ProbeKey, int],
) -> None:
  """Refuses the ``shared`` layers none of whose probes a loop held as a
  constant: the loop changes the params it carries (an inner optimization
  loop), or they reach it through another transformation."""
  sliced = {key[0] for key in steps}
  carried = sorted(({key[0] for key in keys} & set(shared)) - sliced)
  if carried:
    raise _loop_error(
      {
        name: (
          "inside a loop that passes its params (and so its probes) "
          "as a carry or through another transformation, not as a "
          "constant"
        )
        for name in carried
      }
    )


def _steps_after_examples(
  probe_grads: Mapping[str, Any],
  steps: Mapping[ProbeKey, int],
  calls: Mapping[str, Sequence[Call]],
) -> dict[str, Any]:
  """``probe_grads`` with each per-step gradient's leading step axis moved
  after the example axis: ``[*stack, B, T, …]``, or ``[*stack, T, …]`` for a
  tensor with no example axis (``factors.batch``'s weight-sharing axes)."""
  result = {
    name: [list(pair) for pair in pairs] for name, pairs in probe_grads.items()
  }
  for name, call, which in steps:
    signature = calls[name][0].signature
    features = (
      len(signature.input_axes) if which == 0 else (signature.output_ndim)
    )
    gradient = result[name][call][which]
    examples = gradient.ndim - 1 > signature.stack_ndim + features
    result[name][call][which] = jnp.moveaxis(
      gradient, 0, signature.stack_ndim + int(examples)
    )
  return {
    name: tuple(tuple(pair) for pair in pairs) for name, pairs in result.items()
  }
