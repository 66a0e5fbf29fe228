"""The Grafana dashboard (deploy/grafana/apf-dashboard.json) proven against a real Prometheus.

A real apf_gunicorn (``APF_CONCURRENCY_LIMIT=auto``, an app holding a declared resource of one
unit per worker, a level that queues little: tests/apps/dashboard_app.py, dashboard.yaml) runs
a short flood that both waits and is rejected; Debian's ``prometheus`` server, started here on
127.0.0.1 with a temporary storage directory, scrapes its admin endpoint every second. Every
panel's query, with Grafana's variables substituted as Grafana would, is then run through the
HTTP API as the panel runs it (a range query) and must return at least one series with a
number in it: a panel whose metric was renamed returns nothing and fails the test. The
template variables' own queries must list the server and its loaded level, and every metric
the alert rules (deploy/prometheus/apf-rules.yml) read must exist.

Without the ``prometheus`` binary the test skips, saying why, but fails under CI (``CI=true``):
tests/promtool.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import promtool
from tests.apps.loadgen import Client
from tests.conftest import APPS, ROOT, free_port

pytestmark = pytest.mark.server

DASHBOARD = ROOT / "deploy" / "grafana" / "apf-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "apf-rules.yml"
JOB = "apf-gunicorn"  # the rules' APFAdminEndpointDown names this job
# Grafana's $__rate_interval is at least four scrape intervals; 10 s of the test's 1 s
# scrapes leaves slack for a loaded machine's late scrapes
RATE_INTERVAL = "10s"
SCRAPE_INTERVAL = "1s"
LEVEL = "work"  # the level tests/apps/dashboard.yaml loads
# what the dashboard must show (issue 35): per level, seats in use against the limit, waiting,
# dispatched and rejected by reason, wait p99; auto's limit with its signals (the app's pools)
REQUIRED = ("apf_current_executing_seats", "apf_current_limit_seats",
            "apf_current_inqueue_requests", "apf_dispatched_requests_total",
            "apf_rejected_requests_total", "apf_request_wait_duration_seconds_bucket",
            "apf_server_concurrency_limit_seats", "apf_adaptive_latency_ratio",
            "apf_adaptive_concurrency_seats", "apf_pool_capacity", "apf_pool_in_use",
            "apf_pool_waiting", "apf_pool_wait_seconds_total",
            "apf_config_info", "apf_config_reloads_total")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows included."""
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def targets(d: dict) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` of every query of every panel."""
    return [(p["title"], t["refId"], t["expr"]) for p in panels(d) for t in p.get("targets", [])]


def grafana_regex(value: str) -> str:
    """A variable's value as Grafana writes it into a PromQL regex matcher: regex
    metacharacters escaped, and the backslashes escaped again for the string literal."""
    return re.escape(value).replace("\\", "\\\\")


def substitute(expr: str, *, level: str, instance: str) -> str:
    """``expr`` with Grafana's variables as Grafana sends them for one level and instance."""
    for var, value in (("$__rate_interval", RATE_INTERVAL), ("$__interval", SCRAPE_INTERVAL),
                       ("$level", grafana_regex(level)), ("$instance", grafana_regex(instance))):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def test_the_dashboard_shows_what_an_operator_needs() -> None:
    d = dashboard()
    exprs = " ".join(e for _, _, e in targets(d))
    missing = [m for m in REQUIRED if not re.search(rf"\b{m}\b", exprs)]
    assert not missing, f"no panel shows {missing}"
    assert re.search(r"sum by \([^)]*\breason\b[^)]*\) \(rate\(apf_rejected_requests_total", exprs)
    assert "histogram_quantile(0.99" in exprs
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "instance", "level"], names
    # the per-level panels follow the row repeated per level, and each filters on it
    rows = [p for p in d["panels"] if p["type"] == "row"]
    assert any(r.get("repeat") == "level" for r in rows), rows
    start = next(i for i, p in enumerate(d["panels"]) if p.get("repeat") == "level")
    for p in d["panels"][start + 1:]:
        for t in p["targets"]:
            assert 'priority_level=~"$level"' in t["expr"], (p["title"], t["expr"])
    for p in panels(d):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


class Prometheus:
    """Debian's ``prometheus`` on 127.0.0.1, scraping one target every second."""

    def __init__(self, binary: str, tmp: Path, target: str) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
        }))
        self.log_path = tmp / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def get(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # a query Prometheus refuses: say which and why
            raise AssertionError(f"{params}: {e.code} {e.read().decode(errors='replace')}") from e
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def instant(self, query: str) -> list:
        return self.get("/api/v1/query", query=query)["result"]

    def series_with_data(self, query: str, start: float) -> list:
        """The series of ``query`` from ``start`` to now, as a panel asks (a range query,
        a step a second) that hold at least one number (not NaN: a quantile or ratio of
        rates that were all 0 is NaN)."""
        data = self.get("/api/v1/query_range", query=query, start=f"{start:.3f}",
                        end=f"{time.time():.3f}", step="1")
        return [s for s in data["result"] if any(math.isfinite(float(v)) for _, v in s["values"])]


@contextlib.contextmanager
def prometheus(binary: str, tmp: Path, target: str) -> Iterator[Prometheus]:
    prom = Prometheus(binary, tmp, target)
    try:
        yield prom
    finally:
        prom.stop()


def label_values(prom: Prometheus, query: str, instance: str) -> set[str]:
    """A Grafana ``label_values(selector, label)`` variable query's values."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)",
                     query.replace("$instance", grafana_regex(instance)))
    assert m, query
    found = prom.get("/api/v1/series", **{"match[]": m.group(1)})
    return {s[m.group(2)] for s in found if m.group(2) in s}


def test_every_panel_query_returns_data_from_a_real_prometheus(server_factory, tmp_path):
    binary = promtool.require("prometheus", "the dashboard's queries")
    admin = free_port()
    instance = f"127.0.0.1:{admin}"
    env = {"APF_ADMIN_BIND": instance, "APF_CONCURRENCY_LIMIT": "auto:2-8",
           "APF_ADAPTIVE_TICK": "0.25", "APF_BORROWING_PERIOD": "1"}
    t0 = time.monotonic()
    stop = threading.Event()
    clients: list[Client] = []
    with prometheus(binary, tmp_path, instance) as prom, \
            server_factory(workers=2, threads=4, env=env, config=str(APPS / "dashboard.yaml"),
                           app="tests.apps.dashboard_app:app") as srv:
        assert srv.wait_for(prom.ready, timeout=30), prom.log()
        assert srv.wait_for(lambda: prom.instant(f'up{{job="{JOB}"}} == 1'), timeout=30), \
            prom.instant("up")
        start = time.time() - 1
        queries = {(title, ref): substitute(expr, level=LEVEL, instance=instance)
                   for title, ref, expr in targets(dashboard())}
        missing = dict(queries)
        # 10 users' 100 ms requests against about 4 seats, queues of 2 and a resource of one
        # unit per worker: requests wait in APF and for the resource, and are rejected
        clients = [Client(srv.port, "/work?ms=100", user=f"u{i}", stop=stop, timeout=30)
                   for i in range(10)]
        try:
            for c in clients:
                c.start()

            def all_have_data() -> bool:
                for key, query in list(missing.items()):
                    if prom.series_with_data(query, start):
                        del missing[key]
                return not missing

            srv.wait_for(all_have_data, timeout=30, step=0.5)
        finally:
            stop.set()
            for c in clients:
                c.join(30)
        statuses = {s for c in clients for s in c.statuses}
        assert {200, 429} <= statuses, statuses
        assert not missing, "panels whose query returned no data:\n" + "\n".join(
            f"  {title} ({ref}): {q}" for (title, ref), q in missing.items())

        # the template variables list this server and its loaded level
        variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
        assert instance in label_values(prom, variables["instance"]["query"]["query"], instance)
        assert LEVEL in label_values(prom, variables["level"]["query"]["query"], instance)

        # every metric the alert rules read exists
        import yaml

        exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"]
                 for r in g["rules"]]
        rule_metrics = set(re.findall(r"\bapf_[a-z_]+", " ".join(exprs)))
        assert len(rule_metrics) >= 10, rule_metrics
        absent = [m for m in sorted(rule_metrics) if not prom.instant(m)]
        assert not absent, f"the alert rules read metrics the server does not export: {absent}"
        assert prom.instant('apf_request_wait_duration_seconds_bucket{le="10.0"}'), \
            "APFQueueWaitNearLimit's bucket bound is not one the server exports"

        # the check can fail: the first query with its metric renamed returns nothing
        (title, _ref), query = next(iter(queries.items()))
        renamed = re.sub(r"\bapf_", "apf_renamed_", query, count=1)
        assert renamed != query and not prom.series_with_data(renamed, start), (title, renamed)
    print(f"dashboard test: {len(queries)} queries, {time.monotonic() - t0:.1f} s")
