"""``python -m benchmarks.soak`` runs end to end (50 steps), reports success."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
SOAK = ("-m", "benchmarks.soak")


def test_help():
  result = subprocess.run(
    [sys.executable, *SOAK, "--help"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  assert "--steps" in result.stdout and "--out" in result.stdout


def test_short_soak_succeeds(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      *SOAK,
      "--steps",
      "50",
      "--log-every",
      "25",
      "--out",
      str(tmp_path),
      "--no-progress",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert result.returncode == 0, result.stdout + result.stderr[-5000:]
  (path,) = tmp_path.glob("soak_digits_50steps_*.json")
  report = json.loads(path.read_text())
  assert report["ok"] is True
  assert report["steps"] == 50
  assert report["non_finite_steps"] == 0
  assert report["first_non_finite_step"] is None
  assert report["skipped_factor_updates"] == 0
  assert report["rejected_decompositions"] == 0
  assert report["final_loss"] < report["initial_loss"]
  assert [point["step"] for point in report["curve"]] == [25, 50]
  assert report["dtypes"] == {
    "params": ["bfloat16"],
    "factors": ["bfloat16"],
    "preconditioners": ["float32"],
  }
  assert f"result: {path}" in result.stdout
