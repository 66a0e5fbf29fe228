"""server/startup.py without a server: unknown APF_* variables and their closest known name,
the ready line, the per-route clamp notes, and package logs routed through gunicorn's error
log. (The same on a real gunicorn: tests/test_server_startup.py.)"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
from flask import Flask

from apf_gunicorn.flask import cost
from apf_gunicorn.flowcontrol.routes import parse_routes
from apf_gunicorn.server import startup
from apf_gunicorn.server.generation import level_max_seats, load_generation
from apf_gunicorn.server.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent


def test_misspelled_setting_gets_the_closest_known_name() -> None:
    env = {"APF_CONCURENCY_LIMIT": "4", "APF_TRUSTED_PROXY": "10.0.0.0/8",
           "APF_CONFIG": "builtin:webapp", "APF_ZZZ": "1", "PATH": "/bin"}
    assert startup.unknown_variable_warnings(env) == [
        "unknown setting APF_CONCURENCY_LIMIT is ignored; did you mean APF_CONCURRENCY_LIMIT?",
        "unknown setting APF_TRUSTED_PROXY is ignored; did you mean APF_TRUSTED_PROXIES?",
        "unknown setting APF_ZZZ is ignored; known: APF_ACCEPT_GRACE, APF_ACCEPT_SLACK, APF_ADAPTIVE_TICK, "
        "APF_ADMIN_BIND, "
        "APF_AGENT_BIND, APF_AGENT_DRAIN_DELAY, APF_BORROWING_PERIOD, APF_CONCURRENCY_LIMIT, "
        "APF_CONFIG, APF_CONFIG_WATCH, APF_EXEMPT_THREADS, APF_FAIRNESS, APF_GROUP_HEADER, "
        "APF_HEADER_TIMEOUT, "
        "APF_HEAD_BUFFER_LIMIT, APF_HEAD_CONNECTIONS, APF_HELD_REJECTIONS, APF_INSTANCE, "
        "APF_JWT_AUDIENCE, APF_JWT_GROUPS_CLAIM, APF_JWT_GROUPS_PREFIX, APF_JWT_ISSUER, "
        "APF_JWT_KEY, APF_JWT_LEEWAY, APF_JWT_USER_PREFIX, "
        "APF_LOAD_REPORT, APF_LOAD_REPORT_INTERVAL, APF_METRICS_PREFIX, APF_NO_ACCELERATOR, APF_PATHS, "
            "APF_PF_HEADERS, APF_POOL_SIGNALS, "
        "APF_QUEUE_WAIT_LIMIT, APF_REQUEST_INFO, APF_ROUTES, APF_SERVICE_ESTIMATE, "
        "APF_TRUSTED_PROXIES, APF_USER_FROM, APF_USER_HEADER, APF_WORKER_OOM_SCORE_ADJ, "
        "APF_WORK_ESTIMATOR",
    ]


def test_every_documented_setting_is_known_and_none_warns() -> None:
    """The README's settings table and what the server reads agree: setting every documented
    variable warns about none of them."""
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"^\| `(APF_[A-Z_]+)`", readme, re.M))
    documented |= set(re.findall(r"^\| `APF_[A-Z_]+`, `(APF_[A-Z_]+)`", readme, re.M))
    assert {"APF_CONFIG", "APF_CONCURRENCY_LIMIT", "APF_GROUP_HEADER"} <= documented
    known = startup.known_variables({})
    assert documented <= known, documented - known
    assert startup.unknown_variable_warnings(dict.fromkeys(documented, "")) == []


def _generation(config: str | None, limit: int):
    settings = load_settings({"APF_CONFIG": config or "", "APF_CONCURRENCY_LIMIT": str(limit)})
    return settings, load_generation(settings)


def test_ready_line_names_config_limit_levels_and_admin() -> None:
    settings, gen = _generation(None, 64)
    line = startup.ready_line(settings, gen, ("127.0.0.1", 9180), "on", 2, 64, env={})
    assert line.startswith("ready: configuration builtin:webapp (default; set APF_CONFIG to "
                           "change), limit 64 seats (default: 2 workers x 64 threads / 2; "
                           "follows the app's pools once found), "
                           "fairness maxmin (default), 4 priority levels (nominal seats): ")
    assert "exempt (exempt)" in line and ", users " in line and ", anonymous " in line
    assert line.endswith("; admin http://127.0.0.1:9180/")
    line = startup.ready_line(settings, gen, None, "off", 2, 64,
                              env={"APF_CONCURRENCY_LIMIT": "64"})
    assert "limit 64 seats (APF_CONCURRENCY_LIMIT)" in line
    assert line.endswith("; admin endpoint off (APF_ADMIN_BIND=off)")
    line = startup.ready_line(settings, gen, None, "busy", 2, 64, env={})
    assert line.endswith("admin endpoint 127.0.0.1:9180 is in use, retrying every second")


def test_ready_line_says_why_the_public_configuration_runs() -> None:
    settings = load_settings({"APF_USER_FROM": "address", "APF_CONCURRENCY_LIMIT": "8"})
    line = startup.ready_line(settings, load_generation(settings), None, "off", 2, 16, env={})
    assert line.startswith("ready: configuration builtin:public (default when "
                           "APF_USER_FROM=address names no verified identity; set APF_CONFIG to "
                           "change), limit 8 seats")
    assert ", anonymous 8" in line and "users" not in line


def test_ready_line_of_an_auto_limit() -> None:
    env = {"APF_CONCURRENCY_LIMIT": "auto:4-30"}
    settings = load_settings(env, workers=2, threads=64)
    line = startup.ready_line(settings, load_generation(settings), None, "off", 2, 64, env=env)
    assert ("limit auto (now 30) seats, within 4-30, experimental (APF_CONCURRENCY_LIMIT; "
            "signals: the app's pools once found, CPU, latency)") in line
    env["APF_POOL_SIGNALS"] = "off"
    settings = load_settings(env, workers=2, threads=64)
    line = startup.ready_line(settings, load_generation(settings), None, "off", 2, 64, env=env)
    assert "(APF_CONCURRENCY_LIMIT; signals: CPU, latency)" in line


def test_ready_line_names_the_fairness_and_annotated_levels(tmp_path) -> None:
    """APF_FAIRNESS is named with where it came from; a level that chooses its own fairness by
    annotation says so (here kubernetes, the one this build runs)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "apiVersion: flowcontrol.apiserver.k8s.io/v1\n"
        "kind: PriorityLevelConfiguration\n"
        "metadata: {name: tenants, annotations: {apf-gunicorn.io/fairness: kubernetes}}\n"
        "spec: {type: Limited, limited: {nominalConcurrencyShares: 10, limitResponse: "
        "{type: Queue, queuing: {queues: 8, handSize: 2, queueLengthLimit: 5}}}}\n")
    env = {"APF_CONFIG": str(cfg), "APF_CONCURRENCY_LIMIT": "20", "APF_FAIRNESS": "kubernetes"}
    gen = load_generation(load_settings(env))
    line = startup.ready_line(load_settings(env), gen, None, "off", 1, 40, env=env)
    assert line.endswith(
        "limit 20 seats (APF_CONCURRENCY_LIMIT), fairness kubernetes (APF_FAIRNESS), 3 priority "
        "levels (nominal seats): tenants 14 (fairness kubernetes by annotation), exempt "
        "(exempt), catch-all 7; admin endpoint off (APF_ADMIN_BIND=off)"), line


def test_route_notes_name_every_level_that_clamps_a_declared_cost() -> None:
    app = Flask(__name__)

    @app.get("/reports/<int:year>")
    @cost(seats=4)
    def report(year):
        return ""

    @app.post("/jobs")
    @cost(seats=1, final_seats=3, additional_latency="1s")
    def jobs():
        return ""

    @app.get("/small")
    @cost(seats=1)
    def small():
        return ""

    routes = parse_routes({"routes": [{"path": "/export/<path:rest>", "seats": 3}]},
                          "routes.yaml")
    costs = startup.declared_costs(app, routes)
    assert [w for w, _ in costs] == ["@cost on GET /reports/<int:year>", "@cost on POST /jobs",
                                     "@cost on GET /small",
                                     "APF_ROUTES routes.yaml: routes[0] (/export/<path:rest>)"]
    max_seats = {"exempt": 100, "big": 8, "mid": 2, "tiny": 1}
    notes = startup.route_notes(costs, max_seats, {"exempt"})
    tail = (" (a level's widest request, Kubernetes' 15% rule unless an apf-gunicorn.io/max-seats "
            "annotation sets it; see docs/work-estimation.md)")
    assert notes == [
        "@cost on GET /reports/<int:year> asks for 4 seat(s): clamped to 1 on priority level "
        "tiny; clamped to 2 on priority level mid" + tail,
        "@cost on POST /jobs asks for 1 seat(s) and 3 final seat(s): clamped to 1 (final 1) on "
        "priority level tiny; clamped to 1 (final 2) on priority level mid" + tail,
        "APF_ROUTES routes.yaml: routes[0] (/export/<path:rest>) asks for 3 seat(s): clamped "
        "to 1 on priority level tiny; clamped to 2 on priority level mid" + tail,
    ]


def test_route_notes_use_the_servers_max_seats() -> None:
    settings, gen = _generation(str(ROOT / "tests" / "apps" / "seats.yaml"), 16)
    app = Flask(__name__)

    @app.get("/clamped")
    @cost(seats=4)
    def clamped():
        return ""

    notes = startup.route_notes(startup.declared_costs(app, None),
                                level_max_seats(gen, settings), {"exempt"})
    assert notes == ["@cost on GET /clamped asks for 4 seat(s): clamped to 1 on priority level "
                     "catch-all; clamped to 2 on priority level narrow (a level's widest "
                     "request, Kubernetes' 15% rule unless an apf-gunicorn.io/max-seats "
                     "annotation sets it; see docs/work-estimation.md)"]
    annotated = startup.route_notes(startup.declared_costs(app, None), {"narrow": 2},
                                    set(), {"narrow"})
    assert annotated == ["@cost on GET /clamped asks for 4 seat(s): clamped to 2 on priority "
                         "level narrow (a level's widest request, set by their "
                         "apf-gunicorn.io/max-seats annotation; see docs/work-estimation.md)"]


@pytest.fixture
def package_logger():
    logger = logging.getLogger(startup.PACKAGE_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def test_package_logs_go_through_gunicorns_error_log(package_logger) -> None:
    from gunicorn.config import Config
    from gunicorn.glogging import Logger

    glog = Logger(Config())
    out = io.StringIO()
    # gunicorn's own handler and format, into a buffer (only gunicorn's: pytest attaches its
    # capture handlers to every logger that does not propagate, gunicorn.error among them once
    # an earlier test in this process made a gunicorn Logger)
    for h in glog.error_log.handlers:
        if getattr(h, "_gunicorn", False):
            h.setStream(out)
    startup.route_logs(glog)
    startup.route_logs(glog)  # idempotent: one handler, one line per record
    logging.getLogger("apf_gunicorn.middleware").warning("apf: clamped %d", 4)
    logging.getLogger("apf_gunicorn.admin").debug("not at gunicorn's level (info)")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}\] \[\d+\] \[WARNING\] "
                        r"apf: clamped 4", lines[0]), lines[0]
