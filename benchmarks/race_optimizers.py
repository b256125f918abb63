"""The convergence race's contestants and their settings.

``build_optimizer(name, lr, task)`` makes one contestant at its swept value:
the learning rate, or ``kfac_adaptive``'s initial damping λ₀.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

import kfac_jax
from examples import tasks
from examples import training

# The adaptive mode with the eigen method (not raced unless asked for):
# eigh, the subspace solver, and the subspace solver with EKFAC's scaling,
# each at the decomposition period given here.
EIGEN_ADAPTIVE = {
    "kfac_eigh": dict(compute_method="eigen", inv_update_steps=5),
    "kfac_subspace": dict(compute_method="eigen", eigen_solver="subspace",
                          inv_update_steps=5),
    "kfac_subspace2": dict(compute_method="eigen", eigen_solver="subspace",
                           inv_update_steps=2),
    "kfac_ekfac": dict(compute_method="eigen", eigen_solver="subspace",
                       eigenvalue_correction=True, inv_update_steps=5),
}
OPTIMIZERS = ("sgd", "adam", "muon", "kron", "kfac", "kfac_adaptive",
              *EIGEN_ADAPTIVE)
DEFAULT_OPTIMIZERS = OPTIMIZERS[:6]
FIRST_ORDER = ("sgd", "adam", "muon", "kron")
# The optimizers without a learning rate: their sweep is over λ₀.
ADAPTIVE = ("kfac_adaptive", *EIGEN_ADAPTIVE)
KFAC_OPTIMIZERS = ("kfac", *ADAPTIVE)
# Each optimizer's customary learning rate (the adaptive ones: λ₀, that of
# KFAC_ADAPTIVE_SETTINGS, below); the sweep is center × LR_GRID.
CENTERS = {"sgd": 1e-2, "adam": 1e-3, "muon": 1e-2, "kron": 3e-4,
           "kfac": 0.1, **{name: 150.0 for name in ADAPTIVE}}
LR_GRID = (1 / 3, 1.0, 3.0)
EXTENSION_FACTOR = 3.0  # beyond a winning edge of the grid
MUON_ADAM_LR = 1e-3

# K-FAC's settings per task: those of the matching example (chosen there by
# short sweeps; the Shakespeare ones were not tuned at all). Only the
# learning rate is swept here, as for every other optimizer.
KFAC_SETTINGS = {
    "autoencoder": dict(compute_method="inverse", damping=0.1, kl_clip=1e-2,
                        factor_decay=0.95, factor_update_steps=1,
                        inv_update_steps=10),
    # examples/cifar10_resnet.py's. (The autoencoder's damping 0.1 and
    # kl_clip 1e-2 reach 40% and then collapse to chance on this CNN.)
    "cifar": dict(compute_method="inverse", damping=0.3, kl_clip=1e-3,
                  factor_decay=0.95, factor_update_steps=10,
                  inv_update_steps=10),
    "shakespeare": dict(compute_method="inverse", damping=0.3, kl_clip=1e-3,
                        factor_decay=0.95, factor_update_steps=1,
                        inv_update_steps=10),
}
# DeepMind kfac-jax's examples/autoencoder_mnist settings (damping adapted
# every 5 steps by 0.95^5 within [1e-5, 1000], inverses every 5 steps, factor
# decay 0.95), used for every task; its initial damping, 150, is the center
# of kfac_adaptive's sweep (CENTERS). The inverse method (with π-split
# damping in this mode) costs less per step than the eigen method.
KFAC_ADAPTIVE_SETTINGS = dict(
    compute_method="inverse", factor_decay=0.95, factor_update_steps=1,
    inv_update_steps=5, kl_clip=None)


def import_kron():
  """``distributed_kron.kron``, or None when the package is missing.

  distributed-kron 2.0.0 annotates an argument as ``PartitionSpec[str, str]``,
  which fails at import with the jax versions kfac_jax supports
  (``PartitionSpec`` is not generic there). A no-op ``__class_getitem__``
  lets the annotation evaluate; nothing else of jax is touched.
  """
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top
  if not hasattr(PartitionSpec, "__class_getitem__"):
    PartitionSpec.__class_getitem__ = classmethod(lambda cls, _: cls)
  try:
    import distributed_kron  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return distributed_kron.kron


def adaptive_config(min_damping: float | None) -> kfac_jax.AdaptiveConfig:
  """``kfac_adaptive``'s settings: the library's, with λ's floor if given."""
  if min_damping is None:
    return kfac_jax.AdaptiveConfig()
  return kfac_jax.AdaptiveConfig(min_damping=min_damping)


def kfac_dtypes(inv_dtype: str) -> dict[str, Any]:
  """The K-FAC contestants' ``inv_dtype`` setting (none for the default)."""
  if inv_dtype == "float32":
    return {}
  return dict(inv_dtype=jnp.dtype(inv_dtype))


def build_optimizer(name: str, lr: float, task: tasks.Task,
                    curvature: str = "batch",
                    curvature_examples: int | None = None,
                    min_damping: float | None = None,
                    inv_dtype: str = "float32") -> training.Optimizer:
  """One contestant at its swept value ``lr``: the learning rate, or
  ``kfac_adaptive``'s initial damping λ₀.

  ``curvature``: ``kfac_adaptive``'s factor statistics (``--curvature``);
  with ``"subset"``, from ``curvature_examples`` of each batch.
  ``min_damping``: ``kfac_adaptive``'s floor of λ (None: the library's).
  ``inv_dtype``: both K-FAC contestants' ``inv_dtype`` (``--inv-dtype``).
  """
  if name == "sgd":
    return training.Optimizer(
        "sgd", optax.sgd(lr, momentum=0.9, nesterov=True),
        description=f"optax.sgd(lr={lr:g}, momentum=0.9, nesterov=True)")
  if name == "adam":
    return training.Optimizer("adam", optax.adam(lr),
                            description=f"optax.adam(lr={lr:g})")
  if name == "muon":
    return training.Optimizer(
        "muon", optax.contrib.muon(lr, adam_learning_rate=MUON_ADAM_LR),
        description=(f"optax.contrib.muon(lr={lr:g}, "
                     f"adam_learning_rate={MUON_ADAM_LR:g})"))
  if name == "kron":
    kron = import_kron()
    if kron is None:
      raise SystemExit("--optimizers kron needs the distributed-kron package: "
                       "pip install distributed-kron (or leave kron out).")
    return training.Optimizer("kron", kron(lr, b1=0.9),
                            description=f"distributed_kron.kron(lr={lr:g}, "
                            "b1=0.9)")
  if name == "kfac":
    settings = dict(KFAC_SETTINGS[task.name], **kfac_dtypes(inv_dtype))
    return training.Optimizer(
        "kfac",
        kfac_jax.kfac(learning_rate=lr, momentum=0.9, layers=task.layers,
                      **settings),
        uses_kfac=True,
        description=f"kfac_jax.kfac(lr={lr:g}, momentum=0.9, " + ", ".join(
            f"{k}={v!r}" for k, v in settings.items()) + ")")
  if name in ADAPTIVE:
    settings = dict(KFAC_ADAPTIVE_SETTINGS, **EIGEN_ADAPTIVE.get(name, {}),
                    damping=lr, **kfac_dtypes(inv_dtype))
    if curvature == "subset":
      settings["factor_batch_size"] = curvature_examples
    adaptive = adaptive_config(min_damping)
    return training.Optimizer(
        name,
        kfac_jax.scale_by_kfac(layers=task.layers, adaptive=adaptive,
                               **settings),
        uses_kfac=True, needs_split_loss=True,
        separate_curvature=curvature in ("empirical", "gauss-newton"),
        description=f"kfac_jax.scale_by_kfac(adaptive={adaptive}, " +
        ", ".join(f"{k}={v!r}" for k, v in settings.items()) +
        f"), curvature {curvature!r}")
  raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}.")
