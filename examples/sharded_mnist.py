"""Sharded K-FAC: the MNIST classifier on a device mesh, KAISA style.

Data parallel over a 2-D mesh ``("data", "fsdp")`` (8 simulated CPU devices
here; real GPUs/TPUs unchanged): the batch is sharded over both axes, kernels
are sharded over ``"fsdp"`` (``params_partition_specs``), and K-FAC's
decompositions and preconditioner memory are spread over all devices with
``--strategy`` (KAISA's ``grad_worker_fraction``). The optimizer state is
created directly in its shardings from ``get_opt_state_partition_specs``.

  python -m examples.sharded_mnist                       # 8 simulated devices
  python -m examples.sharded_mnist --strategy mem_opt --steps 50
  python -m examples.sharded_mnist --help

On one host the simulated device count comes from ``--devices`` (ignored
when ``XLA_FLAGS`` already sets one or on real accelerators). On several
hosts, call ``jax.distributed.initialize()`` first and build the same mesh
from all hosts' devices (README, "Several hosts").
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--devices",
    type=int,
    default=8,
    help="simulated CPU devices (a single-host CPU run)",
  )
  p.add_argument(
    "--mesh-shape",
    type=int,
    nargs=2,
    default=[2, 4],
    metavar=("DATA", "FSDP"),
    help="the ('data', 'fsdp') mesh; its product must not exceed --devices",
  )
  p.add_argument(
    "--strategy",
    default="hybrid_opt",
    choices=["comm_opt", "hybrid_opt", "mem_opt"],
    help="KAISA's distribution strategy over the whole mesh",
  )
  p.add_argument("--steps", type=int, default=300, help="training steps")
  p.add_argument(
    "--batch-size",
    type=int,
    default=256,
    help="global batch, a multiple of the mesh's devices",
  )
  p.add_argument(
    "--eval-size",
    type=int,
    default=10_000,
    help="test images for the final accuracy",
  )
  p.add_argument("--seed", type=int, default=0, help="init and data order")
  p.add_argument(
    "--out",
    type=pathlib.Path,
    default=pathlib.Path("results"),
    help="the results table is written to <out>/sharded_mnist.md",
  )
  args = p.parse_args(argv)
  for flag in ("steps", "batch_size", "eval_size", "devices"):
    if getattr(args, flag) < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  if min(args.mesh_shape) < 1 or math.prod(args.mesh_shape) > args.devices:
    raise SystemExit(
      f"--mesh-shape {' '.join(map(str, args.mesh_shape))}: "
      f"needs {math.prod(args.mesh_shape)} devices, "
      f"--devices is {args.devices}."
    )
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if "jax" not in sys.modules and "device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.devices}"
    )
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  import kfac_jax  # pylint: disable=g-import-not-at-top
  from examples import datasets, models  # pylint: disable=g-import-not-at-top
  from examples.mnist_classifier import DEFAULTS  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh(
    tuple(args.mesh_shape),
    ("data", "fsdp"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  if args.batch_size % mesh.size:
    raise SystemExit(
      f"--batch-size {args.batch_size} must be a multiple of "
      f"the {mesh.size} devices."
    )
  mnist = datasets.load_mnist()
  model = models.MLP(widths=(512, 256), outputs=10)
  params = model.init(jax.random.key(args.seed), mnist.x_train[:1])["params"]
  fsdp = args.mesh_shape[1]
  # Kernels [in, out] sharded on their output axis where it divides evenly.
  params_specs = jax.tree.map(
    lambda p: (
      PartitionSpec(None, "fsdp")
      if p.ndim == 2 and p.shape[1] % fsdp == 0
      else PartitionSpec()
    ),
    params,
  )
  kfac_kwargs = dict(
    learning_rate=DEFAULTS["kfac_lr"],
    momentum=0.9,
    damping=DEFAULTS["damping"],
    kl_clip=DEFAULTS["kl_clip"],
    factor_decay=DEFAULTS["factor_decay"],
    inv_update_steps=DEFAULTS["inv_update_steps"],
    compute_method=DEFAULTS["compute_method"],
    mesh_axes=("data", "fsdp"),
    grad_worker_fraction=args.strategy,
    params_partition_specs=params_specs,
  )
  sgd = optax.sgd(DEFAULTS["kfac_lr"], momentum=0.9)
  tx = optax.chain(kfac_jax.scale_by_kfac(**kfac_kwargs), sgd)

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  named = lambda specs: jax.tree.map(
    lambda s: NamedSharding(mesh, s),
    specs,
    is_leaf=lambda s: isinstance(s, PartitionSpec),
  )
  batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

  with jax.set_mesh(mesh):
    state_specs = kfac_jax.get_opt_state_partition_specs(
      params, chain_with=sgd, **kfac_kwargs
    )
    params = jax.device_put(params, named(params_specs))
    opt_state = jax.jit(tx.init, out_shardings=named(state_specs))(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
      loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
      return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def accuracy(params, x, y):
      return (model.apply({"params": params}, x).argmax(-1) == y).mean()

    per_device = max(
      shard.data.nbytes
      for shard in opt_state[0].preconditioners.rows.addressable_shards
    )
    unsharded = jax.eval_shape(
      kfac_jax.scale_by_kfac(compute_method=DEFAULTS["compute_method"]).init,
      params,
    )
    replicated = sum(
      x.size * x.dtype.itemsize
      for x in jax.tree.leaves(unsharded.preconditioners)
    )
    print(
      f"{mesh.size} devices, mesh {dict(mesh.shape)}, {args.strategy}: "
      f"preconditioners {per_device / 2**20:.2f} MiB per device "
      f"({replicated / 2**20:.2f} MiB unsharded)",
      flush=True,
    )
    simulated = jax.default_backend() == "cpu"
    rng = np.random.default_rng(args.seed)
    losses, start = [], time.perf_counter()
    for _ in tqdm(range(args.steps), desc=f"sharded K-FAC ({args.strategy})"):
      index = rng.choice(len(mnist.x_train), args.batch_size, replace=False)
      x, y = jax.device_put(
        (mnist.x_train[index], mnist.y_train[index]), batch_sharding
      )
      params, opt_state, loss = train_step(params, opt_state, x, y)
      losses.append(loss)
      if simulated:
        # XLA:CPU's simulated devices can deadlock in a collective when
        # several steps are in flight (seen here with plain SGD too), so
        # each step finishes before the next is dispatched.
        jax.block_until_ready(loss)
    losses = np.asarray(jax.device_get(losses))
    seconds = time.perf_counter() - start
    n = args.eval_size
    test_accuracy = float(accuracy(params, mnist.x_test[:n], mnist.y_test[:n]))
  window = max(1, min(20, len(losses) // 5))
  table = (
    f"Sharded K-FAC, MNIST MLP 784-512-256-10, {mesh.size} devices "
    f"{dict(mesh.shape)}, {args.strategy}, batch {args.batch_size}, seed "
    f"{args.seed}; test accuracy over {min(n, len(mnist.x_test)):,} images; "
    "seconds include compilation.\n\n"
    "| strategy | steps | first loss "
    f"| last-{window} mean loss | test acc (%) | seconds |\n"
    "|---|---|---|---|---|---|\n"
    f"| {args.strategy} | {args.steps} | {losses[0]:.4f} | "
    f"{losses[-window:].mean():.4f} | {100 * test_accuracy:.2f} | "
    f"{seconds:.1f} |\n"
  )
  print(table)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "sharded_mnist.md").write_text(table)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
