"""kfac_jax: K-FAC gradient preconditioning as an optax transformation."""

from kfac_jax import schedules
from kfac_jax.capture import sampled_curvature
from kfac_jax.capture.api import trace_layers, value_grad_and_stats
from kfac_jax.capture.layers import LayerInfo
from kfac_jax.capture.statistics import LayerStatistics
from kfac_jax.distribution.placement import ShardedPreconditioners
from kfac_jax.distribution.strategy import (
  AssignmentStrategy,
  DistributedStrategy,
)
from kfac_jax.factors.running import LayerFactors
from kfac_jax.hyperparameters import ComputeMethod, DampingMode, WeightSharing
from kfac_jax.preconditioning.eigen import EigenPreconditioner
from kfac_jax.preconditioning.inverse import InversePreconditioner
from kfac_jax.preconditioning.subspace import SubspaceSolver
from kfac_jax.train_state import TrainState
from kfac_jax.transform.alias import kfac
from kfac_jax.transform.checks import NO_STATS
from kfac_jax.transform.labels import kfac_labels
from kfac_jax.transform.partition_specs import get_opt_state_partition_specs
from kfac_jax.transform.quadratic_model import (
  AdaptiveConfig,
  QuadraticModelState,
  SplitLoss,
)
from kfac_jax.transform.scale_by_kfac import (
  AccumulatorState,
  ScaleByKFACState,
  scale_by_kfac,
)

__version__ = "0.1.0"

__all__ = [
  "AccumulatorState",
  "AdaptiveConfig",
  "AssignmentStrategy",
  "ComputeMethod",
  "DampingMode",
  "DistributedStrategy",
  "EigenPreconditioner",
  "InversePreconditioner",
  "LayerInfo",
  "LayerFactors",
  "LayerStatistics",
  "NO_STATS",
  "QuadraticModelState",
  "ScaleByKFACState",
  "ShardedPreconditioners",
  "SplitLoss",
  "SubspaceSolver",
  "TrainState",
  "WeightSharing",
  "get_opt_state_partition_specs",
  "kfac",
  "kfac_labels",
  "sampled_curvature",
  "scale_by_kfac",
  "schedules",
  "trace_layers",
  "value_grad_and_stats",
]
