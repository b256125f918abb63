"""``examples/multihost.py`` end to end: it launches itself as 2 processes x 4
simulated CPU devices, trains, checkpoints, and a second run resumes from
that checkpoint under another strategy. Tiny settings (a few steps of batch
64); the checks are the exit codes and what process 0 reports."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
  # The example's own --timeout stops its processes first.
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "examples.multihost",
      "--num-processes",
      "2",
      "--batch-size",
      "64",
      "--eval-size",
      "200",
      "--timeout",
      "200",
      *args,
    ],
    cwd=REPO_ROOT,
    env=dict(os.environ),
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )


@pytest.mark.multiprocess
@pytest.mark.timeout(520)
def test_multihost_example_trains_checkpoints_and_resumes(tmp_path):
  checkpoints = tmp_path / "checkpoints"
  first = run_example("--steps", "2", "--checkpoint-dir", str(checkpoints))
  assert first.returncode == 0, first.stdout + first.stderr
  assert "2 processes x 4 devices, mesh {'data': 2, 'fsdp': 4}, hybrid_opt" in (
    first.stdout
  )
  assert f"saved {checkpoints / 'step_2'}" in first.stdout
  second = run_example(
    "--steps",
    "1",
    "--strategy",
    "mem_opt",
    "--checkpoint-dir",
    str(checkpoints),
  )
  assert second.returncode == 0, second.stdout + second.stderr
  assert f"resumed from {checkpoints / 'step_2'}" in second.stdout
  assert "step 3: loss" in second.stdout
  assert f"saved {checkpoints / 'step_3'}" in second.stdout
  assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_3"]
