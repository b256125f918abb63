"""Sphinx configuration of kfac_jax's docs (``make docs``).

The pages are MyST Markdown; the API reference (``api.md``) is autodoc over
the package's Google-style docstrings (napoleon). The build fails when a
public member of a public module has no entry there (``check_api_coverage``;
the list: ``api_coverage.public_members``).

Links to Python, jax, optax and Flax go through intersphinx, from
inventories this file writes from ``docs/inventories/*.txt`` (the objects
these pages name, with their pages on those sites), so the build reads no
network. Types are shown by their public names (``jax.Array``, not
``jax.jaxlib._jax.Array``; ``kfac_jax.LayerFactors``, not the module that
defines it), so that they link.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
import zlib
from collections.abc import Iterator

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS))  # api_coverage

import api_coverage  # noqa: E402  pylint: disable=g-import-not-at-top

import kfac_jax  # noqa: E402  pylint: disable=g-import-not-at-top

logger = logging.getLogger(__name__)

project = "kfac_jax"
author = "kfac_jax contributors"
copyright = "kfac_jax contributors, Apache-2.0"  # pylint: disable=redefined-builtin
release = kfac_jax.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.intersphinx",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# The docstrings are Google style, with RST literals (``x``) and a few
# ``.. math::`` blocks. Fields of the NamedTuple states are documented by
# their ``Attributes:`` sections (as :ivar: fields, so they do not register a
# second object beside autodoc's own), and only there: types go to the
# documented parameters alone, not to a second list of the fields as the
# constructor's parameters.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
# The package's aliases by name, not expanded into their unions.
autodoc_type_aliases = {
  "ScalarOrSchedule": "ScalarOrSchedule",
  "Schedule": "Schedule",
  "hp.Schedule": "Schedule",
  "LayerTable": "LayerTable",
  "TracedLayers": "TracedLayers",
}
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False
autosummary_generate = False
# A reference that resolves nowhere warns, except the API page's type hints
# (type_hints_may_stay_text).
nitpicky = True

html_theme = "furo"
html_title = f"kfac_jax {release}"
html_static_path: list[str] = []

# -- intersphinx, offline ----------------------------------------------------

# Each site's inventory: docs/inventories/<name>.txt holds the body of a
# Sphinx inventory (version 2: "name domain:role priority uri display", the
# uri relative to the site, "$" for the name, "-" for the name as display).
INVENTORY_SITES = {
  "python": "https://docs.python.org/3/",
  "jax": "https://docs.jax.dev/en/latest/",
  "optax": "https://optax.readthedocs.io/en/latest/",
  "flax": "https://flax.readthedocs.io/en/latest/",
  "flax-linen": "https://flax-linen.readthedocs.io/en/latest/",
}
_INVENTORY_DIR = DOCS / "_build" / "inventories"


def _inventory_lines(name: str) -> list[str]:
  """The entries of ``docs/inventories/<name>.txt``, comments dropped."""
  text = (DOCS / "inventories" / f"{name}.txt").read_text(encoding="utf-8")
  return [
    line
    for line in text.splitlines()
    if line.strip() and not line.startswith("#")
  ]


def _write_inventory(name: str) -> str:
  """Writes ``<name>.inv`` (the zlib-compressed format intersphinx reads)
  from its text; returns its path."""
  header = (
    "# Sphinx inventory version 2\n"
    f"# Project: {name}\n# Version: latest\n"
    "# The remainder of this file is compressed using zlib.\n"
  )
  body = "".join(f"{line}\n" for line in _inventory_lines(name))
  _INVENTORY_DIR.mkdir(parents=True, exist_ok=True)
  path = _INVENTORY_DIR / f"{name}.inv"
  path.write_bytes(header.encode() + zlib.compress(body.encode()))
  return str(path)


intersphinx_mapping = {
  name: (url, _write_inventory(name)) for name, url in INVENTORY_SITES.items()
}
intersphinx_timeout = 1  # never used: every inventory is a local file

# -- public names in types ---------------------------------------------------


def _defined_name(obj: object) -> str | None:
  """``module.qualname`` of a class, as type hints print it."""
  if not inspect.isclass(obj):
    return None
  return f"{obj.__module__}.{obj.__qualname__}"


# Public names shown for classes that no inventory lists.
PUBLIC_WITHOUT_PAGE = ("jax.sharding.AbstractMesh",)


def _public_classes() -> Iterator[tuple[str, object]]:
  """(public name, class) of kfac_jax's classes and the inventories'."""
  for name in kfac_jax.__all__:
    yield f"kfac_jax.{name}", getattr(kfac_jax, name)
  for name in PUBLIC_WITHOUT_PAGE:
    yield name, api_coverage.resolve(name)
  for site in INVENTORY_SITES:
    for line in _inventory_lines(site):
      name, role = line.split()[:2]
      if role == "py:class":
        yield name, api_coverage.resolve(name)


_PUBLIC = {
  defined: public
  for public, obj in _public_classes()
  if (defined := _defined_name(obj)) not in (None, public)
}
_DEFINED = re.compile(
  r"(?<![\w.])("
  + "|".join(map(re.escape, sorted(_PUBLIC, key=len, reverse=True)))
  + r")(?!\w)"
)


def public_names(text: str) -> str:
  """``text`` with each class named where it is defined renamed to its
  public name (``jax.jaxlib._jax.Array`` → ``jax.Array``)."""
  return _DEFINED.sub(lambda match: _PUBLIC[match.group(1)], text)


# -- docstrings --------------------------------------------------------------

_LITERAL = re.compile(r"(``(?:(?!``).)+?``)", re.S)
_BARS = re.compile(r"(?<!\\)\|(?=[^\s|])([^|\n]*?[^\s\\|])\|")


def _escape(text: str) -> str:
  parts = _LITERAL.split(text)
  for j in range(0, len(parts), 2):
    parts[j] = _BARS.sub(r"\\|\1\\|", parts[j])
    if j > 0 and parts[j][:1].isalnum():
      parts[j] = "\\ " + parts[j]
  return "".join(parts)


def plain_text_for_rst(app, what, name, obj, options, lines) -> None:
  """Reads two plain-text habits of the docstrings as they are meant.

  ``jax.ShapeDtypeStruct``s (a literal followed by a letter) is invalid RST:
  the literal is closed by an escaped space. ``|μ|`` (an absolute value) would
  be a substitution reference: its bars are escaped. Literal blocks (after a
  line ending in ``::``) are left as they are. Runs after napoleon, whose
  ``:vartype:`` lines get the public names of their types.
  """
  del app, what, name, obj, options
  out, prose, block_indent = [], [], None

  def flush():
    if prose:
      out.extend(_escape("\n".join(prose)).split("\n"))
      prose.clear()

  for line in lines:
    indent = len(line) - len(line.lstrip())
    if block_indent is not None and line.strip() and indent <= block_indent:
      block_indent = None
    if block_indent is not None:
      out.append(line)
      continue
    prose.append(
      public_names(line) if line.lstrip().startswith(":vartype") else line
    )
    if line.rstrip().endswith("::"):
      flush()
      block_indent = indent
  flush()
  lines[:] = out


def data_docstrings(app, what, name, obj, options, lines) -> None:
  """A constant exported by kfac_jax (``kfac_jax.NO_STATS``) is described
  by the docstring under its assignment in the module defining its type,
  not by its type's docstring."""
  del app, options
  module = getattr(type(obj), "__module__", "")
  if what != "data" or not module.startswith("kfac_jax"):
    return
  docs = (
    ModuleAnalyzer.for_module(module)
    .find_attr_docs()
    .get(("", name.rsplit(".", 1)[1]))
  )
  if docs:
    lines[:] = list(docs)


_ALIAS_REPR = re.compile(r"TypeAliasForwardRef\('([^']+)'\)")


def public_type_hints(app, domain, objtype, contentnode) -> None:
  """The recorded type hints as written: ``ScalarOrSchedule | None``, not
  the alias object's repr, and public names.

  Runs before autodoc merges them into the description.
  """
  del domain, objtype, contentnode
  for hints in app.env.current_document.autodoc_annotations.values():
    for key, value in hints.items():
      hints[key] = public_names(_ALIAS_REPR.sub(r"\1", value))


def type_hints_may_stay_text(app, domain, node) -> bool | None:
  """Keeps the API page's unresolved Python references quiet: its type
  hints name aliases that its prose defines (``ScalarOrSchedule``) and
  types no inventory lists, shown as text. Everywhere else (a guide page's
  ``{func}`` role) an unresolved reference is a typo, and warns (an error
  under -W)."""
  del app, domain
  if node.get("refdomain") == "py" and node.get("refdoc") == "api":
    return True
  return None


# -- coverage ----------------------------------------------------------------


def check_api_coverage(app, env) -> None:
  """Fails the build when a public member has no entry in the API
  reference."""
  objects = env.get_domain("py").objects
  missing = [
    name for name in api_coverage.public_members() if name not in objects
  ]
  if missing:
    logger.error(
      "undocumented public members (add them to docs/api.md): %s",
      ", ".join(missing),
    )
    app.statuscode = 1


def setup(app):
  # After napoleon (500), which would read the first line of the docstring
  # it gives as a type.
  app.connect("autodoc-process-docstring", data_docstrings, priority=550)
  # After napoleon (500), which writes the :vartype: lines.
  app.connect("autodoc-process-docstring", plain_text_for_rst, priority=600)
  app.connect("object-description-transform", public_type_hints, priority=400)
  app.connect("warn-missing-reference", type_hints_may_stay_text)
  app.connect("env-check-consistency", check_api_coverage)
