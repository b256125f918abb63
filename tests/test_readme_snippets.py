"""README.md's python examples run as written.

Each ```` ```python ```` block of the README is a complete program, run here
as ``__main__`` in a fresh namespace from a temporary working directory,
unless the line before its fence marks it, as in the docs pages
(``tests/test_docs.py``, whose block reader and runner this uses):

* ``<!-- snippet: fragment -->``: not run (a piece shown for its shape);
* ``<!-- snippet: continue -->``: run after the block before it, in its
  namespace.
"""

from __future__ import annotations

import pathlib

import pytest

from tests import test_docs

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


PROGRAMS = test_docs.programs_of(README, "README.md")


def test_the_readme_has_an_example_that_runs():
  assert PROGRAMS, "README.md: no python block to run"


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.id)
def test_readme_program_runs(program, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  test_docs.run(program, "README.md")
