"""benchmarks/plot_effect.py, the README picture's script, on a short real run: both servers
start and stop cleanly, the light user and the flood are measured, and with APF the flood is
partly rejected while the light user is never rejected. The picture itself is drawn only when
matplotlib (the optional ``plot`` extra) is installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def effect(monkeypatch):
    spec = importlib.util.spec_from_file_location("plot_effect",
                                                  ROOT / "benchmarks" / "plot_effect.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plot_effect", mod)
    spec.loader.exec_module(mod)
    # a short run: 3 s, the flood (32 connections: more than bob's queues hold) from 1 s to 2 s
    for name, value in (("DURATION", 3.0), ("FLOOD_START", 1.0), ("FLOOD_END", 2.0)):
        monkeypatch.setattr(mod, name, value)
    return mod


def test_short_real_run_with_and_without_apf(effect, tmp_path):
    results = {}
    for key in ("bare", "apf"):
        with effect.server(key == "apf", tmp_path) as port:
            results[key] = effect.run(port)
        results[key]["summary"] = effect.summary(results[key])
    bare, apf = results["bare"]["summary"], results["apf"]["summary"]
    assert bare["light_requests"] > 5 and apf["light_requests"] > 5
    assert bare["light_not_200"] == 0 and apf["light_not_200"] == 0
    assert set(bare["flood_statuses"]) == {"200"}  # gthread queues everything
    assert apf["flood_statuses"].get("429", 0) > 0  # beyond bob's queues: rejected at once
    assert apf["flood_statuses"].get("200", 0) > 0
    if importlib.util.find_spec("matplotlib") is None:
        return
    out = tmp_path / "effect.png"
    effect.plot(results, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size < 200_000


def test_summary_of_a_window_alice_sent_nothing_in(effect):
    """On a loaded machine one slow answer can span the short run's flood window: the summary
    says NaN for it instead of failing (the CI flake of a short real run)."""
    import math

    events = {"light": [(0.1, 0.05, 200), (1.2, 0.9, 200), (2.2, 0.05, 200)],
              "flood": [(1.1, 0.05, 200), (1.3, 0.0, 429)]}
    s = effect.summary(events)
    assert s["light_alone_p50_ms"] == 50.0
    assert math.isnan(s["light_flood_p50_ms"]) and math.isnan(s["light_flood_p99_ms"])
    assert s["flood_statuses"] == {"200": 1, "429": 1} and s["light_requests"] == 3
