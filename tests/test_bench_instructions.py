"""benchmarks/bench_instructions.py, the instructions-per-request benchmark: which servers it
plans for each fairness and baseline (a baseline without a fairness runs kubernetes, once, and is
named so), and a short real callgrind run of a gunicorn worker under every fairness this build
has (``checkouts.available_fairness()``: maxmin too once ``LevelSpec`` takes a fairness;
skipped without valgrind). No instruction count is asserted beyond being a plausible positive
number."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from apf_gunicorn.flowcontrol import fairness

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_instructions",
                                                  ROOT / "benchmarks" / "bench_instructions.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_instructions", mod)
    spec.loader.exec_module(mod)
    return mod


def _checkout(bench, fairness_names, field, selectable):
    return bench.Checkout(Path("/base"), "/base/apf_gunicorn/__init__.py", fairness_names, field,
                          selectable)


def test_plan_a_baseline_that_predates_the_fairnesses(bench):
    old = _checkout(bench, ("kubernetes",), False, False)
    runs, against, notes = bench.plan_runs(["kubernetes", "maxmin"], "kubernetes", old)
    names = [r[0] for r in runs]
    assert names == ["bare", "apf kubernetes", "apf maxmin", "apf@/base kubernetes"]
    assert [r[4] for r in runs] == [None, {"APF_FAIRNESS": "kubernetes"},
                                    {"APF_FAIRNESS": "maxmin"}, None]  # it reads no APF_FAIRNESS
    assert runs[3][1] == Path("/base") and runs[3][2] is True
    assert against == {"kubernetes": "apf@/base kubernetes", "maxmin": "apf@/base kubernetes"}
    assert len(notes) == 1 and "lacks maxmin (LevelSpec has no fairness field)" in notes[0]


def test_plan_a_baseline_with_both_fairnesses_and_the_side_runs(bench):
    new = _checkout(bench, ("kubernetes", "maxmin"), True, True)
    runs, against, notes = bench.plan_runs(["kubernetes", "maxmin"], "maxmin", new,
                                           rejecting=True, orca=True)
    env = {r[0]: r[4] for r in runs}
    assert env["apf@/base kubernetes"] == {"APF_FAIRNESS": "kubernetes"}
    assert env["apf@/base maxmin"] == {"APF_FAIRNESS": "maxmin"}
    assert against == {"kubernetes": "apf@/base kubernetes", "maxmin": "apf@/base maxmin"}
    assert notes == []
    assert env["apf 429"] == {"APF_FAIRNESS": "maxmin", "APF_HELD_REJECTIONS": "0"}
    assert env["apf+orca"]["APF_FAIRNESS"] == env["apf+orca60"]["APF_FAIRNESS"] == "maxmin"
    assert [r[3] for r in runs].count(True) == 1  # only the 429 server rejects


def test_plan_without_a_baseline(bench):
    runs, against, notes = bench.plan_runs(["kubernetes"], "kubernetes", None)
    assert [r[0] for r in runs] == ["bare", "apf kubernetes"] and against == {} and notes == []


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("callgrind_control")),
                    reason="needs valgrind (apt-get install -y valgrind)")
def test_a_short_callgrind_run_under_the_default_fairness(bench, tmp_path):
    """One real worker under callgrind (the fairness only changes APF_FAIRNESS, which the plan
    tests above check per fairness; each run costs ~30 s)."""
    fairness_name = fairness.SERVER_DEFAULT
    config = tmp_path / "bench.yaml"
    config.write_text(bench.BENCH_CONFIG)
    per_request, dump = bench.instructions_per_request(
        ROOT, True, str(config), 8, str(tmp_path), extra_env={"APF_FAIRNESS": fairness_name})
    assert 100_000 < per_request < 100_000_000
    assert Path(dump).is_file() and Path(dump).parent == tmp_path


def test_plan_the_asgi_runs(bench):
    runs = bench.plan_asgi_runs(["kubernetes", "maxmin"])
    assert [r[0] for r in runs] == ["uvicorn bare", "uvicorn apf kubernetes",
                                    "uvicorn apf maxmin", "asgi bare", "asgi apf kubernetes",
                                    "asgi apf maxmin"]
    assert [(r[1], r[2]) for r in runs] == [("uvicorn", False), ("uvicorn", True),
                                            ("uvicorn", True), ("asgi", False), ("asgi", True),
                                            ("asgi", True)]
    assert runs[0][3] is None and runs[2][3] == {"APF_FAIRNESS": "maxmin"}
    for _, front_end, _, _, rejecting in runs:  # a bare and an APF server and an app each
        bare, apf, app = bench.FRONT_ENDS[front_end]
        assert "-k" in bare and "python:apf_gunicorn.conf" in apf and app == bench.ASGI_APP
        assert not rejecting


def test_plan_the_asgi_runs_with_pf_headers_off_and_429s(bench):
    runs = bench.plan_asgi_runs(["kubernetes", "maxmin"], ("uvicorn",), pf_off=True,
                                rejecting=True)
    side = bench.side_fairness(["kubernetes", "maxmin"])
    assert [r[0] for r in runs] == ["uvicorn bare", "uvicorn apf kubernetes",
                                    "uvicorn apf maxmin", f"uvicorn apf {side} nopf",
                                    "uvicorn apf 429"]
    assert runs[3][3] == {"APF_FAIRNESS": side, "APF_PF_HEADERS": "off"} and not runs[3][4]
    assert runs[4][3] == {"APF_FAIRNESS": side} and runs[4][4]


def test_plan_the_fastapi_runs(bench):
    runs = bench.plan_asgi_runs(["maxmin"], tuple(bench.FASTAPI_CLASSES))
    assert [r[0] for r in runs] == ["fastapi bare", "fastapi apf maxmin"]
    bare, apf, app = bench.FRONT_ENDS["fastapi"]
    assert "uvicorn_worker.UvicornWorker" in bare and "apf_gunicorn.asgi.UvicornWorker" in apf
    assert app == bench.FASTAPI_APP and bench.REQUEST_PATH["fastapi"] == "/items/42"


def test_the_asgi_report_says_ours_over_bare_against_the_target(bench):
    counts = {"uvicorn bare": 500_000, "uvicorn apf kubernetes": 540_000,
              "asgi bare": 400_000, "asgi apf kubernetes": 460_000}
    lines = bench.asgi_report(counts, dict.fromkeys(counts, 1.5), ["kubernetes"], 400)
    text = "\n".join(lines)
    assert "400 requests over 4 keep-alive connections" in lines[0]
    assert "uvicorn apf kubernetes      540,000" in text and "+40,000 (+8.0%)" in text
    assert ("apf_gunicorn.asgi.UvicornWorker / uvicorn_worker.UvicornWorker (target <= 1.06): "
            "kubernetes 1.080 MISSED") in text
    assert ("apf_gunicorn.asgi.ASGIWorker / gunicorn's asgi (target <= 1.08): kubernetes 1.150 "
            "MISSED") in text


def test_the_asgi_report_says_what_the_pf_headers_and_a_429_cost(bench):
    counts = {"uvicorn bare": 500_000, "uvicorn apf maxmin": 530_000,
              "uvicorn apf maxmin nopf": 510_000, "uvicorn apf 429": 15_000}
    text = "\n".join(bench.asgi_report(counts, dict.fromkeys(counts, 1.5), ["maxmin"], 400,
                                       classes={"uvicorn": bench.ASGI_CLASSES["uvicorn"]}))
    assert ("uvicorn: the PF headers cost +20,000 instructions per response "
            "(APF_PF_HEADERS=on vs off, maxmin)") in text
    assert "uvicorn: a 429 costs 0.028 of a served request (maxmin; target <= 0.033: ok)" in text


def test_the_asgi_report_without_the_time_based_work(bench):
    counts = {"uvicorn bare": 500_000, "uvicorn apf kubernetes": 560_000,
              "asgi bare": 400_000, "asgi apf kubernetes": 440_000}
    elapsed = {"uvicorn bare": 4.0, "uvicorn apf kubernetes": 4.0, "asgi bare": 2.0,
               "asgi apf kubernetes": 2.0}
    idle = {"uvicorn bare": 500_000, "uvicorn apf kubernetes": 1_500_000, "asgi bare": 0,
            "asgi apf kubernetes": 0}
    text = "\n".join(bench.asgi_report(counts, elapsed, ["kubernetes"], 400, idle))
    # 1.5 M/s x 4 s / 400 requests = 15,000 per request; bare 5,000
    assert "idle 1,500,000/s: 15,000 of it time-based" in text
    assert ("uvicorn_worker.UvicornWorker (target <= 1.06): kubernetes 1.120 MISSED (without "
            "the time-based work 1.101)") in text  # 545,000 / 495,000
    assert ("gunicorn's asgi (target <= 1.08): kubernetes 1.100 MISSED (without the "
            "time-based work 1.100)") in text


def test_asgi_refuses_the_wsgi_only_options(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--asgi", "--orca"])
    assert exc.value.code == 2
    assert "--asgi and --fastapi do not combine with --baseline or --orca" in (
        capsys.readouterr().err)


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("callgrind_control")),
                    reason="needs valgrind (apt-get install -y valgrind)")
@pytest.mark.parametrize("front_end", ["uvicorn"])
def test_a_short_callgrind_run_of_an_asgi_worker(bench, tmp_path, front_end):
    """Ours on uvicorn-worker under callgrind, serving asgi_hello_app (the other front end and
    the bare workers run the same code with other options, which test_plan_the_asgi_runs
    checks; each callgrind run costs ~35 s of the suite)."""
    if front_end == "uvicorn":
        pytest.importorskip("uvicorn_worker", reason="needs pip install 'apf_gunicorn[asgi]'")
    config = tmp_path / "bench.yaml"
    config.write_text(bench.BENCH_CONFIG)
    per_request, dump = bench.instructions_per_request(
        ROOT, True, str(config), 8, str(tmp_path), front_end=front_end,
        extra_env={"APF_FAIRNESS": fairness.SERVER_DEFAULT}, idle_s=0.5)
    assert 100_000 < per_request < 100_000_000
    idle = list(bench.IDLE.values())[-1]
    assert 0 < idle < 1_000_000_000  # instructions a second of the idle worker
    assert Path(dump).is_file() and Path(dump).parent == tmp_path
    # the dump is the worker of ours on that front end
    cmd = next(line for line in Path(dump).read_text().splitlines() if line.startswith("cmd:"))
    assert bench.FRONT_ENDS[front_end][1][-1] in cmd and bench.ASGI_APP in cmd


def test_the_asgi_hello_app_holds_a_seat_with_work(bench):
    """``--asgi --rejecting`` holds the level's one seat with ``HOLD_PATH`` (``/work?ms=N``)."""
    import asyncio

    from benchmarks.asgi_hello_app import app

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/work", "query_string": b"ms=1"}
    asyncio.run(app(scope, None, send))
    assert bench.HOLD_PATH.startswith("/work?ms=")
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"hello\n"


def test_the_pf_report_lines_without_the_time_based_work(bench):
    counts = {"uvicorn bare": 500_000, "uvicorn apf maxmin": 540_000,
              "uvicorn apf maxmin nopf": 515_000, "uvicorn apf 429": 270_000}
    elapsed = dict.fromkeys(counts, 4.0)
    idle = {"uvicorn bare": 0, "uvicorn apf maxmin": 1_000_000,
            "uvicorn apf maxmin nopf": 2_000_000, "uvicorn apf 429": 0}
    text = "\n".join(bench.asgi_report(counts, elapsed, ["maxmin"], 400, idle,
                                       {"uvicorn": bench.ASGI_CLASSES["uvicorn"]}))
    # 1 M/s x 4 s / 400 = 10,000 time-based; 2 M/s: 20,000
    assert "on vs off, maxmin; without the time-based work +35,000)" in text
    assert "a 429 costs 0.500 of a served request" in text
    assert "without the time-based work 0.509)" in text  # 270,000 / 530,000
