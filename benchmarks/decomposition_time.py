#!/usr/bin/env python3
"""A decomposition step's work, factors stacked by size against one by one.

Times ``placement.decompose_checked`` (decompose every A and G, assemble the
preconditioners, reject non-finite ones) for each method on the factor
sizes of the MNIST autoencoder (784-1000-500-250-30-250-500-1000-784: 16
factors of 10 distinct sizes), in the two layouts ``batched`` offers on the
platform it runs on:

  stacked      one solver call per size (``vmap`` over the stack)
  one by one   one solver call per factor

and marks the layout the library picks there (``Method.decompose_each_on``).
The eigen method is timed with ``eigh`` and with the subspace solver
(``eigen_solver="subspace"``, k = 1 and 2, and k = 0: the refresh by
drift, eigenvalues only while the basis holds) refreshing the eigenbases of the
same factors one averaging step earlier, ``F₀ = 0.95·F + 0.05·F'`` (a
running factor's change between two refreshes at decay 0.95; its
``fallbacks`` column counts the factors that fell back to ``eigh``).
A second table times the two orthogonalizations the subspace step could
use on ``F·Q`` per factor size: Householder (``jnp.linalg.qr``, the one
built) and CholeskyQR2 (two passes of ``R = chol(XᵀX)``, ``X ← X R⁻¹``:
matmuls, a Cholesky and a triangular solve), beside ``eigh`` and one matmul.
The factors are ``XᵀX/n + 10⁻³I`` of random rows with decaying scales.
Run it on each platform whose choice is in question (CPU, a GPU):

  python -m benchmarks.decomposition_time
  python -m benchmarks.decomposition_time --smoke --out /tmp/x   # CI-cheap
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks import bench_common
from examples import models
from kfac_jax.distribution import placement
from kfac_jax.factors.running import LayerFactors
from kfac_jax.preconditioning import methods
from kfac_jax.preconditioning.subspace import SubspaceSolver


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--repeats",
    type=int,
    default=10,
    help="timed calls per method and layout, after a warm-up",
  )
  p.add_argument(
    "--rows", type=int, default=256, help="random rows n behind each factor"
  )
  p.add_argument(
    "--smoke",
    action="store_true",
    help="tiny widths and two repeats (CI-cheap)",
  )
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--out", default="results", help="folder for the JSON")
  return p.parse_args(argv)


def autoencoder_factors(
  widths: Sequence[int], pixels: int, rows: int, seed: int = 0
) -> dict[str, LayerFactors]:
  """``{layer: LayerFactors(A [in+1, in+1], G [out, out])}``, SPD, float32."""
  rng = np.random.default_rng(seed)

  def factor(d: int) -> jax.Array:
    x = rng.standard_normal((rows, d)) * np.linspace(1.0, 0.01, d)
    return jnp.asarray(x.T @ x / rows + 1e-3 * np.eye(d), jnp.float32)

  dims = [pixels, *widths, pixels]
  return {
    f"dense_{i}": LayerFactors(factor(fan_in + 1), factor(fan_out))
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:]))
  }


def time_layout(
  method: methods.Method,
  factors: dict[str, LayerFactors],
  repeats: int,
  previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Compile time and median/min call time of ``decompose_checked``.

  ``previous``: the preconditioners refined (the subspace solver's warm
  start); ``None``: those of identity factors.
  """
  if previous is None:
    previous = {
      name: method.init(
        pair.activation_factor.shape[0], pair.gradient_factor.shape[0]
      )
      for name, pair in factors.items()
    }
  damping = jnp.float32(1e-3)
  start = time.perf_counter()
  compiled = (
    jax.jit(lambda fs, ps, d: placement.decompose_checked(method, fs, ps, d))
    .lower(factors, previous, damping)
    .compile()
  )
  compile_s = time.perf_counter() - start
  _, counts = jax.block_until_ready(compiled(factors, previous, damping))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(factors, previous, damping))
    times.append(time.perf_counter() - start)
  return dict(
    compile_s=round(compile_s, 3),
    median_ms=round(1e3 * statistics.median(times), 2),
    min_ms=round(1e3 * min(times), 2),
    rejected=int(counts.rejected),
    fallbacks=int(counts.fallbacks),
  )


def cholesky_qr2(x: jax.Array) -> jax.Array:
  """``Q`` of ``x`` by CholeskyQR2 (the alternative measured, not built)."""
  for _ in range(2):
    r = jnp.linalg.cholesky(x.T @ x).T
    x = jax.scipy.linalg.solve_triangular(r, x.T, trans="T").T
  return x


def orthogonalization_ms(
  factors: dict[str, LayerFactors], repeats: int
) -> list[dict[str, Any]]:
  """Median ms of eigh, one matmul, Householder QR and CholeskyQR2 per size."""
  sizes = {f.shape[0]: f for pair in factors.values() for f in pair}
  kernels = {
    "eigh": lambda f, q: jnp.linalg.eigh(f)[1],
    "matmul F·Q": lambda f, q: f @ q,
    "householder qr(F·Q)": lambda f, q: jnp.linalg.qr(f @ q)[0],
    "cholesky_qr2(F·Q)": lambda f, q: cholesky_qr2(f @ q),
  }
  rows = []
  for size, factor in sorted(sizes.items()):
    basis = jnp.linalg.eigh(factor)[1]
    row = dict(size=size)
    for name, kernel in kernels.items():
      compiled = jax.jit(kernel)
      jax.block_until_ready(compiled(factor, basis))
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(factor, basis))
        times.append(time.perf_counter() - start)
      row[name] = round(1e3 * statistics.median(times), 2)
    rows.append(row)
  return rows


def previous_bases(
  factors: dict[str, LayerFactors], rows: int, method: methods.Method
) -> dict[str, Any]:
  """``eigh``'s preconditioners of ``0.95·F + 0.05·F'`` (``F'`` fresh
  factors of the same sizes): the bases of one averaging step earlier."""
  widths = [pair.gradient_factor.shape[0] for pair in factors.values()][:-1]
  pixels = factors["dense_0"].activation_factor.shape[0] - 1
  other = autoencoder_factors(widths, pixels, rows, seed=1)
  earlier = jax.tree.map(lambda f, g: 0.95 * f + 0.05 * g, factors, other)
  return jax.jit(
    lambda fs: placement.decompose_checked(
      method,
      fs,
      {
        name: method.init(
          pair.activation_factor.shape[0], pair.gradient_factor.shape[0]
        )
        for name, pair in fs.items()
      },
      jnp.float32(1e-3),
    )[0]
  )(earlier)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  widths, pixels = (
    (bench_common.SMOKE_AUTOENCODER_WIDTHS, bench_common.SMOKE_PIXELS)
    if args.smoke
    else (models.AUTOENCODER_WIDTHS, models.MNIST_PIXELS)
  )
  repeats = 2 if args.smoke else args.repeats
  factors = autoencoder_factors(widths, pixels, args.rows)
  platform = jax.default_backend()
  rows = []
  solvers = {
    "eigen": None,
    "eigen subspace k=0": SubspaceSolver(0),
    "eigen subspace k=1": SubspaceSolver(1),
    "eigen subspace k=2": SubspaceSolver(2),
    "inverse": None,
  }
  cases = [
    (name, layout) for name in solvers for layout in ("stacked", "one by one")
  ]
  eigh = methods.make_method(True, jnp.float32, precompute_damped_inverse=False)
  previous = previous_bases(factors, args.rows, eigh)
  for name, layout in tqdm(cases, disable=args.no_progress):
    method = methods.make_method(
      name != "inverse",
      jnp.float32,
      precompute_damped_inverse=False,
      solver=solvers[name],
    )
    library_choice = (
      "one by one" if platform in method.decompose_each_on else "stacked"
    )
    method = method._replace(
      decompose_each_on=(platform,) if layout == "one by one" else ()
    )
    rows.append(
      dict(
        method=name,
        layout=layout,
        library_choice=layout == library_choice,
        **time_layout(
          method, factors, repeats, previous if solvers[name] else None
        ),
      )
    )

  print(
    f"{len(factors) * 2} factors, sizes "
    f"{sorted({f.shape[0] for pair in factors.values() for f in pair})}, "
    f"on {platform} ({jax.devices()[0]})"
  )
  print(
    "| method | layout | compile s | median ms | min ms | fallbacks | "
    "library's choice |"
  )
  print("|---|---|---:|---:|---:|---:|:-:|")
  for row in rows:
    print(
      f"| {row['method']} | {row['layout']} | {row['compile_s']:.2f} | "
      f"{row['median_ms']:.1f} | {row['min_ms']:.1f} | "
      f"{row['fallbacks']} | {'✓' if row['library_choice'] else ''} |"
    )
  orthogonalization = orthogonalization_ms(factors, repeats)
  names = [k for k in orthogonalization[0] if k != "size"]
  print("\n| size | " + " | ".join(f"{n} ms" for n in names) + " |")
  print("|---:|" + "---:|" * len(names))
  for row in orthogonalization:
    print(
      f"| {row['size']} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |"
    )
  record = dict(
    environment=bench_common.environment(),
    args=vars(args),
    results=rows,
    orthogonalization=orthogonalization,
  )
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
  path = out / f"decomposition_time_{stamp}.json"
  path.write_text(json.dumps(record, indent=1))
  print(f"wrote {path}")
  return record


if __name__ == "__main__":
  main()
