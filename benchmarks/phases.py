#!/usr/bin/env python3
"""Where K-FAC's step spends its time on the race workloads, beside AdamW's.

For each task of the race (``examples/tasks.py``) at its race batch, whole
jitted programs are timed, interleaved in rounds so that machine noise
falls on all alike, each on the same batch with its state donated and
carried from call to call (as in training):

  adamw          optax.adamw's step (the baseline of every ratio)
  grad           jax.value_and_grad of the loss
  capture        kfac_jax.value_grad_and_stats of the loss
  stats          a K-FAC step (``race_optimizers.KFAC_SETTINGS``) that
                 updates the factors and preconditions, no decomposition
  no_stats       the same step fed ``kfac_stats=kfac_jax.NO_STATS`` after
                 a plain ``value_and_grad``: preconditioning only
  decompose      a decomposition step without statistics
  full           a decomposition step with statistics (factors too)
  eigen_*        no_stats and decompose with ``compute_method="eigen"``
  fraction_stats stats with ``factor_batch_size=0.25``
  reduce_stats   stats with ``weight_sharing="reduce"``
  both_stats     stats with both
  levers_*       no_stats and full with all of the race's ``KFAC_LEVERS``
                 (both, and ``max_factor_dim``)

The step's count is set before each call (11: a factor step that does not
decompose; 10: one that does, ``inv_update_steps=10``), the factors having
been warmed by three steps on real data first. The phases are differences
of whole programs (XLA fuses across phases inside one, so they are
estimates): forward/backward = grad; statistics = capture − grad; factor
update = stats − no_stats − statistics; preconditioning (with SGD's
momentum update) = no_stats − grad, beside AdamW's update, adamw − grad;
decomposition = decompose − no_stats. The largest factor's ``eigh`` and
Cholesky inverse (``potrf`` + ``potri``, as the inverse method) are timed
alone on the warmed factor. Each sample is timed twice, in wall-clock and
in the process's CPU seconds (``time.process_time``, all its threads);
the table shows the median CPU time by default (``--statistic``): the
work, summed over the process's threads, which other processes on a
shared machine do not lengthen as they lengthen the wall clock (on one
otherwise idle core the two agree). Amortized over a period of 10 steps:
``(9·stats + full) / 10`` with statistics on every step (the race's
setting, ``factor_update_steps=1``), ``(9·no_stats + full) / 10`` with
statistics only on the factor steps (``factor_update_steps=10``), and the
same with the cheaper statistics of each lever (its full step estimated as
``full − (stats − lever_stats)``), and ``(9·levers_no_stats +
levers_full) / 10``, the race's ``kfac_levers``.

  python -m benchmarks.phases --tasks mnist_bn resnet20   # minutes a task here
  python -m benchmarks.phases --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import optax
from tqdm.auto import tqdm

import kfac_jax
from benchmarks import bench_common, phases_report
from benchmarks.race import RACE_TASKS
from benchmarks.race_optimizers import KFAC_LEVERS, KFAC_SETTINGS
from examples import tasks

REPO = pathlib.Path(__file__).resolve().parent.parent
PERIOD = 10  # inv_update_steps of KFAC_SETTINGS, and the lever's factor period
PLAIN_COUNT, DECOMPOSITION_COUNT = PERIOD + 1, PERIOD
FRACTION = 0.25
# K-FAC's configurations: KFAC_SETTINGS with these changes.
CONFIGS = {
  "inverse": {},
  "eigen": dict(compute_method="eigen"),
  "fraction": dict(factor_batch_size=FRACTION),
  "reduce": dict(weight_sharing="reduce"),
  "both": dict(factor_batch_size=FRACTION, weight_sharing="reduce"),
  # factor_update_steps is the programs' (with or without statistics).
  "levers": {
    k: v for k, v in KFAC_LEVERS.items() if k != "factor_update_steps"
  },
}
# (program, configuration, with statistics, count).
KFAC_PROGRAMS = (
  ("stats", "inverse", True, PLAIN_COUNT),
  ("no_stats", "inverse", False, PLAIN_COUNT),
  ("decompose", "inverse", False, DECOMPOSITION_COUNT),
  ("full", "inverse", True, DECOMPOSITION_COUNT),
  ("eigen_no_stats", "eigen", False, PLAIN_COUNT),
  ("eigen_decompose", "eigen", False, DECOMPOSITION_COUNT),
  ("fraction_stats", "fraction", True, PLAIN_COUNT),
  ("reduce_stats", "reduce", True, PLAIN_COUNT),
  ("both_stats", "both", True, PLAIN_COUNT),
  ("levers_no_stats", "levers", False, PLAIN_COUNT),
  ("levers_full", "levers", True, DECOMPOSITION_COUNT),
)


@dataclasses.dataclass
class Program:
  """One timed program: ``run(carry) -> carry`` (blocked on by the caller)."""

  name: str
  run: Callable[[Any], Any]
  carry: Any
  times: list[float] = dataclasses.field(default_factory=list)
  cpu_times: list[float] = dataclasses.field(default_factory=list)


def stateful_loss(task: tasks.Task) -> Callable[..., tuple[jax.Array, Any]]:
  """``loss(params, model_state, *batch) -> (loss, model_state)`` for
  either kind of task (a stateless one's state passes through)."""
  if task.stateful:
    return task.loss_fn
  return lambda params, state, *batch: (task.loss_fn(params, *batch), state)


def train_step(
  loss: Callable[..., Any],
  tx: optax.GradientTransformation,
  kfac: bool,
  stats: bool,
) -> Callable[..., Any]:
  """``step((params, opt_state, model_state), *batch) -> carry``, jitted,
  the carry donated; K-FAC's with its statistics or with ``NO_STATS``."""

  def step(carry, *batch):
    params, opt_state, model_state = carry
    if stats:
      (_, model_state), grads, kfac_stats = kfac_jax.value_grad_and_stats(
        loss, has_aux=True
      )(params, model_state, *batch)
    else:
      (_, model_state), grads = jax.value_and_grad(loss, has_aux=True)(
        params, model_state, *batch
      )
      kfac_stats = kfac_jax.NO_STATS
    extra = dict(kfac_stats=kfac_stats) if kfac else {}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state, model_state

  return jax.jit(step, donate_argnums=0)


def with_count(opt_state: Any, count: int) -> Any:
  """The chain's state with ``scale_by_kfac``'s step count set."""
  return tuple(
    s._replace(count=jnp.asarray(count, jnp.int32))
    if isinstance(s, kfac_jax.ScaleByKFACState)
    else s
    for s in opt_state
  )


def kfac_state(opt_state: Any) -> kfac_jax.ScaleByKFACState:
  return next(s for s in opt_state if isinstance(s, kfac_jax.ScaleByKFACState))


def copies(tree: Any) -> Any:
  """Fresh buffers: every program donates its own."""
  return jax.tree.map(jnp.copy, tree)


def kfac_tx(
  task: tasks.Task, changes: dict[str, Any]
) -> optax.GradientTransformation:
  return kfac_jax.kfac(
    1e-3,
    layers=task.layers,
    **dict(KFAC_SETTINGS, factor_update_steps=1, **changes),
  )


def warm_factors(
  step: Callable[..., Any],
  tx: optax.GradientTransformation,
  params: Any,
  model_state: Any,
  batches: Sequence[tuple[Any, ...]],
) -> Any:
  """Running factors after K-FAC steps (``step``, with statistics) on
  real batches."""
  carry = (copies(params), tx.init(params), copies(model_state))
  for batch in batches:
    carry = step(carry, *batch)
  return kfac_state(carry[1]).factors


def build_programs(
  task: tasks.Task, batches: Sequence[tuple[Any, ...]]
) -> tuple[list[Program], Any]:
  """The programs of the module docstring, each with its own carry, timed
  on ``batches[0]`` with the factors warmed on the others; and those
  factors."""
  batch = batches[0]
  loss = stateful_loss(task)
  params, model_state = task.initial(0)
  steps = {
    ("inverse", True): train_step(
      loss, kfac_tx(task, {}), kfac=True, stats=True
    )
  }
  factors = warm_factors(
    steps["inverse", True], kfac_tx(task, {}), params, model_state, batches[1:]
  )
  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  capture = jax.jit(kfac_jax.value_grad_and_stats(loss, has_aux=True))
  adamw = optax.adamw(1e-3)
  adamw_step = train_step(loss, adamw, kfac=False, stats=False)
  programs = [
    Program(
      "adamw",
      lambda c: adamw_step(c, *batch),
      (copies(params), adamw.init(params), copies(model_state)),
    ),
    # Their outputs are the carry, which the timing blocks on.
    Program("grad", lambda _: grad(params, model_state, *batch), None),
    Program("capture", lambda _: capture(params, model_state, *batch), None),
  ]
  for name, config, stats, count in KFAC_PROGRAMS:
    tx = kfac_tx(task, CONFIGS[config])
    step = steps.setdefault(
      (config, stats), train_step(loss, tx, kfac=True, stats=stats)
    )
    opt_state = tx.init(params)
    # The warmed factors of the layers this configuration keeps
    # (max_factor_dim leaves some out).
    opt_state = tuple(
      s._replace(factors=copies({k: factors[k] for k in s.factors}))
      if isinstance(s, kfac_jax.ScaleByKFACState)
      else s
      for s in opt_state
    )

    def run(carry, step=step, count=count):
      p, o, m = carry
      return step((p, with_count(o, count), m), *batch)

    programs.append(
      Program(name, run, (copies(params), opt_state, copies(model_state)))
    )
  return programs, factors


def time_programs(
  programs: Sequence[Program],
  rounds: int,
  calls: int,
  progress: bool,
  label: str,
) -> dict[str, float]:
  """First calls (compilation) apart, then ``rounds`` rounds of ``calls``
  timed calls of each program in turn; the first-call seconds."""
  first = {}
  bar = tqdm(
    total=len(programs) * (1 + rounds * calls),
    desc=label,
    disable=not progress,
    dynamic_ncols=True,
    leave=False,
  )
  for program in programs:
    start = time.perf_counter()
    program.carry = jax.block_until_ready(program.run(program.carry))
    first[program.name] = time.perf_counter() - start
    bar.update(1)
  for _ in range(rounds):
    for program in programs:
      for _ in range(calls):
        start, cpu = time.perf_counter(), time.process_time()
        program.carry = jax.block_until_ready(program.run(program.carry))
        program.cpu_times.append(time.process_time() - cpu)
        program.times.append(time.perf_counter() - start)
        bar.update(1)
  bar.close()
  return first


def largest_factor(factors: Any) -> tuple[str, jax.Array]:
  """The largest running factor (the first block of a stacked layer)."""
  best = None
  for name, layer in factors.items():
    for which, factor in zip(("A", "G"), layer):
      matrix = factor.reshape(-1, *factor.shape[-2:])[0]
      if best is None or matrix.shape[0] > best[1].shape[0]:
        best = (f"{name} {which}", matrix)
  return best


def time_largest_factor(factors: Any, repeats: int) -> dict[str, Any]:
  """``eigh`` and the Cholesky inverse of the largest factor, damped by
  KFAC_SETTINGS' λ relative to its mean eigenvalue: the median CPU time
  of ``repeats`` calls, in ms."""
  name, matrix = largest_factor(factors)
  size = matrix.shape[0]
  damped = matrix + KFAC_SETTINGS["damping"] * jnp.trace(matrix) / size * (
    jnp.eye(size)
  )
  eigh = jax.jit(jnp.linalg.eigh)
  inverse = jax.jit(lambda m: jsl.cho_solve(jsl.cho_factor(m), jnp.eye(size)))
  out = dict(factor=name, size=size)
  for key, fn in (("eigh_ms", eigh), ("cholesky_inverse_ms", inverse)):
    jax.block_until_ready(fn(damped))
    samples = []
    for _ in range(repeats):
      start = time.process_time()
      jax.block_until_ready(fn(damped))
      samples.append(time.process_time() - start)
    out[key] = 1e3 * statistics.median(samples)
  return out


def measure_task(
  name: str, batch_size: int | None, rounds: int, calls: int, progress: bool
) -> dict[str, Any]:
  """Every program's median and least milliseconds on one task, and the
  largest factor's decompositions."""
  builder, race_batch = tasks.TASK_BUILDERS[name]
  task = builder(64, batch_size or race_batch)
  batches = [
    jax.device_put(
      tuple(
        a[i * task.batch_size : (i + 1) * task.batch_size] for a in task.data
      )
    )
    for i in range(4)
  ]
  programs, factors = build_programs(task, batches)
  load = bench_common.load_average()
  first = time_programs(programs, rounds, calls, progress, name)
  return dict(
    task=name,
    description=task.description,
    batch_size=task.batch_size,
    load_average_before=load,
    load_average_after=bench_common.load_average(),
    median_ms={p.name: 1e3 * statistics.median(p.times) for p in programs},
    min_ms={p.name: 1e3 * min(p.times) for p in programs},
    cpu_ms={p.name: 1e3 * statistics.median(p.cpu_times) for p in programs},
    samples_ms={p.name: [1e3 * t for t in p.times] for p in programs},
    cpu_samples_ms={p.name: [1e3 * t for t in p.cpu_times] for p in programs},
    first_call_s=first,
    largest_factor=time_largest_factor(factors, max(3, calls)),
  )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--tasks",
    nargs="+",
    default=list(RACE_TASKS),
    choices=list(tasks.TASK_BUILDERS),
  )
  parser.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help="every task's batch (default: each one's race batch)",
  )
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument(
    "--calls", type=int, default=1, help="timed calls of each program per round"
  )
  parser.add_argument(
    "--statistic",
    choices=("cpu", "min", "median"),
    default="cpu",
    help="the table's statistic of each program's "
    "samples (the JSON has all three and every sample): "
    "the median of the process's CPU seconds (the "
    "work, which other processes on a shared machine do "
    "not lengthen), or the least or median wall-clock "
    "time",
  )
  parser.add_argument("--out", type=pathlib.Path, default=REPO / "results")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument(
    "--smoke",
    action="store_true",
    help="CI check: the Shakespeare transformer at batch "
    "8, one round of one call",
  )
  args = parser.parse_args(argv)
  if args.smoke:
    args.tasks, args.batch_size, args.rounds, args.calls = (
      ["shakespeare"],
      8,
      1,
      1,
    )
  for flag in ("batch_size", "rounds", "calls"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  stem = args.out / f"phases_{datetime.datetime.now():%Y%m%d-%H%M%S}"
  result = dict(
    command=" ".join(["python -m benchmarks.phases", *sys.argv[1:]]),
    environment=bench_common.environment(),
    kfac_settings=KFAC_SETTINGS,
    configs=CONFIGS,
    period=PERIOD,
    tasks=[],
  )
  for name in args.tasks:
    result["tasks"].append(
      measure_task(
        name, args.batch_size, args.rounds, args.calls, not args.no_progress
      )
    )
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
  table = phases_report.markdown(result, args.statistic)
  stem.with_suffix(".md").write_text(table + "\n")
  print(table)
  print(f"Wrote {stem}.json and {stem}.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
