"""DeepMind's kfac-jax beside ``step_time.py``: its run and the comparison.

DeepMind's package imports as ``kfac_jax`` too, so ``dm_kfac_step_time.py``
runs in its own virtual environment (``--dm-python``), in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

from benchmarks import step_variants

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_DM_PYTHON = "/tmp/dm-venv/bin/python"
DM_VENV_COMMAND = (
  "python3 -m venv /tmp/dm-venv && /tmp/dm-venv/bin/pip install "
  "kfac-jax==0.0.8 jax==0.8.2 jaxlib==0.8.2 flax optax tqdm"
)
# Targets for (ours / DeepMind) of each ratio-to-SGD, K-FAC inverse method.
DM_TARGETS = dict(
  plain_x=0.9, decomposition_x=0.5, amortized_x=0.75, compile_x=0.5
)


def ensure_dm_python(args: argparse.Namespace) -> str | None:
  python = args.dm_python
  if os.path.exists(python):
    return python
  if not args.dm_create_venv:
    print(
      f"--dm: {python} not found. Create it with\n  {DM_VENV_COMMAND}\n"
      "or pass --dm-create-venv.",
      file=sys.stderr,
    )
    return None
  print(f"Creating the DeepMind venv: {DM_VENV_COMMAND}", file=sys.stderr)
  subprocess.run(DM_VENV_COMMAND, shell=True, check=True)
  return "/tmp/dm-venv/bin/python"


def run_dm(
  args: argparse.Namespace, out_dir: pathlib.Path, stamp: str
) -> dict[str, Any] | None:
  python = ensure_dm_python(args)
  if python is None:
    return None
  out_file = out_dir.resolve() / f"dm_kfac_{stamp}.json"
  cmd = [
    python,
    "-m",
    "benchmarks.dm_kfac_step_time",
    "--batch-size",
    "256",
    "--rounds",
    str(args.dm_rounds or args.rounds),
    "--steps-per-round",
    str(args.steps_per_round),
    "--warmup-steps",
    str(args.warmup_steps),
    "--inverse-update-period",
    str(args.inv_update_steps),
    "--learning-rate",
    str(args.learning_rate),
    "--damping",
    str(args.damping),
    "--estimation-mode",
    args.dm_estimation_mode,
    "--seed",
    str(args.seed),
    "--out",
    str(out_file),
  ]
  if args.no_progress:
    cmd.append("--no-progress")
  if args.smoke:
    cmd.append("--smoke")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  print("Running DeepMind kfac-jax:", " ".join(cmd), file=sys.stderr)
  # From the repository root, where benchmarks.deepmind_kfac imports the
  # venv's kfac_jax in place of ours.
  done = subprocess.run(cmd, check=False, env=env, cwd=REPO)
  if done.returncode != 0 or not out_file.exists():
    print(
      f"DeepMind run failed (exit {done.returncode}); no comparison.",
      file=sys.stderr,
    )
    return None
  return json.loads(out_file.read_text())


def dm_comparison(
  results: list[dict[str, Any]], dm: dict[str, Any]
) -> dict[str, Any] | None:
  ours = next(
    (r for r in results if r["model"] == "autoencoder" and r["batch"] == 256),
    None,
  )
  if ours is None:
    return None
  table = {}
  for variant in (
    "kfac-inverse",
    "kfac-inverse-gfs",
    "kfac-eigen",
    "kfac-eigen-gfs",
  ):
    s = ours["variants"].get(variant)
    if s is None:
      continue
    d = dm["variants"]["dm-kfac"]
    table[variant] = {
      key: dict(
        ours=s[key],
        dm=d[key],
        ratio=s[key] / d[key],
        target=(
          DM_TARGETS[key]
          if step_variants.kfac_method(variant) == "inverse"
          else None
        ),
      )
      for key in DM_TARGETS
    }
  return table
