"""What the API reference (``docs/api.md``) must document, without Sphinx.

``public_members()`` lists every public member of the public modules
(``PUBLIC_MODULES``): their ``__all__``, or else the functions and classes
each defines, and the methods, properties and enum members those classes
define themselves. ``docs/conf.py`` fails the build when one has no entry;
``tests/test_docs.py`` checks ``documented(api.md)`` against the same list
without building.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
from collections.abc import Iterator

# kfac_jax.checkpoint is imported on its own (it needs the checkpoint extra,
# which the docs and test extras install).
PUBLIC_MODULES = (
  "kfac_jax",
  "kfac_jax.sampled_curvature",
  "kfac_jax.schedules",
  "kfac_jax.checkpoint",
)


def resolve(dotted: str) -> object | None:
  """The object a dotted name imports to (a module, or an attribute of
  one, as ``kfac_jax.sampled_curvature``), or ``None``."""
  parts = dotted.split(".")
  for split in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:split]))
    except ImportError:
      continue
    try:
      for attribute in parts[split:]:
        obj = getattr(obj, attribute)
    except AttributeError:
      return None
    return obj
  return None


def _members(module_name: str) -> Iterator[tuple[str, object]]:
  """(documented name, object) of a public module's public members."""
  module = resolve(module_name)
  names = getattr(module, "__all__", None)
  if names is None:
    names = [
      name
      for name, obj in vars(module).items()
      if not name.startswith("_")
      and getattr(obj, "__module__", None) == module.__name__
    ]
  for name in names:
    yield f"{module_name}.{name}", getattr(module, name)


def _class_members(cls: type) -> Iterator[str]:
  """The public methods, properties and enum members ``cls`` defines
  itself (not those Flax's dataclass machinery generates, as ``replace``)."""
  for name, value in vars(cls).items():
    if name.startswith("_"):
      continue
    if isinstance(value, enum.Enum):
      yield name
      continue
    function = (
      value.fget
      if isinstance(value, property)
      else getattr(value, "__func__", value)
    )
    if inspect.isfunction(function) and function.__module__.startswith(
      "kfac_jax"
    ):
      yield name


def public_members() -> list[str]:
  """Every name the API reference must document, dotted from its module:
  the submodules too (``automodule``'s entry)."""
  required = list(PUBLIC_MODULES[1:])
  for module_name in PUBLIC_MODULES:
    for name, obj in _members(module_name):
      if name in required:  # kfac_jax.__all__ names two of the submodules
        continue
      required.append(name)
      if inspect.isclass(obj):
        required.extend(f"{name}.{member}" for member in _class_members(obj))
  return required


_DIRECTIVE = re.compile(
  r"^\.\. auto(function|class|module|data|exception):: ([\w.]+)\s*\n"
  r"((?:[ \t]+:.*\n)*)",
  re.M,
)
_MEMBERS = re.compile(r":members:(.*)")


def documented(api_text: str) -> set[str]:
  """The names ``api_text``'s autodoc directives document: each directive's
  object and, with ``:members:``, the class members it lists (all those
  ``public_members`` requires when the option lists none)."""
  names = set()
  for kind, name, options in _DIRECTIVE.findall(api_text):
    names.add(name)
    listed = _MEMBERS.search(options)
    if listed is None:
      continue
    members = [
      member.strip() for member in listed.group(1).split(",") if member.strip()
    ]
    if not members:
      obj = resolve(name)
      if kind == "class" and inspect.isclass(obj):
        members = list(_class_members(obj))
      elif kind == "module" and obj is not None:
        members = [member.rsplit(".", 1)[1] for member, _ in _members(name)]
    names.update(f"{name}.{member}" for member in members)
  return names
