"""Start-up refusals: wrong worker class, bad settings, invalid configuration (real gunicorn)."""

import pytest

pytestmark = pytest.mark.server

BAD_CONFIG = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: broken}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: -3
    limitResponse: {type: Queue, queuing: {queues: 4, handSize: 8}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: fs}
spec:
  matchingPrecedence: 20000
  priorityLevelConfiguration: {name: broken}
"""


def test_sync_worker_is_refused(server_factory):
    with server_factory(workers=1, threads=1, args=("-k", "sync"), expect_fail=True) as srv:
        assert srv.proc.returncode != 0
        log = srv.log()
        assert "worker class 'SyncWorker' is not supported" in log
        assert "gthread" in log


@pytest.mark.parametrize("worker_class, name", [("sync", "SyncWorker"),
                                                 ("gthread", "ThreadWorker")])
def test_a_worker_class_not_ours_is_refused_whatever_threads_says(server_factory, worker_class,
                                                                 name):
    """With --threads > 1 gunicorn silently runs its stock gthread worker for ``sync``: that
    is refused too, as is stock gthread asked for by name (neither has our worker's
    protections), naming the class the user asked for."""
    with server_factory(workers=1, threads=64, args=("-k", worker_class),
                        expect_fail=True) as srv:
        assert srv.proc.returncode != 0
        log = srv.log()
        assert f"worker class '{name}' is not supported" in log, log
        assert "ApfThreadWorker" in log
        assert "Booting worker" not in log


def test_bad_setting_names_variable_value_and_allowed(server_factory):
    with server_factory(env={"APF_QUEUE_WAIT_LIMIT": "soon"}, expect_fail=True) as srv:
        assert srv.proc.returncode == 1
        assert ("invalid APF_QUEUE_WAIT_LIMIT='soon': must be a number of seconds greater "
                "than 0") in srv.log()


def test_invalid_configuration_lists_every_error(server_factory, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_CONFIG)
    with server_factory(config=str(bad), expect_fail=True) as srv:
        assert srv.proc.returncode == 1
        log = srv.log()
        assert "invalid configuration" in log
        assert "nominalConcurrencyShares" in log
        assert "handSize" in log
        assert "matchingPrecedence" in log


def test_apf_fairness_maxmin_serves_and_is_named(server_factory):
    """APF_FAIRNESS=maxmin: the ready line names the fairness and where it came from, and the
    server serves."""
    with server_factory(workers=1, threads=4, env={"APF_FAIRNESS": "maxmin"}) as srv:
        assert srv.wait_for(lambda: "fairness maxmin (APF_FAIRNESS)" in srv.log(),
                            timeout=15), srv.log()
        status, _, _ = srv.request("/work?ms=1", headers={"X-Remote-User": "pf"})
        assert status == 200


def test_reload_switches_a_level_to_maxmin(server_factory, tmp_path):
    """A HUP whose configuration annotates a level maxmin is applied in place, the level keeps
    serving under its new fairness, and the admin endpoint says so: the dump's Fairness column
    (also through `apf-gunicorn dump levels`) and the fairness series change from
    kubernetes to maxmin for that level only."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from tests.conftest import APPS, free_port
    from tests.test_server_observability import DUMP, admin_get, parse_dump, scrape

    def fairnesses() -> dict[str, str]:
        rows = parse_dump(admin_get(aport, DUMP + "dump_priority_levels?includeFairness=1"))
        col = rows[0].index("Fairness")
        return {r[0]: r[col] for r in rows[1:]}

    def info(level: str) -> set[str]:
        return {dict(labels)["fairness"] for (name, labels), v in scrape(aport).items()
                if name == "apf_fairness_info" and dict(labels)["priority_level"] == level
                and v == 1}

    aport = free_port()
    cfg = tmp_path / "apf.yaml"
    shutil.copy(APPS / "apf.yaml", cfg)
    with server_factory(workers=1, threads=4, config=str(cfg),
                        env={"APF_ADMIN_BIND": f"127.0.0.1:{aport}",
                             "APF_FAIRNESS": "kubernetes", "APF_CONFIG_WATCH": "off"}) as srv:
        before = fairnesses()
        assert before["work"] == "kubernetes" and info("work") == {"kubernetes"}
        text = cfg.read_text()
        marked = "metadata: {name: work, uid: uid-pl-work}"
        assert marked in text
        cfg.write_text(text.replace(marked, "metadata: {name: work, uid: uid-pl-work, "
                                            "annotations: {apf-gunicorn.io/fairness: maxmin}}"))
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "configuration generation 2 applied" in srv.log(),
                            timeout=15), srv.log()
        assert "reload rejected" not in srv.log()
        for _ in range(3):
            status, headers, _ = srv.request("/work?ms=1", headers={"X-Remote-User": "pf"})
            assert status == 200 and headers["X-Kubernetes-PF-PriorityLevel-UID"] == "uid-pl-work"
        after = fairnesses()
        assert after["work"] == "maxmin" and info("work") == {"maxmin"}
        assert {k: v for k, v in after.items() if k != "work"} == \
            {k: v for k, v in before.items() if k != "work"}  # the other levels unchanged
        cli = subprocess.run([sys.executable, "-m", "apf_gunicorn", "dump", "levels", "--admin",
                              f"127.0.0.1:{aport}"], capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0, cli.stderr
        rows = parse_dump(cli.stdout)
        assert next(r for r in rows if r[0] == "work")[rows[0].index("Fairness")] == "maxmin"


def test_a_reload_logs_each_levels_seats_and_the_dump_shows_them(server_factory, tmp_path):
    """A HUP that moves seats between levels logs each level's nominal and current seats before
    and after, and `apf-gunicorn dump levels` shows the new seats (nominal and current; the
    levels lend and borrow nothing, so current stays at nominal)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from apf_gunicorn.flowcontrol.limits import compute_limits
    from apf_gunicorn.flowcontrol.loader import load_configuration
    from tests.conftest import APPS, free_port
    from tests.test_server_observability import parse_dump

    def nominal(path) -> dict[str, int]:
        cfg = load_configuration(str(path))
        return {name: int(lim.nominal) for name, lim in
                compute_limits(cfg.priority_levels.values(), 16).items()}

    def dumped() -> dict[str, tuple[str, str]]:
        cli = subprocess.run([sys.executable, "-m", "apf_gunicorn", "dump", "levels",
                              "--admin", f"127.0.0.1:{aport}"],
                             capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0, cli.stderr
        rows = parse_dump(cli.stdout)
        n, c = rows[0].index("NominalSeats"), rows[0].index("CurrentSeats")
        return {r[0]: (r[n], r[c]) for r in rows[1:] if not r[0].startswith("#")}

    aport = free_port()
    cfg = tmp_path / "apf.yaml"
    shutil.copy(APPS / "apf.yaml", cfg)
    old = nominal(cfg)
    text = cfg.read_text()
    marked = "metadata: {name: other, uid: uid-pl-other}\nspec:\n  type: Limited\n  limited:\n" \
             "    nominalConcurrencyShares: 1000"
    assert marked in text
    with server_factory(workers=1, threads=4, config=str(cfg),
                        env={"APF_ADMIN_BIND": f"127.0.0.1:{aport}",
                             "APF_CONCURRENCY_LIMIT": "16", "APF_CONFIG_WATCH": "off"}) as srv:
        assert dumped()["other"] == (str(old["other"]), str(old["other"]))
        cfg.write_text(text.replace(marked, marked.replace("1000", "3000")))
        new = nominal(cfg)
        assert new["other"] > old["other"] and new["work"] < old["work"]
        os.kill(srv.pid, signal.SIGHUP)
        line = (f"level 'other': nominal {old['other']} -> {new['other']} seats, "
                f"current {old['other']} -> {new['other']}")
        assert srv.wait_for(lambda: line in srv.log(), timeout=15), srv.log()
        assert (f"level 'work': nominal {old['work']} -> {new['work']} seats, "
                f"current {old['work']} -> {new['work']}") in srv.log()
        assert "reload rejected" not in srv.log()
        seats = dumped()
        assert seats["other"] == (str(new["other"]), str(new["other"])), seats
        assert seats["work"] == (str(new["work"]), str(new["work"])), seats


def test_path_form_config_serves_with_apf(server_factory):
    with server_factory(workers=2, threads=8, conf=("-c", "apf_gunicorn/conf.py")) as srv:
        status, headers, _ = srv.request("/work?ms=1", headers={"X-Remote-User": "pf"})
        assert status == 200
        assert headers["X-Kubernetes-PF-FlowSchema-UID"] == "uid-fs-work"


STAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}\] \[\d+\] "


def test_start_up_output_through_gunicorns_log(server_factory):
    """A misspelled setting is named with its closest known name; one "ready" line names the
    configuration, the limit in seats (here the server's default, the same as `apf-gunicorn
    check --workers 2 --threads 8`), the levels and the admin address; the first worker notes
    the @cost and APF_ROUTES costs a level clamps; all with gunicorn's timestamps."""
    import json
    import re
    import subprocess
    import sys

    from tests.conftest import APPS, free_port

    aport = free_port()
    env = {"APF_CONCURENCY_LIMIT": "4", "APF_CONCURRENCY_LIMIT": "",
           "APF_ADMIN_BIND": f"127.0.0.1:{aport}",
           "APF_ROUTES": str(APPS / "seats_routes.yaml")}
    with server_factory(workers=2, threads=8, env=env, config=str(APPS / "seats.yaml"),
                        args=("tests.apps.seats_app:app",)) as srv:
        assert srv.request("/clamped?ms=1")[0] == 200
        # the first worker (index 0) logs the notes as it boots, which may be after the other
        # worker answered
        assert srv.wait_for(lambda: "@cost on GET /clamped" in srv.log(), timeout=30), \
            srv.log()
        log = srv.log()
    check = subprocess.run([sys.executable, "-m", "apf_gunicorn", "check", str(APPS / "seats.yaml"),
                            "--workers", "2", "--threads", "8", "--json"],
                           capture_output=True, text=True, timeout=60)
    assert json.loads(check.stdout)["concurrencyLimit"] == 8
    assert re.search(STAMP + r"\[WARNING\] apf: unknown setting APF_CONCURENCY_LIMIT is "
                     r"ignored; did you mean APF_CONCURRENCY_LIMIT\?$", log, re.M), log
    ready = re.findall(STAMP + r"\[INFO\] apf: ready: (.*)$", log, re.M)
    assert len(ready) == 1, log
    assert ready[0].startswith(f"configuration {APPS / 'seats.yaml'} (APF_CONFIG), limit 8 "
                               "seats (default: 2 workers x 8 threads / 2; follows the "
                               "app's pools once found), fairness "
                               "maxmin (default), 4 priority levels "
                               "(nominal seats): wide 4, narrow 4, exempt (exempt), catch-all 1; "
                               f"admin http://127.0.0.1:{aport}/ (ledger in shared memory "
                               f"apf_{srv.instance}_"), ready[0]
    notes = re.findall(STAMP + r"\[WARNING\] apf: (.* asks for .*)$", log, re.M)
    # at 8 seats, "narrow" (4 nominal, hand size 1) admits 1 seat per request (catch-all too,
    # but the "narrow" schema takes every request to /clamped before it: not named)
    assert ("@cost on GET /clamped asks for 4 seat(s): clamped to 1 on priority level "
            "narrow (a level's widest request, Kubernetes' 15% rule unless an "
            "apf-gunicorn.io/max-seats annotation sets it; see docs/work-estimation.md)"
            in notes), log
    # the APF_ROUTES cost of /wide: the "wide" schema takes all its requests, to a level that
    # admits 4 seats, so no level it can reach clamps it
    assert not [n for n in notes if n.startswith("APF_ROUTES")], notes
    # logged by the first worker only, not once per worker
    assert sum(n.startswith("@cost on GET /clamped ") for n in notes) == 1
