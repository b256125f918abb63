"""The examples' datasets, read from local files (no download).

* ``load_mnist()``: the four canonical gzip IDX files of MNIST.
* ``load_image_classification()``: the CIFAR-10 subset (``train_10k.npz``,
  ``test_1k.npz``) when found, else scikit-learn's 8x8 digits, which ship
  inside its wheel, so the CIFAR example also runs on a fresh clone.
* ``load_shakespeare()``: Tiny Shakespeare's ``input.txt``.

Each dataset ``<name>/`` is looked for in, in order:

1. ``$KFAC_JAX_DATA/<name>/`` or ``$KFAC_JAX_DATA/`` when the environment
   variable ``KFAC_JAX_DATA`` is set (an explicit override: no fallback);
2. ``<repo>/../shared/data/<name>/`` (a shared data folder beside the checkout);
3. ``<repo>/examples/data/<name>/`` (the copies this repository ships: MNIST
   and Tiny Shakespeare).

Every file found is checked against the SHA256 sums in
``examples/data/SHA256SUMS`` before it is used.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pathlib
import struct
from collections.abc import Sequence
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


def candidate_dirs(name: str = "mnist") -> list[pathlib.Path]:
  """The folders searched for dataset ``name``, in order."""
  override = os.environ.get(ENV_VAR)
  if override:
    root = pathlib.Path(override).expanduser()
    return [root / name, root]
  return [SHARED_DATA_DIR / name, BUNDLED_DATA_DIR / name]


def find_dataset_dir(
  name: str, files: Sequence[str], required: bool = True
) -> pathlib.Path | None:
  """The first candidate folder holding all ``files`` of dataset ``name``."""
  candidates = candidate_dirs(name)
  for folder in candidates:
    if all((folder / f).is_file() for f in files):
      return folder
  if not required:
    return None
  tried = "\n  ".join(str(c) for c in candidates)
  hint = (
    f" (${ENV_VAR} is set; unset it to use the bundled copy)"
    if os.environ.get(ENV_VAR)
    else ""
  )
  raise FileNotFoundError(
    f"{name} not found{hint}. Looked for {sorted(files)} in:\n  {tried}"
  )


def _verified(
  folder: pathlib.Path, name: str, file: str, verify: bool
) -> pathlib.Path:
  """``folder / file`` after checking its SHA256 (key ``name/file``)."""
  path = folder / file
  if verify:
    want = _expected_sha256().get(f"{name}/{file}")
    got = _sha256(path)
    if want is None or got != want:
      raise ValueError(
        f"{path}: SHA256 {got} does not match the expected {want} "
        f"(from {CHECKSUMS_FILE})."
      )
  return path


def load_idx_gz(path: pathlib.Path) -> np.ndarray:
  """Reads a gzip-compressed IDX file of unsigned bytes."""
  raw = gzip.decompress(pathlib.Path(path).read_bytes())
  if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
    raise ValueError(f"{path}: not an unsigned-byte IDX file.")
  ndim = raw[3]
  shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
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
  folder = find_dataset_dir("mnist", list(MNIST_FILES.values()))
  arrays = {
    key: load_idx_gz(_verified(folder, "mnist", name, verify))
    for key, name in MNIST_FILES.items()
  }

  def images(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1).astype(np.float32) / 255.0

  data = MNIST(
    x_train=images(arrays["train_images"]),
    y_train=arrays["train_labels"].astype(np.int32),
    x_test=images(arrays["test_images"]),
    y_test=arrays["test_labels"].astype(np.int32),
  )
  assert data.x_train.shape == (60000, 784) and data.y_train.shape == (60000,)
  assert data.x_test.shape == (10000, 784) and data.y_test.shape == (10000,)
  return data


class ImageData(NamedTuple):
  """An image classification set: channels last, float32, standardized."""

  name: str
  x_train: np.ndarray  # [N, H, W, C]
  y_train: np.ndarray  # [N] int32
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int


CIFAR10_FILES = ("train_10k.npz", "test_1k.npz")


def _standardize(train: np.ndarray, test: np.ndarray):
  mean = train.mean(axis=(0, 1, 2))
  std = train.std(axis=(0, 1, 2))
  return (train - mean) / std, (test - mean) / std


def load_image_classification(verify: bool = True) -> ImageData:
  """The CIFAR-10 subset (10k/1k, 32x32x3), else sklearn's digits (8x8x1)."""
  folder = find_dataset_dir("cifar10", CIFAR10_FILES, required=False)
  if folder is not None:
    train = np.load(_verified(folder, "cifar10", CIFAR10_FILES[0], verify))
    test = np.load(_verified(folder, "cifar10", CIFAR10_FILES[1], verify))
    x_train, x_test = _standardize(
      train["x"].astype(np.float32) / 255, test["x"].astype(np.float32) / 255
    )
    return ImageData(
      "CIFAR-10 (10k/1k subset)",
      x_train,
      train["y"].astype(np.int32),
      x_test,
      test["y"].astype(np.int32),
      10,
    )
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top

  digits = load_digits()
  images = digits.images.astype(np.float32)[..., None] / 16
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(images))
  train, test = order[:1500], order[1500:]
  x_train, x_test = _standardize(images[train], images[test])
  return ImageData(
    "scikit-learn digits (8x8; CIFAR-10 not found)",
    x_train,
    labels[train],
    x_test,
    labels[test],
    10,
  )


def load_shakespeare(verify: bool = True) -> str:
  """Tiny Shakespeare (1,115,394 characters)."""
  folder = find_dataset_dir("tinyshakespeare", ["input.txt"])
  path = _verified(folder, "tinyshakespeare", "input.txt", verify)
  return path.read_text(encoding="utf-8")


if __name__ == "__main__":
  mnist = load_mnist()
  print(f"MNIST from {find_dataset_dir('mnist', list(MNIST_FILES.values()))}")
  for field, value in mnist._asdict().items():
    print(
      f"  {field}: {value.shape} {value.dtype} [{value.min()}, {value.max()}]"
    )
  images = load_image_classification()
  print(
    f"{images.name}: train {images.x_train.shape}, test {images.x_test.shape}"
  )
  print(f"Tiny Shakespeare: {len(load_shakespeare()):,} characters")
