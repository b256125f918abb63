"""Pieces shared by ``step_time.py`` and ``dm_kfac_step_time.py``.

This module must not import ``kfac_jax``: ``dm_kfac_step_time.py`` runs in a
separate virtual environment where ``kfac_jax`` is DeepMind's package. (The
autoencoder they time is ``examples.models.Autoencoder``.)

* ``random_images``: the timed batch.
* ``Contestant`` and ``run_interleaved``: the round-robin timing loop.
* ``summarize``: medians and ratios to the SGD baseline.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

SMOKE_AUTOENCODER_WIDTHS = (8,)
SMOKE_PIXELS = 64


def random_images(key: jax.Array, batch: int, features: int) -> jax.Array:
  """Uniform [0, 1) pixels: timing does not depend on the values."""
  return jax.random.uniform(key, (batch, features), jnp.float32)


def tree_nbytes(tree: Any) -> int:
  """Sum of ``nbytes`` over the array leaves of ``tree``."""
  return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def load_average() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def environment() -> dict[str, Any]:
  """Versions and machine facts recorded beside the timings."""
  import flax  # pylint: disable=g-import-not-at-top

  return dict(
    python=platform.python_version(),
    jax=jax.__version__,
    jaxlib=getattr(jax.lib, "__version__", None) or _dist_version("jaxlib"),
    flax=flax.__version__,
    optax=optax.__version__,
    numpy=np.__version__,
    backend=jax.default_backend(),
    devices=[str(d) for d in jax.devices()],
    cpu_count=os.cpu_count(),
    machine=platform.machine(),
    platform=platform.platform(),
    load_average_at_start=load_average(),
    xla_flags=os.environ.get("XLA_FLAGS"),
    openblas_num_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
  )


def _dist_version(name: str) -> str | None:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top

    return metadata.version(name)
  except Exception:  # pylint: disable=broad-except
    return None


@dataclasses.dataclass
class Contestant:
  """One optimizer being timed.

  Attributes:
    name: short name (``sgd``, ``adamw``, ``kfac-eigen``, ...).
    step: ``carry -> carry``; one optimizer step. Its outputs are blocked on
      (``jax.block_until_ready``) by the runner, inside the timed region.
    carry: the state threaded through ``step`` (params, optimizer state, ...).
    inv_update_steps: for K-FAC, steps with ``count % inv_update_steps == 0``
      recompute decompositions; ``None`` for first-order optimizers.
    count: the optimizer's step count before the next call (tracked here, and
      checked against the state by ``read_count`` at the end).
    read_count: ``carry -> int``, the step count stored in the state, if any.
    state_bytes: bytes of the optimizer state.
    lower: ``() -> jax.stages.Lowered`` of the step at ``carry``'s initial
      value (trace + lower, no compile), where the step is a ``jax.jit``;
      ``compile_time.py`` times it and its ``compile()``.
  """

  name: str
  step: Callable[[Any], Any]
  carry: Any
  inv_update_steps: int | None = None
  count: int = 0
  read_count: Callable[[Any], int] | None = None
  state_bytes: int = 0
  lower: Callable[[], Any] | None = None
  first_call_s: float = float("nan")
  first_call_count: int = 0
  times: list[float] = dataclasses.field(default_factory=list)
  counts: list[int] = dataclasses.field(default_factory=list)
  rounds: list[int] = dataclasses.field(default_factory=list)
  notes: dict[str, Any] = dataclasses.field(default_factory=dict)

  def is_decomposition(self, count: int) -> bool:
    return (
      self.inv_update_steps is not None and count % self.inv_update_steps == 0
    )

  def timed_step(self) -> float:
    start = time.perf_counter()
    self.carry = jax.block_until_ready(self.step(self.carry))
    elapsed = time.perf_counter() - start
    self.count += 1
    return elapsed


def run_interleaved(
  contestants: Sequence[Contestant],
  rounds: int,
  steps_per_round: int,
  warmup_steps: int,
  progress: Callable[[str], Any] | None = None,
  bar: Any = None,
) -> list[dict[str, Any]]:
  """Times every contestant's steps, round-robin over contestants.

  1. First call of each contestant (compilation included), timed.
  2. ``warmup_steps`` untimed steps each.
  3. ``rounds`` rounds; in each, every contestant in turn takes
     ``steps_per_round`` steps, each timed on its own (``block_until_ready``
     inside the timed region). Machine noise thus hits all contestants alike.

  Returns:
    Per-round metadata (load average after each round).
  """
  for c in contestants:
    if progress:
      progress(f"compile {c.name}")
    c.first_call_count = c.count
    c.first_call_s = c.timed_step()
    if bar is not None:
      bar.update(1)
  for c in contestants:
    for _ in range(warmup_steps):
      c.timed_step()
      if bar is not None:
        bar.update(1)
  meta = []
  for r in range(rounds):
    for c in contestants:
      if progress:
        progress(f"round {r + 1}/{rounds} {c.name}")
      for _ in range(steps_per_round):
        count = c.count
        c.times.append(c.timed_step())
        c.counts.append(count)
        c.rounds.append(r)
        if bar is not None:
          bar.update(1)
    meta.append(dict(round=r, load_average=load_average()))
  for c in contestants:
    if c.read_count is not None:
      stored = c.read_count(c.carry)
      if stored != c.count:
        raise RuntimeError(
          f"{c.name}: the optimizer state's count is {stored} but "
          f"{c.count} steps were taken; the decomposition-step "
          "classification would be wrong."
        )
  return meta


def run_with_progress(
  contestants: Sequence[Contestant], args: Any, desc: str
) -> tuple[Any, dict[str, Any]]:
  """``run_interleaved`` under a tqdm bar, then ``summarize``.

  ``args`` supplies ``rounds``, ``steps_per_round``, ``warmup_steps`` and
  ``no_progress``. Returns ``(run metadata, summary)``.
  """
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  total = len(contestants) * (
    1 + args.warmup_steps + args.rounds * args.steps_per_round
  )
  bar = tqdm(
    total=total,
    desc=desc,
    unit="step",
    disable=args.no_progress,
    dynamic_ncols=True,
  )
  with bar:
    meta = run_interleaved(
      contestants,
      args.rounds,
      args.steps_per_round,
      args.warmup_steps,
      progress=bar.set_postfix_str,
      bar=bar,
    )
  return meta, summarize(contestants)


def _median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if xs else float("nan")


def summarize(
  contestants: Sequence[Contestant], baseline: str = "sgd"
) -> dict[str, dict[str, Any]]:
  """Medians per contestant and ratios to the baseline's median step.

  For K-FAC contestants with period ``T``:
    plain = median of steps with ``count % T != 0``;
    decomposition = median of steps with ``count % T == 0``;
    amortized = ((T - 1) * plain + decomposition) / T (mean step over a period).
  Compile time = first call − the median steady step of the same kind (the
  first call is at count 0: a decomposition step for K-FAC).
  """
  out: dict[str, dict[str, Any]] = {}
  for c in contestants:
    plain = [t for t, k in zip(c.times, c.counts) if not c.is_decomposition(k)]
    decomp = [t for t, k in zip(c.times, c.counts) if c.is_decomposition(k)]
    plain_s = _median(plain)
    decomp_s = _median(decomp) if c.inv_update_steps else float("nan")
    if c.inv_update_steps:
      period = c.inv_update_steps
      amortized_s = ((period - 1) * plain_s + decomp_s) / period
    else:
      amortized_s = plain_s
    first_kind = decomp_s if c.is_decomposition(c.first_call_count) else plain_s
    out[c.name] = dict(
      plain_s=plain_s,
      decomposition_s=decomp_s,
      amortized_s=amortized_s,
      mean_s=float(np.mean(c.times)) if c.times else float("nan"),
      plain_iqr_s=_iqr(plain),
      decomposition_iqr_s=_iqr(decomp),
      n_plain=len(plain),
      n_decomposition=len(decomp),
      first_call_s=c.first_call_s,
      compile_s=c.first_call_s - first_kind,
      state_bytes=c.state_bytes,
      inv_update_steps=c.inv_update_steps,
      times_s=list(c.times),
      counts=list(c.counts),
      rounds=list(c.rounds),
      **c.notes,
    )
  base = out.get(baseline)
  if base is not None:
    for s in out.values():
      s["plain_x"] = s["plain_s"] / base["plain_s"]
      s["decomposition_x"] = s["decomposition_s"] / base["plain_s"]
      s["amortized_x"] = s["amortized_s"] / base["plain_s"]
      s["compile_x"] = s["compile_s"] / base["compile_s"]
  return out


def _iqr(xs: Sequence[float]) -> list[float] | None:
  if len(xs) < 2:
    return None
  q1, q3 = np.percentile(xs, [25, 75])
  return [float(q1), float(q3)]
