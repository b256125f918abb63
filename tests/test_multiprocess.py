"""Several processes under one mesh: 2 processes x 4 simulated CPU devices
(``jax.distributed`` on localhost) train and checkpoint as one process with
8 devices does (``tests/multiprocess_program.py``).

The three processes run at once, each under a deadline; the first to fail
fails the test and the others are killed (a process whose peer died would
wait in a collective until its own deadline).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.multidevice import ROOT, TOLERANCE

MODULE = "tests.multiprocess_program"
# The three processes together took 2 min on a loaded 2-core machine (8
# training runs compiled in each, and the checkpoints); the deadline only
# ends a hang (a failure ends the test at once).
DEADLINE_S = 420


def free_port() -> int:
  """A port nothing listens on now (the coordinator binds it next)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def env_with_devices(count: int) -> dict[str, str]:
  """This environment with ``count`` simulated CPU devices added to the
  inherited ``XLA_FLAGS`` (``make test`` sets compile flags there)."""
  flags = os.environ.get("XLA_FLAGS", "")
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={count}",
  )


def run_together(
  commands: dict[str, tuple[list[str], dict[str, str]]],
  logs: pathlib.Path,
  deadline_s: float,
) -> None:
  """Runs every ``name: (argv, env)`` at once; fails with the log of the
  first to exit non-zero (or of all, past ``deadline_s``), after killing the
  rest."""
  running = {}
  for name, (argv, env) in commands.items():
    log = open(logs / f"{name}.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
    running[name] = (
      subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
      ),
      log,
    )
  deadline = time.monotonic() + deadline_s
  failed = None
  try:
    while failed is None and any(p.poll() is None for p, _ in running.values()):
      failed = next(
        (name for name, (p, _) in running.items() if p.poll() not in (None, 0)),
        None,
      )
      if time.monotonic() > deadline:
        failed = "deadline"
      time.sleep(0.2)
    failed = failed or next(
      (name for name, (p, _) in running.items() if p.returncode != 0), None
    )
  finally:
    for process, log in running.values():
      if process.poll() is None:
        process.kill()
        process.wait()
      log.close()
  if failed is not None:
    tails = {
      name: (logs / f"{name}.log").read_text()[-4000:]
      for name in (commands if failed == "deadline" else [failed])
    }
    header = (
      f"past the deadline ({deadline_s} s)"
      if failed == "deadline"
      else f"{failed} failed"
    )
    pytest.fail(
      header
      + ":\n"
      + "\n".join(f"--- {name}:\n{tail}" for name, tail in tails.items())
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(DEADLINE_S + 30)
def test_two_processes_train_and_checkpoint_as_one_process(tmp_path):
  """Every strategy on Auto and Explicit axes and the adaptive mode, and a
  HYBRID_OPT state moved to COMM_OPT through a checkpoint: updates, factors
  and preconditioners of both processes equal the single process's within
  the mesh tolerance. The checkpoints' own checks (restore onto the mesh,
  without a mesh in every process, and in one process onto 8, 4 and 1
  devices) run inside the programs."""
  port = free_port()
  program = [sys.executable, "-m", MODULE]
  commands = {
    f"process_{i}": (
      program
      + [
        "distributed",
        "--out",
        str(tmp_path),
        "--process-id",
        str(i),
        "--num-processes",
        "2",
        "--port",
        str(port),
      ],
      env_with_devices(4),
    )
    for i in range(2)
  }
  commands["single"] = (
    program + ["single", "--out", str(tmp_path)],
    env_with_devices(8),
  )
  run_together(commands, tmp_path, DEADLINE_S)
  reference = np.load(tmp_path / "single_0.npz")
  assert {
    key.split("/")[0] + "/" + key.split("/")[1]
    for key in reference
    if key.count("/") > 1
  } >= {
    f"{axes}/{strategy}"
    for axes in ("Auto", "Explicit")
    for strategy in ("COMM_OPT", "HYBRID_OPT", "MEM_OPT")
  }
  for i in range(2):
    run = np.load(tmp_path / f"distributed_{i}.npz")
    assert set(run) == set(reference)
    for key in reference:
      np.testing.assert_allclose(
        run[key], reference[key], **TOLERANCE, err_msg=f"process {i}: {key}"
      )
