"""The benchmark scripts still run (tiny sizes); no timing is asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_smoke(script: str, out) -> subprocess.CompletedProcess[str]:
  result = subprocess.run(
      [sys.executable, f"benchmarks/{script}", "--smoke", "--no-progress",
       "--out", str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_step_time_smoke(tmp_path):
  result = run_smoke("step_time.py", tmp_path)
  (results_file,) = tmp_path.glob("step_time_*.json")
  results = json.loads(results_file.read_text())
  assert results  # a non-empty record of the run
  for variant in ("sgd", "kfac-eigen", "kfac-inverse"):
    assert variant in result.stdout


def test_scaling_smoke(tmp_path):
  run_smoke("scaling.py", tmp_path)
  (results_file,) = tmp_path.glob("scaling_*.json")
  rows = json.loads(results_file.read_text())["rows"]
  strategies = {(r["model"], r["devices"], r["strategy"]) for r in rows}
  assert ("balanced", 2, "mem_opt") in strategies
  for row in rows:
    if row["devices"] == 2 and row["strategy"] != "sgd":
      # Two devices share the decompositions (the smoke layers are balanced
      # to within one layer).
      assert row["decomposition_share"] < 0.75, row
