"""The docs site's code runs, and its API reference covers ``kfac_jax``.

Every ```` ```python ```` block of ``docs/**/*.md`` is a complete program,
run here as ``__main__`` in a fresh namespace (from a temporary working
directory), unless the line before its fence is one of:

* ``<!-- snippet: fragment -->``: not run (a piece of a program, shown for
  its shape: it names a model, params or a mesh it does not define);
* ``<!-- snippet: continue -->``: the next part of the block before it on the
  same page: run after it, in its namespace.

Sphinx (``make docs``) is not needed: the API test reads ``docs/api.md``'s
autodoc directives (``docs/api_coverage.documented``) and compares them with
the public members the build's own check (``docs/conf.py``) requires
(``docs/api_coverage.public_members``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
FRAGMENT = "<!-- snippet: fragment -->"
CONTINUE = "<!-- snippet: continue -->"
_MARKER = re.compile(r"^<!-- snippet: (\w+) -->$")


@dataclasses.dataclass
class Program:
  page: str
  line: int  # of the first block's fence, 1-based
  parts: list[tuple[int, str]]  # (fence line, code) of each block

  @property
  def id(self) -> str:
    return f"{self.page}:{self.line}"


def pages() -> list[pathlib.Path]:
  return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def blocks(path: pathlib.Path) -> list[tuple[int, str | None, str]]:
  """(fence line, marker or None, code) of each python block of a page."""
  lines = path.read_text(encoding="utf-8").splitlines()
  found = []
  i = 0
  while i < len(lines):
    fence = re.match(r"^(`{3,})(\S*)\s*$", lines[i])
    if not fence:
      i += 1
      continue
    ticks, info = fence.groups()
    end = i + 1
    while end < len(lines) and lines[end].rstrip() != ticks:
      end += 1
    if info == "python":
      before = next(
        (lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), ""
      )
      marker = _MARKER.match(before)
      found.append(
        (
          i + 1,
          marker.group(1) if marker else None,
          "\n".join(lines[i + 1 : end]) + "\n",
        )
      )
    i = end + 1
  return found


def programs_of(path: pathlib.Path, page: str) -> list[Program]:
  """The programs of one page: its python blocks less the fragments, a
  ``continue`` block appended to the program before it."""
  result: list[Program] = []
  for line, marker, code in blocks(path):
    if marker == "fragment":
      continue
    if marker == "continue":
      assert result, f"{page}:{line}: nothing to continue"
      result[-1].parts.append((line, code))
      continue
    assert marker is None, f"{page}:{line}: unknown marker {marker!r}"
    result.append(Program(page, line, [(line, code)]))
  return result


def programs() -> list[Program]:
  return [
    program
    for path in pages()
    for program in programs_of(path, str(path.relative_to(DOCS)))
  ]


def run(program: Program, where: str) -> None:
  """Runs ``program`` as ``__main__`` in a fresh namespace; ``where`` names
  its page in tracebacks."""
  namespace = {"__name__": "__main__"}
  for line, code in program.parts:
    exec(compile(code, f"{where}:{line}", "exec"), namespace)  # pylint: disable=exec-used


PROGRAMS = programs()


def test_the_guide_has_programs_and_known_markers():
  assert len(PROGRAMS) >= 10
  for path in pages():
    for number, line in enumerate(
      path.read_text(encoding="utf-8").splitlines(), 1
    ):
      if line.strip().startswith("<!-- snippet"):
        assert line.strip() in (FRAGMENT, CONTINUE), (
          f"{path.name}:{number}: unknown snippet marker {line.strip()!r}"
        )


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.id)
def test_guide_program_runs(program, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  run(program, f"docs/{program.page}")


def _api_coverage():
  """``docs/api_coverage.py``, imported by path (docs/ is no package)."""
  spec = importlib.util.spec_from_file_location(
    "api_coverage", DOCS / "api_coverage.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_api_reference_documents_every_public_member():
  coverage = _api_coverage()
  documented = coverage.documented(
    (DOCS / "api.md").read_text(encoding="utf-8")
  )
  required = coverage.public_members()
  missing = sorted(set(required) - documented)
  assert not missing, f"docs/api.md lacks {missing}"
  unknown = sorted(documented - set(required))
  assert not unknown, f"docs/api.md documents non-public {unknown}"
  # The three losses are imported from a submodule: autodoc skips them
  # under automodule's :members:, and they were not on the page.
  assert {
    f"kfac_jax.sampled_curvature.{name}"
    for name in (
      "sigmoid_cross_entropy",
      "softmax_cross_entropy",
      "squared_error",
    )
  } <= set(required)
  assert "kfac_jax.TrainState.apply_gradients" in required


def test_coverage_counts_members_not_only_the_packages_all():
  """A module's functions and a class's methods are required too."""
  coverage = _api_coverage()
  required = set(coverage.public_members())
  assert "kfac_jax.schedules.exp_decay_factor_averaging" in required
  assert "kfac_jax.LayerInfo.block_names" in required
  assert "kfac_jax.ComputeMethod.EIGEN" in required
  # Generated by Flax's dataclass machinery, not kfac_jax's API.
  assert "kfac_jax.TrainState.replace" not in required
  text = ".. autoclass:: kfac_jax.LayerInfo\n   :members: groups\n"
  assert coverage.documented(text) == {
    "kfac_jax.LayerInfo",
    "kfac_jax.LayerInfo.groups",
  }


def test_the_examples_page_shows_the_code_of_every_example_it_runs():
  page = (DOCS / "examples.md").read_text(encoding="utf-8")
  run = set(re.findall(r"python -m examples\.(\w+)", page))
  shown = set(
    re.findall(r"^```\{literalinclude\} \.\./examples/(\w+)\.py$", page, re.M)
  )
  assert len(run) >= 6 and run <= shown, sorted(run - shown)
  for name in shown:
    assert (DOCS.parent / "examples" / f"{name}.py").is_file(), name


@pytest.mark.parametrize(
  "site", ["python", "jax", "optax", "flax", "flax-linen"]
)
def test_each_inventory_entry_names_an_object_that_exists(site):
  """The offline intersphinx inventories (docs/inventories, read by
  docs/conf.py) list real objects, each with a page and an anchor."""
  import builtins  # pylint: disable=g-import-not-at-top

  coverage = _api_coverage()
  lines = [
    line
    for line in (DOCS / "inventories" / f"{site}.txt")
    .read_text(encoding="utf-8")
    .splitlines()
    if line.strip() and line[0] != "#"
  ]
  assert lines
  for line in lines:
    name, role, priority, uri, display = line.split()
    assert role.startswith("py:") and priority == "1" and display == "-", line
    assert ".html#" in uri and not uri.startswith(("/", "http")), line
    assert "$" not in uri[:-1], line  # intersphinx replaces a final $ only
    obj = (
      coverage.resolve(name) if "." in name else getattr(builtins, name, None)
    )
    assert obj is not None, line
