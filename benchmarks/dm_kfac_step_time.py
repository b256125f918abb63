#!/usr/bin/env python3
"""Step time of DeepMind's kfac-jax 0.0.8 ``kfac_jax.Optimizer`` vs SGD.

Runs in its own virtual environment, because DeepMind's PyPI package
``kfac-jax`` also imports as ``kfac_jax``::

  python3 -m venv /tmp/dm-venv
  /tmp/dm-venv/bin/pip install kfac-jax==0.0.8 jax==0.8.2 jaxlib==0.8.2 \
      flax optax tqdm

(kfac-jax 0.0.8 fails to trace under jax 0.9.2: ``benchmarks/README.md``,
*DeepMind's kfac-jax*.)
  # from the repository root:
  /tmp/dm-venv/bin/python -m benchmarks.dm_kfac_step_time --out /tmp/dm.json

``step_time.py --dm`` runs it for you. Same autoencoder, batch, random data and
timing loop as ``step_time.py`` (``bench_common``): SGD+momentum and the K-FAC
``Optimizer`` are interleaved in rounds; each step is timed on its own with
``jax.block_until_ready``. K-FAC updates the curvature (factors) every step and
recomputes the damped factor inverses every ``--inverse-update-period`` steps;
learning rate, momentum and damping are fixed (no adaptation), no burn-in.
"""

from __future__ import annotations

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-order
import functools  # pylint: disable=g-import-not-at-top,wrong-import-order
import json  # pylint: disable=g-import-not-at-top,wrong-import-order
import os  # pylint: disable=g-import-not-at-top,wrong-import-order
import pathlib  # pylint: disable=g-import-not-at-top,wrong-import-order
import sys  # pylint: disable=g-import-not-at-top,wrong-import-order
import time  # pylint: disable=g-import-not-at-top,wrong-import-order
from collections.abc import Sequence  # pylint: disable=g-import-not-at-top,wrong-import-order

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top

from benchmarks import bench_common  # pylint: disable=g-import-not-at-top
from benchmarks.bench_common import Contestant  # pylint: disable=g-import-not-at-top

# DeepMind's kfac_jax first: nothing may import the repository's before it.
from benchmarks.deepmind_kfac import check_deepmind_kfac, kfac_jax  # pylint: disable=g-bad-import-order
from examples import models  # pylint: disable=g-import-not-at-top


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--rounds", type=int, default=4)
  p.add_argument("--steps-per-round", type=int, default=10)
  p.add_argument("--warmup-steps", type=int, default=2)
  p.add_argument("--inverse-update-period", type=int, default=10)
  p.add_argument("--learning-rate", type=float, default=1e-3)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--damping", type=float, default=1e-3)
  p.add_argument(
    "--norm-constraint",
    type=float,
    default=1e-3,
    help="DeepMind's norm_constraint: the update is scaled by "
    "min(1, sqrt(c / (lr² Σ P·∇))), i.e. KAISA's KL clipping, "
    "as kl_clip=1e-3 in step_time.py (<= 0: off)",
  )
  p.add_argument(
    "--estimation-mode",
    default="fisher_empirical",
    help="DeepMind's estimation_mode (its default is ggn_curvature_prop)",
  )
  p.add_argument(
    "--smoke", action="store_true", help="tiny autoencoder, 2 rounds of 3 steps"
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--out", type=pathlib.Path, required=True, help="JSON file to write"
  )
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  if args.smoke:
    args.batch_size, args.rounds, args.steps_per_round = 16, 2, 3
    args.warmup_steps, args.inverse_update_period = 0, 2
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  started = time.time()
  env = bench_common.environment()
  env.update(check_deepmind_kfac())
  widths = (
    bench_common.SMOKE_AUTOENCODER_WIDTHS
    if args.smoke
    else models.AUTOENCODER_WIDTHS
  )
  pixels = bench_common.SMOKE_PIXELS if args.smoke else models.MNIST_PIXELS
  model = models.Autoencoder(widths, out_features=pixels)
  key_data, key_init = jax.random.split(jax.random.PRNGKey(args.seed))
  x = bench_common.random_images(key_data, args.batch_size, pixels)
  params = model.init(key_init, x[:1])["params"]

  def loss_fn(params, x):
    logits = model.apply({"params": params}, x)
    return models.autoencoder_losses(logits, x).mean()

  # --- SGD + momentum baseline (same step as step_time.py's, donated buffers
  # included: under jax 0.8.2 an undonated step took 3-4 % longer).
  sgd = optax.sgd(args.learning_rate, momentum=args.momentum)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def sgd_step(params, opt_state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, opt_state = sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  sgd_state = sgd.init(params)
  sgd_contestant = Contestant(
    name="sgd",
    step=lambda c: sgd_step(c[0], c[1], x),
    # Donated: its own copy, as DeepMind's step gets below.
    carry=(jax.tree.map(jnp.copy, params), sgd_state, jnp.zeros([])),
    state_bytes=bench_common.tree_nbytes(sgd_state),
  )

  # --- DeepMind K-FAC.
  def kfac_loss_fn(params, x):
    logits = model.apply({"params": params}, x)
    kfac_jax.register_sigmoid_cross_entropy_loss(logits, x)
    return models.autoencoder_losses(logits, x).mean()

  optimizer = kfac_jax.Optimizer(
    value_and_grad_func=jax.value_and_grad(kfac_loss_fn),
    l2_reg=0.0,
    use_adaptive_learning_rate=False,
    use_adaptive_momentum=False,
    use_adaptive_damping=False,
    curvature_ema=0.95,
    curvature_update_period=1,
    inverse_update_period=args.inverse_update_period,
    num_burnin_steps=0,
    norm_constraint=(
      args.norm_constraint if args.norm_constraint > 0 else None
    ),
    estimation_mode=args.estimation_mode,
    multi_device=False,
  )
  rng = jax.random.PRNGKey(args.seed + 1)
  init_start = time.perf_counter()
  kfac_state = jax.block_until_ready(optimizer.init(params, rng, x))
  init_s = time.perf_counter() - init_start
  # Which curvature blocks the auto-registration made (Dense layers should be
  # Kronecker-factored blocks); recorded to check the comparison is fair.
  # pylint: disable-next=protected-access
  blocks = [type(b).__name__ for b in (optimizer._estimator.blocks or ())]
  lr = jnp.asarray(args.learning_rate, jnp.float32)
  momentum = jnp.asarray(args.momentum, jnp.float32)
  damping = jnp.asarray(args.damping, jnp.float32)
  # The same rng every step: fisher_empirical / ggn_curvature_prop do not
  # sample, and splitting keys would only add dispatches.

  def kfac_step(carry):
    params, state, _ = carry
    params, state, stats = optimizer.step(
      params,
      state,
      rng,
      batch=x,
      learning_rate=lr,
      momentum=momentum,
      damping=damping,
    )
    return params, state, stats["loss"]

  kfac_contestant = Contestant(
    name="dm-kfac",
    step=kfac_step,
    # DeepMind's step donates params: give it its own copy.
    carry=(jax.tree.map(jnp.copy, params), kfac_state, jnp.zeros([])),
    inv_update_steps=args.inverse_update_period,
    read_count=lambda c: int(c[1].step_counter),
    state_bytes=bench_common.tree_nbytes(kfac_state),
    notes=dict(init_s=init_s, curvature_blocks=blocks),
  )

  contestants = [sgd_contestant, kfac_contestant]
  meta, summary = bench_common.run_with_progress(
    contestants, args, f"DeepMind kfac-jax b={args.batch_size}"
  )
  for c in contestants:
    summary[c.name]["final_loss"] = float(c.carry[2])
  record = dict(
    command=" ".join(
      [sys.executable, os.path.relpath(sys.argv[0])] + sys.argv[1:]
    ),
    args={
      k: str(v) if isinstance(v, pathlib.Path) else v
      for k, v in vars(args).items()
    },
    environment=env,
    model="autoencoder",
    description="-".join(map(str, (pixels, *widths, pixels))) + ", float32",
    batch=args.batch_size,
    estimation_mode=args.estimation_mode,
    rounds=meta,
    variants=summary,
    load_average_at_end=bench_common.load_average(),
    wall_s=time.time() - started,
  )
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=1))
  for name, s in summary.items():
    print(
      f"{name}: step {s['plain_s'] * 1e3:.1f} ms (x{s['plain_x']:.2f}), "
      f"inverse step {s['decomposition_s'] * 1e3:.1f} ms "
      f"(x{s['decomposition_x']:.2f}), amortized x{s['amortized_x']:.2f}, "
      f"compile {s['compile_s']:.1f} s (x{s['compile_x']:.2f})"
    )
  print(f"DeepMind curvature blocks: {blocks}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
