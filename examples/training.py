"""Training several optimizers side by side: the examples' comparison loop.

``compare`` trains several optimizers from the same initial parameters on the
same sequence of mini-batches: at every step each optimizer takes one step on
the same batch. Each step is timed on its own (with ``block_until_ready``),
after an ahead-of-time compilation that is timed separately, so the
per-optimizer wall times are comparable even though the runs are interleaved.

The steps are the caller's (``make_step``): ``make_train_step`` builds them
from a loss (K-FAC steps use ``kfac_jax.value_grad_and_stats`` and pass
``kfac_stats`` to ``tx.update``; first-order steps use
``jax.value_and_grad``); ``stateless`` adapts a step that has no model state
nor PRNG key.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import kfac_jax

Batch = tuple[np.ndarray, ...]
LossFn = Callable[..., jax.Array]
# step(params, opt_state, model_state, key, *batch)
#   -> (params, opt_state, model_state, loss), jitted.
StepFn = Callable[..., tuple[Any, Any, Any, jax.Array]]


@dataclasses.dataclass
class Optimizer:
  """One contestant of a comparison.

  Attributes:
    name: short name for the progress bar, table and plot legend.
    tx: the optax transformation.
    uses_kfac: whether ``tx.update`` needs ``kfac_stats`` (K-FAC).
    description: hyper-parameters, printed under the table.
    needs_split_loss: whether ``tx.update`` also needs ``split_loss``
      (``scale_by_kfac(adaptive=...)``).
    separate_curvature: whether K-FAC's stats come from a ``curvature_fn``
      of their own (a ``kfac_jax.sampled_curvature`` surrogate: Gauss-Newton
      factors; or the loss on part of the batch) rather than from the
      gradient's backward pass (the empirical Fisher of the whole batch).
  """

  name: str
  tx: optax.GradientTransformation
  uses_kfac: bool = False
  description: str = ""
  needs_split_loss: bool = False
  separate_curvature: bool = False

  def __post_init__(self):
    if (
      self.needs_split_loss or self.separate_curvature
    ) and not self.uses_kfac:
      raise ValueError(
        f"Optimizer {self.name!r}: needs_split_loss and "
        "separate_curvature are K-FAC's; set uses_kfac=True."
      )


@dataclasses.dataclass
class RunResult:
  """What ``compare`` records for one optimizer.

  Attributes:
    name: the optimizer's name.
    losses: mini-batch training loss of every step, ``[steps]``.
    seconds: cumulative training time after every step, ``[steps]``
      (compilation excluded).
    compile_seconds: ahead-of-time compilation time of the train step.
    params: the final parameters.
    model_state: the final non-param model state (``None`` if stateless).
    metrics: filled in by the caller's evaluation (e.g. test accuracy).
  """

  name: str
  losses: np.ndarray
  seconds: np.ndarray
  compile_seconds: float
  params: Any
  model_state: Any = None
  metrics: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def steps(self) -> int:
    return len(self.losses)

  @property
  def train_seconds(self) -> float:
    return float(self.seconds[-1]) if len(self.seconds) else 0.0

  @property
  def ms_per_step(self) -> float:
    return 1000 * self.train_seconds / max(self.steps, 1)


def make_train_step(
  loss_fn: LossFn,
  optimizer: Optimizer,
  stateful: bool = False,
  split_loss: Callable[..., kfac_jax.SplitLoss] | None = None,
  curvature_fn: Callable[..., jax.Array] | None = None,
) -> Callable[..., Any]:
  """``step(params, opt_state, model_state, key, *batch) -> (params,
  opt_state, model_state, loss)``, jitted.

  ``stateful``: ``loss_fn(params, model_state, *batch)`` returns ``(loss,
  new_model_state)``; otherwise ``loss_fn(params, *batch)`` returns the loss
  and ``model_state`` passes through. ``split_loss(*batch)``: the batch
  loss as a ``kfac_jax.SplitLoss``, for optimizers that need it.
  ``curvature_fn(params, key, *batch)``: the scalar whose stats K-FAC uses,
  for optimizers with ``separate_curvature``; ``key`` (a fresh PRNG key each
  step) is only used by it.

  ``params``, ``opt_state`` and ``model_state`` are donated: XLA updates
  them in place (and K-FAC's preconditioners, untouched on most steps, are
  not copied), so the caller must not use the arrays it passed in again.
  """
  tx = optimizer.tx
  if optimizer.needs_split_loss and (split_loss is None or stateful):
    raise ValueError(
      f"{optimizer.name} needs a split_loss (and a stateless loss_fn)."
    )
  if optimizer.separate_curvature and curvature_fn is None:
    raise ValueError(
      f"{optimizer.name} takes its stats from a curvature_fn: pass one."
    )

  def loss_and_state(params, model_state, *batch):
    if stateful:
      return loss_fn(params, model_state, *batch)
    return loss_fn(params, *batch), model_state

  def step(params, opt_state, model_state, key, *batch):
    if optimizer.uses_kfac and not optimizer.separate_curvature:
      (loss, model_state), grads, stats = kfac_jax.value_grad_and_stats(
        loss_and_state, has_aux=True
      )(params, model_state, *batch)
    else:
      (loss, model_state), grads = jax.value_and_grad(
        loss_and_state, has_aux=True
      )(params, model_state, *batch)
    if optimizer.separate_curvature:
      _, _, stats = kfac_jax.value_grad_and_stats(curvature_fn)(
        params, key, *batch
      )
    if optimizer.uses_kfac:
      extra = (
        dict(split_loss=split_loss(*batch))
        if optimizer.needs_split_loss
        else {}
      )
      updates, opt_state = tx.update(
        grads, opt_state, params, kfac_stats=stats, **extra
      )
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, model_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2))


def epoch_batches(
  num_examples: int, batch_size: int, epochs: int, seed: int
) -> Iterator[np.ndarray]:
  """Index arrays of shuffled mini-batches, epoch after epoch.

  The last incomplete batch of each epoch is dropped, so every step has the
  same shape (one compilation).
  """
  if batch_size > num_examples:
    raise ValueError(
      f"batch size {batch_size} exceeds the {num_examples} examples."
    )
  rng = np.random.default_rng(seed)
  for _ in range(epochs):
    order = rng.permutation(num_examples)
    for start in range(0, num_examples - batch_size + 1, batch_size):
      yield order[start : start + batch_size]


def num_steps(
  num_examples: int, batch_size: int, epochs: int, max_steps: int | None
) -> int:
  steps = epochs * (num_examples // batch_size)
  return steps if max_steps is None else min(steps, max_steps)


def stateless(step: Callable[..., tuple[Any, Any, jax.Array]]) -> StepFn:
  """``step(params, opt_state, *batch) -> (params, opt_state, loss)`` as a
  ``StepFn`` (no model state, no PRNG key), jitted.

  ``params`` and ``opt_state`` are donated, as ``make_train_step``'s.
  """

  def full_step(params, opt_state, model_state, key, *batch):
    del key  # no sampled curvature
    params, opt_state, loss = step(params, opt_state, *batch)
    return params, opt_state, model_state, loss

  return jax.jit(full_step, donate_argnums=(0, 1))


def curvature_batch(batch: Sequence[Any], examples: int) -> tuple[Any, ...]:
  """The first ``examples`` of a batch (all of a smaller one).

  Martens' curvature mini-batch (Hessian-free optimisation, 2010): the
  Kronecker factors' statistics and the quadratic model's curvature products
  and reduction ratio use part of a large batch, the gradient all of it. On a
  small batch the model of a few examples is too noisy: on CIFAR-10 at batch
  128, 32 examples drove the damping to ~5e-5 and training diverged after
  380 steps, where all 128 did not.
  """
  return tuple(a[:examples] for a in batch)


def curvature_shared_loss(loss_fn: LossFn, examples: int) -> LossFn:
  """``loss_fn`` on ``N`` examples: ``(M/N)·loss(head) + (1−M/N)·loss(rest)``.

  The same objective for a ``loss_fn`` that is a mean over the batch's
  examples plus terms that do not depend on the batch (every task's is), with
  the head the ``M = examples`` of ``curvature_batch`` (a batch of at most
  ``M`` is passed whole). Computed so, the gradient's forward pass over the
  head is the one the curvature capture and the quadratic model run on the
  same parameters and examples, and XLA's common-subexpression elimination
  runs it once: one forward pass over ``M`` examples less a step
  (``benchmarks/race_flops.py``, *all, the gradient split*).
  """

  def loss(params, *batch):
    size = batch[0].shape[0]
    if examples >= size:
      return loss_fn(params, *batch)
    head_weight = examples / size
    return head_weight * loss_fn(params, *curvature_batch(batch, examples)) + (
      1 - head_weight
    ) * loss_fn(params, *(a[examples:] for a in batch))

  return loss


def compare(
  optimizers: Sequence[Optimizer],
  make_step: Callable[[Optimizer], StepFn],
  init_params: Any,
  data: Sequence[np.ndarray],
  batch_size: int,
  epochs: int,
  max_steps: int | None = None,
  seed: int = 0,
  desc: str = "training",
  model_state: Any = None,
) -> dict[str, RunResult]:
  """Trains every optimizer on the same batches, one step each in turn.

  Args:
    optimizers: the contestants.
    make_step: ``make_step(optimizer)``, the jitted train step of one
      optimizer (``make_train_step``, ``stateless``); it donates its
      params, optimizer state and model state.
    init_params: the common starting point.
    data: arrays with a leading example axis (e.g. ``(x, y)``); a batch is
      ``tuple(a[idx] for a in data)``.
    batch_size: examples per step.
    epochs: passes over the data.
    max_steps: optional cap on the number of steps (smoke runs).
    seed: shuffling seed; step ``i``'s PRNG key is ``fold_in(key(seed), i)``.
    desc: progress-bar label.
    model_state: initial non-param model state (BatchNorm statistics), None
      for a stateless model.

  Returns:
    ``{name: RunResult}`` in the order of ``optimizers``.
  """
  names = [o.name for o in optimizers]
  if len(set(names)) != len(names):
    raise ValueError(f"optimizer names must be distinct: {names}")
  num_examples = len(data[0])
  total = num_steps(num_examples, batch_size, epochs, max_steps)
  if total < 1:
    raise ValueError("nothing to train: the number of steps is 0.")

  def batch_of(idx: np.ndarray) -> Batch:
    return tuple(a[idx] for a in data)

  example = batch_of(np.arange(batch_size))
  states, steps, compile_seconds = {}, {}, {}
  for opt in optimizers:
    # Each optimizer gets its own copies: its step donates them.
    params, state = (
      jax.tree.map(jnp.copy, t) for t in (init_params, model_state)
    )
    opt_state = opt.tx.init(params)
    start = time.perf_counter()
    steps[opt.name] = (
      make_step(opt)
      .lower(params, opt_state, state, jax.random.key(seed), *example)
      .compile()
    )
    compile_seconds[opt.name] = time.perf_counter() - start
    states[opt.name] = (params, opt_state, state)

  losses = {n: [] for n in names}
  seconds = {n: np.zeros(total) for n in names}
  elapsed = dict.fromkeys(names, 0.0)
  batches = epoch_batches(num_examples, batch_size, epochs, seed)
  refresh = max(1, total // 100)
  with tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True) as bar:
    for i in range(total):
      # Copied to the device once, outside the timed region, for all.
      batch = jax.device_put(batch_of(next(batches)))
      key = jax.random.fold_in(jax.random.key(seed), i)
      for name in names:
        start = time.perf_counter()
        *state, loss = jax.block_until_ready(
          steps[name](*states[name], key, *batch)
        )
        elapsed[name] += time.perf_counter() - start
        seconds[name][i] = elapsed[name]
        states[name] = tuple(state)
        losses[name].append(loss)
      if (i + 1) % refresh == 0 or i + 1 == total:
        bar.set_postfix(
          {n: f"{float(losses[n][-1]):.4g}" for n in names}, refresh=False
        )
      bar.update(1)

  results = {}
  for name in names:
    loss_values = np.asarray(jax.device_get(losses[name]), np.float64)
    if not np.all(np.isfinite(loss_values)):
      first = int(np.argmin(np.isfinite(loss_values)))
      tqdm.write(f"warning: {name} loss became non-finite at step {first}.")
    results[name] = RunResult(
      name=name,
      losses=loss_values,
      seconds=seconds[name],
      compile_seconds=compile_seconds[name],
      params=states[name][0],
      model_state=states[name][2],
    )
  return results
