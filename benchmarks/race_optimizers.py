"""The convergence race's contestants and their settings.

``build_optimizer(name, lr, task)`` makes one contestant at its swept value:
the learning rate, or ``kfac_adaptive``'s initial damping λ₀.
``unsupported(name, task)`` says why a contestant cannot run a task (the
adaptive mode needs a split loss and no model state).
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import optax

import kfac_jax
from benchmarks import soap
from examples import tasks, training

# The adaptive mode with the eigen method (not raced unless asked for):
# eigh, the subspace solver, and the subspace solver with EKFAC's scaling,
# each at the decomposition period given here.
EIGEN_ADAPTIVE = {
  "kfac_eigh": dict(compute_method="eigen", inv_update_steps=5),
  "kfac_subspace": dict(
    compute_method="eigen", eigen_solver="subspace", inv_update_steps=5
  ),
  "kfac_subspace2": dict(
    compute_method="eigen", eigen_solver="subspace", inv_update_steps=2
  ),
  # Refresh by drift: bases kept, eigenvalues refreshed, eigh past the drift.
  "kfac_drift": dict(
    compute_method="eigen",
    eigen_solver=kfac_jax.SubspaceSolver(steps=0),
    inv_update_steps=5,
  ),
  "kfac_ekfac": dict(
    compute_method="eigen",
    eigen_solver="subspace",
    eigenvalue_correction=True,
    inv_update_steps=5,
  ),
}
# K-FAC with its levers, swept over the learning rate or over the KL clip κ
# (the learning rate then LEVERS_LR): once the clip binds, the step taken,
# lr·ν·P with ν = √(κ / (lr²·PᵀF̂P)), no longer depends on the rate.
# kfac_levers_adamw: the same on K-FAC's layers, the other params
# (embeddings, norms, layers left out) to AdamW at MUON_ADAM_LR, as Muon's.
# kfac_levers_scaled: swept over the rate with κ = KL_PER_LR2·lr², which
# makes the step lr·min(1, √(KL_PER_LR2 / PᵀF̂P))·P: the rate scales the
# step whether or not the clip binds (KFAC_SETTINGS is its point lr = 0.1).
# kfac_second_moment: kfac_levers_scaled with the gradient's second moment
# in K-FAC's eigenbasis in place of its eigenvalues (SECOND_MOMENT).
# kfac_second_moment_adamw: that on K-FAC's layers, the other params to
# AdamW at ADAMW_PER_LR·lr, so that one swept value sets both rates (0.01:
# the race's AdamW and K-FAC rates on the transformer, 3e-3 and 0.3).
LEVERS = (
  "kfac_levers",
  "kfac_levers_kl",
  "kfac_levers_adamw",
  "kfac_levers_scaled",
  "kfac_second_moment",
  "kfac_second_moment_adamw",
)
OPTIMIZERS = (
  "adamw",
  "muon",
  "soap",
  "kron",
  "kfac",
  "kfac_adaptive",
  "sgd",
  "adam",
  *LEVERS,
  *EIGEN_ADAPTIVE,
)
DEFAULT_OPTIMIZERS = OPTIMIZERS[:6]
FIRST_ORDER = ("sgd", "adam", "adamw", "muon", "soap", "kron")
# The optimizers without a learning rate: their sweep is over λ₀.
ADAPTIVE = ("kfac_adaptive", *EIGEN_ADAPTIVE)
KL_SCALED = (
  "kfac_levers_scaled",
  "kfac_second_moment",
  "kfac_second_moment_adamw",
)
SECOND_MOMENT_CONTESTANTS = ("kfac_second_moment", "kfac_second_moment_adamw")
# The contestants whose params outside K-FAC's layers go to AdamW.
OTHERS_TO_ADAMW = ("kfac_levers_adamw", "kfac_second_moment_adamw")
KL_SWEPT = ("kfac_levers_kl", "kfac_levers_adamw")
LEVERS_LR = 0.1
KL_PER_LR2 = 10.0
ADAMW_PER_LR = 0.01
KFAC_OPTIMIZERS = ("kfac", *LEVERS, *ADAPTIVE)
# Each optimizer's customary learning rate (SOAP: the paper's default; the
# adaptive ones: λ₀, that of KFAC_ADAPTIVE_SETTINGS, below); the sweep is
# center × LR_GRID.
CENTERS = {
  "sgd": 1e-2,
  "adam": 1e-3,
  "adamw": 1e-3,
  "muon": 1e-2,
  "soap": 3e-3,
  "kron": 3e-4,
  "kfac": 0.1,
  "kfac_levers": 0.1,
  "kfac_levers_kl": 0.1,  # κ
  "kfac_levers_adamw": 0.1,  # κ
  "kfac_levers_scaled": 0.1,
  "kfac_second_moment": 0.1,
  "kfac_second_moment_adamw": 0.1,
  **{name: 150.0 for name in ADAPTIVE},
}
LR_GRID = (1 / 3, 1.0, 3.0)
EXTENSION_FACTOR = 3.0  # beyond a winning edge of the grid
# Muon's Adam, for the parameters it does not orthogonalize (embeddings,
# biases, norms), at Adam's customary rate.
MUON_ADAM_LR = 1e-3

# K-FAC's settings, the same on every task: kfac_jax.kfac (scale_by_kfac,
# then SGD with momentum 0.9) at the swept learning rate. The one place to
# change them; the race records them in its JSON.
KFAC_SETTINGS = dict(
  damping=0.01, kl_clip=0.1, inv_update_steps=10, compute_method="inverse"
)
# ``kfac_levers`` (on request): KFAC_SETTINGS with issue 49's cheap-step
# levers, measured by phases.py: statistics only on the factor steps (every
# STATS_EVERY-th; the others run without, kfac_stats=NO_STATS), from a
# quarter of each batch, one row per example for weight-sharing layers, and
# layers with a factor over 2048 rows (of the race's tasks, only the
# BatchNorm CNN's 3136→256 Dense) left to the SGD after K-FAC.
STATS_EVERY = 10
KFAC_LEVERS = dict(
  factor_update_steps=STATS_EVERY,
  factor_batch_size=0.25,
  weight_sharing="reduce",
  max_factor_dim=2048,
)
# kfac_second_moment's changes: eigenbases, and SOAP's β₂ for the running
# second moment of the gradient in them.
SECOND_MOMENT = dict(compute_method="eigen", second_moment_decay=0.95)
# DeepMind kfac-jax's examples/autoencoder_mnist settings (damping adapted
# every 5 steps by 0.95^5 within [1e-5, 1000], inverses every 5 steps, factor
# decay 0.95), used for every task; its initial damping, 150, is the center
# of kfac_adaptive's sweep (CENTERS). The inverse method (with π-split
# damping in this mode) costs less per step than the eigen method.
KFAC_ADAPTIVE_SETTINGS = dict(
  compute_method="inverse",
  factor_decay=0.95,
  factor_update_steps=1,
  inv_update_steps=5,
  kl_clip=None,
)


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


def unsupported(name: str, task: tasks.Task) -> str | None:
  """Why contestant ``name`` cannot train ``task``, or None if it can."""
  if name in ADAPTIVE and (task.split_loss is None or task.stateful):
    return (
      f"{name} needs the loss split into network and loss "
      "(SplitLoss) and no model state; the task has "
      + ("model state (BatchNorm)" if task.stateful else "no split")
    )
  return None


def stats_every(name: str) -> int | None:
  """Every how many steps contestant ``name`` reads statistics (None: it
  is not K-FAC, or reads them every step)."""
  return STATS_EVERY if name in LEVERS else None


def muon_dimensions(layers: Any) -> Any:
  """``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` for the
  kernels of ``layers`` (a ``kfac_jax.trace_layers`` table): the contracted
  axes (a convolution's window and input channels) reduced, the output
  axes out, ``nn.scan``'s stack axes batched; every other parameter
  (embeddings, biases, norms) None, left to Muon's Adam."""
  from optax.contrib import MuonDimensionNumbers  # pylint: disable=g-import-not-at-top

  kernels = {}
  for layer in layers.values():
    if layer.kernel_key == "embedding":
      continue
    start = layer.stack_ndim
    middle = start + len(layer.contracted_shape)
    kernels[(*map(str, layer.path), layer.kernel_key)] = MuonDimensionNumbers(
      reduction_axis=tuple(range(start, middle)),
      output_axis=tuple(range(middle, len(layer.kernel_shape))),
    )

  def dimensions(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: kernels.get(
        tuple(kfac_jax.capture.layers.path_key_name(k) for k in path)
      ),
      params,
    )

  return dimensions


def muon(
  lr: float, task: tasks.Task
) -> tuple[optax.GradientTransformation, str]:
  """``optax.contrib.muon`` on the task's kernels, Adam (``MUON_ADAM_LR``)
  on the rest, and its description.

  With optax ≥ 0.2.7 (``muon_weight_dimension_numbers``) the kernels of the
  task's layer table are orthogonalized over their contracted and output
  axes, stacked ones per layer; without a table, or with an older optax,
  the 2-D parameters (Muon's default; older optax has no
  ``adam_learning_rate`` either, so the partition is built here).
  """
  accepted = inspect.signature(optax.contrib.muon).parameters
  if "adam_learning_rate" not in accepted:
    tx = optax.partition(
      {
        "muon": optax.chain(
          optax.contrib.scale_by_muon(), optax.scale_by_learning_rate(lr)
        ),
        "adam": optax.adam(MUON_ADAM_LR),
      },
      lambda params: jax.tree.map(
        lambda x: "muon" if x.ndim == 2 else "adam", params
      ),
    )
    return tx, (
      f"optax.contrib.scale_by_muon() on the 2-D parameters, lr="
      f"{lr:g}; optax.adam({MUON_ADAM_LR:g}) on the others"
    )
  kwargs = dict(adam_learning_rate=MUON_ADAM_LR)
  which = "2-D parameters"
  if task.layers is not None and "muon_weight_dimension_numbers" in accepted:
    kwargs["muon_weight_dimension_numbers"] = muon_dimensions(task.layers)
    which = "kernels of the layer table (no embeddings)"
  return (
    optax.contrib.muon(lr, **kwargs),
    f"optax.contrib.muon(lr={lr:g}, adam_learning_rate="
    f"{MUON_ADAM_LR:g}) on the {which}",
  )


def build_optimizer(
  name: str,
  lr: float,
  task: tasks.Task,
  curvature: str = "batch",
  curvature_examples: int | None = None,
  min_damping: float | None = None,
  inv_dtype: str = "float32",
) -> training.Optimizer:
  """One contestant at its swept value ``lr``: the learning rate, or
  ``kfac_adaptive``'s initial damping λ₀.

  ``curvature``: ``kfac_adaptive``'s factor statistics (``--curvature``);
  with ``"subset"``, from ``curvature_examples`` of each batch.
  ``min_damping``: ``kfac_adaptive``'s floor of λ (None: the library's).
  ``inv_dtype``: both K-FAC contestants' ``inv_dtype`` (``--inv-dtype``).
  """
  reason = unsupported(name, task)
  if reason is not None:
    raise ValueError(f"{name} on {task.name}: {reason}.")
  if name == "sgd":
    return training.Optimizer(
      "sgd",
      optax.sgd(lr, momentum=0.9, nesterov=True),
      description=f"optax.sgd(lr={lr:g}, momentum=0.9, nesterov=True)",
    )
  if name == "adam":
    return training.Optimizer(
      "adam", optax.adam(lr), description=f"optax.adam(lr={lr:g})"
    )
  if name == "adamw":
    return training.Optimizer(
      "adamw",
      optax.adamw(lr),
      description=f"optax.adamw(lr={lr:g}) (weight_decay 1e-4)",
    )
  if name == "muon":
    tx, description = muon(lr, task)
    return training.Optimizer("muon", tx, description=description)
  if name == "soap":
    return training.Optimizer(
      "soap",
      soap.soap(lr),
      description=f"benchmarks.soap.soap(lr={lr:g}) (b1 = b2 = 0.95, "
      "weight_decay 0.01, QR refresh every 10 steps)",
    )
  if name == "kron":
    kron = import_kron()
    if kron is None:
      raise SystemExit(
        "--optimizers kron needs the distributed-kron package: "
        "pip install distributed-kron (or leave kron out)."
      )
    return training.Optimizer(
      "kron",
      kron(lr, b1=0.9),
      description=f"distributed_kron.kron(lr={lr:g}, b1=0.9)",
    )
  if name in ("kfac", *LEVERS):
    settings = dict(
      KFAC_SETTINGS,
      **(KFAC_LEVERS if name in LEVERS else {}),
      **kfac_dtypes(inv_dtype),
    )
    if name in KL_SWEPT:
      lr, settings["kl_clip"] = LEVERS_LR, lr
    if name in SECOND_MOMENT_CONTESTANTS:
      settings.update(SECOND_MOMENT)
    if name in KL_SCALED:
      settings["kl_clip"] = float(f"{KL_PER_LR2 * lr**2:.3g}")
    tx = kfac_jax.kfac(
      learning_rate=lr, momentum=0.9, layers=task.layers, **settings
    )
    description = (
      f"kfac_jax.kfac(lr={lr:g}, momentum=0.9, "
      + ", ".join(f"{k}={v!r}" for k, v in settings.items())
      + ")"
    )
    if name in OTHERS_TO_ADAMW:
      adamw_lr = (
        MUON_ADAM_LR
        if name == "kfac_levers_adamw"
        else float(f"{ADAMW_PER_LR * lr:.3g}")
      )
      tx = optax.partition(
        {"kfac": tx, "other": optax.adamw(adamw_lr)},
        lambda params: kfac_jax.kfac_labels(
          params, layers=task.layers, **settings
        ),
      )
      description += (
        f" on its layers, optax.adamw({adamw_lr:g}) on the other "
        "params (kfac_jax.kfac_labels)"
      )
    if name in LEVERS:
      description += "; kfac_stats=NO_STATS between factor steps"
    return training.Optimizer(name, tx, uses_kfac=True, description=description)
  if name in ADAPTIVE:
    settings = dict(
      KFAC_ADAPTIVE_SETTINGS,
      **EIGEN_ADAPTIVE.get(name, {}),
      damping=lr,
      **kfac_dtypes(inv_dtype),
    )
    if curvature == "subset":
      settings["factor_batch_size"] = curvature_examples
    adaptive = adaptive_config(min_damping)
    return training.Optimizer(
      name,
      kfac_jax.scale_by_kfac(layers=task.layers, adaptive=adaptive, **settings),
      uses_kfac=True,
      needs_split_loss=True,
      separate_curvature=curvature in ("empirical", "gauss-newton"),
      description=f"kfac_jax.scale_by_kfac(adaptive={adaptive}, "
      + ", ".join(f"{k}={v!r}" for k, v in settings.items())
      + f"), curvature {curvature!r}",
    )
  raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}.")
