"""benchmarks/bench_tls_flood.py in a short form: against a real TLS server it measures both
probe kinds quiet and beside the flood, counts the flood's handshakes and prints its verdict.
Latencies are reported, never asserted: on a shared machine they are not facts of the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.server


def test_short_tls_flood_benchmark_runs_and_reports_every_line(capsys):
    spec = importlib.util.spec_from_file_location("bench_tls_flood",
                                                  ROOT / "benchmarks" / "bench_tls_flood.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.run(samples=5, every=0.01, key="ec", threads=2)
    out = capsys.readouterr().out
    assert "quiet:        kept: p50" in out and "new: p50" in out, out
    assert "beside flood: kept" in out, out
    flood = next(line for line in out.splitlines() if line.startswith("flood: "))
    assert int(flood.split()[1]) > 0, flood  # the flood got server flights back
    assert "kept-alive probe p99 beside the flood" in out, out
