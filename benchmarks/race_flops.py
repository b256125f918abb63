#!/usr/bin/env python3
"""XLA's FLOP count of the autoencoder race step's model passes, piece by piece.

The adaptive race step (``convergence.py --curvature gauss-newton``) runs
the model three ways: the gradient over the whole batch, a second capture
(the sampled Gauss-Newton surrogate's forward and backward) over the first
``--curvature-examples``, and the quadratic model's linearisation with two
forward-mode products over the same examples. Each piece is jitted alone,
and the last two also together, and ``Compiled.cost_analysis()`` gives
the FLOPs XLA will run. Printed beside them, the counts from the layer
shapes (``W = Σ in·out`` over the kernels, batch ``N``, curvature examples
``M``; a forward pass is ``2·rows·W``):

  gradient            6·N·W − 2·N·in₀·out₀  (no input gradient at layer 0)
  capture             4·M·W − 2·M·in₀·out₀  (forward, then input gradients;
                                             its weight gradients are unused)
  quadratic model     10·M·W − 4·M·in₀·out₀ (forward, then two tangents
                                             ``dW·x + W·dx``, no ``dx`` at 0)

"capture + quadratic model" below the sum of the two apart is the forward
pass over the same examples that XLA computes once. "all, the gradient
split" jits the three together with the gradient's loss split into the
curvature examples and the rest (``examples.training.curvature_shared_loss``, as
the race does): below "gradient" + "capture + quadratic model" by the
gradient's forward pass over the curvature examples, computed once too.

  python -m benchmarks.race_flops
  python -m benchmarks.race_flops --out results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from tqdm import tqdm

import kfac_jax
from examples import flops, tasks, training
from kfac_jax.transform import quadratic_model


def shape_counts(params: Any, batch: int, examples: int) -> dict[str, float]:
  """The pieces' matmul FLOPs from the kernel shapes (module docstring)."""
  kernels = [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    if jax.tree_util.keystr(path).endswith("['kernel']")
  ]
  weights = sum(k.shape[0] * k.shape[1] for k in kernels)
  first = kernels[0].shape[0] * kernels[0].shape[1]
  return {
    "gradient": 6 * batch * weights - 2 * batch * first,
    "capture": 4 * examples * weights - 2 * examples * first,
    "quadratic_model": 10 * examples * weights - 4 * examples * first,
  }


def measure(examples: int, progress: bool = True) -> dict[str, Any]:
  """XLA's and the shapes' counts on the race's autoencoder, seed 0."""
  task = tasks.autoencoder_task(None, 1000)
  params = task.init(0)
  batch = tuple(array[: task.batch_size] for array in task.data)
  # Two different directions (identical ones XLA would merge too), passed
  # as arguments like everything else, so that nothing is constant-folded.
  directions = (
    jax.tree.map(lambda p: p * 0.5, params),
    jax.tree.map(lambda p: p * 0.25, params),
  )
  key = jax.random.key(0)
  curvature = lambda b: training.curvature_batch(b, examples)

  def gradient(p, directions, key, *b):
    del directions, key
    return jax.value_and_grad(task.loss_fn)(p, *b)

  def capture(p, directions, key, *b):
    del directions
    return kfac_jax.value_grad_and_stats(
      lambda q: task.gauss_newton_fn(q, key, *curvature(b))
    )(p)[2]

  def model(p, directions, key, *b):
    del key
    return quadratic_model.curvature_products(
      task.split_loss(*curvature(b)), p, directions
    )

  def split_gradient(p, directions, key, *b):
    del directions, key
    return jax.value_and_grad(
      training.curvature_shared_loss(task.loss_fn, examples)
    )(p, *b)

  pieces: Sequence[tuple[str, Callable[..., Any]]] = (
    ("gradient", gradient),
    ("capture", capture),
    ("quadratic_model", model),
    (
      "capture_and_quadratic_model",
      lambda *args: (capture(*args), model(*args)),
    ),
    (
      "all_gradient_split",
      lambda *args: (split_gradient(*args), capture(*args), model(*args)),
    ),
  )
  xla = {
    name: flops.compiled_flops(fun, params, directions, key, *batch)
    for name, fun in tqdm(pieces, disable=not progress, desc="compiling")
  }
  return {
    "batch": task.batch_size,
    "curvature_examples": examples,
    "xla_flops": xla,
    "shape_flops": shape_counts(params, task.batch_size, examples),
  }


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--curvature-examples", type=int, default=250)
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=None,
    help="also write race_flops_<stamp>.json there",
  )
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  if not 1 <= args.curvature_examples <= 1000:
    raise SystemExit("--curvature-examples must be in [1, 1000].")
  result = measure(args.curvature_examples, not args.no_progress)
  xla, shapes = result["xla_flops"], result["shape_flops"]
  print(
    f"| piece (batch {result['batch']}, curvature examples "
    f"{result['curvature_examples']}) | XLA GFLOP | from the shapes |"
  )
  print("|---|---:|---:|")
  for name, count in xla.items():
    shape = shapes.get(name)
    print(
      f"| {name} | {count / 1e9:.2f} | "
      + ("" if shape is None else f"{shape / 1e9:.2f}")
      + " |"
    )
  apart = xla["capture"] + xla["quadratic_model"]
  print(
    f"\nTogether {xla['capture_and_quadratic_model'] / 1e9:.2f} against "
    f"{apart / 1e9:.2f} GFLOP apart: "
    f"{(apart - xla['capture_and_quadratic_model']) / 1e9:.2f} shared."
  )
  separate = xla["gradient"] + xla["capture_and_quadratic_model"]
  print(
    f"All three with the gradient split {xla['all_gradient_split'] / 1e9:.2f}"
    f" against {separate / 1e9:.2f} GFLOP: "
    f"{(separate - xla['all_gradient_split']) / 1e9:.2f} shared."
  )
  if args.out is not None:
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"race_flops_{stamp}.json"
    path.write_text(json.dumps(dict(result, jax=jax.__version__), indent=1))
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
