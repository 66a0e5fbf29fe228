"""The docs stand alone and name what is there.

docs/ARCHITECTURE.md's tree lists every module of the layers a reader navigates by
(``flowcontrol/``, ``ledger/``, ``signals/``, ``server/``, ``admission/``, ``gthread/``, ``asgi/``, ``master/`` and the package's top level; ``cli/`` and
``simulate/`` are described as packages), and no page under docs/ or the README sends the reader
outside the repository (a clone has no ``../shared/``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "apf_gunicorn"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
LISTED_PER_MODULE = ("", "flowcontrol", "ledger", "signals", "server", "admission", "gthread", "asgi",
                     "master")


def listed_names(text: str) -> set[str]:
    """File names that open a line of the architecture page's tree (after indentation)."""
    return set(re.findall(r"^\s+([\w.]+\.(?:py|c|h))\b", text, re.M))


@pytest.mark.parametrize("folder", LISTED_PER_MODULE, ids=lambda f: f or "top")
def test_architecture_lists_every_module(folder: str) -> None:
    names = listed_names(ARCHITECTURE.read_text())
    modules = sorted(p.name for p in (PACKAGE / folder).iterdir()
                     if p.suffix in (".py", ".c", ".h")
                     and p.name not in ("__init__.py", "__main__.py"))
    assert modules, folder
    missing = [m for m in modules if m not in names]
    assert not missing, f"docs/ARCHITECTURE.md does not list {folder or 'apf_gunicorn'}/: {missing}"


def test_docs_do_not_send_the_reader_outside_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offenders = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
                 for page in pages
                 for n, line in enumerate(page.read_text().splitlines(), 1)
                 if "../shared" in line or "shared/SPEC" in line or "shared/DESIGN" in line]
    assert not offenders, offenders
