#!/usr/bin/env python3
"""Where a K-FAC step spends its time: each component jitted and timed alone.

On the autoencoder (or ``--widths``), at one batch size, times the median of
``--repeats`` calls of:

  grad            jax.value_and_grad of the loss (what SGD pays)
  capture         kfac_jax.value_grad_and_stats (grads, layers' inputs and
                  output cotangents)
  batch_factors   A and G of the batch for every layer (from captured stats)
  decompose       eigh of every A and G (eigen) / damped Cholesky inverses
  decompose_*_each / _stacked
                  the same factor decompositions one call per factor (what
                  kfac_jax does on CPU) and stacked by size, one vmapped
                  call per size (what it does elsewhere)
  precondition    P for every layer from the stored eigenbases / inverses
  plain_step      full K-FAC step without decomposition (count % T != 0)
  decomp_step     full K-FAC step with decomposition (count % T == 0)
  sgd_step        full SGD+momentum step

and the per-layer decomposition times. The components are compiled separately,
so they do not add up exactly to a step (XLA fuses across them in a step).
It calls kfac_jax internals (``factors.batch``, ``preconditioning.eigen`` /
``inverse``), so it may need updating when those change.

  python -m benchmarks.kfac_profile --batch 256 --blas-threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if __name__ == "__main__":
  for _i, _a in enumerate(sys.argv):
    if _a == "--blas-threads" and _i + 1 < len(sys.argv):
      os.environ["OPENBLAS_NUM_THREADS"] = sys.argv[_i + 1]

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import optax  # pylint: disable=g-import-not-at-top,wrong-import-position

import kfac_jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import bench_common  # pylint: disable=g-import-not-at-top,wrong-import-position
from examples import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from kfac_jax.factors import batch as batch_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from kfac_jax.factors.running import LayerFactors  # pylint: disable=g-import-not-at-top,wrong-import-position
from kfac_jax.preconditioning import batched, eigen, inverse  # pylint: disable=g-import-not-at-top,wrong-import-position


def timeit(
  fn: Callable[..., Any], *args: Any, repeats: int
) -> dict[str, float]:
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return dict(
    median_ms=float(np.median(times)) * 1e3,
    min_ms=float(np.min(times)) * 1e3,
    compile_s=compile_s,
  )


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument(
    "--widths", type=int, nargs="+", default=list(models.AUTOENCODER_WIDTHS)
  )
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument(
    "--blas-threads",
    type=int,
    default=None,
    help="OPENBLAS_NUM_THREADS for this run",
  )
  p.add_argument(
    "--out", type=pathlib.Path, default=None, help="optional JSON file"
  )
  args = p.parse_args(argv)
  if min(args.batch, args.repeats, *args.widths) < 1:
    p.error("--batch, --repeats and every --widths must be >= 1")
  model = models.Autoencoder(tuple(args.widths))
  key_data, key_init = jax.random.split(jax.random.PRNGKey(0))
  x = bench_common.random_images(key_data, args.batch, models.MNIST_PIXELS)
  params = model.init(key_init, x[:1])["params"]

  def loss_fn(params, x):
    return models.autoencoder_losses(
      model.apply({"params": params}, x), x
    ).mean()

  r = args.repeats
  out: dict[str, Any] = dict(
    batch=args.batch,
    widths=args.widths,
    openblas_num_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
    jax=jax.__version__,
  )
  out["grad"] = timeit(jax.value_and_grad(loss_fn), params, x, repeats=r)
  capture = kfac_jax.value_grad_and_stats(loss_fn)
  out["capture"] = timeit(capture, params, x, repeats=r)
  _, grads, stats = jax.jit(capture)(params, x)

  def all_batch_factors(stats):
    return {n: batch_lib.batch_factors(s) for n, s in stats.items()}

  out["batch_factors"] = timeit(all_batch_factors, stats, repeats=r)
  # Dense layers: one Kronecker block each.
  factors = {
    n: LayerFactors(a[0], g[0])
    for n, (a, g) in jax.jit(all_batch_factors)(stats).items()
  }
  damping = jnp.float32(1e-3)
  gradient_matrices = {}
  for name in stats:
    node = grads
    for key in name.split("/"):
      node = node[key]
    gradient_matrices[name] = jnp.concatenate(
      [node["kernel"], node["bias"][None]]
    )

  for method, decompose, precondition in (
    (
      "eigen",
      lambda f: eigen.decompose(f, damping, jnp.float32, True),
      eigen.precondition,
    ),
    (
      "inverse",
      lambda f: inverse.invert(f, damping, jnp.float32),
      inverse.precondition,
    ),
  ):
    # B023 (below): the closures run within their iteration (timed or jitted
    # and called at once), before the loop variables change.
    out[f"decompose_{method}"] = timeit(
      lambda fs: {n: decompose(f) for n, f in fs.items()},  # noqa: B023
      factors,
      repeats=max(3, r // 2),
    )
    factor_fn = (
      eigen.eigh_factor if method == "eigen" else inverse.damped_inverse
    )
    for layout in ("each", "stacked"):
      decompose_all = getattr(batched, f"decompose_{layout}")
      out[f"decompose_{method}_{layout}"] = timeit(
        lambda fs, fn=decompose_all: fn(fs, factor_fn, damping),  # noqa: B023
        factors,
        repeats=max(3, r // 2),
      )
    per_layer = {}
    for name, f in factors.items():
      per_layer[name] = dict(
        dims=[f.activation_factor.shape[0], f.gradient_factor.shape[0]],
        **timeit(decompose, f, repeats=3),
      )
    out[f"decompose_{method}_per_layer"] = per_layer
    preconditioners = jax.jit(
      lambda fs: {n: decompose(f) for n, f in fs.items()}  # noqa: B023
    )(factors)
    out[f"precondition_{method}"] = timeit(
      lambda ps, gs: {n: precondition(ps[n], gs[n], damping) for n in ps},  # noqa: B023
      preconditioners,
      gradient_matrices,
      repeats=r,
    )

    tx = optax.chain(
      kfac_jax.scale_by_kfac(
        learning_rate=1e-3,
        damping=1e-3,
        inv_update_steps=10,
        compute_method=method,
      ),
      optax.sgd(1e-3, momentum=0.9),
    )
    state = tx.init(params)

    def step(params, state, x):
      loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x)
      updates, state = tx.update(grads, state, params, kfac_stats=stats)  # noqa: B023
      return optax.apply_updates(params, updates), state, loss

    out[f"decomp_step_{method}"] = timeit(
      step, params, state, x, repeats=max(3, r // 2)
    )
    # count = 1: a step that updates the factors but does not decompose.
    plain_state = (state[0]._replace(count=jnp.ones([], jnp.int32)), *state[1:])
    out[f"plain_step_{method}"] = timeit(
      step, params, plain_state, x, repeats=r
    )

  sgd = optax.sgd(1e-3, momentum=0.9)

  def sgd_step(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, state = sgd.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  out["sgd_step"] = timeit(sgd_step, params, sgd.init(params), x, repeats=r)

  for key, value in out.items():
    if isinstance(value, dict) and "median_ms" in value:
      print(
        f"{key:24s} {value['median_ms']:9.2f} ms  (min {value['min_ms']:.2f}"
        f", compile {value['compile_s']:.1f} s)"
      )
    elif isinstance(value, dict):
      for name, v in value.items():
        print(
          f"  {key[:-10]:18s} {name:10s} {str(v['dims']):12s} "
          f"{v['median_ms']:9.2f} ms"
        )
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
