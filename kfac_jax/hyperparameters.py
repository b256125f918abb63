"""Hyper-parameters that are constants or schedules of the step count.

Every scalar hyper-parameter of ``scale_by_kfac`` may be a constant or a
callable ``step -> value`` (an optax schedule works). Constants are checked at
construction; schedules are called once at step 0 at construction to check the
type and range of what they return. Inside ``jit`` their later values (and
values ``optax.inject_hyperparams`` traces) cannot raise, so they are guarded
where they are used: an interval below 1 counts as 1, and ``all_valid``
tells the update whether real values are in range (``scale_by_kfac`` then
skips the parts of the step it feeds: factor update, decompositions, the
update).

Arguments that fix the program (enums, flags, integers) are Python-side
values checked when the transformation is built: enums given as the member or
its value's string; flags, integers and numbers as Python, NumPy or concrete
0-d JAX values. A traced value (what ``optax.inject_hyperparams`` hands a
transformation for a numeric argument not in its ``static_args``) is refused
with that advice.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

Schedule = Callable[[jax.Array], jax.typing.ArrayLike]
ScalarOrSchedule = float | int | Schedule

E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], name: str, value: object) -> E:
  """``value`` as a member of ``cls`` (case-insensitive string or member).

  Raises:
    ValueError: naming the argument ``name`` and the allowed values.
  """
  if isinstance(value, cls):
    return value
  if isinstance(value, str):
    try:
      return cls(value.lower())
    except ValueError:
      pass
  allowed = ", ".join(repr(m.value) for m in cls)
  raise ValueError(
    f"{name}={value!r} is not supported; use one of {allowed} "
    f"(or kfac_jax.{cls.__name__})."
  )


def _refuse_traced(name: str, value: object, static_arg: str | None) -> None:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} fixes the program and cannot be traced; with "
      "optax.inject_hyperparams, pass "
      f"static_args=({static_arg or name!r},)."
    )


def static_scalar(name: str, value: Any, static_arg: str | None = None) -> Any:
  """``value``, or a 0-d array's Python number; tracers refused.

  ``static_arg``: the argument ``static_args`` must name, when ``name`` is a
  field inside one (``AdaptiveConfig.max_damping`` inside ``adaptive``).
  """
  _refuse_traced(name, value, static_arg)
  if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
    return value.item()
  return value


def static_bool(
  name: str, value: object, static_arg: str | None = None
) -> bool:
  """A flag: a bool, NumPy bool or concrete 0-d bool array."""
  value = static_scalar(name, value, static_arg)
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TypeError(
    f"{name} must be True or False; got {value!r} ({type(value).__name__})."
  )


def static_positive_integer(
  name: str, value: Any, static_arg: str | None = None
) -> int:
  """A positive integer (NumPy integers and 0-d arrays accepted, bools not)."""
  return static_integer(name, value, 1, static_arg)


def static_integer(
  name: str, value: Any, minimum: int, static_arg: str | None = None
) -> int:
  """An integer ``≥ minimum`` (NumPy integers and 0-d arrays accepted, bools
  not)."""
  kind = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
  value = static_scalar(name, value, static_arg)
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be {kind}; got {value!r}.")
  try:
    integer = operator.index(value)
  except TypeError as e:
    raise TypeError(
      f"{name} must be {kind}; got {value!r} ({type(value).__name__})."
    ) from e
  if integer < minimum:
    raise ValueError(f"{name} must be {kind}; got {value!r}.")
  return integer


class ComputeMethod(enum.Enum):
  """How the preconditioner is formed from the factors."""

  EIGEN = "eigen"
  INVERSE = "inverse"

  @classmethod
  def parse(cls, value: ComputeMethod | str) -> ComputeMethod:
    return parse_enum(cls, "compute_method", value)


class WeightSharing(enum.Enum):
  """The rows of a layer that shares its weights over positions
  (``factors.batch``): every position a row (KFAC-expand), or one row per
  example (KFAC-reduce)."""

  EXPAND = "expand"
  REDUCE = "reduce"

  @classmethod
  def parse(cls, value: WeightSharing | str) -> WeightSharing:
    return parse_enum(cls, "weight_sharing", value)


class DampingMode(enum.Enum):
  """What the damping λ is measured against.

  ``RELATIVE``: each layer's curvature normalized to unit mean eigenvalue,
  ``Â = A / (tr A / dA)``, ``Ĝ = G / (tr G / dG)``, so λ is a fraction of
  the layer's own mean curvature and ``P`` keeps the gradient's scale.
  ``ABSOLUTE``: λ added to the factors as they are (KAISA's convention,
  whose factors scale with the batch size and the layer's inputs).
  """

  RELATIVE = "relative"
  ABSOLUTE = "absolute"

  @classmethod
  def parse(cls, value: DampingMode | str) -> DampingMode:
    return parse_enum(cls, "damping_mode", value)


@dataclasses.dataclass(frozen=True)
class Hyperparameter:
  """A checked constant or schedule; call it with the step count.

  ``is_valid``: the range check as a traced predicate, applied at each step
  to a value not checked at construction (a schedule's, or a traced one);
  ``None`` for an interval, which is raised to 1 instead.
  """

  name: str
  value: ScalarOrSchedule
  integer: bool = False
  is_valid: Callable[[jax.Array], jax.Array] | None = None

  @property
  def checked(self) -> bool:
    """Whether construction checked every value it can take."""
    return not (callable(self.value) or isinstance(self.value, jax.core.Tracer))

  def __call__(self, count: jax.Array) -> jax.Array:
    value = self.value(count) if callable(self.value) else self.value
    value = jnp.asarray(value, jnp.int32 if self.integer else jnp.float32)
    if self.integer and not self.checked:
      # `count % 0` is 0 in jnp (every step) but `count` in lax.rem (never
      # again): an interval below 1 counts as 1 rather than either.
      value = jnp.maximum(value, 1)
    return value


def hyperparameter(
  name: str,
  value: ScalarOrSchedule,
  is_valid: Callable[[float | jax.Array], bool | jax.Array],
  requirement: str,
  integer: bool = False,
) -> Hyperparameter:
  """Validates ``value`` (or a schedule's value at step 0) and wraps it.

  Args:
    name: the argument name, for messages.
    value: a number or a callable of the step count.
    is_valid: predicate on the (step-0) value, also applied to traced
      values at each step (``all_valid``): write it with jnp
      operators (``&``, not ``and`` or a chained ``<``).
    requirement: what a valid value is, e.g. ``"> 0"``, for messages.
    integer: whether the value must be an integer (update intervals).

  Raises:
    TypeError: the value (or what the schedule returns) is not a real scalar.
    ValueError: the value is outside its allowed range.
  """
  source = "" if not callable(value) else " (the schedule's value at step 0)"
  if callable(value):
    sample = _call_schedule(name, value)
  else:
    sample = value
  if isinstance(sample, bool) or not isinstance(
    sample, (numbers.Real, np.ndarray, jax.Array, np.generic)
  ):
    raise TypeError(
      f"{name} must be a real number or a callable of the step count "
      f"returning one; got {sample!r}{source} of type {type(sample).__name__}."
    )
  # optax.inject_hyperparams builds the transformation inside a jitted update
  # from traced values: only their shape and kind can be checked.
  traced = isinstance(sample, jax.core.Tracer)
  shape, dtype = (
    (sample.shape, sample.dtype)
    if traced
    else (np.shape(sample), np.asarray(sample).dtype)
  )
  kind_ok = (
    jnp.issubdtype(dtype, jnp.integer)
    if integer
    else jnp.issubdtype(dtype, jnp.number)
    and not jnp.issubdtype(dtype, jnp.complexfloating)
  )
  if shape != () or not kind_ok:
    expected = "an integer scalar" if integer else "a real scalar"
    advice = ""
    if integer and callable(value) and jnp.issubdtype(dtype, jnp.floating):
      advice = (
        " optax's schedules return floats: pass lambda count: "
        "jnp.round(schedule(count)).astype(jnp.int32)."
      )
    raise TypeError(
      f"{name} must be {expected}; got {sample!r}{source} with shape "
      f"{shape} and dtype {dtype}.{advice}"
    )
  # The predicates are jnp expressions: they check Python floats here and
  # traced values at each step (`all_valid`).
  runtime_check = None if integer else (lambda v: jnp.isfinite(v) & is_valid(v))
  if traced:
    return Hyperparameter(name, value, integer, runtime_check)
  given = np.asarray(sample).item()
  scalar = given
  # Checked as update will use it: int32 for intervals, float32 otherwise.
  if integer:
    representable = scalar <= np.iinfo(np.int32).max
  else:
    with np.errstate(over="ignore", under="ignore"):
      scalar = np.float32(scalar).item()
    representable = np.isfinite(scalar)
  if not np.isfinite(float(given)):
    raise ValueError(
      f"{name} must be {requirement} and finite; got {given!r}{source}."
    )
  if bool(is_valid(given)) and not representable:
    raise ValueError(
      f"{name}={given!r}{source} does not fit in "
      f"{'int32' if integer else 'float32'}, the type update uses."
    )
  if not representable or not bool(is_valid(scalar)):
    raise ValueError(
      f"{name} must be {requirement} (as {'int32' if integer else 'float32'}); "
      f"got {given!r}{source}."
    )
  return Hyperparameter(name, value, integer, runtime_check)


def all_valid(
  count: jax.Array, *hyperparameters: Hyperparameter | None
) -> jax.Array | None:
  """Whether every given hyper-parameter's value at ``count`` is in range
  (its ``is_valid``); ``None`` when construction checked them all (nothing
  to guard). Intervals (no ``is_valid``) are raised to 1 instead."""
  valid = None
  for hyperparameter in hyperparameters:
    if (
      hyperparameter is not None
      and not hyperparameter.checked
      and hyperparameter.is_valid is not None
    ):
      one = hyperparameter.is_valid(hyperparameter(count))
      valid = one if valid is None else valid & one
  return valid


def _call_schedule(name: str, schedule: Schedule) -> jax.typing.ArrayLike:
  """Calls ``schedule`` at step 0, concrete and traced; errors name ``name``."""
  step = jnp.asarray(0, jnp.int32)
  try:
    sample = schedule(step)
    jax.eval_shape(schedule, jax.ShapeDtypeStruct((), jnp.int32))
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(
      f"{name}: the schedule must be a function of the step count alone that "
      "jax can trace (use jnp.where, not Python if, on the step); calling it "
      f"failed with {type(e).__name__}: {e}"
    ) from e
  return sample


def positive(name: str, value: ScalarOrSchedule) -> Hyperparameter:
  # Not just > 0: XLA on CPU flushes float32 subnormals to 0, and a λ of 0
  # makes every decomposition of a rank-deficient factor non-finite.
  tiny = float(np.finfo(np.float32).tiny)
  return hyperparameter(
    name,
    value,
    lambda v: v >= tiny,
    f"> 0 and a normal float32 (>= {tiny:.3g})",
  )


def non_negative(name: str, value: ScalarOrSchedule) -> Hyperparameter:
  return hyperparameter(name, value, lambda v: v >= 0, ">= 0")


def positive_integer(name: str, value: ScalarOrSchedule) -> Hyperparameter:
  return hyperparameter(
    name, value, lambda v: v >= 1, "a positive integer", integer=True
  )


def decay(name: str, value: ScalarOrSchedule) -> Hyperparameter:
  """A running average's weight d in ``F ← d·F + (1 − d)·F_batch``: [0, 1].

  Both ends are well defined: 0 replaces ``F`` by ``F_batch`` (KAISA's
  ``exp_decay_factor_averaging`` gives 0 at the first steps), 1 keeps ``F``.
  """
  return hyperparameter(name, value, lambda v: (0 <= v) & (v <= 1), "in [0, 1]")


def floating_dtype(name: str, dtype: jnp.dtype | None) -> jnp.dtype | None:
  """Checks that ``dtype`` is a floating dtype (``None`` passes)."""
  if dtype is None:
    return None
  if isinstance(dtype, (jax.Array, np.ndarray)):
    raise TypeError(
      f"{name} must be a dtype, got an array: with optax.inject_hyperparams "
      f"pass it as a dtype instance (jnp.dtype(jnp.bfloat16): the scalar "
      f"type is callable, taken for a schedule) or in static_args=({name!r},)."
    )
  try:
    resolved = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name}={dtype!r} is not a dtype.") from e
  if not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(
      f"{name} must be a floating dtype such as jnp.float32 or "
      f"jnp.bfloat16; got {resolved}."
    )
  return resolved


def _narrower_than_float32(dtype: jnp.dtype) -> bool:
  return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


# float32's exponent range is not enough: float8_e8m0fnu has it, with no
# mantissa, sign or zero (the identity stored in it is NaN off the diagonal).
STORAGE_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float32, jnp.float64)))


def _check_storage(name: str, dtype: jnp.dtype) -> jnp.dtype:
  if dtype not in STORAGE_DTYPES:
    raise ValueError(
      f"{name}={dtype} cannot store K-FAC's factors or preconditioners; use "
      "jnp.float32 (the default), jnp.bfloat16 or jnp.float64."
    )
  # jax's Config makes its option attributes at run time.
  x64 = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]
  if dtype == jnp.float64 and not x64:
    # jax would store float32 instead, with only its generic warning.
    raise ValueError(
      f"{name}=float64 needs 64-bit mode: call "
      "jax.config.update('jax_enable_x64', True) before building the "
      "optimizer, or use jnp.float32."
    )
  return dtype


def factor_dtype(name: str, dtype: jnp.dtype | None) -> jnp.dtype | None:
  """``floating_dtype`` with float32's exponent range (bfloat16 passes).

  A factor holds second moments of activations and cotangents: an
  activation of 256 already squares past float16's 65504, and the running
  factor comes out infinite, is restarted at every decomposition step and
  leaves the layer's curvature unknown.
  """
  resolved = floating_dtype(name, dtype)
  if resolved is not None and _narrower_than_float32(resolved):
    raise ValueError(
      f"{name}={resolved} cannot hold the factors: their entries are "
      "squares of activations and cotangents, past its largest value "
      f"{jnp.finfo(resolved).max:g} for an activation of "
      f"{float(np.sqrt(jnp.finfo(resolved).max)):.0f}. Use jnp.float32 "
      "(the default) or jnp.bfloat16 (float32's range, half the memory; "
      "see the README's Mixed precision)."
    )
  return resolved if resolved is None else _check_storage(name, resolved)


def preconditioner_dtype(name: str, dtype: jnp.dtype) -> jnp.dtype:
  """``floating_dtype`` with float32's exponent range (bfloat16 passes).

  A stored preconditioner holds ``(F + λI)⁻¹``, whose entries reach ``1/λ``,
  or a factor's eigenvalues, which pass 65504 for large activations: past
  float16's (and float8's) largest value, where the decomposition comes out
  non-finite, is rejected, and the layer keeps its previous preconditioner
  (the identity at first) without a sign beyond ``rejected_decompositions``.
  """
  resolved = floating_dtype(name, dtype)
  if resolved is None:
    raise TypeError(
      f"{name} must be a floating dtype such as jnp.float32; got None."
    )
  info = jnp.finfo(resolved)
  if _narrower_than_float32(resolved):
    raise ValueError(
      f"{name}={resolved} cannot hold the preconditioners: entries of "
      f"(F + λI)⁻¹ reach 1/λ and factor eigenvalues can pass {info.max:g}, "
      "its largest value, so decompositions would be rejected and layers "
      "left unpreconditioned. Use jnp.bfloat16 (float32's range, half the "
      "memory; KAISA's float16 inv_dtype maps to it) or jnp.float32."
    )
  return _check_storage(name, resolved)
