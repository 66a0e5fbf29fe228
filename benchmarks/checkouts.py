"""Which dispatch policies a benchmark runs, in this checkout and in a ``--baseline`` one.

The ledger implements the policies listed in ``flowcontrol.fairness.AVAILABLE``
(``kubernetes``, and ``maxmin`` once it lands, issue 12); a level runs the one its
``LevelSpec.fairness`` names, and the server's levels the one ``APF_FAIRNESS`` names. A
baseline checkout may predate both (no ``flowcontrol/fairness.py``, no ``LevelSpec.fairness``):
it then runs ``kubernetes``, and a benchmark compares a policy it lacks with that.

    policies = choose_policies(args.fairness)      # ["kubernetes", "maxmin"], or SystemExit
    base = inspect_checkout(Path("/tmp/base"))      # Checkout(policies=("kubernetes",), ...)
    base_policy, note = base.runs("maxmin")         # ("kubernetes", "… predates maxmin …")
    build_extension(Path("/tmp/base"))              # its C fast path, compiled in place
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

from apf_gunicorn.flowcontrol import fairness

#: ``--fairness`` choices.
CHOICES = ("kubernetes", "maxmin", "both")

# Run with PYTHONPATH=<checkout>: what that checkout's apf_gunicorn offers, as one JSON line.
_PROBE = """
import json, apf_gunicorn
from apf_gunicorn.ledger import LevelSpec
try:
    from apf_gunicorn.flowcontrol.fairness import AVAILABLE
    selectable = True
except ImportError:
    AVAILABLE, selectable = ("kubernetes",), False
print(json.dumps({"package": apf_gunicorn.__file__, "policies": list(AVAILABLE),
                  "levelspec_field": "fairness" in LevelSpec._fields,
                  "selectable": selectable}))
"""


def choose_policies(arg: str | None, available: tuple[str, ...] = fairness.AVAILABLE
                    ) -> tuple[list[str], str]:
    """The policies to measure for ``--fairness``, and a line saying why.

    Args:
        arg: ``"kubernetes"``, ``"maxmin"``, ``"both"``, or None (the default: both when this
            build has maxmin, else kubernetes).
        available: the policies this build's ledger implements.

    Returns:
        ``(policies, note)``: e.g. ``(["kubernetes", "maxmin"], "fairness: kubernetes, maxmin")``.

    Raises:
        SystemExit: ``arg`` asks for a policy this build lacks (the message says which).
    """
    if arg is None:
        arg = "both" if fairness.MAXMIN in available else fairness.KUBERNETES
        if arg == fairness.KUBERNETES:
            return [arg], (f"fairness: kubernetes only ({fairness.MAXMIN} is not available in "
                           f"this build: flowcontrol.fairness.AVAILABLE = {available})")
    wanted = list(fairness.POLICIES) if arg == "both" else [arg]
    missing = [p for p in wanted if p not in available]
    if missing:
        raise SystemExit(f"--fairness {arg}: {', '.join(missing)} is not available in this "
                         f"build (flowcontrol.fairness.AVAILABLE = {available})")
    return wanted, f"fairness: {', '.join(wanted)}"


class Checkout(NamedTuple):
    """What a checkout's ``apf_gunicorn`` offers (see :func:`inspect_checkout`)."""

    root: Path
    package: str  # the apf_gunicorn/__init__.py that was imported (proves PYTHONPATH won)
    policies: tuple[str, ...]  # its flowcontrol.fairness.AVAILABLE, ("kubernetes",) if none
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
               else f"its AVAILABLE is {self.policies}")
        return fairness.KUBERNETES, (f"baseline {self.root} lacks {policy} ({why}): "
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
    res = subprocess.run([sys.executable, "-c", _PROBE], cwd=str(root), capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(root)))
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
