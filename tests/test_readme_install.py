"""Every ``pip install`` line of the README's (and docs') code blocks works as typed.

Each line is run from the repository root, as a reader of a checkout would, with
``--dry-run --no-deps --no-index --no-build-isolation`` added so it needs no network and
installs nothing: pip still has to find the project and build its metadata (the PEP 517 hook of
pyproject.toml), which is what a wrong path (``pip install ./apf_gunicorn``, the package folder)
or a broken pyproject.toml fails. Extras named in a line must exist in pyproject.toml (pip only
warns about unknown extras). ``--no-build-isolation`` uses this venv's setuptools, which the
test extra pins to what pyproject.toml's build-system asks for.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OFFLINE = ["--dry-run", "--no-deps", "--no-index", "--no-build-isolation",
           "--disable-pip-version-check", "--quiet"]


def code_lines(text: str) -> list[str]:
    """The lines of a Markdown text's code blocks: fenced (```), and indented by 4 spaces
    after a blank line."""
    out: list[str] = []
    fenced = False
    prev_blank = True
    indented = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prev_blank = False
            continue
        if fenced:
            out.append(line)
        elif line.startswith("    ") and (indented or prev_blank) and line.strip():
            indented = True
            out.append(line[4:])
        elif line.strip():
            indented = False
        prev_blank = not line.strip()
    return out


def pip_install_lines() -> list[tuple[str, str]]:
    """(file name, command) of every ``pip install`` command in the docs' code blocks."""
    found = []
    for path in DOCS:
        for line in code_lines(path.read_text()):
            cmd = line.strip().removeprefix("$ ")
            if re.match(r"^(\S*/)?(pip3?|python3? -m pip) install\b", cmd):
                found.append((path.name, cmd))
    return found


def test_the_docs_show_an_install_line() -> None:
    lines = pip_install_lines()
    assert any(name == "README.md" for name, _ in lines), lines


def test_code_lines_sees_fenced_and_indented_blocks() -> None:
    text = "intro\n\n    pip install a\n    b\n\ntext\n```sh\npip install c  # x\n```\n    not\n"
    assert code_lines(text) == ["pip install a", "b", "pip install c  # x"]


def _extras(args: list[str]) -> set[str]:
    out = set()
    for a in args:
        m = re.fullmatch(r"\.(?:/)?\[([^\]]+)\]", a)
        if m:
            out.update(x.strip() for x in m.group(1).split(","))
    return out


@pytest.mark.parametrize("where,cmd", pip_install_lines())
def test_pip_install_line_works_from_the_repository_root(where: str, cmd: str) -> None:
    import setuptools

    args = shlex.split(cmd, comments=True)
    args = args[args.index("install") + 1:]
    assert args, f"{where}: {cmd!r} installs nothing"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    unknown = _extras(args) - set(declared)
    assert not unknown, f"{where}: {cmd!r} names extras pyproject.toml lacks: {unknown}"
    assert int(setuptools.__version__.split(".")[0]) >= 77, (
        "this venv's setuptools is older than pyproject.toml's build-system asks for: "
        "run bash scripts/test.sh to install the test extra")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", *OFFLINE, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{where}: {cmd!r} fails:\n{proc.stdout}\n{proc.stderr}"


def test_every_package_is_installed() -> None:
    """``pip install .`` (not editable) installs only the packages pyproject.toml lists: every
    folder of apf_gunicorn with an ``__init__.py`` must be among them."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "apf_gunicorn").rglob("__init__.py")}
    assert found - listed == set(), f"not in pyproject.toml's packages: {found - listed}"
