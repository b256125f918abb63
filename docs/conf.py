"""Sphinx configuration of kfac_jax's docs (``make docs``).

The pages are MyST Markdown; the API reference (``api.md``) is autodoc over
the package's Google-style docstrings (napoleon). The build fails when a name
of ``kfac_jax.__all__`` is not documented there (``check_api_coverage``).
"""

from __future__ import annotations

import pathlib
import re
import sys

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
# second object beside autodoc's own).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_use_rtype = False
autodoc_typehints = "description"
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
# Type hints name jax/optax/flax types that this site does not document.
nitpicky = False

html_theme = "furo"
html_title = f"kfac_jax {release}"
html_static_path: list[str] = []


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
  line ending in ``::``) are left as they are.
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
    prose.append(line)
    if line.rstrip().endswith("::"):
      flush()
      block_indent = indent
  flush()
  lines[:] = out


_ALIAS_REPR = re.compile(r"TypeAliasForwardRef\('([^']+)'\)")


def alias_names_in_unions(app, domain, objtype, contentnode) -> None:
  """``ScalarOrSchedule | None`` as written, not the alias object's repr.

  Runs before autodoc merges the recorded type hints into the description.
  """
  del domain, objtype, contentnode
  for hints in app.env.current_document.autodoc_annotations.values():
    for key, value in hints.items():
      hints[key] = _ALIAS_REPR.sub(r"\1", value)


def check_api_coverage(app, env) -> None:
  """Fails the build when a public name has no entry in the API reference."""
  objects = env.get_domain("py").objects
  missing = [name for name in kfac_jax.__all__
             if f"kfac_jax.{name}" not in objects]
  if missing:
    logger.error("undocumented public names of kfac_jax.__all__ (add them "
                 "to docs/api.md): %s", ", ".join(missing))
    app.statuscode = 1


def setup(app):
  app.connect("autodoc-process-docstring", plain_text_for_rst)
  app.connect("object-description-transform", alias_names_in_unions,
              priority=400)
  app.connect("env-check-consistency", check_api_coverage)
