"""Shared pieces of the examples: the optimizer comparison loop, table, plot.

``compare`` trains several optimizers side by side from the same initial
parameters on the same sequence of mini-batches: at every step each optimizer
takes one step on the same batch. Each step is timed on its own (with
``block_until_ready``), after an ahead-of-time compilation that is timed
separately, so the per-optimizer wall times are comparable even though the runs
are interleaved.

K-FAC steps use ``kfac_jax.value_grad_and_stats`` and pass ``kfac_stats`` to
``tx.update``; first-order steps use ``jax.value_and_grad``. A model with
state besides its params (BatchNorm statistics) passes ``model_state``: its
loss then returns ``(loss, new_model_state)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import kfac_jax

Batch = tuple[np.ndarray, ...]
LossFn = Callable[..., jax.Array]


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
    if ((self.needs_split_loss or self.separate_curvature) and
        not self.uses_kfac):
      raise ValueError(f"Optimizer {self.name!r}: needs_split_loss and "
                       "separate_curvature are K-FAC's; set uses_kfac=True.")


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
    loss_fn: LossFn, optimizer: Optimizer, stateful: bool = False,
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
    raise ValueError(f"{optimizer.name} needs a split_loss (and a stateless "
                     "loss_fn).")
  if optimizer.separate_curvature and curvature_fn is None:
    raise ValueError(f"{optimizer.name} takes its stats from a curvature_fn: "
                     "pass one.")

  def loss_and_state(params, model_state, *batch):
    if stateful:
      return loss_fn(params, model_state, *batch)
    return loss_fn(params, *batch), model_state

  def step(params, opt_state, model_state, key, *batch):
    if optimizer.uses_kfac and not optimizer.separate_curvature:
      (loss, model_state), grads, stats = kfac_jax.value_grad_and_stats(
          loss_and_state, has_aux=True)(params, model_state, *batch)
    else:
      (loss, model_state), grads = jax.value_and_grad(
          loss_and_state, has_aux=True)(params, model_state, *batch)
    if optimizer.separate_curvature:
      _, _, stats = kfac_jax.value_grad_and_stats(curvature_fn)(params, key,
                                                                *batch)
    if optimizer.uses_kfac:
      extra = (dict(split_loss=split_loss(*batch))
               if optimizer.needs_split_loss else {})
      updates, opt_state = tx.update(grads, opt_state, params,
                                     kfac_stats=stats, **extra)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, model_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2))


def epoch_batches(num_examples: int, batch_size: int, epochs: int,
                  seed: int) -> Iterator[np.ndarray]:
  """Index arrays of shuffled mini-batches, epoch after epoch.

  The last incomplete batch of each epoch is dropped, so every step has the
  same shape (one compilation).
  """
  if batch_size > num_examples:
    raise ValueError(
        f"batch size {batch_size} exceeds the {num_examples} examples.")
  rng = np.random.default_rng(seed)
  for _ in range(epochs):
    order = rng.permutation(num_examples)
    for start in range(0, num_examples - batch_size + 1, batch_size):
      yield order[start:start + batch_size]


def num_steps(num_examples: int, batch_size: int, epochs: int,
              max_steps: int | None) -> int:
  steps = epochs * (num_examples // batch_size)
  return steps if max_steps is None else min(steps, max_steps)


def compare(optimizers: Sequence[Optimizer],
            loss_fn: LossFn,
            init_params: Any,
            data: Sequence[np.ndarray],
            batch_size: int,
            epochs: int,
            max_steps: int | None = None,
            seed: int = 0,
            desc: str = "training",
            model_state: Any = None,
            split_loss: Callable[..., kfac_jax.SplitLoss] | None = None,
            curvature_fn: Callable[..., jax.Array] | None = None
            ) -> dict[str, RunResult]:
  """Trains every optimizer on the same batches, one step each in turn.

  Args:
    optimizers: the contestants.
    loss_fn: ``loss_fn(params, *batch) -> scalar``; the model must be called
      inside it (K-FAC captures its Dense layers there).
    init_params: the common starting point.
    data: arrays with a leading example axis (e.g. ``(x, y)``); a batch is
      ``tuple(a[idx] for a in data)``.
    batch_size: examples per step.
    epochs: passes over the data.
    max_steps: optional cap on the number of steps (smoke runs).
    seed: shuffling seed.
    desc: progress-bar label.
    model_state: initial non-param model state; when given, ``loss_fn(params,
      model_state, *batch)`` returns ``(loss, new_model_state)``.
    split_loss: ``split_loss(*batch) -> kfac_jax.SplitLoss``, the loss split
      into network and outputs' loss (for ``kfac-adaptive``).
    curvature_fn: ``curvature_fn(params, key, *batch)``, a
      ``kfac_jax.sampled_curvature`` surrogate (for ``kfac-adaptive``).

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
    params, state = (jax.tree.map(jnp.copy, t)
                     for t in (init_params, model_state))
    opt_state = opt.tx.init(params)
    start = time.perf_counter()
    steps[opt.name] = make_train_step(
        loss_fn, opt, stateful=model_state is not None,
        split_loss=split_loss, curvature_fn=curvature_fn).lower(
            params, opt_state, state, jax.random.key(seed),
            *example).compile()
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
        *state, loss = jax.block_until_ready(steps[name](*states[name], key,
                                                         *batch))
        elapsed[name] += time.perf_counter() - start
        seconds[name][i] = elapsed[name]
        states[name] = tuple(state)
        losses[name].append(loss)
      if (i + 1) % refresh == 0 or i + 1 == total:
        bar.set_postfix({n: f"{float(losses[n][-1]):.4g}" for n in names},
                        refresh=False)
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
        model_state=states[name][2])
  return results


def batched_means(fn: Callable[..., Sequence[jax.Array]],
                  arrays: Sequence[np.ndarray],
                  chunk: int = 5000) -> tuple[float, ...]:
  """Means over a data set of per-example quantities, computed in chunks.

  ``fn(*chunk_arrays)`` returns a tuple of per-example arrays ``[n]``; the
  result holds the mean of each over all the examples.
  """
  n = len(arrays[0])
  totals = None
  for start in range(0, n, chunk):
    parts = fn(*(a[start:start + chunk] for a in arrays))
    sums = [float(np.sum(np.asarray(p, np.float64))) for p in parts]
    totals = sums if totals is None else [t + s for t, s in zip(totals, sums)]
  return tuple(t / n for t in totals)


# --------------------------------------------------------------------------
# Reporting.


@dataclasses.dataclass(frozen=True)
class Column:
  header: str
  value: Callable[[RunResult], Any]
  fmt: str = "{}"


def standard_columns(metric_columns: Sequence[Column]) -> list[Column]:
  """Optimizer name, the caller's metrics, then steps and timings."""
  return [
      Column("optimizer", lambda r: r.name),
      *metric_columns,
      Column("steps", lambda r: r.steps, "{:d}"),
      Column("train time (s)", lambda r: r.train_seconds, "{:.1f}"),
      Column("time/step (ms)", lambda r: r.ms_per_step, "{:.1f}"),
      Column("compile (s)", lambda r: r.compile_seconds, "{:.1f}"),
  ]


def classification_columns(
    results: Mapping[str, RunResult],
    evaluate: Callable[[RunResult, np.ndarray, np.ndarray], Sequence[jax.Array]],
    train_eval: Sequence[np.ndarray],
    test_eval: Sequence[np.ndarray]) -> list[Column]:
  """Evaluates each classifier; returns the table's columns.

  ``evaluate(result, x, y) -> (per-example loss, per-example correct)``. Fills
  ``metrics`` ``train_loss`` and ``train_acc`` over ``train_eval`` and
  ``test_acc`` over ``test_eval``.
  """
  for result in results.values():
    fn = lambda x, y, r=result: evaluate(r, x, y)
    (result.metrics["train_loss"],
     result.metrics["train_acc"]) = batched_means(fn, train_eval)
    result.metrics["test_acc"] = batched_means(fn, test_eval)[1]
  return standard_columns([
      Column("final train loss", lambda r: r.metrics["train_loss"], "{:.4f}"),
      Column("train acc (%)", lambda r: 100 * r.metrics["train_acc"],
             "{:.2f}"),
      Column("test acc (%)", lambda r: 100 * r.metrics["test_acc"], "{:.2f}"),
  ])


def format_table(results: Mapping[str, RunResult],
                 columns: Sequence[Column]) -> str:
  """A Markdown table, one row per optimizer."""
  rows = [[c.header for c in columns]]
  for result in results.values():
    row = []
    for c in columns:
      value = c.value(result)
      row.append(c.fmt.format(value) if value is not None else "-")
    rows.append(row)
  widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]

  def line(cells):
    padded = [cells[0].ljust(widths[0])] + [
        cell.rjust(w) for cell, w in zip(cells[1:], widths[1:])]
    return "| " + " | ".join(padded) + " |"

  rule = "|" + "|".join(
      "-" * (w + 1) + ":" if i else ":" + "-" * (w + 1)
      for i, w in enumerate(widths)) + "|"
  return "\n".join([line(rows[0]), rule] + [line(r) for r in rows[1:]])


def smooth(values: np.ndarray, window: int) -> np.ndarray:
  """Trailing moving average (shorter windows at the start)."""
  if window <= 1 or len(values) < 2:
    return values
  cumulative = np.cumsum(np.insert(values, 0, 0.0))
  idx = np.arange(1, len(values) + 1)
  lo = np.maximum(idx - window, 0)
  return (cumulative[idx] - cumulative[lo]) / (idx - lo)


def plot_curves(results: Mapping[str, RunResult], path: pathlib.Path,
                title: str, ylabel: str, log_y: bool = False) -> pathlib.Path:
  """Loss vs step and loss vs training seconds, one line per optimizer."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  steps = max(r.steps for r in results.values())
  window = max(1, steps // 50)
  fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
  for result in results.values():
    curve = smooth(result.losses, window)
    x = np.arange(1, result.steps + 1)
    (line,) = ax_step.plot(x, curve, label=result.name, lw=1.6)
    ax_time.plot(result.seconds, curve, label=result.name, lw=1.6,
                 color=line.get_color())
  suffix = f" (moving average of {window} steps)" if window > 1 else ""
  ax_step.set_xlabel("step")
  ax_time.set_xlabel("training time (s, compilation excluded)")
  for ax in (ax_step, ax_time):
    ax.set_ylabel(ylabel + suffix)
    if log_y:
      ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def report(results: Mapping[str, RunResult], optimizers: Sequence[Optimizer],
           columns: Sequence[Column], out_dir: pathlib.Path, stem: str,
           header: str, plot_title: str, ylabel: str,
           log_y: bool = False) -> str:
  """Prints the table and hyper-parameters; writes ``<stem>.md`` and ``.png``."""
  table = format_table(results, columns)
  details = "\n".join(f"- {o.name}: {o.description}" for o in optimizers
                      if o.description)
  text = f"{header}\n\n{table}\n\n{details}\n"
  print("\n" + text, flush=True)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.md").write_text(text)
  png = plot_curves(results, out_dir / f"{stem}.png", plot_title, ylabel,
                    log_y=log_y)
  print(f"Wrote {png} and {out_dir / f'{stem}.md'}", flush=True)
  return text


# --------------------------------------------------------------------------
# Command line.


def base_parser(description: str, *, epochs: int, batch_size: int,
                kfac_lr: float, sgd_lr: float, adam_lr: float,
                damping: float, kl_clip: float, inv_update_steps: int,
                factor_decay: float,
                compute_method: str,
                optimizers: str = "kfac,sgd,adam",
                factor_update_steps: int = 1,
                weight_decay: float = 1e-4,
                gradient_from_stats: bool = True) -> argparse.ArgumentParser:
  """The flags both examples share, with each example's defaults."""
  parser = argparse.ArgumentParser(
      description=description,
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--epochs", type=int, default=epochs,
                      help="passes over the training set")
  parser.add_argument("--batch-size", type=int, default=batch_size,
                      help="examples per step (all optimizers)")
  parser.add_argument("--steps", type=int, default=None,
                      help="cap on the number of steps, for smoke runs "
                      "(None: epochs × steps per epoch)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initialization and the shuffling")
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path("results"),
                      help="folder for the loss-curve PNG and the table")
  parser.add_argument("--eval-size", type=int, default=None,
                      help="evaluate on the first N examples of each "
                      "evaluated split only, for quick runs (None: all)")
  parser.add_argument("--optimizers", default=optimizers,
                      help="comma-separated subset of kfac,kfac-adaptive,sgd,"
                      "adam,adamw (kfac-adaptive where the example splits "
                      "its loss and samples its curvature)")
  group = parser.add_argument_group("K-FAC (scale_by_kfac + SGD momentum 0.9)")
  group.add_argument("--kfac-lr", type=float, default=kfac_lr,
                     help="learning rate of the SGD after K-FAC")
  group.add_argument("--compute-method", choices=("eigen", "inverse"),
                     default=compute_method,
                     help="eigen: (A⊗G + λI)⁻¹ via eigenbases; inverse: "
                     "(A + λI)⁻¹ ∇ (G + λI)⁻¹")
  group.add_argument("--damping", type=float, default=damping,
                     help="K-FAC damping λ")
  group.add_argument("--kl-clip", type=float, default=kl_clip,
                     help="KL-clipping bound (<= 0 turns it off)")
  group.add_argument("--inv-update-steps", type=int, default=inv_update_steps,
                     help="steps between recomputing the eigendecompositions "
                     "or inverses")
  group.add_argument("--factor-update-steps", type=int,
                     default=factor_update_steps,
                     help="steps between updates of the Kronecker factors")
  group.add_argument("--factor-decay", type=float, default=factor_decay,
                     help="running-average decay of the Kronecker factors")
  group.add_argument("--gradient-from-stats", default=gradient_from_stats,
                     action=argparse.BooleanOptionalAction,
                     help="precondition dense layers' gradients in the "
                     "factored form aᵀg of the captured stats where that is "
                     "cheaper (scale_by_kfac(gradient_from_stats=True); the "
                     "examples' losses hold no regularizer, and weight decay "
                     "comes after K-FAC)")
  group = parser.add_argument_group(
      "K-FAC adaptive (scale_by_kfac(adaptive=...): no learning rate; "
      "inverse method, factors every step, inverses every 5 steps)")
  group.add_argument("--initial-damping", type=float, default=150.0,
                     help="initial λ, then adapted (DeepMind kfac-jax's "
                     "autoencoder value)")
  group = parser.add_argument_group("baselines")
  group.add_argument("--sgd-lr", type=float, default=sgd_lr,
                     help="learning rate of SGD with momentum 0.9")
  group.add_argument("--adam-lr", type=float, default=adam_lr,
                     help="learning rate of Adam and AdamW")
  group.add_argument("--weight-decay", type=float, default=weight_decay,
                     help="decoupled weight decay of AdamW")
  return parser


def build_optimizers(args: argparse.Namespace,
                     layers: Mapping[str, kfac_jax.LayerInfo] | None = None,
                     adaptive: bool = False) -> list[Optimizer]:
  """K-FAC, SGD with momentum, Adam and AdamW from the shared flags.

  ``layers``: the layer table (``kfac_jax.trace_layers``) for models with
  scanned layers, grouped convolutions or ``DenseGeneral``. ``adaptive``:
  whether the example offers ``kfac-adaptive`` (it splits its loss and
  samples its curvature).
  """
  kl_clip = args.kl_clip if args.kl_clip > 0 else None
  available = {
      "kfac": lambda: Optimizer(
          "K-FAC",
          kfac_jax.kfac(
              learning_rate=args.kfac_lr,
              momentum=0.9,
              damping=args.damping,
              kl_clip=kl_clip,
              factor_decay=args.factor_decay,
              factor_update_steps=args.factor_update_steps,
              inv_update_steps=args.inv_update_steps,
              compute_method=args.compute_method,
              gradient_from_stats=args.gradient_from_stats,
              layers=layers),
          uses_kfac=True,
          description=(
              f"kfac_jax.kfac: lr {args.kfac_lr:g}, momentum 0.9, damping "
              f"{args.damping:g}, kl_clip {kl_clip}, factor_decay "
              f"{args.factor_decay:g}, factor_update_steps "
              f"{args.factor_update_steps}, "
              f"inv_update_steps {args.inv_update_steps}, "
              f"compute_method {args.compute_method!r}, "
              f"gradient_from_stats {args.gradient_from_stats}")),
      "kfac-adaptive": lambda: Optimizer(
          "K-FAC adaptive",
          kfac_jax.scale_by_kfac(
              damping=args.initial_damping, kl_clip=None,
              factor_decay=args.factor_decay, compute_method="inverse",
              inv_update_steps=5, layers=layers,
              adaptive=kfac_jax.AdaptiveConfig()),
          uses_kfac=True, needs_split_loss=True, separate_curvature=True,
          description=(
              "kfac_jax.scale_by_kfac(adaptive=AdaptiveConfig()): initial "
              f"damping {args.initial_damping:g}, factor_decay "
              f"{args.factor_decay:g}, inverse method, inv_update_steps 5, "
              "Gauss-Newton factors (kfac_jax.sampled_curvature)")),
      "sgd": lambda: Optimizer(
          "SGD",
          optax.sgd(args.sgd_lr, momentum=0.9),
          description=f"optax.sgd: lr {args.sgd_lr:g}, momentum 0.9"),
      "adam": lambda: Optimizer(
          "Adam",
          optax.adam(args.adam_lr),
          description=f"optax.adam: lr {args.adam_lr:g}, betas (0.9, 0.999)"),
      "adamw": lambda: Optimizer(
          "AdamW",
          optax.adamw(args.adam_lr, weight_decay=args.weight_decay),
          description=(f"optax.adamw: lr {args.adam_lr:g}, betas (0.9, 0.999), "
                       f"weight_decay {args.weight_decay:g}")),
  }
  if not adaptive:
    del available["kfac-adaptive"]
  chosen = [s.strip().lower() for s in args.optimizers.split(",") if s.strip()]
  if "kfac-adaptive" in chosen and not adaptive:
    raise SystemExit(
        "--optimizers kfac-adaptive: this example does not split its loss "
        "into network and loss (kfac_jax.SplitLoss) nor sample Gauss-Newton "
        "curvature; examples/mnist_autoencoder.py does.")
  unknown = sorted(set(chosen) - set(available))
  if unknown or not chosen:
    raise SystemExit(f"--optimizers: unknown {unknown}; use a comma-separated "
                     f"subset of {','.join(available)}.")
  return [available[name]() for name in dict.fromkeys(chosen)]


def check_args(args: argparse.Namespace) -> None:
  for flag in ("epochs", "batch_size", "inv_update_steps",
               "factor_update_steps"):
    if getattr(args, flag) < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  for flag in ("steps", "eval_size"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  for flag in ("kfac_lr", "sgd_lr", "adam_lr", "damping"):
    if not getattr(args, flag) > 0:
      raise SystemExit(f"--{flag.replace('_', '-')} must be > 0.")
  if not 0 <= args.factor_decay <= 1:
    raise SystemExit("--factor-decay must be in [0, 1].")


def head(arrays: Sequence[np.ndarray], n: int | None) -> tuple[np.ndarray, ...]:
  """The first ``n`` examples of each array (all when ``n`` is None)."""
  return tuple(a if n is None else a[:n] for a in arrays)


def describe_setup() -> str:
  devices = jax.devices()
  return (f"jax {jax.__version__} on {len(devices)} {devices[0].platform} "
          f"device(s), {os.cpu_count()} CPU cores")
