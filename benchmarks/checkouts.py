"""Which fairnesses a benchmark runs, in this checkout and in a ``--baseline`` one.

A level runs the fairness its ``LevelSpec.fairness`` names, and the server's levels the one
``APF_FAIRNESS`` names (issue 12). A checkout's ledger runs every fairness in
``flowcontrol.fairness.NAMES`` once its ``LevelSpec`` has that field (while the selection
plumbing was ahead of the ledger, ``fairness.AVAILABLE`` listed fewer), and only
``kubernetes`` before. A baseline may predate both the field and ``flowcontrol/fairness.py``:
it then runs ``kubernetes``, and a benchmark compares a fairness it lacks with that.

    names, note = choose_fairness(args.fairness)  # ["kubernetes", "maxmin"], or SystemExit
    base = inspect_checkout(Path("/tmp/base"))    # Checkout(fairness_names=("kubernetes",), ...)
    base_fairness, note = base.runs("maxmin")     # ("kubernetes", "… lacks maxmin …")
    build_extension(Path("/tmp/base"))            # its C fast path, compiled in place

``python benchmarks/checkouts.py --probe`` with ``PYTHONPATH=<checkout>`` prints what that
checkout offers, as one JSON line (``inspect_checkout`` runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

try:
    from apf_gunicorn.flowcontrol import fairness
except ImportError:  # --probe of a checkout from before fairness could be chosen
    fairness = None

#: ``--fairness`` choices.
CHOICES = ("kubernetes", "maxmin", "both")
KUBERNETES, MAXMIN = "kubernetes", "maxmin"


def available_fairness() -> tuple[str, ...]:
    """The fairnesses the imported ``apf_gunicorn``'s ledger runs.

    Returns:
        ``("kubernetes",)`` while ``LevelSpec`` has no ``fairness`` field or there is no
        ``flowcontrol/fairness.py``; else its ``fairness.AVAILABLE`` where that exists, else
        its ``fairness.NAMES`` (``fairness.POLICIES`` in checkouts that predate that name).
    """
    from apf_gunicorn.ledger import LevelSpec

    if fairness is None or "fairness" not in LevelSpec._fields:
        return (KUBERNETES,)
    names = getattr(fairness, "NAMES", None) or fairness.POLICIES  # a baseline may predate NAMES
    return tuple(getattr(fairness, "AVAILABLE", names))


def _probe() -> dict:
    import apf_gunicorn
    from apf_gunicorn.ledger import LevelSpec

    return {"package": apf_gunicorn.__file__, "fairness": list(available_fairness()),
            "levelspec_field": "fairness" in LevelSpec._fields,
            "selectable": fairness is not None}


def choose_fairness(arg: str | None, available: tuple[str, ...] | None = None
                    ) -> tuple[list[str], str]:
    """The fairnesses to measure for ``--fairness``, and a line saying why.

    Args:
        arg: ``"kubernetes"``, ``"maxmin"``, ``"both"``, or None (the default: both when this
            build has maxmin, else kubernetes).
        available: the fairnesses this build's ledger runs (default:
            :func:`available_fairness`).

    Returns:
        ``(fairness_names, note)``: e.g. ``(["kubernetes", "maxmin"],
        "fairness: kubernetes, maxmin")``.

    Raises:
        SystemExit: ``arg`` asks for a fairness this build lacks (the message says which).
    """
    if available is None:
        available = available_fairness()
    if arg is None:
        arg = "both" if MAXMIN in available else KUBERNETES
        if arg == KUBERNETES:
            return [arg], (f"fairness: kubernetes only ({MAXMIN} is not available in this "
                           f"build: its ledger runs {', '.join(available)})")
    wanted = [KUBERNETES, MAXMIN] if arg == "both" else [arg]
    missing = [p for p in wanted if p not in available]
    if missing:
        raise SystemExit(f"--fairness {arg}: {', '.join(missing)} is not available in this "
                         f"build (its ledger runs {', '.join(available)})")
    return wanted, f"fairness: {', '.join(wanted)}"


class Checkout(NamedTuple):
    """What a checkout's ``apf_gunicorn`` offers (see :func:`inspect_checkout`)."""

    root: Path
    package: str  # the apf_gunicorn/__init__.py that was imported (proves PYTHONPATH won)
    fairness_names: tuple[str, ...]  # its available_fairness()
    levelspec_field: bool  # its LevelSpec has a ``fairness`` field
    selectable: bool  # it has flowcontrol/fairness.py, so its server reads APF_FAIRNESS

    def describe(self) -> str:
        """One line for a benchmark's output: where the package is, what it runs."""
        return (f"baseline {self.package}: fairness {', '.join(self.fairness_names)}; LevelSpec "
                f"{'has' if self.levelspec_field else 'has no'} fairness field; its server "
                f"{'reads' if self.selectable else 'predates'} APF_FAIRNESS")

    def runs(self, fairness_name: str) -> tuple[str, str]:
        """The fairness this checkout runs when ``fairness_name`` is asked for, and a note.

        Returns:
            ``(fairness_name, "")`` when it has that fairness, else ``("kubernetes", note)``, the
            note saying that the baseline lacks ``fairness_name`` and runs kubernetes instead.
        """
        if fairness_name in self.fairness_names:
            return fairness_name, ""
        why = ("LevelSpec has no fairness field" if not self.levelspec_field
               else f"it runs {', '.join(self.fairness_names)}")
        return KUBERNETES, (f"baseline {self.root} lacks {fairness_name} ({why}): "
                            f"its {fairness_name} rows run kubernetes")


def inspect_checkout(root: Path) -> Checkout:
    """Ask a checkout (in a child process, ``PYTHONPATH=root``) which fairnesses it runs.

    Args:
        root: the checkout's top directory (holding ``apf_gunicorn/``).

    Returns:
        Its :class:`Checkout`.

    Raises:
        RuntimeError: its ``apf_gunicorn`` could not be imported, or the one imported is not
            the checkout's.
    """
    root = root.resolve()
    res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe"],
                         cwd=str(root), capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    if res.returncode:
        raise RuntimeError(f"cannot import apf_gunicorn from {root}: {res.stderr.strip()}")
    info = json.loads(res.stdout)
    if not Path(info["package"]).resolve().is_relative_to(root):
        raise RuntimeError(f"PYTHONPATH={root} imported {info['package']}, not the checkout's")
    return Checkout(root, info["package"], tuple(info["fairness"]), info["levelspec_field"],
                    info["selectable"])


def build_extension(root: Path) -> None:
    """Compile a checkout's C fast path in place, when it is not built yet and gcc exists (pip
    would reinstall the venv's own); without it that checkout runs the pure-Python paths. The
    flags are those a ``pip install`` gives this tree's extension (Python's own ``CFLAGS``,
    then setup.py's), so a baseline and this commit are compiled alike.

    Args:
        root: the checkout's top directory.

    Raises:
        subprocess.CalledProcessError: gcc failed.
    """
    src = root / "apf_gunicorn" / "ledger" / "_fastpath.c"
    out = src.with_name("_fastpath" + sysconfig.get_config_var("EXT_SUFFIX"))
    if src.exists() and not out.exists() and shutil.which("gcc"):
        python_flags = (sysconfig.get_config_var("CFLAGS") or "").split()
        subprocess.run(["gcc", "-shared", "-fPIC", *python_flags, "-O2", "-ffp-contract=off",
                        "-fno-strict-aliasing", f"-I{sysconfig.get_paths()['include']}",
                        str(src), "-o", str(out)], check=True)


if __name__ == "__main__" and sys.argv[1:] == ["--probe"]:
    print(json.dumps(_probe()))
