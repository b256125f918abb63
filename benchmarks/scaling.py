"""How KAISA's strategies divide K-FAC's work over 1, 2, 4, 8 devices.

For every device count n and strategy (COMM_OPT, HYBRID_OPT, MEM_OPT) this
compiles one data-parallel training step (batch sharded over a 1-D mesh of
the first n devices, ``scale_by_kfac(mesh_axes="devices", ...)``) and reads
the compiled program with ``hlo_cost``:

* decomposition FLOPs per device (eigh/Cholesky custom calls, the device's
  own branch) and its share of the total;
* bytes of the K-FAC state held per device (all of it, and the
  preconditioners alone), from the shards of ``jit(tx.init)``'s output;
* collective bytes per device on a decomposition step and on a step with
  neither factor nor decomposition update, beside SGD's (the data-parallel
  gradient all-reduce every optimizer pays).

On this CPU the devices are simulated
(``--xla_force_host_platform_device_count``) and share the cores, so wall time
means nothing and is left out; ``--time`` measures the median step on real
devices (GPUs, TPUs).

  python -m benchmarks.scaling --out results/          # the README table
  python -m benchmarks.scaling --smoke --out /tmp/s    # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

STRATEGIES = ("comm_opt", "hybrid_opt", "mem_opt")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--devices",
    nargs="+",
    type=int,
    default=[1, 2, 4, 8],
    help="device counts (meshes of the first n devices)",
  )
  p.add_argument(
    "--models",
    nargs="+",
    choices=["autoencoder", "balanced"],
    default=["autoencoder", "balanced"],
    help="autoencoder: the MNIST 784-1000-...-784 (unequal "
    "layers); balanced: 8 Dense 512 → 512 layers",
  )
  p.add_argument("--batch", type=int, default=256)
  p.add_argument(
    "--compute-method", choices=["eigen", "inverse"], default="eigen"
  )
  p.add_argument(
    "--time",
    action="store_true",
    help="also time steps (meaningful on real devices only)",
  )
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
  p.add_argument(
    "--smoke",
    action="store_true",
    help="tiny balanced layers on 1 and 2 devices: checks the script runs",
  )
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  if args.smoke:
    args.devices, args.models = [1, 2], ["balanced"]
  for n in args.devices:
    # The batch is sharded over the n devices.
    if n < 1 or args.batch % n:
      p.error(f"--devices {n}: must be >= 1 and divide --batch {args.batch}")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  # Simulated devices must be requested before jax is imported.
  if (
    "jax" not in sys.modules
    and "--xla_force_host_platform_device_count"
    not in os.environ.get("XLA_FLAGS", "")
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={max(args.devices)}"
    )
  rows = run(args)
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / f"scaling_{time.strftime('%Y%m%d_%H%M%S')}.json"
  path.write_text(json.dumps(rows, indent=1))
  print(markdown_table(rows))
  print(f"results: {path}")


def run(args: argparse.Namespace) -> dict[str, Any]:
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

  import kfac_jax  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_common  # pylint: disable=g-import-not-at-top
  from examples import hlo_cost, models  # pylint: disable=g-import-not-at-top

  if jax.device_count() < max(args.devices):
    raise SystemExit(
      f"{max(args.devices)} devices requested, {jax.device_count()} available"
    )

  class Balanced(nn.Module):
    width: int
    depth: int = 8

    @nn.compact
    def __call__(self, x):
      for _ in range(self.depth):
        x = jnp.tanh(nn.Dense(self.width)(x))
      return x

  pixels = bench_common.SMOKE_PIXELS if args.smoke else models.MNIST_PIXELS
  widths = (
    bench_common.SMOKE_AUTOENCODER_WIDTHS
    if args.smoke
    else models.AUTOENCODER_WIDTHS
  )
  models = {
    "autoencoder": (models.Autoencoder(widths, pixels), pixels),
    "balanced": (Balanced(8 if args.smoke else 512), 8 if args.smoke else 512),
  }
  x = jax.random.uniform(jax.random.key(0), (args.batch, pixels))
  results: dict[str, Any] = {
    "environment": bench_common.environment(),
    "args": {k: str(v) for k, v in vars(args).items()},
    "rows": [],
  }
  jobs = [
    (m, n, s)
    for m in args.models
    for n in args.devices
    for s in (["sgd"] + list(STRATEGIES) if n > 1 else ["sgd", "local"])
  ]
  for model_name, n, strategy in tqdm(
    jobs, disable=args.no_progress, desc="compiling"
  ):
    model, features = models[model_name]
    data = x[:, :features]
    params = model.init(jax.random.key(1), data)["params"]

    # B023 (loss_fn, step): compiled and timed within this iteration.
    def loss_fn(p, batch):
      if model_name == "autoencoder":  # noqa: B023
        return models.autoencoder_losses(
          model.apply({"params": p}, batch),  # noqa: B023
          batch,
        ).mean()
      return jnp.mean(model.apply({"params": p}, batch) ** 2)  # noqa: B023

    mesh = jax.make_mesh(
      (n,),
      ("devices",),
      devices=jax.devices()[:n],
      axis_types=(jax.sharding.AxisType.Auto,),
    )
    kfac_kwargs = dict(compute_method=args.compute_method, inv_update_steps=10)
    if strategy not in ("sgd", "local"):
      kfac_kwargs.update(mesh_axes="devices", grad_worker_fraction=strategy)
    if strategy == "sgd":
      tx = optax.sgd(0.1, momentum=0.9)

      def step(p, s, batch):
        grads = jax.grad(loss_fn)(p, batch)
        return tx.update(grads, s, p)  # noqa: B023
    else:
      tx = kfac_jax.scale_by_kfac(**kfac_kwargs)

      def step(p, s, batch):
        _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(p, batch)
        return tx.update(grads, s, p, kfac_stats=stats)  # noqa: B023

    with jax.set_mesh(mesh):
      replicated = NamedSharding(mesh, PartitionSpec())
      params = jax.device_put(params, replicated)
      batch = jax.device_put(
        data, NamedSharding(mesh, PartitionSpec("devices"))
      )
      state = jax.jit(tx.init)(params)
      compiled = jax.jit(step).lower(params, state, batch).compile()
      text = compiled.as_text()
      decomposition = hlo_cost.per_device_costs(text, n, path="max")
      plain = hlo_cost.per_device_costs(text, n, path="min")
      row = dict(model=model_name, devices=n, strategy=strategy)
      if strategy != "sgd":
        flops = [c.decomposition_flops for c in decomposition]
        kfac_state = state
        row.update(
          decomposition_gflops_per_device=max(flops) / 1e9,
          decomposition_share=max(flops) / sum(flops) if sum(flops) else 0.0,
          state_mib_per_device=_device_mib(kfac_state),
          preconditioner_mib_per_device=_device_mib(kfac_state.preconditioners),
        )
      row.update(
        collective_mib_decomposition_step=max(
          c.collective_bytes for c in decomposition
        )
        / 2**20,
        collective_mib_plain_step=max(c.collective_bytes for c in plain)
        / 2**20,
      )
      if args.time:
        row["median_step_ms"] = _median_step_ms(compiled, params, state, batch)
    results["rows"].append(row)
  return results


def _device_mib(tree: Any) -> float:
  """Largest per-device byte count of ``tree``'s shards, in MiB."""
  import jax  # pylint: disable=g-import-not-at-top

  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = (
        per_device.get(shard.device, 0) + shard.data.nbytes
      )
  return max(per_device.values()) / 2**20


def _median_step_ms(compiled, params, state, batch, steps: int = 20) -> float:
  import statistics  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  times = []
  for _ in range(steps):
    start = time.perf_counter()
    updates, state = compiled(params, state, batch)
    jax.block_until_ready(updates)
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def markdown_table(results: dict[str, Any]) -> str:
  header = (
    "| model | n | strategy | eig GFLOP/device | share "
    "| K-FAC state MiB/device "
    "| preconditioners MiB/device | collectives MiB, decomposition step "
    "| collectives MiB, plain step |"
  )
  lines = [header, "|---" * 9 + "|"]
  for row in results["rows"]:

    def cell(key, fmt="{:.3g}", row=row):
      return fmt.format(row[key]) if key in row else "–"

    lines.append(
      f"| {row['model']} | {row['devices']} | {row['strategy']} | "
      f"{cell('decomposition_gflops_per_device')} | "
      f"{cell('decomposition_share', '{:.3f}')} | "
      f"{cell('state_mib_per_device')} | "
      f"{cell('preconditioner_mib_per_device')} | "
      f"{cell('collective_mib_decomposition_step')} | "
      f"{cell('collective_mib_plain_step')} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main()
