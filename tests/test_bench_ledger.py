"""benchmarks/bench_ledger.py, the ledger's cost benchmark, briefly under every fairness this build
has (``checkouts.available_fairness()``: maxmin too once ``LevelSpec`` takes a fairness): each
scenario reaches and keeps the steady state it claims (one dispatch per cycle; in ``flows x2`` every flow keeps 2 waiting), the
fairness reaches ``LevelSpec``, the requests admitted at once take the C fast path when it is
built (as the server's do), and ``--baseline`` runs its child protocol end to end (against
this checkout itself). No timing is asserted."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.ledger import LevelSpec

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
from benchmarks.checkouts import available_fairness  # noqa: E402

AVAILABLE = available_fairness()


def _load(monkeypatch, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def bench(monkeypatch):
    return _load(monkeypatch, "bench_ledger")


@pytest.mark.parametrize("fairness_name", AVAILABLE)
@pytest.mark.parametrize("queues", [8, 64])
def test_each_scenario_keeps_its_steady_state(bench, fairness_name, queues):
    for scenario in bench.SCENARIOS:
        led, cleanup = bench._bytearray_ledger()
        try:
            run = bench._setup(led, queues, scenario, fairness_name)
            before = led.snapshot(0).levels[0].dispatched
            assert run(200) > 0
            lv = led.snapshot(0).levels[0]
            assert lv.dispatched - before == 200, scenario  # one dispatch per cycle
            executing, waiting = run.state()
            assert (lv.requests_executing, lv.requests_waiting) == (
                executing, sum(waiting.values())), scenario
            if scenario == bench.AT_ONCE:
                assert (executing, waiting) == (0, {})
            elif scenario == bench.WAITING:
                assert (executing, lv.requests_waiting) == (4, 1000)
            else:  # every flow backlogged, 2 waiting each
                assert executing == 4
                assert sorted(waiting) == sorted(bench.HASHES[:queues])
                assert set(waiting.values()) == {2}
        finally:
            cleanup()


@pytest.mark.parametrize("fairness_name", AVAILABLE)
def test_at_once_runs_what_the_server_runs(bench, fairness_name):
    """With the C extension bound, an admitted-at-once request never reaches a Python frame of
    the ledger (the benchmark calls admit as the middleware does); without it, the Python
    fast path runs."""
    led, cleanup = bench._bytearray_ledger()
    try:
        run = bench._setup(led, 8, bench.AT_ONCE, fairness_name)
        run(5)  # the first admit creates the level's stats entry in Python
        frames = []

        def profile(frame, event, _arg):
            if event == "call" and "apf_gunicorn" in frame.f_code.co_filename:
                frames.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            run(50)
        finally:
            sys.setprofile(None)
        if led.accelerated:
            assert frames == []
        else:
            assert frames
    finally:
        cleanup()


@pytest.mark.parametrize("fairness_name", AVAILABLE)
def test_measure_on_shared_memory(bench, fairness_name):
    cost, accelerated = bench.measure(bench.BUFFERS[1], bench.FLOWS, 8, 50, fairness_name, reps=1)
    assert cost > 0 and isinstance(accelerated, bool)


def test_the_fairness_reaches_levelspec(bench):
    for fairness_name in fairness.NAMES:
        if "fairness" in LevelSpec._fields:
            assert bench._spec(8, 4, fairness_name).fairness == fairness_name
        elif fairness_name == fairness.KUBERNETES:
            assert bench._spec(8, 4, fairness_name) == LevelSpec("bench", 8, 6, 100_000, 4)
        else:
            with pytest.raises(ValueError, match="no fairness field"):
                bench._spec(8, 4, fairness_name)


def test_main_prints_each_fairness_and_the_flatness(bench, capsys):
    assert bench.main(["--cycles", "20", "--queues", "8,16"]) == 0
    out = capsys.readouterr().out
    for fairness_name in AVAILABLE:
        for scenario in bench.SCENARIOS:
            assert sum(line.startswith(f"{fairness_name:<11}") and scenario in line
                       for line in out.splitlines()) == 2  # both buffers
        assert f"  {fairness_name:<11}at once " in out
    assert "16/8" in out and "flatness (16 q / 8 q" in out


def test_baseline_child_protocol_against_this_checkout(bench, capsys):
    results = bench._compare(str(ROOT), list(AVAILABLE), (8, 16), cycles=20, reps=1)
    out = capsys.readouterr().out
    assert f"baseline {ROOT / 'apf_gunicorn' / '__init__.py'}: fairness " in out
    assert len(results) == len(AVAILABLE) * 2 * 3 * 2
    assert all(now > 0 and base > 0 for now, base in results.values())
    assert "WARNING" not in out  # the same C fast path state on both sides
    for fairness_name in AVAILABLE:
        assert f"  {fairness_name}: ratio " in out and f"(baseline ran {fairness_name})" in out


def test_fairness_choice_and_a_baseline_without_the_field(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.checkouts import Checkout, choose_fairness, inspect_checkout

    assert choose_fairness(None, ("kubernetes",))[0] == ["kubernetes"]
    assert "maxmin is not available" in choose_fairness(None, ("kubernetes",))[1]
    assert choose_fairness(None, ("kubernetes", "maxmin"))[0] == ["kubernetes", "maxmin"]
    assert choose_fairness("maxmin", ("kubernetes", "maxmin"))[0] == ["maxmin"]
    with pytest.raises(SystemExit, match="maxmin is not available"):
        choose_fairness("both", ("kubernetes",))
    old = Checkout(Path("/old"), "/old/apf_gunicorn/__init__.py", ("kubernetes",), False, False)
    fairness_name, note = old.runs("maxmin")
    assert fairness_name == "kubernetes"
    assert "lacks maxmin (LevelSpec has no fairness field)" in note
    assert old.runs("kubernetes") == ("kubernetes", "")
    here = inspect_checkout(ROOT)
    assert here.fairness_names == AVAILABLE and here.selectable
    assert here.levelspec_field == ("fairness" in LevelSpec._fields)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("valgrind"), reason="needs valgrind (apt-get install -y "
                                                         "valgrind)")
def test_instructions_per_cycle_under_callgrind(bench):
    """--instructions' data part: the at-once cycle, counted twice alike (one fairness: each
    callgrind run costs ~13 s of the suite, and the fairness is only an argument here)."""
    fairness_name = AVAILABLE[-1]
    counts = [bench.instructions_per_cycle(bench.AT_ONCE, 8, fairness_name, 100)
              for _ in range(2)]
    assert 100 < counts[0] < 1_000_000
    assert counts[0] == pytest.approx(counts[1], rel=0.01)
