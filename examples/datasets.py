"""MNIST for the examples, read from local IDX files (no download).

``load_mnist()`` looks for the four canonical gzip IDX files
(``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``) in, in order:

1. ``$KFAC_JAX_DATA/mnist/`` or ``$KFAC_JAX_DATA/`` when the environment
   variable ``KFAC_JAX_DATA`` is set (an explicit override: no fallback);
2. ``<repo>/../shared/data/mnist/`` (a shared data folder beside the checkout);
3. ``<repo>/examples/data/mnist/`` (the copy this repository ships).

Every file found is checked against the SHA256 sums in
``examples/data/SHA256SUMS`` before it is used.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pathlib
import struct
from typing import NamedTuple

import numpy as np

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = EXAMPLES_DIR.parent
BUNDLED_DATA_DIR = EXAMPLES_DIR / "data"
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
CHECKSUMS_FILE = BUNDLED_DATA_DIR / "SHA256SUMS"
ENV_VAR = "KFAC_JAX_DATA"

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


class MNIST(NamedTuple):
  """MNIST as arrays.

  Attributes:
    x_train: float32 ``[60000, 784]`` in ``[0, 1]``.
    y_train: int32 ``[60000]`` labels 0..9.
    x_test: float32 ``[10000, 784]`` in ``[0, 1]``.
    y_test: int32 ``[10000]``.
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def _expected_sha256() -> dict[str, str]:
  """``{"mnist/<file>": sha256}`` from ``examples/data/SHA256SUMS``."""
  sums = {}
  for line in CHECKSUMS_FILE.read_text().splitlines():
    line = line.strip()
    if line and not line.startswith("#"):
      digest, name = line.split(maxsplit=1)
      sums[name.lstrip("*")] = digest
  return sums


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def candidate_dirs() -> list[pathlib.Path]:
  """The folders ``load_mnist`` tries, in order."""
  override = os.environ.get(ENV_VAR)
  if override:
    root = pathlib.Path(override).expanduser()
    return [root / "mnist", root]
  return [SHARED_DATA_DIR / "mnist", BUNDLED_DATA_DIR / "mnist"]


def find_mnist_dir() -> pathlib.Path:
  """The first candidate folder holding all four MNIST files."""
  candidates = candidate_dirs()
  for folder in candidates:
    if all((folder / name).is_file() for name in MNIST_FILES.values()):
      return folder
  tried = "\n  ".join(str(c) for c in candidates)
  hint = (f" (${ENV_VAR} is set; unset it to use the bundled copy)"
          if os.environ.get(ENV_VAR) else "")
  raise FileNotFoundError(
      f"MNIST not found{hint}. Looked for {sorted(MNIST_FILES.values())} in:"
      f"\n  {tried}")


def load_idx_gz(path: pathlib.Path) -> np.ndarray:
  """Reads a gzip-compressed IDX file of unsigned bytes."""
  raw = gzip.decompress(pathlib.Path(path).read_bytes())
  if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
    raise ValueError(f"{path}: not an unsigned-byte IDX file.")
  ndim = raw[3]
  shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
  data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
  if data.size != int(np.prod(shape)):
    raise ValueError(f"{path}: header shape {shape} does not match the data.")
  return data.reshape(shape)


def load_mnist(verify: bool = True) -> MNIST:
  """Loads MNIST: flattened float32 images in [0, 1] and int32 labels.

  Args:
    verify: check each file's SHA256 against ``examples/data/SHA256SUMS``.

  Returns:
    ``MNIST(x_train [60000, 784], y_train [60000], x_test [10000, 784],
    y_test [10000])``.
  """
  folder = find_mnist_dir()
  expected = _expected_sha256() if verify else {}
  arrays = {}
  for key, name in MNIST_FILES.items():
    path = folder / name
    if verify:
      want = expected.get(f"mnist/{name}")
      got = _sha256(path)
      if want is None or got != want:
        raise ValueError(
            f"{path}: SHA256 {got} does not match the expected {want} "
            f"(from {CHECKSUMS_FILE}).")
    arrays[key] = load_idx_gz(path)

  def images(a: np.ndarray) -> np.ndarray:
    return (a.reshape(a.shape[0], -1).astype(np.float32) / 255.0)

  data = MNIST(
      x_train=images(arrays["train_images"]),
      y_train=arrays["train_labels"].astype(np.int32),
      x_test=images(arrays["test_images"]),
      y_test=arrays["test_labels"].astype(np.int32))
  assert data.x_train.shape == (60000, 784) and data.y_train.shape == (60000,)
  assert data.x_test.shape == (10000, 784) and data.y_test.shape == (10000,)
  return data


if __name__ == "__main__":
  mnist = load_mnist()
  print(f"MNIST from {find_mnist_dir()}")
  for field, value in mnist._asdict().items():
    print(f"  {field}: {value.shape} {value.dtype} "
          f"[{value.min()}, {value.max()}]")
