"""Which dispatch policies a benchmark runs, in this checkout and in a ``--baseline`` one.

A level runs the policy its ``LevelSpec.fairness`` names, and the server's levels the one
``APF_FAIRNESS`` names (issue 12). A checkout's ledger runs every policy in
``flowcontrol.fairness.POLICIES`` once its ``LevelSpec`` has that field (while the selection
plumbing was ahead of the ledger, ``fairness.AVAILABLE`` listed fewer), and only
``kubernetes`` before. A baseline may predate both the field and ``flowcontrol/fairness.py``:
it then runs ``kubernetes``, and a benchmark compares a policy it lacks with that.

    policies, note = choose_policies(args.fairness)  # ["kubernetes", "maxmin"], or SystemExit
    base = inspect_checkout(Path("/tmp/base"))      # Checkout(policies=("kubernetes",), ...)
    base_policy, note = base.runs("maxmin")         # ("kubernetes", "… lacks maxmin …")
    build_extension(Path("/tmp/base"))              # its C fast path, compiled in place

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
except ImportError:  # --probe of a checkout from before the policy's selection
    fairness = None

#: ``--fairness`` choices.
CHOICES = ("kubernetes", "maxmin", "both")
KUBERNETES, MAXMIN = "kubernetes", "maxmin"


def available_policies() -> tuple[str, ...]:
    """The dispatch policies the imported ``apf_gunicorn``'s ledger runs.

    Returns:
        ``("kubernetes",)`` while ``LevelSpec`` has no ``fairness`` field or there is no
        ``flowcontrol/fairness.py``; else its ``fairness.AVAILABLE`` where that exists, else
        its ``fairness.POLICIES``.
    """
    from apf_gunicorn.ledger import LevelSpec

    if fairness is None or "fairness" not in LevelSpec._fields:
        return (KUBERNETES,)
    return tuple(getattr(fairness, "AVAILABLE", fairness.POLICIES))


def _probe() -> dict:
    import apf_gunicorn
    from apf_gunicorn.ledger import LevelSpec

    return {"package": apf_gunicorn.__file__, "policies": list(available_policies()),
            "levelspec_field": "fairness" in LevelSpec._fields,
            "selectable": fairness is not None}


def choose_policies(arg: str | None, available: tuple[str, ...] | None = None
                    ) -> tuple[list[str], str]:
    """The policies to measure for ``--fairness``, and a line saying why.

    Args:
        arg: ``"kubernetes"``, ``"maxmin"``, ``"both"``, or None (the default: both when this
            build has maxmin, else kubernetes).
        available: the policies this build's ledger runs (default:
            :func:`available_policies`).

    Returns:
        ``(policies, note)``: e.g. ``(["kubernetes", "maxmin"], "fairness: kubernetes, maxmin")``.

    Raises:
        SystemExit: ``arg`` asks for a policy this build lacks (the message says which).
    """
    if available is None:
        available = available_policies()
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
    policies: tuple[str, ...]  # its available_policies()
    levelspec_field: bool  # its LevelSpec has a ``fairness`` field
    selectable: bool  # it has flowcontrol/fairness.py, so its server reads APF_FAIRNESS

    def describe(self) -> str:
        """One line for a benchmark's output: where the package is, what it runs."""
        return (f"baseline {self.package}: policies {', '.join(self.policies)}; LevelSpec "
                f"{'has' if self.levelspec_field else 'has no'} fairness field; its server "
                f"{'reads' if self.selectable else 'predates'} APF_FAIRNESS")

    def runs(self, policy: str) -> tuple[str, str]:
        """The policy this checkout runs when ``policy`` is asked for, and a note.

        Returns:
            ``(policy, "")`` when it has the policy, else ``("kubernetes", note)``, the note
            saying that the baseline lacks ``policy`` and runs kubernetes instead.
        """
        if policy in self.policies:
            return policy, ""
        why = ("LevelSpec has no fairness field" if not self.levelspec_field
               else f"it runs {', '.join(self.policies)}")
        return KUBERNETES, (f"baseline {self.root} lacks {policy} ({why}): "
                            f"its {policy} rows run kubernetes")


def inspect_checkout(root: Path) -> Checkout:
    """Ask a checkout (in a child process, ``PYTHONPATH=root``) which policies it runs.

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
    return Checkout(root, info["package"], tuple(info["policies"]), info["levelspec_field"],
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
