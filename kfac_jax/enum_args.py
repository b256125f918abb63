"""Enum-valued arguments given as the enum or its value's string."""

from __future__ import annotations

import enum
from typing import TypeVar

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
