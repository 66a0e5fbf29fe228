"""Django views with a cost (apf_gunicorn.django): resolution through the URLconf, cached per
(method, path); explain naming the view; costs that cannot take effect reported; and the
example project (examples/mysite) under a real gunicorn, where a 4-seat report on a level
annotated ``apf-gunicorn.io/max-seats: "4"`` is admitted with 4 seats."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("django")  # the test extra installs it; apf_gunicorn does not need it

from flask import Flask  # noqa: E402

from apf_gunicorn import django as apf_django
from apf_gunicorn import flask as apf_flask
from apf_gunicorn.appcosts import declared_view_costs, unusable_costs, view_costs_for_app
from apf_gunicorn.cli import main
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from tests.apps.overload import scrape, total
from tests.conftest import ROOT, free_port

EXAMPLE_CONFIG = str(ROOT / "examples" / "mysite" / "apf.yaml")
REPORT = "examples.mysite.views.report (reports/<int:year>/)"


@pytest.fixture(scope="module")
def app():
    from tests.apps.django_wsgi import application

    return application


@pytest.fixture(autouse=True)
def _no_apf_environment(monkeypatch):
    """explain reads APF_* as the server does: start every test from none."""
    for name in list(os.environ):
        if name.startswith("APF_"):
            monkeypatch.delenv(name)


def test_view_costs_resolve_through_the_urlconf(app):
    costs = view_costs_for_app(app)
    assert isinstance(costs, apf_django.DjangoViewCosts)
    assert costs.lookup("GET", "/reports/2024/") == WorkEstimate(4)
    assert costs.lookup("HEAD", "/reports/2025/") == WorkEstimate(4)
    assert costs.lookup("GET", "/reports/2024") is None  # no view: Django redirects (APPEND_SLASH)
    assert costs.lookup("GET", "/reports/twenty/") is None  # 404
    assert costs.lookup("GET", "/items/") is None  # a class-based view's undecorated method
    assert costs.lookup("POST", "/items/") == WorkEstimate(2)  # its decorated one
    assert costs.lookup("POST", "/api/v1/items/") == WorkEstimate(2)
    assert costs.lookup("GET", "/exports/") == WorkEstimate(2, 1, 10_000_000)  # on the class
    assert costs.lookup("GET", "/misplaced/") is None  # Flask's decorator is not read
    assert costs.lookup("GET", "/" + "x" * 5000) is None  # a long path: resolved, not cached
    assert costs.name("GET", "/reports/2024/") == REPORT
    assert costs.name("GET", "/items/") == "examples.mysite.views.Items (items/)"
    assert costs.name("GET", "/nowhere/") is None


def test_lookups_are_cached_per_method_and_path(app, monkeypatch):
    costs = apf_django.DjangoViewCosts(cache_size=2)
    calls = []
    match = costs._match
    monkeypatch.setattr(costs, "_match", lambda path: calls.append(path) or match(path))
    for _ in range(3):
        assert costs.lookup("GET", "/reports/2024/") == WorkEstimate(4)
    assert calls == ["/reports/2024/"]
    costs.lookup("GET", "/reports/2025/")  # another path: its own entry
    costs.lookup("POST", "/reports/2025/")
    costs.lookup("GET", "/reports/2024/")  # evicted by the bound of 2
    assert calls == ["/reports/2024/", "/reports/2025/", "/reports/2025/", "/reports/2024/"]


def test_i18n_patterns_resolve_in_the_paths_language_not_the_threads(app):
    """The dispatcher thread never has a language active, a request's thread keeps the one
    LocaleMiddleware activated last: neither may decide which view (and cost) a path has,
    cached for every thread after."""
    from django.utils import translation

    costs = apf_django.DjangoViewCosts()
    found = {}

    def look(path: str, language: str | None) -> None:
        if language is None:  # a fresh thread: no language active, as the dispatcher's
            found[path] = (costs.lookup("GET", path), costs.name("GET", path))
            return
        with translation.override(language):  # as LocaleMiddleware leaves it
            found[path] = (costs.lookup("GET", path), costs.name("GET", path))

    for path, language in (("/fr/localized/2024/", None), ("/en/localized/2024/", "fr"),
                           ("/fr/localized/2025/", "en"), ("/de/localized/2024/", None)):
        t = threading.Thread(target=look, args=(path, language))
        t.start()
        t.join()
    view = "examples.mysite.views.report"
    assert found["/fr/localized/2024/"] == (WorkEstimate(4), f"{view} (fr/localized/<int:year>/)")
    assert found["/en/localized/2024/"] == (WorkEstimate(4), f"{view} (en/localized/<int:year>/)")
    assert found["/fr/localized/2025/"][0] == WorkEstimate(4)
    assert found["/de/localized/2024/"] == (None, None)  # not a language of the project
    # the views' routes are named in LANGUAGE_CODE whatever the thread has active
    with translation.override("fr"):
        declared = dict(declared_view_costs(app))
        assert translation.get_language() == "fr"
    assert declared[f"@cost on view {view} (en/localized/<int:year>/)"] == WorkEstimate(4)


def test_only_django_apps_get_django_costs(app):
    assert apf_django.django_handler(app) is app

    class Wrapper:  # a WSGI wrapper that keeps the app in .application (WhiteNoise does)
        def __init__(self, application):
            self.application = application

        def __call__(self, environ, start_response):
            return self.application(environ, start_response)

    assert apf_django.django_handler(Wrapper(Wrapper(app))) is app
    assert isinstance(view_costs_for_app(Wrapper(app)), apf_django.DjangoViewCosts)
    assert view_costs_for_app(lambda environ, start_response: []) is None
    assert apf_django.DjangoViewCosts.for_app(Flask("x")) is None

    class Hiding:  # keeps the app where nobody looks: its costs cannot be read, and that is said
        def __init__(self, inner):
            self._inner = inner

    assert view_costs_for_app(Hiding(app)) is None
    # (endpoints other tests tagged with apf_gunicorn.starlette.cost are hidden from it too)
    (hidden,) = [m for m in unusable_costs(Hiding(app)) if m.startswith("Django")]
    assert hidden.startswith("Django views declare @cost, but the app (")
    assert hidden.endswith("Hiding) is not Django's WSGIHandler or ASGIHandler and keeps none in "
                           ".application or .app: the costs have no effect (keep the handler "
                           "reachable, or declare the costs in APF_ROUTES)")


def test_django_asgi_apps_get_their_costs_too(app):
    """Under an ASGI worker gunicorn loads Django's ASGIHandler (mysite/asgi.py): the same
    URLconf, the same costs."""
    from django.core.handlers.asgi import ASGIHandler

    handler = ASGIHandler()
    assert apf_django.django_handler(handler) is handler
    costs = view_costs_for_app(handler)
    assert isinstance(costs, apf_django.DjangoViewCosts)
    assert costs.lookup("GET", "/reports/2024/") == WorkEstimate(4)
    assert unusable_costs(handler) == unusable_costs(app)


def test_declared_and_unusable_costs(app):
    declared = dict(declared_view_costs(app))
    assert declared[f"@cost on view {REPORT}"] == WorkEstimate(4)
    assert declared["@cost on view examples.mysite.views.Items (items/) POST"] == WorkEstimate(2)
    assert "@cost on view examples.mysite.views.Items (items/) GET" not in declared
    assert declared["@cost on view tests.apps.django_urls.Exports (exports/) GET"] == (
        WorkEstimate(2, 1, 10_000_000))
    assert unusable_costs(app) == [
        "@cost from apf_gunicorn.flask on the Django view tests.apps.django_urls.misplaced "
        "(misplaced/) has no effect: use apf_gunicorn.django.cost"]

    flask_app = Flask("wrong")

    @flask_app.get("/r")
    @apf_django.cost(seats=2)
    def r():
        return ""

    assert unusable_costs(flask_app) == [
        "@cost from apf_gunicorn.django on the Flask view 'r' (/r) has no effect: use "
        "apf_gunicorn.flask.cost"]


def test_first_worker_logs_unusable_and_clamped_costs(app):
    """What post_worker_init logs for a Django app: the misplaced Flask decorator, and the
    costs a level would clamp (naming where its maximum comes from)."""
    from apf_gunicorn.server import startup
    from apf_gunicorn.server.generation import level_max_seats, load_generation
    from apf_gunicorn.server.settings import load_settings

    settings = load_settings({"APF_CONFIG": EXAMPLE_CONFIG, "APF_CONCURRENCY_LIMIT": "8"})
    gen = load_generation(settings)
    warnings = []

    class Log:
        def warning(self, fmt, *args):
            warnings.append(fmt % args)

        def exception(self, msg):
            raise AssertionError(msg)

    startup.log_route_notes(Log(), app, None, level_max_seats(gen, settings), gen)
    assert ("apf: @cost from apf_gunicorn.flask on the Django view "
            "tests.apps.django_urls.misplaced (misplaced/) has no effect: use "
            "apf_gunicorn.django.cost") in warnings
    # /reports/* goes to the level as wide as a report: the levels that would clamp it
    # (catch-all, web) are never reached by a report
    assert not [w for w in warnings if f"@cost on view {REPORT}" in w], warnings
    # a report on a configuration that sends it to any level is clamped on the narrow ones
    warnings.clear()
    settings = load_settings({"APF_CONFIG": str(ROOT / "tests" / "apps" / "rest.yaml"),
                              "APF_CONCURRENCY_LIMIT": "8"})
    gen = load_generation(settings)
    startup.log_route_notes(Log(), app, None, level_max_seats(gen, settings), gen)
    assert [w for w in warnings if w.startswith(f"apf: @cost on view {REPORT} asks for 4 "
                                                "seat(s): clamped to ")], warnings


def test_flask_and_django_read_their_views_through_one_function_each(app, caplog):
    """One ``for_app`` (costs_for_app), one ``declared_costs`` and one list of named views
    (``app_views``) serve both frameworks: a view table that cannot be read is logged and
    gives no costs for Flask as for Django, instead of an exception at worker start."""
    import inspect

    from apf_gunicorn import viewcost

    for module in (apf_flask, apf_django):
        assert not hasattr(module, "declared_costs") and not hasattr(module, "named_views")
        assert all(isinstance(v, viewcost.NamedView) for v in module.app_views(app))
    for for_app in (apf_flask.ViewCosts.for_app, apf_django.DjangoViewCosts.for_app):
        assert "costs_for_app(" in inspect.getsource(for_app)

    class Unreadable:  # a view whose attributes fail to read (a broken proxy)
        def __getattr__(self, name):
            raise RuntimeError("broken view")

    flask_app = Flask("unreadable")
    flask_app.view_functions["broken"] = Unreadable()
    with caplog.at_level("ERROR", logger="apf_gunicorn.flask"):
        assert apf_flask.ViewCosts.for_app(flask_app) is None
    assert "cannot read the Flask URL map; @cost declarations are ignored" in caplog.text


def test_cost_arguments_are_checked_as_flasks():
    with pytest.raises(ValueError, match="seats"):
        apf_django.cost(seats=0)
    with pytest.raises(ValueError, match="additional_latency"):
        apf_django.cost(final_seats=1, additional_latency="soon")


def _explain(capsys, *argv: str) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_names_the_view_and_reports_unusable_costs(app, capsys):
    argv = ["--app", "tests.apps.django_wsgi:application", "--config", EXAMPLE_CONFIG,
            "--concurrency-limit", "8"]
    out = _explain(capsys, *argv, "--request", "GET /reports/2024/")
    assert out["seats"]["view"] == REPORT
    assert (out["seats"]["initial"], out["seats"]["source"]) == (4, "@cost")
    assert out["notes"] == unusable_costs(app)
    out = _explain(capsys, *argv, "--request", "GET /misplaced/")
    assert out["seats"]["view"] == "tests.apps.django_urls.misplaced (misplaced/)"
    assert (out["seats"]["initial"], out["seats"]["source"]) == (1, "default")
    assert any("apf_gunicorn.flask on the Django view tests.apps.django_urls.misplaced" in n
               for n in out["notes"])
    # without the annotation Kubernetes' max (ceil(15% x 8 nominal) = 2) clamps it, and says so
    plain = ROOT / "tests" / "apps" / "rest.yaml"
    out = _explain(capsys, "--app", "tests.apps.django_wsgi:application", "--config",
                   str(plain), "--concurrency-limit", "8", "--request", "GET /reports/2024/")
    assert (out["seats"]["requested"]["initial"], out["seats"]["initial"]) == (4, 2)
    assert "apf-gunicorn.io/max-seats" in out["seats"]["maxSeatsFrom"]


def test_apf_routes_and_the_hook_keep_working_beside_django_costs(app, capsys, tmp_path,
                                                                  monkeypatch):
    """Precedence: APF_WORK_ESTIMATOR > @cost > APF_ROUTES > one seat."""
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes:\n- {path: /items/, seats: 3}\n- {path: /reports/<int:y>/, "
                      "seats: 2}\n")
    monkeypatch.setenv("APF_ROUTES", str(routes))
    argv = ["--app", "tests.apps.django_wsgi:application", "--config", EXAMPLE_CONFIG,
            "--concurrency-limit", "8"]
    out = _explain(capsys, *argv, "--request", "GET /items/")
    assert (out["seats"]["initial"], out["seats"]["source"]) == (2, "APF_ROUTES")  # web: max 2
    assert out["seats"]["requested"]["initial"] == 3
    out = _explain(capsys, *argv, "--request", "GET /reports/2024/")
    assert (out["seats"]["initial"], out["seats"]["source"]) == (4, "@cost")
    monkeypatch.setenv("APF_WORK_ESTIMATOR", "tests.test_django:three_seats")
    out = _explain(capsys, *argv, "--request", "GET /reports/2024/")
    assert (out["seats"]["initial"], out["seats"]["source"]) == (3, "APF_WORK_ESTIMATOR")


def three_seats(environ, attrs, classification):
    return {"seats": 3}


# -- the example project under a real gunicorn ------------------------------------------------

def _get(port: int, path: str, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _report_rows(dump: str) -> list[dict]:
    lines = [[c.strip() for c in line.split(",")] for line in dump.splitlines()]
    header, rows = lines[0], lines[1:]
    return [dict(zip(header, row, strict=True)) for row in rows if row[0] == "reports"]


@pytest.mark.server
def test_example_project_admits_a_four_seat_report(server_factory):
    """Six concurrent reports on the 8-seat example server: each holds 4 seats (the level's
    apf-gunicorn.io/max-seats), so they run one at a time on the level's 4 nominal seats:
    dump_requests shows InitialSeats 4 for each it lists, the level's work_estimated_seats
    counts six of 4 seats; explain --app says the same."""
    aport = free_port()
    env = {"APF_CONCURRENCY_LIMIT": "8", "APF_ADMIN_BIND": f"127.0.0.1:{aport}",
           "APF_QUEUE_WAIT_LIMIT": "60", "DJANGO_SETTINGS_MODULE": "examples.mysite.settings"}
    with server_factory(workers=2, threads=16, env=env, config=EXAMPLE_CONFIG,
                        args=("examples.mysite.wsgi:application",)) as srv:
        barrier = threading.Barrier(6)

        def report(_):
            barrier.wait()
            return srv.request("/reports/2024/?ms=1500", timeout=60)[0]

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(report, i) for i in range(6)]
            # every report the dump shows while they run (a report waiting, then executing,
            # is one row: its arrival time)
            seen: dict = {}

            def all_answered() -> bool:
                for r in _report_rows(_get(aport, "/debug/api_priority_and_fairness/"
                                               "dump_requests")[2].decode()):
                    seen[(r["FlowDistingsher"], r["ArriveTime"])] = r["InitialSeats"]
                return all(f.done() for f in futures)

            assert srv.wait_for(all_answered, timeout=120, step=0.02), srv.log()
            statuses = [f.result() for f in futures]
        print(f"{len(seen)} of the 6 reports seen in dump_requests while they ran")
        assert statuses == [200] * 6
        assert seen and set(seen.values()) == {"4"}, seen
        # all six were admitted with 4 seats: the level's work_estimated_seats (max(initial,
        # final) per admit) counts 6 reports and 24 seats
        samples = scrape(aport)
        assert (total(samples, "apf_work_estimated_seats_count", priority_level="reports"),
                total(samples, "apf_work_estimated_seats_sum", priority_level="reports")) \
            == (6, 24), samples
        # REST paths of the example are classified like any other path (no resource rules)
        api = srv.request("/api/v1/items/")[1]["X-Kubernetes-PF-FlowSchema-UID"]
        assert api == srv.request("/items/")[1]["X-Kubernetes-PF-FlowSchema-UID"]
        log = srv.log()
    # no report was clamped, and no start-up note says one would be (reports land in
    # "reports", annotated for 4 seats; the notes name only the levels a cost's requests reach)
    assert "admits at most" not in log and "has no effect" not in log
    assert "clamped" not in log and "[WARNING]" not in log, log

    explain = subprocess.run(
        [sys.executable, "-m", "apf_gunicorn", "explain", "--app",
         "examples.mysite.wsgi:application", "--config", EXAMPLE_CONFIG,
         "--concurrency-limit", "8", "--request", "GET /reports/2024/", "--json"],
        cwd=str(ROOT), capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("APF_")},
             "DJANGO_SETTINGS_MODULE": "examples.mysite.settings"})
    assert explain.returncode == 0, explain.stderr
    seats = json.loads(explain.stdout)["seats"]
    assert (seats["view"], seats["initial"], seats["source"]) == (REPORT, 4, "@cost")
