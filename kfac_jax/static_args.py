"""Python-side arguments: values that fix the program, checked when built.

Enums given as the member or its value's string; flags, integers and numbers
given as Python, NumPy or concrete 0-d JAX values. A traced value (what
``optax.inject_hyperparams`` hands a transformation for a numeric argument
not in its ``static_args``) is refused with that advice.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, TypeVar

import jax
import numpy as np

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
  raise ValueError(f"{name}={value!r} is not supported; use one of {allowed} "
                   f"(or kfac_jax.{cls.__name__}).")


def _refuse_traced(name: str, value: object, static_arg: str | None) -> None:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name} fixes the program and cannot be traced; with "
        "optax.inject_hyperparams, pass "
        f"static_args=({static_arg or name!r},).")


def static_scalar(name: str, value: Any, static_arg: str | None = None) -> Any:
  """``value``, or a 0-d array's Python number; tracers refused.

  ``static_arg``: the argument ``static_args`` must name, when ``name`` is a
  field inside one (``AdaptiveConfig.max_damping`` inside ``adaptive``).
  """
  _refuse_traced(name, value, static_arg)
  if isinstance(value, (np.ndarray, jax.Array)) and value.shape == ():
    return value.item()
  return value


def static_bool(name: str, value: object, static_arg: str | None = None) -> bool:
  """A flag: a bool, NumPy bool or concrete 0-d bool array."""
  value = static_scalar(name, value, static_arg)
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TypeError(f"{name} must be True or False; got {value!r} "
                  f"({type(value).__name__}).")


def static_positive_integer(name: str, value: object,
                            static_arg: str | None = None) -> int:
  """A positive integer (NumPy integers and 0-d arrays accepted, bools not)."""
  value = static_scalar(name, value, static_arg)
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a positive integer; got {value!r}.")
  try:
    integer = operator.index(value)
  except TypeError as e:
    raise TypeError(
        f"{name} must be a positive integer; got {value!r} "
        f"({type(value).__name__}).") from e
  if integer < 1:
    raise ValueError(f"{name} must be a positive integer; got {value!r}.")
  return integer
