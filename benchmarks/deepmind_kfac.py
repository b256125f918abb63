"""DeepMind's kfac-jax under its import name ``kfac_jax``, for the dm scripts.

DeepMind's PyPI package ``kfac-jax`` imports as ``kfac_jax``, the name of this
repository's package, which ``python -m benchmarks.dm_kfac_...`` run from the
repository root would find first. Importing this module, before anything
imports ``kfac_jax``, loads the ``kfac_jax`` of the interpreter's
site-packages (the virtual environment with ``kfac-jax==0.0.8``) and
registers it as ``kfac_jax`` for the whole process. Where site-packages holds
none (the repository's own environment), the repository's package is
imported, and ``check_deepmind_kfac`` stops the script.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import site
import sys
import types


def _site_kfac_jax() -> types.ModuleType:
  spec = importlib.machinery.PathFinder.find_spec(
    "kfac_jax", site.getsitepackages()
  )
  if spec is None:
    import kfac_jax  # pylint: disable=g-import-not-at-top

    return kfac_jax
  module = importlib.util.module_from_spec(spec)
  sys.modules["kfac_jax"] = module  # its own ``kfac_jax._src`` imports
  spec.loader.exec_module(module)
  return module


kfac_jax = _site_kfac_jax()


def check_deepmind_kfac() -> dict[str, str]:
  """The version and path of DeepMind's kfac-jax; exits where it is not."""
  if not hasattr(kfac_jax, "Optimizer") or not hasattr(
    kfac_jax, "register_sigmoid_cross_entropy_loss"
  ):
    raise SystemExit(
      f"kfac_jax at {kfac_jax.__file__} is not DeepMind's kfac-jax; run "
      "this script with the python of a venv that has kfac-jax==0.0.8."
    )
  return dict(kfac_jax=kfac_jax.__version__, kfac_jax_path=kfac_jax.__file__)
