"""Smoke tests of the examples: each runs end to end in a subprocess.

Tiny settings (3 steps of batch 64, evaluation on 500 examples) keep them fast;
they check the exit code, the written PNG and the results table, not the
numbers.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_example(
  module: str,
  out: pathlib.Path,
  *extra: str,
  data_dir: pathlib.Path | None = None,
  **env_overrides: str,
) -> subprocess.CompletedProcess[str]:
  env = dict(
    os.environ, MPLBACKEND="Agg", TQDM_MININTERVAL="5", **env_overrides
  )
  if data_dir is not None:
    env["KFAC_JAX_DATA"] = str(data_dir)
  return subprocess.run(
    [
      sys.executable,
      "-m",
      f"examples.{module}",
      "--steps",
      "3",
      "--batch-size",
      "64",
      "--eval-size",
      "500",
      "--out",
      str(out),
      *extra,
    ],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )


def table_rows(stdout: str) -> dict[str, list[str]]:
  """``{optimizer: cells}`` of the Markdown results table in ``stdout``."""
  rows = {}
  for line in stdout.splitlines():
    if line.startswith("|") and not line.startswith("|:"):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      rows[cells[0]] = cells[1:]
  return rows


@pytest.mark.parametrize(
  "module, stem, names",
  [
    ("mnist_classifier", "mnist_classifier", ("K-FAC", "SGD", "Adam")),
    (
      "mnist_autoencoder",
      "mnist_autoencoder",
      ("K-FAC", "K-FAC adaptive", "SGD", "Adam"),
    ),
    (
      "shakespeare_transformer",
      "shakespeare_transformer",
      ("K-FAC", "SGD", "AdamW"),
    ),
    ("nnx_mlp", "nnx_mlp", ("K-FAC", "SGD", "AdamW")),
  ],
)
def test_example_runs(
  module: str, stem: str, names: tuple[str, ...], tmp_path: pathlib.Path
) -> None:
  result = run_example(module, tmp_path)
  assert result.returncode == 0, (
    f"{module} failed:\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
  )

  png = tmp_path / f"{stem}.png"
  assert png.is_file(), f"{png} was not written; stdout:\n{result.stdout}"
  assert png.read_bytes()[:8] == PNG_MAGIC
  assert (tmp_path / f"{stem}.md").is_file()

  rows = table_rows(result.stdout)
  assert "optimizer" in rows, f"no results table in:\n{result.stdout}"
  for name in names:
    assert name in rows, f"{name} missing from the table:\n{result.stdout}"
    steps = rows[name][rows["optimizer"].index("steps")]
    assert steps == "3"
    # Losses and metrics came out as numbers.
    assert not {c.lower() for c in rows[name]} & {"nan", "inf", "-inf"}, rows[
      name
    ]


def test_resnet_example_falls_back_to_digits_without_cifar10(
  tmp_path: pathlib.Path,
) -> None:
  """A clone without the CIFAR-10 files trains on scikit-learn's digits."""
  empty = tmp_path / "no_data"
  empty.mkdir()
  result = run_example("cifar10_resnet", tmp_path, data_dir=empty)
  assert result.returncode == 0, (
    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
  )
  assert "scikit-learn digits (8x8; CIFAR-10 not found)" in result.stdout
  assert (tmp_path / "cifar10_resnet.png").read_bytes()[:8] == PNG_MAGIC
  rows = table_rows(result.stdout)
  for name in ("K-FAC", "SGD", "AdamW"):
    assert rows[name][rows["optimizer"].index("steps")] == "3"


def test_sharded_example_runs_on_eight_simulated_devices(
  tmp_path: pathlib.Path,
) -> None:
  # JAX_PLATFORMS: simulated CPU devices also where an accelerator is present.
  result = run_example(
    "sharded_mnist", tmp_path, "--strategy", "mem_opt", JAX_PLATFORMS="cpu"
  )
  assert result.returncode == 0, (
    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
  )
  assert "8 devices, mesh {'data': 2, 'fsdp': 4}, mem_opt" in result.stdout
  rows = table_rows(result.stdout)
  assert rows["mem_opt"][0] == "3"
  assert (tmp_path / "sharded_mnist.md").read_text().count("| mem_opt |") == 1
