"""The promtool check of the /metrics tests (``tests/promtool.py``): without promtool it skips
saying why, but under CI (``CI=true``) it fails, so a CI run cannot pass without the lint that
``scripts/test.sh`` installs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import promtool
from tests.conftest import ROOT

PROMTOOL_TEST = "tests/test_metrics.py::test_metrics_text_passes_promtool"


def _without_promtool(ci: str | None) -> subprocess.CompletedProcess:
    """The /metrics promtool test run by pytest with a PATH that holds no promtool (only this
    Python's directory) and ``CI`` as given (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(Path(sys.executable).parent)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "-rs", PROMTOOL_TEST], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_missing_promtool_fails_the_test_under_ci() -> None:
    out = _without_promtool("true")
    print(out.stdout[-2000:])
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed" in out.stdout and "promtool is not installed" in out.stdout, out.stdout


def test_a_missing_promtool_skips_the_test_outside_ci() -> None:
    out = _without_promtool(None)
    print(out.stdout[-2000:])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 skipped" in out.stdout and "promtool is not installed" in out.stdout, out.stdout


@pytest.mark.parametrize(("value", "ci"), [("true", True), ("TRUE", True), ("1", True),
                                           ("false", False), ("0", False), ("", False)])
def test_ci_is_read_from_the_environment(monkeypatch, value: str, ci: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert promtool.in_ci() is ci


@pytest.mark.parametrize("binary", ["promtool", "prometheus"])
def test_require_fails_under_ci_and_skips_outside(monkeypatch, binary: str) -> None:
    """The rules' and the dashboard's tests (tests/test_deploy_prometheus.py,
    tests/test_dashboard_prometheus.py) find their binaries with ``require``."""
    monkeypatch.setattr(promtool.shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"{binary} is not installed.*CI is set"):
        promtool.require(binary, "the check")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=f"{binary} is not installed"):
        promtool.require(binary, "the check")
    monkeypatch.setattr(promtool.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert promtool.require(binary) == f"/usr/bin/{binary}"
