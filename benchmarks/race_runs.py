"""One run of the convergence race: training for a budget of seconds.

The clock counts training steps only (each timed alone with
``jax.block_until_ready``); it stops while the metric is evaluated and while
``kfac_adaptive``'s trace is read. It reads the wall clock, or with
``clock="cpu"`` the process's CPU seconds (``time.process_time``, all its
threads): the steps' work, which other processes on a shared machine do
not lengthen as they lengthen the wall clock; on an otherwise idle core
the two agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from tqdm.auto import tqdm

import kfac_jax
from examples import tasks, training

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def train_run(
  task: tasks.Task,
  optimizer: training.Optimizer,
  seed: int,
  budget: float,
  eval_every: float,
  max_steps: int | None,
  progress: bool,
  label: str,
  curvature_examples: int | None = None,
  curvature: str = "batch",
  clock: str = "wall",
  stats_every: int | None = None,
) -> dict[str, Any]:
  """Trains for ``budget`` training seconds; returns the run's record.

  ``curvature_examples``: see ``curvature_batch`` (None: the whole batch).
  ``curvature``: where a ``separate_curvature`` optimizer's stats come from
  on the curvature batch, ``"empirical"`` (the loss) or ``"gauss-newton"``
  (the task's ``gauss_newton_fn``). A task's model state (BatchNorm's
  running statistics) is threaded through every step, K-FAC's included.
  ``stats_every``: a K-FAC optimizer with ``factor_update_steps=k`` reads
  statistics only on every k-th step; the others run ``no_stats_step``'s
  program (docs: *Statistics only on factor steps*). The clock
  (``CLOCKS[clock]``, which also times the compilations) and the
  evaluations are ``timed_training``'s.
  """
  params, model_state = task.initial(seed)
  opt_state = optimizer.tx.init(params)
  example = tuple(a[: task.batch_size] for a in task.data)
  examples = curvature_examples or task.batch_size
  split_loss = None
  if task.split_loss is not None:
    split_loss = lambda *b: task.split_loss(
      *training.curvature_batch(b, examples)
    )
  if curvature == "gauss-newton":
    curvature_fn = lambda p, key, *b: task.gauss_newton_fn(
      p, key, *training.curvature_batch(b, examples)
    )
  elif curvature == "empirical":
    curvature_fn = lambda p, key, *b: task.loss_fn(
      p, *training.curvature_batch(b, examples)
    )
  else:
    curvature_fn = None
  # The gradient's forward pass over the curvature examples is shared with
  # the curvature pass (the whole-batch capture of the other settings is
  # not: its layers would be captured twice).
  loss_fn = (
    training.curvature_shared_loss(task.loss_fn, examples)
    if optimizer.separate_curvature
    else task.loss_fn
  )
  start = CLOCKS[clock]()
  compiled = (
    training.make_train_step(
      loss_fn,
      optimizer,
      stateful=task.stateful,
      split_loss=split_loss,
      curvature_fn=curvature_fn,
    )
    .lower(params, opt_state, model_state, jax.random.key(seed), *example)
    .compile()
  )
  plain = compiled
  if stats_every is not None:
    plain = (
      no_stats_step(loss_fn, optimizer.tx, task.stateful)
      .lower(params, opt_state, model_state, jax.random.key(seed), *example)
      .compile()
    )
  compile_seconds = CLOCKS[clock]() - start
  count = [0]

  def step(carry, key, *batch):
    params, opt_state, model_state = carry
    program = (
      compiled if stats_every is None or count[0] % stats_every == 0 else plain
    )
    params, opt_state, model_state, loss = program(
      params, opt_state, model_state, key, *batch
    )
    count[0] += 1
    return (params, opt_state, model_state), loss

  record = timed_training(
    task,
    step,
    (params, opt_state, model_state),
    lambda carry: task.measure(carry[0], carry[2]),
    seed,
    budget,
    eval_every,
    max_steps,
    progress,
    label,
    trace=(
      (lambda carry: adaptive_trace(carry[1]))
      if optimizer.needs_split_loss
      else None
    ),
    clock=clock,
  )
  return dict(
    task=task.name,
    optimizer=optimizer.name,
    description=optimizer.description,
    seed=seed,
    budget=budget,
    compile_seconds=compile_seconds,
    clock=clock,
    **record,
  )


def no_stats_step(
  loss_fn: Callable[..., Any], tx: optax.GradientTransformation, stateful: bool
) -> Callable[..., Any]:
  """A K-FAC step without statistics: ``jax.value_and_grad`` and
  ``tx.update(..., kfac_stats=kfac_jax.NO_STATS)``, with
  ``make_train_step``'s signature and donation."""

  def loss_and_state(params, model_state, *batch):
    if stateful:
      return loss_fn(params, model_state, *batch)
    return loss_fn(params, *batch), model_state

  def step(params, opt_state, model_state, key, *batch):
    del key
    (loss, model_state), grads = jax.value_and_grad(
      loss_and_state, has_aux=True
    )(params, model_state, *batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, kfac_stats=kfac_jax.NO_STATS
    )
    return optax.apply_updates(params, updates), opt_state, model_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2))


def adaptive_trace(opt_state: kfac_jax.ScaleByKFACState) -> dict[str, float]:
  """λ, ``[α, μ]`` and the last ρ after a ``kfac_adaptive`` step."""
  model = opt_state.quadratic_model
  alpha, mu = np.asarray(model.step_sizes).tolist()
  return dict(
    damping=float(model.damping),
    alpha=alpha,
    mu=mu,
    rho=float(model.reduction_ratio),
  )


def timed_training(
  task: tasks.Task,
  step: Callable[..., tuple[Any, Any]],
  carry: Any,
  evaluate: Callable[[Any], float],
  seed: int,
  budget: float,
  eval_every: float,
  max_steps: int | None,
  progress: bool,
  label: str,
  trace: Callable[[Any], dict[str, float]] | None = None,
  clock: str = "wall",
) -> dict[str, Any]:
  """Runs ``step(carry, key, *batch) -> (carry, loss)`` on the task's
  shuffled batches for ``budget`` training seconds, with a fresh PRNG key
  each step; ``carry`` holds what the steps thread (parameters, optimizer
  and model state), ``evaluate(carry)`` gives the metric.

  Each step is timed alone (``jax.block_until_ready``) by ``CLOCKS[clock]``
  (the wall clock or the process's CPU seconds). The metric is
  evaluated at the start, every ``eval_every`` training seconds and at the
  end, with the training clock stopped. A non-finite mini-batch loss ends the
  run (``diverged``), its last metric recorded as NaN. ``trace(carry)``,
  if given, is read after every step, off the clock, and recorded per step
  (``trace``: ``{name: [value per step]}``).
  """
  curve = [(0, 0.0, evaluate(carry))]
  batches = training.epoch_batches(
    len(task.data[0]), task.batch_size, epochs=10**9, seed=seed
  )
  trained, steps, diverged = 0.0, 0, False
  traced: dict[str, list[float]] = {}
  next_eval = eval_every
  bar = tqdm(
    total=round(budget),
    desc=label,
    unit="s",
    disable=not progress,
    dynamic_ncols=True,
    leave=False,
  )
  while trained < budget and (max_steps is None or steps < max_steps):
    idx = next(batches)
    batch = jax.device_put(tuple(a[idx] for a in task.data))
    key = jax.random.fold_in(jax.random.key(seed), steps)
    start = CLOCKS[clock]()
    carry, loss = jax.block_until_ready(step(carry, key, *batch))
    elapsed = CLOCKS[clock]() - start
    trained += elapsed
    steps += 1
    bar.update(min(elapsed, budget - bar.n))
    if trace is not None:
      for name, value in trace(carry).items():
        traced.setdefault(name, []).append(value)
    if not math.isfinite(float(loss)):
      diverged = True
      curve.append((steps, trained, float("nan")))
      break
    done = trained >= budget or steps == max_steps
    if trained >= next_eval or done:
      curve.append((steps, trained, evaluate(carry)))
      bar.set_postfix(metric=f"{curve[-1][2]:.4g}", refresh=False)
      while next_eval <= trained:
        next_eval += eval_every
  bar.close()
  record = dict(
    steps=steps,
    train_seconds=trained,
    ms_per_step=1000 * trained / max(steps, 1),
    diverged=diverged,
    final=curve[-1][2],
    curve=[dict(step=s, seconds=t, metric=m) for s, t, m in curve],
  )
  if trace is not None:
    record.update(trace=traced)
  return record
