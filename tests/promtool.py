"""``promtool check metrics`` (Prometheus' own linter) on a /metrics text, for the tests that
check the exposition; and :func:`require`, which finds promtool or the ``prometheus`` server
for the tests of deploy/prometheus/ and of the Grafana dashboard.

``scripts/test.sh`` installs both (Debian's ``prometheus`` package) when it runs as root
with apt-get. Without them the check skips, saying why; under CI (``CI`` set to ``true``
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


def require(binary: str = "promtool", what: str = "the /metrics lint") -> str:
    """The path of ``binary`` (``promtool`` or ``prometheus``, both from Debian's
    ``prometheus`` package); when it is not installed, skip the calling test saying why, or
    fail it under CI (:func:`in_ci`): ``what`` names the check that must run there."""
    path = shutil.which(binary)
    if path is None:
        why = (f"{binary} is not installed (apt-get install prometheus; scripts/test.sh "
               "installs it when run as root)")
        if in_ci():
            pytest.fail(f"{why}, and CI is set: {what} must run under CI")
        pytest.skip(why)
    return path


def check_metrics(text: str) -> None:
    """Assert that ``promtool check metrics`` passes on ``text``; skip the calling test when
    promtool is not installed, or fail it under CI (:func:`in_ci`)."""
    promtool = require()
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
