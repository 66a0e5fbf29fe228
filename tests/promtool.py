"""``promtool check metrics`` (Prometheus' own linter) on a /metrics text, for the tests that
check the exposition.

``scripts/test.sh`` installs promtool (Debian's ``prometheus`` package) when it runs as root
with apt-get. Without promtool the check skips, saying why; under CI (``CI`` set to ``true``
or ``1``, as GitHub Actions, GitLab CI and most others set it) it fails instead, as a missing
C extension does: a CI run must not pass while checking less than it says.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def in_ci() -> bool:
    """Whether the tests run under CI (the ``CI`` environment variable is ``true`` or ``1``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def check_metrics(text: str) -> None:
    """Assert that ``promtool check metrics`` passes on ``text``; skip the calling test when
    promtool is not installed, or fail it under CI (:func:`in_ci`)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        why = ("promtool is not installed (apt-get install prometheus; scripts/test.sh "
               "installs it when run as root)")
        if in_ci():
            pytest.fail(f"{why}, and CI is set: the /metrics lint must run under CI")
        pytest.skip(why)
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
