"""Multi-host K-FAC: one process per host, one mesh over all their devices.

Every process runs this same program (as on a TPU pod slice or a GPU
cluster): it joins the others with ``jax.distributed.initialize``, builds a
``("data", "fsdp")`` mesh over all devices, reads its own shard of the data
and feeds its rows of each global batch
(``jax.make_array_from_process_local_data``); the optimizer state is created
in the shardings ``kfac_jax.get_opt_state_partition_specs`` gives, and
``kfac_jax.checkpoint`` saves and restores it from every process. Run again,
it resumes from the latest checkpoint in ``--checkpoint-dir``.

  python -m examples.multihost --num-processes 2  # 2 processes x 4 CPU devices
  python -m examples.multihost                    # on each host of a cluster

With ``--num-processes`` it launches that many copies of itself on this
machine, each with ``--local-devices`` simulated CPU devices and a local
coordinator, and fails as soon as one of them does. Without it,
``jax.distributed.initialize()`` takes the processes from the cluster's
environment (TPU, SLURM, ...); ``--checkpoint-dir`` can be a ``gs://`` URL.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--num-processes",
    type=int,
    default=None,
    help="launch this many local processes (a one-machine "
    "test); omit on a cluster",
  )
  p.add_argument(
    "--local-devices",
    type=int,
    default=4,
    help="simulated CPU devices per launched process",
  )
  p.add_argument(
    "--steps",
    type=int,
    default=30,
    help="training steps of this run (after any resumed ones)",
  )
  p.add_argument(
    "--batch-size",
    type=int,
    default=256,
    help="global batch: a multiple of the devices",
  )
  p.add_argument(
    "--strategy",
    default="hybrid_opt",
    choices=["comm_opt", "hybrid_opt", "mem_opt"],
    help="KAISA's distribution strategy over the whole mesh",
  )
  p.add_argument(
    "--checkpoint-dir",
    default="results/multihost_checkpoints",
    help="where step_<n> checkpoints go (any path Orbax takes)",
  )
  p.add_argument(
    "--eval-size",
    type=int,
    default=2000,
    help="test images for the final accuracy",
  )
  p.add_argument(
    "--timeout",
    type=float,
    default=300,
    help="seconds the launched processes may take",
  )
  p.add_argument("--seed", type=int, default=0)
  # Set by the launcher for the processes it starts.
  p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for flag in ("steps", "batch_size", "eval_size", "local_devices"):
    if getattr(args, flag) < 1:
      raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1.")
  if args.num_processes is not None and args.num_processes < 1:
    raise SystemExit("--num-processes must be >= 1.")
  return args


def launch(args: argparse.Namespace, argv: list[str]) -> int:
  """Runs ``args.num_processes`` copies of this program here; returns 1 as
  soon as one fails (after stopping the others), else 0."""
  with socket.socket() as s:  # A free port for the coordinator.
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  flags = os.environ.get("XLA_FLAGS", "")
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=(
      f"{flags} --xla_force_host_platform_device_count={args.local_devices}"
    ),
  )
  logs = pathlib.Path(tempfile.mkdtemp(prefix="kfac_jax_multihost_"))
  processes = []
  for i in range(args.num_processes):
    with open(logs / f"process_{i}.log", "w", encoding="utf-8") as log:
      # Process 0 reports to this terminal; the rest goes to the logs.
      processes.append(
        subprocess.Popen(
          [
            sys.executable,
            "-m",
            "examples.multihost",
            *argv,
            "--process-id",
            str(i),
            "--coordinator",
            f"localhost:{port}",
          ],
          env=env,
          stdout=None if i == 0 else log,
          stderr=log,
        )
      )
  deadline = time.monotonic() + args.timeout
  while True:
    codes = [p.poll() for p in processes]
    failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
    if failed is not None or None not in codes or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  for p in processes:  # A process whose peer died waits in a collective.
    if p.poll() is None:
      p.kill()
    p.wait()
  if failed is None and None not in codes:
    shutil.rmtree(logs)
    return 0
  culprit = 0 if failed is None else failed
  reason = (
    f"did not finish in {args.timeout:g} s"
    if failed is None
    else f"exited with status {codes[failed]}"
  )
  log = logs / f"process_{culprit}.log"
  print(
    f"process {culprit} {reason}; the end of its log ({log}):\n"
    f"{log.read_text()[-3000:]}",
    file=sys.stderr,
  )
  return 1


def train(args: argparse.Namespace) -> int:
  """This process's part of the training (``jax.distributed`` joined)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P

  import kfac_jax  # pylint: disable=g-import-not-at-top
  from examples import datasets, models  # pylint: disable=g-import-not-at-top
  from kfac_jax import checkpoint  # pylint: disable=g-import-not-at-top

  process, processes = jax.process_index(), jax.process_count()
  report = print if process == 0 else lambda *_, **__: None
  mesh = jax.make_mesh(
    (processes, jax.local_device_count()),
    ("data", "fsdp"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  if args.batch_size % mesh.size:
    raise SystemExit(
      f"--batch-size {args.batch_size} must be a multiple of "
      f"the {mesh.size} devices."
    )
  # Each process reads its own shard of the data, as a real loader would.
  mnist = datasets.load_mnist()
  x_train, y_train = (a[process::processes] for a in mnist[:2])
  x_test, y_test = (a[: args.eval_size][process::processes] for a in mnist[2:])
  batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
  global_batch = lambda *local: [
    jax.make_array_from_process_local_data(batch_sharding, a) for a in local
  ]

  model = models.MLP(widths=(256, 128), outputs=10)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x_train[:1])["params"]
  # FSDP: kernels [in, out] sharded on their output axis where it divides.
  fsdp = mesh.shape["fsdp"]
  params_specs = jax.tree.map(
    lambda p: (
      P(None, "fsdp") if p.ndim == 2 and p.shape[1] % fsdp == 0 else P()
    ),
    shapes,
  )
  kfac_kwargs = dict(
    learning_rate=0.1,
    momentum=0.9,
    damping=0.01,
    kl_clip=0.1,
    inv_update_steps=10,
    mesh_axes=("data", "fsdp"),
    grad_worker_fraction=args.strategy,
    params_partition_specs=params_specs,
  )
  sgd = optax.sgd(0.1, momentum=0.9)
  tx = optax.chain(kfac_jax.scale_by_kfac(**kfac_kwargs), sgd)
  named = lambda specs: jax.tree.map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
  )

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params, x, y):
    return (model.apply({"params": params}, x).argmax(-1) == y).mean()

  with jax.set_mesh(mesh):
    # Every array is made in its sharding: no process holds all of them.
    params = jax.jit(
      lambda key: model.init(key, x_train[:1])["params"],
      out_shardings=named(params_specs),
    )(jax.random.key(args.seed))
    state_specs = kfac_jax.get_opt_state_partition_specs(
      params, chain_with=sgd, **kfac_kwargs
    )
    opt_state = jax.jit(tx.init, out_shardings=named(state_specs))(params)
    directory = epath.Path(args.checkpoint_dir)
    start, params, opt_state = resume(
      directory, params, opt_state, kfac_kwargs, report
    )
    report(
      f"{processes} processes x {jax.local_device_count()} devices, "
      f"mesh {dict(mesh.shape)}, {args.strategy}",
      flush=True,
    )
    rng = np.random.default_rng([args.seed, process, start])
    local = args.batch_size // processes
    for step in range(start, start + args.steps):
      index = rng.choice(len(x_train), local, replace=False)
      params, opt_state, loss = train_step(
        params, opt_state, *global_batch(x_train[index], y_train[index])
      )
      # One step in flight: simulated CPU devices can deadlock in a
      # collective otherwise (examples/sharded_mnist.py).
      loss = float(loss)
      if (
        step == start or (step + 1) % 10 == 0 or step + 1 == start + args.steps
      ):
        report(f"step {step + 1}: loss {loss:.4f}", flush=True)
    test_accuracy = float(accuracy(params, *global_batch(x_test, y_test)))
    report(
      f"test accuracy {100 * test_accuracy:.2f}% "
      f"({processes * len(x_test)} images)",
      flush=True,
    )
    path = directory / f"step_{start + args.steps}"
    # Without the eigenbases (KAISA's default): `resume` recomputes them,
    # so a run may resume under another strategy or device count.
    checkpoint.save(
      path,
      {"params": params, "opt_state": opt_state},
      include_preconditioners=False,
    )
    report(f"saved {path}", flush=True)
  return 0


def resume(directory, params, opt_state, kfac_kwargs, report):
  """``(step, params, opt_state)`` of the latest ``step_<n>`` checkpoint in
  ``directory``, each array in the sharding of the fresh one given (called
  by every process, under the mesh); ``(0, params, opt_state)`` if none."""
  import jax  # pylint: disable=g-import-not-at-top

  from kfac_jax import checkpoint  # pylint: disable=g-import-not-at-top

  steps = (
    [int(p.name.split("_")[1]) for p in directory.glob("step_*")]
    if directory.exists()
    else []
  )
  if not steps:
    return 0, params, opt_state
  step = max(steps)
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    {"params": params, "opt_state": opt_state},
  )
  kfac_state = target["opt_state"][0]._replace(preconditioners=None)
  target["opt_state"] = (kfac_state, *target["opt_state"][1:])
  restored = checkpoint.restore(directory / f"step_{step}", target)
  restored = checkpoint.recompute_preconditioners(restored, **kfac_kwargs)
  report(f"resumed from {directory / f'step_{step}'}", flush=True)
  return step, restored["params"], restored["opt_state"]


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.num_processes is not None and args.process_id is None:
    return launch(args, argv)
  import jax  # pylint: disable=g-import-not-at-top

  if args.process_id is not None:  # Launched here by --num-processes.
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
      initialization_timeout=60,
    )
  else:  # On a cluster: the processes come from its environment.
    jax.distributed.initialize()
  try:
    return train(args)
  except BaseException:  # pylint: disable=broad-except
    # Exit at once: jax.distributed's shutdown at exit would wait for the
    # other processes, which wait for this one in a collective.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access


if __name__ == "__main__":
  raise SystemExit(main())
