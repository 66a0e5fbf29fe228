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


def fenced_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced (```) code block of a Markdown text."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_their_dependencies(names: set[str]) -> set[str]:
    """``names`` and what they require, as installed in this venv (extras' requirements left
    out), recursively."""
    from importlib import metadata

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r.replace('"', "'")
                 and "extra==" not in r]
    return seen


def _third_party_imports(module: Path) -> set[str]:
    """The top-level names of the modules ``module`` imports that are neither the standard
    library nor this repository's."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "apf_gunicorn", "examples"}


def test_an_install_line_installs_what_the_example_it_serves_imports() -> None:
    """The README's ASGI section said ``pip install '.[asgi]'`` then served
    ``examples.fastapi_app:app``, which failed: No module named 'fastapi'. A code block that
    installs the project and serves an example must install what the example imports (the
    project's dependencies, the extras the line names, what those require)."""
    from importlib import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    by_import = metadata.packages_distributions()
    checked = []
    for path in DOCS:
        for block in fenced_blocks(path.read_text()):
            text = "\n".join(block)
            examples = re.findall(r"\bexamples\.(\w+):\w+", text)
            installs = [line for line in block
                        if re.match(r"^(\S*/)?(pip3?|python3? -m pip) install\b", line.strip())]
            if not examples or not installs:
                continue
            provided = {_name(r) for r in project["dependencies"]}
            for line in installs:
                args = shlex.split(line, comments=True)
                args = args[args.index("install") + 1:]
                for extra in _extras(args):
                    provided |= {_name(r) for r in project["optional-dependencies"][extra]}
                provided |= {_name(a) for a in args
                             if not a.startswith(("-", ".")) and "/" not in a}
            provided = _with_their_dependencies(provided)
            for example in examples:
                for module in _third_party_imports(ROOT / "examples" / f"{example}.py"):
                    dists = {_name(d) for d in by_import.get(module, [module])}
                    assert dists & provided, (
                        f"{path.name}: {installs} does not install {module} "
                        f"(imported by examples/{example}.py)")
                checked.append((path.name, example))
    assert ("README.md", "fastapi_app") in checked, checked
