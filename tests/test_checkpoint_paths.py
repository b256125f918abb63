"""``checkpoint.save`` and ``restore`` take the paths Orbax takes.

Orbax reads and writes through ``etils.epath``, which also handles ``gs://``
URLs (pods write their checkpoints to GCS). Local ``epath.Path``s, relative
strings and ``pathlib`` paths round-trip for real. A ``gs://`` URL, which
``os.path.abspath`` turned into a local directory named ``gs:``, is shown to
reach Orbax's path layer as it is: under ``epath.testing.mock_epath``
(etils's own stand-in for a remote file system, here answering for GCS)
Orbax's and kfac_jax's checks see the URL itself.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from etils import epath

import kfac_jax
from kfac_jax import checkpoint
from tests.checkpoint_problems import MLP

URL = "gs://kfac-jax-test-bucket/run/step_1000"


def small_tree():
  params = MLP().init(jax.random.key(0), np.ones((2, 5), np.float32))["params"]
  tx = kfac_jax.scale_by_kfac()
  return {"params": params, "opt_state": tx.init(params)}


@pytest.mark.parametrize("kind", ["epath", "relative", "pathlib"])
def test_save_and_restore_take_orbax_path_types(kind, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  directory = {
    "epath": epath.Path(tmp_path) / "ckpt",
    "relative": "runs/ckpt",
    "pathlib": pathlib.Path("runs") / "ckpt",
  }[kind]
  tree = small_tree()
  checkpoint.save(directory, tree)
  restored = checkpoint.restore(directory, jax.eval_shape(lambda: tree))
  jax.tree.map(np.testing.assert_array_equal, restored, tree)
  if kind != "epath":  # Relative to the working directory, as before.
    assert (tmp_path / "runs" / "ckpt").is_dir()


@pytest.mark.parametrize("as_path", [False, True])
def test_a_gcs_url_reaches_orbax_as_it_is(as_path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # where os.path.abspath put a "gs:" folder
  directory = epath.Path(URL) if as_path else URL
  asked = []

  def exists(original, path):
    asked.append(str(path))
    return str(path) == URL or original(path)

  def isdir(original, path):
    asked.append(str(path))
    return False if str(path).startswith("gs://") else original(path)

  tree = small_tree()
  with epath.testing.mock_epath(exists=exists, isdir=isdir):
    # Orbax refuses to overwrite the (mock) existing directory: it was
    # asked about the URL, not about a local path.
    with pytest.raises(ValueError, match=f"Destination {URL} already exists"):
      checkpoint.save(directory, tree)
    with pytest.raises(
      FileNotFoundError, match=f"no checkpoint directory at '{URL}'"
    ):
      checkpoint.restore(directory, jax.eval_shape(lambda: tree))
  assert URL in asked
  assert not any(
    "gs:/" in path and not path.startswith("gs://") for path in asked
  ), asked
  assert not (tmp_path / "gs:").exists()
