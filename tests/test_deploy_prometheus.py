"""The alert rules of deploy/prometheus/: ``promtool check rules`` passes on
``apf-rules.yml`` and ``promtool test rules`` on its unit tests ``apf-rules.test.yml`` (each
alert fires and stays silent where it should). Without promtool these skip, saying why, but
fail under CI (``CI=true``): tests/promtool.py.

The unit tests must be able to fail: each alert's rule, changed the way a careless edit would
change it, makes ``promtool test rules`` fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import promtool
from tests.conftest import ROOT

RULES = ROOT / "deploy" / "prometheus" / "apf-rules.yml"
TESTS = ROOT / "deploy" / "prometheus" / "apf-rules.test.yml"
WHAT = "the alert rules' checks"

ALERTS = ("APFLevelSaturated", "APFLevelRejecting", "APFQueueWaitNearLimit", "APFAutoLimitCut",
          "APFWorkersDying", "APFAdminEndpointDown", "APFConfigReloadRefused")

# alert -> (text only in its rule, what a careless edit makes of it, everywhere): each makes a
# silent case fire or the firing case go silent
MUTATIONS = {
    "APFLevelSaturated": ("(apf_current_inqueue_requests) > 0)",
                          "(apf_current_inqueue_requests) >= 0)"),
    "APFLevelRejecting": ('{reason!="cancelled"}', ""),
    "APFQueueWaitNearLimit": ('le="10.0"', 'le="5.0"'),
    "APFAutoLimitCut": ("and on (job, instance) apf_adaptive_latency_ratio", ""),
    "APFWorkersDying": ("(increase(apf_reclaimed_workers_total[15m])) > 0",
                        "(increase(apf_reclaimed_workers_total[15m])) >= 0"),
    "APFAdminEndpointDown": ('up{job="apf-gunicorn"} == 0', "up == 0"),
    "APFConfigReloadRefused": ('result="refused"', 'result=~".+"'),
}


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool.require("promtool", WHAT), *args], cwd=str(cwd),
                          capture_output=True, text=True, timeout=120)


def test_promtool_check_rules_passes() -> None:
    out = _promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests_pass() -> None:
    out = _promtool("test", "rules", TESTS.name, cwd=TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    import yaml

    rules = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert tuple(rules) == ALERTS
    cases: dict[str, set[str]] = {a: set() for a in ALERTS}
    for test in yaml.safe_load(TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases[case["alertname"]].add("fires" if case["exp_alerts"] else "silent")
    assert all(kinds == {"fires", "silent"} for kinds in cases.values()), cases


@pytest.mark.parametrize("alert", ALERTS)
def test_a_broken_rule_fails_its_unit_test(tmp_path: Path, alert: str) -> None:
    old, new = MUTATIONS[alert]
    text = RULES.read_text()
    assert old in text, f"{alert}: {old!r} is not in {RULES.name}"
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    assert _promtool("check", "rules", RULES.name, cwd=tmp_path).returncode == 0
    out = _promtool("test", "rules", TESTS.name, cwd=tmp_path)
    assert out.returncode != 0, out.stdout + out.stderr
    # promtool names the failing cases on stderr; only the changed alert's fail
    failed = set(re.findall(r"alertname: (\w+),", out.stderr))
    assert failed == {alert}, out.stdout + out.stderr


def test_the_example_scrape_config_loads_the_rules() -> None:
    out = _promtool("check", "config", "examples/prometheus.yml", cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout, out.stdout


def test_every_alert_is_documented() -> None:
    """docs/observability.md's "Alerts" links the rules and the dashboard and has a row (what it
    means, what to do) for each alert, no more."""
    doc = (ROOT / "docs" / "observability.md").read_text()
    section = doc.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|(.*)\|$", section, re.M)
    assert tuple(name for name, _ in rows) == ALERTS, rows
    assert all(len([c for c in cells.split(" | ") if c.strip()]) == 3 for _, cells in rows), rows
    links = re.findall(r"\]\((\.\./[^)#]+)\)", doc)
    for path in ("deploy/prometheus/apf-rules.yml", "deploy/grafana/apf-dashboard.json"):
        assert f"../{path}" in links, f"docs/observability.md does not link {path}"
        assert (ROOT / path).is_file(), path
