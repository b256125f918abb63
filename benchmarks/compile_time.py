#!/usr/bin/env python3
"""First-call cost of a training step: trace + lower, and XLA compile, apart.

``step_time.py`` reports one first call per variant (compile included) minus
its steady step: a single sample, noisy by ±30 % on this machine. This script
repeats only the first-call work, interleaved across variants (and across
kfac_jax revisions with ``--kfac-revs``), each repetition from empty caches
(``jax.clear_caches``), and reports per variant the median and minimum of

  lower s     trace to a jaxpr + lower to StableHLO (Python-side)
  compile s   XLA's compilation of that program (``Lowered.compile``)

and the size of the compiled program: XLA kernels (fusions; in brackets those
left after XLA:CPU compiles identical ones once) and windowed (tree)
reductions, the instructions XLA:CPU compiles one by one. Same
models, data and optimizer settings as ``step_time.py`` (autoencoder).

  python -m benchmarks.compile_time                       # sgd, inverse -gfs
  python -m benchmarks.compile_time --kfac-revs HEAD~1    # A/B: a commit
  python -m benchmarks.compile_time --smoke --out /tmp/x  # CI-cheap
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
from tqdm import tqdm

import kfac_jax
from benchmarks import step_time, step_variants

_FUSION = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = \S+ fusion\(", re.M)
_REDUCE_WINDOW = re.compile(r"\breduce-window\(")
_FUSION_CALL = re.compile(r"= (\S+) fusion\([^\n]*?calls=(%[\w.-]+)")
_HEADER = re.compile(r"^(?:ENTRY )?(%[\w.-]+) .*\{$")
_NAME = re.compile(r"%[\w.-]+")
_METADATA = re.compile(r", metadata=\{[^}]*\}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--variants",
    nargs="+",
    default=["sgd", "kfac-inverse-gfs"],
    help="step_time.py variant names",
  )
  p.add_argument(
    "--kfac-revs",
    nargs="*",
    default=[],
    help="also time every K-FAC variant as of these revisions",
  )
  p.add_argument("--batch", type=int, default=256)
  p.add_argument(
    "--repeats",
    type=int,
    default=5,
    help="fresh trace + lower + compile per variant",
  )
  p.add_argument(
    "--smoke", action="store_true", help="tiny model, 1 repeat (CI)"
  )
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error("--repeats must be positive")
  if args.smoke:
    args.repeats = 1
  return args


def _computations(text: str) -> dict[str, str]:
  """``{name: body}`` of every computation in an HLO module's text."""
  bodies, name, lines = {}, None, []
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      name, lines = header.group(1), []
    elif line.startswith("}") and name is not None:
      bodies[name], name = "\n".join(lines), None
    elif name is not None:
      lines.append(line)
  return bodies


def program_size(compiled: Any) -> dict[str, int]:
  """Kernels of an XLA:CPU program.

  ``fusions``: fusion instructions; ``distinct_fusions``: those left after
  XLA:CPU's deduplication, which compiles structurally identical kernels
  (same fused computation, shapes and layouts) once: what compile time
  follows. ``reduce_windows``: windowed (tree) reductions.
  """
  text = compiled.as_text()
  bodies = _computations(text)
  kernels = set()
  for shape, called in _FUSION_CALL.findall(text):
    body = _METADATA.sub("", bodies.get(called, called))
    kernels.add((shape, _NAME.sub("%", body)))
  return {
    "fusions": len(_FUSION.findall(text)),
    "distinct_fusions": len(kernels),
    "reduce_windows": len(_REDUCE_WINDOW.findall(text)),
  }


def time_first_call(contestant: Any) -> dict[str, Any]:
  """One cold trace + lower and compile of ``contestant``'s step."""
  jax.clear_caches()
  start = time.perf_counter()
  lowered = contestant.lower()
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  compiled_at = time.perf_counter()
  return {
    "lower_s": lowered_at - start,
    "compile_s": compiled_at - lowered_at,
    **program_size(compiled),
  }


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  # step_time's configuration flags (model sizes, K-FAC settings), defaults.
  bench_args = step_time.parse_args(["--smoke"] if args.smoke else [])
  config = step_variants.autoencoder_config(args.batch, bench_args)
  libraries = {"": kfac_jax}
  for rev in args.kfac_revs:
    commit, module = step_variants.load_kfac_revision(rev)
    libraries[f"@{commit}"] = module
  names = [
    (variant + suffix, variant, lib)
    for variant in args.variants
    for suffix, lib in libraries.items()
    if suffix == "" or step_variants.is_kfac(variant)
  ]
  samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in names}
  progress = tqdm(
    total=args.repeats * len(names),
    disable=args.no_progress,
    desc="trace + lower + compile",
  )
  for _ in range(args.repeats):
    for name, variant, lib in names:
      contestant = step_variants.make_contestant(
        variant, config, bench_args, lib
      )
      samples[name].append(time_first_call(contestant))
      progress.update()
  progress.close()

  rows = []
  for name, runs in samples.items():
    lower = [run["lower_s"] for run in runs]
    compile_s = [run["compile_s"] for run in runs]
    rows.append(
      {
        "variant": name,
        "lower_s_median": statistics.median(lower),
        "lower_s_min": min(lower),
        "compile_s_median": statistics.median(compile_s),
        "compile_s_min": min(compile_s),
        "fusions": runs[0]["fusions"],
        "distinct_fusions": runs[0]["distinct_fusions"],
        "reduce_windows": runs[0]["reduce_windows"],
      }
    )
  lines = [
    f"{config.description}, batch {args.batch}, {args.repeats} cold "
    "first calls per variant, interleaved:",
    "",
    "| variant | lower s (median, min) | compile s (median, min) | "
    "fusions (distinct) | reduce-windows |",
    "|---|---:|---:|---:|---:|",
  ]
  for row in rows:
    lines.append(
      f"| {row['variant']} | {row['lower_s_median']:.2f}, "
      f"{row['lower_s_min']:.2f} | {row['compile_s_median']:.2f}, "
      f"{row['compile_s_min']:.2f} | {row['fusions']} "
      f"({row['distinct_fusions']}) | "
      f"{row['reduce_windows']} |"
    )
  print("\n".join(lines))

  args.out.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = args.out / f"compile_time_{stamp}.json"
  path.write_text(
    json.dumps(
      {
        "args": {k: str(v) for k, v in vars(args).items()},
        "jax": jax.__version__,
        "rows": rows,
        "samples": samples,
      },
      indent=1,
    )
  )
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
