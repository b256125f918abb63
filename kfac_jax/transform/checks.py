"""Checks that stop ``scale_by_kfac`` from a silently wrong result.

Each compares what ``update`` (or ``init``) is given against what the
transformation was built for and says which argument or call to fix: the
state against the params' layers and the configuration
(``check_state``, ``check_preconditioners``), the captured ``kfac_stats``
against the layers (``check_stats``, ``check_stats_shapes``), the adaptive
mode's ``split_loss`` (``check_split_loss``), and optax's params
placeholder (``check_not_params_placeholder``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.core

from kfac_jax.capture import layers as layers_lib
from kfac_jax.capture.layers import LayerInfo
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.transform.config import KFACConfig
from kfac_jax.transform.quadratic_model import SplitLoss
from kfac_jax.transform.state import ScaleByKFACState, shapes_and_dtypes


def check_not_params_placeholder(params: Any) -> None:
  """Refuses ``optax.tree_utils.tree_map_params``'s stand-in for the params.

  That helper calls ``init`` on one opaque placeholder to find the params
  trees in a state; K-FAC's state is built from the layers in the params,
  so it cannot be derived from a placeholder (and failed with a key
  mismatch deep in optax).
  """
  if type(params).__name__ == "_ParamsPlaceholder":
    raise TypeError(
      "scale_by_kfac: init was given optax's params placeholder, as "
      "optax.tree_utils.tree_map_params does. K-FAC's state is built "
      "from the layers found in the params, which a placeholder hides. "
      "For partition specs of the optimizer state use "
      "kfac_jax.get_opt_state_partition_specs(params, ...); to map over "
      "a state, use jax.tree.map on it."
    )


def check_state(
  layers: Mapping[str, LayerInfo], state: ScaleByKFACState, config: KFACConfig
) -> None:
  """The state must have been made by ``init`` for these params and this
  configuration."""
  if not isinstance(state, ScaleByKFACState):
    raise TypeError(
      "scale_by_kfac.update: expected the state made by its init, got "
      f"{type(state).__name__}."
    )
  accumulation_steps = config.accumulation_steps
  for field, needed, setting in (
    ("accumulator", accumulation_steps > 1, "accumulation_steps > 1"),
    (
      "quadratic_model",
      config.adaptive is not None,
      "adaptive=AdaptiveConfig(...)",
    ),
    (
      "eigh_fallbacks",
      config.subspace_solver is not None,
      'eigen_solver="subspace"',
    ),
    (
      "eigenvalue_scales",
      config.keeps_eigenvalue_scales,
      "eigenvalue_correction=True or second_moment_decay",
    ),
  ):
    if (getattr(state, field) is not None) != needed:
      raise ValueError(
        f"scale_by_kfac.update: the state {'lacks' if needed else 'has'} "
        f"the {field} that {setting} {'needs' if needed else 'makes'}, so "
        f"it was made by a transformation {'without' if needed else 'with'} "
        f"{setting}. Start from this transformation's tx.init(params) "
        "(tx.init(params)._replace(factors=old_state.factors) keeps the "
        "curvature gathered so far)."
      )
  micro_step = (
    None if state.accumulator is None else state.accumulator.micro_step
  )
  if micro_step is not None and not isinstance(micro_step, jax.core.Tracer):
    if int(micro_step) < 0:
      raise ValueError(
        f"scale_by_kfac.update: the state's accumulator is at micro-step "
        f"{int(micro_step)}; a state from tx.init counts from 0. The state "
        "is corrupted: start from tx.init(params)."
      )
  if (
    micro_step is not None
    and not isinstance(micro_step, jax.core.Tracer)
    and int(micro_step) >= accumulation_steps
  ):
    raise ValueError(
      f"scale_by_kfac.update: the state's accumulator is at micro-step "
      f"{int(micro_step)}, outside [0, accumulation_steps={accumulation_steps}"
      "): it was saved by a transformation with a larger accumulation_steps. "
      "Resume with that accumulation_steps, or start from this "
      "transformation's tx.init(params)._replace(factors=old_state.factors, "
      "preconditioners=old_state.preconditioners, count=old_state.count)."
    )
  blocks = layers_lib.blocks_of(layers)
  missing = sorted(set(blocks) - set(state.factors))
  extra = sorted(set(state.factors) - set(blocks))
  if missing or extra:
    raise ValueError(
      "scale_by_kfac: the optimizer state does not match the gradients' "
      f"layers (in the gradients but not the state: {missing}; in the state "
      f"but not the gradients: {extra}). Call tx.init with the same params "
      "(and skip_layers and layers) the gradients come from."
    )
  for layer in layers.values():
    for block in layer.block_names:
      a_shape = state.factors[block].activation_factor.shape
      g_shape = state.factors[block].gradient_factor.shape
      if (
        a_shape != (layer.activation_dim,) * 2
        or g_shape != (layer.gradient_dim,) * 2
      ):
        raise ValueError(
          f"Layer {block!r}: state factors A{a_shape}, G{g_shape} do not fit "
          f"a kernel {layer.kernel_shape} (bias={layer.has_bias}); re-run "
          "tx.init with the current params."
        )


def check_dense_only(
  stats: Mapping[str, LayerStatistics], active: Sequence[str], setting: str
) -> None:
  """``setting`` reads dense layers' rows: refuses convs and embeddings."""
  for name in active:
    signature = stats[name].signature
    if signature.conv is not None or signature.num_embeddings is not None:
      raise ValueError(
        f"scale_by_kfac({setting}) works on dense layers' gradient rows; "
        f"layer {name!r} is a {signature.module_type}, whose per-example "
        "gradients are not the product of its rows. Skip it "
        f"(skip_layers=[{name!r}] in scale_by_kfac and in the capture) to "
        "leave it to the chained optimizer, or drop the setting."
      )


def check_preconditioners(preconditioners: Any, expected: Any) -> None:
  """The state's preconditioners must be what this transformation makes.

  ``checkpoint.restore`` of a state saved without them gives ``None``; a
  state of another method, outer-product setting, ``inv_dtype`` or
  distribution has other arrays. Either failed deep inside the update.
  """
  if preconditioners is None:
    raise ValueError(
      "scale_by_kfac.update: the state has no preconditioners (restored "
      "from a checkpoint saved with include_preconditioners=False). Call "
      "kfac_jax.checkpoint.recompute_preconditioners(state, damping, ...) "
      "with this transformation's arguments first."
    )
  try:
    found = shapes_and_dtypes(preconditioners)
  except (AttributeError, TypeError):
    found = None
  if found != shapes_and_dtypes(expected):
    raise ValueError(
      "scale_by_kfac.update: the state's preconditioners are not the ones "
      "this transformation makes: "
      f"{_difference(preconditioners, expected)}. Call "
      "kfac_jax.checkpoint.recompute_preconditioners(state, damping, ...) "
      "with this transformation's arguments, or build the transformation "
      "with the arguments the state was made with."
    )


def _difference(found: Any, expected: Any) -> str:
  """What differs between two preconditioner states (arrays or
  ``ShapeDtypeStruct``s), and which argument would explain it."""

  def kinds(tree: Any) -> list[str]:
    nodes = tree.values() if isinstance(tree, Mapping) else [tree]
    return sorted({type(node).__name__ for node in nodes})

  if kinds(found) != kinds(expected):
    return (
      f"the state holds {kinds(found)}, this transformation makes "
      f"{kinds(expected)} (another compute_method, or mesh_axes)"
    )
  if jax.tree.structure(found) != jax.tree.structure(expected):
    return (
      "other arrays of the same kind (another compute_eigenvalue_outer_product)"
    )
  dtypes = lambda tree: sorted({str(x.dtype) for x in jax.tree.leaves(tree)})
  if dtypes(found) != dtypes(expected):
    return (
      f"stored as {dtypes(found)}, this transformation stores "
      f"{dtypes(expected)} (another inv_dtype)"
    )
  return (
    "other shapes (another device count, grad_worker_fraction or "
    "assignment_strategy)"
  )


def check_split_loss(
  split_loss: SplitLoss | None, params: Any, adaptive: bool
) -> None:
  """The adaptive mode's extra arguments must be there, and only there."""
  if not adaptive:
    if split_loss is not None:
      # Likely meant for the adaptive mode, which this transformation is not.
      raise ValueError(
        "update got split_loss, which only scale_by_kfac(adaptive="
        "kfac_jax.AdaptiveConfig(...)) reads; this one was built without "
        "adaptive. Pass adaptive=... to scale_by_kfac, or drop split_loss."
      )
    return
  if split_loss is None or params is None:
    raise ValueError(
      "scale_by_kfac(adaptive=...).update needs params and split_loss: "
      "tx.update(grads, state, params, kfac_stats=stats, "
      "split_loss=kfac_jax.SplitLoss(outputs_fn, loss_fn)) with the batch "
      "loss = loss_fn(outputs_fn(params)) of the same batch."
    )
  if not isinstance(split_loss, SplitLoss):
    raise TypeError(
      "split_loss must be a kfac_jax.SplitLoss(outputs_fn, loss_fn, "
      f"regularizer=None); got {type(split_loss).__name__}."
    )


class NoStats:
  """The type of ``NO_STATS``."""

  def __repr__(self) -> str:
    return "kfac_jax.NO_STATS"


NO_STATS = NoStats()
"""``kfac_stats=NO_STATS``: a step computed by a plain ``jax.value_and_grad``.

Its ``update`` preconditions with the state's preconditioners (decomposing
them on decomposition steps, which need no statistics) and updates no
factors; on a factor step the factor update is skipped and counted in
``skipped_factor_updates``. With ``factor_update_steps=k``, steps whose
count is not a multiple of k can run this cheaper program
(docs: *Statistics only on factor steps*).
"""


def check_no_stats(config: KFACConfig) -> None:
  """What ``update(kfac_stats=NO_STATS)`` cannot do without statistics.

  Raises:
    ValueError: with gradient accumulation (each micro-batch's factors are
      summed), or with class-name ``skip_layers`` and no layer table (the
      classes are read from the stats).
  """
  if config.accumulation_steps > 1:
    raise ValueError(
      "scale_by_kfac.update(kfac_stats=NO_STATS): with accumulation_steps="
      f"{config.accumulation_steps} every micro-batch of a factor step "
      "adds its factors; pass each micro-batch's kfac_stats."
    )
  if config.layers is None and config.skip_layers:
    raise ValueError(
      "scale_by_kfac.update(kfac_stats=NO_STATS) with skip_layers and no "
      "layer table: which layers a class-name pattern skips is read from "
      "the stats. Pass layers=kfac_jax.trace_layers(loss_fn, params, "
      "*batch) to scale_by_kfac."
    )


def check_stats(
  stats: Mapping[str, LayerStatistics] | None,
  layers: Mapping[str, LayerInfo],
  skip: Sequence[re.Pattern[str]],
  gradients: Any,
  left_out: frozenset[str] = frozenset(),
) -> list[str]:
  """Checks ``kfac_stats`` against the layers and the gradients.

  Args:
    stats: ``update``'s ``kfac_stats``.
    layers: the registered layers (the state's).
    skip: the compiled ``skip_layers``.
    gradients: the incoming gradients.
    left_out: layers ``max_factor_dim`` leaves out: their stats are unused.

  Returns:
    The layers to precondition: those of ``layers`` whose stats a
    ``skip_layers`` class name does not skip.

  Raises:
    ValueError: stats missing (or missing a layer), a layer's stats not
      fitting its kernel, or stats of a layer the optimizer does not hold.
    TypeError: stats not the ``value_grad_and_stats`` dict.
  """
  if stats is None:
    raise ValueError(
      "scale_by_kfac.update needs kfac_stats=...: compute "
      "(loss, grads, stats) = kfac_jax.value_grad_and_stats(loss_fn)(params, "
      "...) and call tx.update(grads, state, params, kfac_stats=stats). "
      "A wrapper that does not forward extra arguments to tx.update "
      "(flax's TrainState.apply_gradients, optax.lookahead) drops them: "
      "use kfac_jax.TrainState, whose apply_gradients takes kfac_stats, "
      "or call tx.update yourself (nnx.Optimizer.update forwards them). "
      "A step without statistics passes "
      "kfac_stats=kfac_jax.NO_STATS."
    )
  if not isinstance(stats, Mapping) or not all(
    isinstance(s, LayerStatistics) for s in stats.values()
  ):
    raise TypeError(
      "kfac_stats must be the dict of LayerStatistics returned by "
      f"kfac_jax.value_grad_and_stats; got {type(stats).__name__}."
    )
  active = []
  for name, layer in layers.items():
    layer_stats = stats.get(name)
    if layer_stats is None:
      raise ValueError(
        f"kfac_stats has no entry for layer {name!r} (kernel "
        f"{layer.kernel_shape}), which the optimizer state holds. Either the "
        "layer was not called in the loss (or is not a layer the capture "
        "knows: Dense, DenseGeneral, Conv, Embed and NNX's Linear, "
        "LinearGeneral, Conv, Embed), was skipped by the capture, or the "
        "stats come from another model. Add "
        f"{layers_lib.skip_pattern(name)!r} to skip_layers to leave it to "
        "the chained optimizer."
        + (
          ""
          if layer.module_type is not None
          else " A skip_layers pattern naming its Flax class skips it in the "
          "capture, but scale_by_kfac cannot see the class without the "
          "layer table: skip it by path, or pass "
          "layers=kfac_jax.trace_layers(...)."
        )
      )
    signature = layer_stats.signature
    if layers_lib.matches_any(skip, signature.module_type):
      continue
    check_stats_shapes(name, layer, layer_stats)
    active.append(name)
  for name, layer_stats in stats.items():
    # Embed tables are layers only with precondition_embeddings.
    if (
      name in layers
      or name in left_out
      or layer_stats.signature.num_embeddings is not None
    ):
      continue
    path = tuple(name.split("/")) if name else ()
    if layers_lib.is_skipped_layer(
      path, layer_stats.signature.module_type, skip
    ) or layers_lib.is_masked_layer(gradients, path):
      continue
    if layers_lib.has_kernel(gradients, path):
      raise ValueError(
        f"kfac_stats has layer {name!r} "
        f"({layer_stats.signature.module_type}), and the gradients have "
        "its kernel, but the optimizer's layers (the layers= table, or "
        "those found in the params at init) lack it: trace the table from "
        "the training loss (kfac_jax.trace_layers), "
        f"or add {layers_lib.skip_pattern(name)!r} to skip_layers to leave "
        "it to the chained optimizer."
      )
    raise ValueError(
      f"kfac_stats has layer {name!r} ({layer_stats.signature.module_type}) "
      "but the gradients have no kernel at that path. Pass the stats and "
      "grads of the same loss call, and init with the same params; a "
      "wrapper that reshapes the gradients (optax.flatten) hides the "
      "layers from scale_by_kfac."
    )
  return active


def check_stats_shapes(
  name: str, layer: LayerInfo, stats: LayerStatistics
) -> None:
  """One layer's captured call must fit its kernel: stack, contracted and
  group axes, bias, conv window, input and output features."""
  signature = stats.signature
  conv = signature.conv
  captured = (signature.stack_ndim, signature.contracted_ndim, signature.groups)
  expected = (layer.stack_ndim, len(layer.contracted_shape), layer.groups)
  if captured != expected:
    raise ValueError(
      f"Layer {name!r} ({signature.module_type}): the captured call has "
      f"{signature.stack_ndim} stack axes, {signature.contracted_ndim} "
      f"contracted kernel axes and {signature.groups} groups, but the "
      f"optimizer reads kernel {layer.kernel_shape} as {expected[0]}, "
      f"{expected[1]} and {expected[2]}. Scanned layers, grouped "
      "convolutions and DenseGeneral need the layer table: "
      "scale_by_kfac(..., layers=kfac_jax.trace_layers(loss_fn, params, "
      f"*batch)). Or add {layers_lib.skip_pattern(name)!r} to skip_layers."
    )
  stack = layer.stack_ndim
  contracted = layer.contracted_shape
  problems = []
  if signature.has_bias != layer.has_bias:
    problems.append(
      f"the captured layer has use_bias={signature.has_bias} but "
      f"the params {'have' if layer.has_bias else 'lack'} a bias"
    )
  if conv is not None and contracted[:-1] != conv.window:
    problems.append(
      f"conv window {conv.window} != kernel window {contracted[:-1]}"
    )
  for x in stats.inputs:
    if x.shape[:stack] != layer.stack_shape:
      problems.append(
        f"input stack axes {x.shape[:stack]} != kernel {layer.stack_shape}"
      )
    elif conv is not None and x.shape[-1] != contracted[-1] * layer.groups:
      problems.append(
        f"input channels {x.shape[-1]} != kernel in "
        f"{contracted[-1]} x {layer.groups} groups"
      )
    elif signature.num_embeddings is not None:
      if (signature.num_embeddings,) != contracted:
        problems.append(
          f"vocabulary {signature.num_embeddings} != table rows {contracted}"
        )
    elif (
      conv is None
      and tuple(x.shape[a] for a in signature.input_axes) != contracted
    ):
      problems.append(
        f"input features {tuple(x.shape[a] for a in signature.input_axes)}"
        f" != kernel in {contracted}"
      )
  output_ndim = 1 if conv is not None else signature.output_ndim
  for g in stats.output_cotangents:
    if (
      g.shape[:stack] != layer.stack_shape
      or g.shape[g.ndim - output_ndim :] != layer.output_shape
    ):
      problems.append(
        f"output {g.shape} does not end in kernel out {layer.output_shape}"
      )
  if problems:
    raise ValueError(
      f"Layer {name!r}: kfac_stats disagree with the params: "
      f"{'; '.join(problems)}. Pass stats and grads from the same model, or "
      f"add {layers_lib.skip_pattern(name)!r} to skip_layers."
    )
