"""benchmarks/bench_lockstep.py in a short form: it runs against real servers under both
fairnesses, the light users are never rejected, every window reports its numbers, and every
"Done means" line is printed. Latencies and rates are reported, never asserted: on a shared
machine they are not facts of the code (``tests/test_simulate_lockstep.py`` asserts them in
virtual time)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def test_short_lockstep_benchmark_runs_and_reports_every_line(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_lockstep",
                                                  ROOT / "benchmarks" / "bench_lockstep.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_lockstep", bench)
    spec.loader.exec_module(bench)
    res = bench.run(1.0, 0.5)
    out = capsys.readouterr().out
    for fairness in ("maxmin", "kubernetes"):
        for name in ("alone", "flood", "jitter"):
            r = res[fairness][name]
            assert r["n"] > 0 and math.isfinite(r["p99"]), (fairness, name, r)
            assert r["light_other"] == {}, (fairness, name, r)  # never rejected
            assert (r["flood_per_s"] > 0) == (name != "alone"), (fairness, name, r)
        assert f"{fairness:10} jitter" in out
    lines = bench.verdicts(res)
    assert len(lines) == 5 and all(isinstance(ok, bool) for _text, ok in lines)
