"""The simulator's own pieces: scenario validation, the event loop, the exact integrator,
fairAlloc, the harness semantics (thread offsets, rejected threads stop, next call timing), the
configuration form (Kubernetes' TestBorrowing) and the CLI's exit statuses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from oracle_queueset import OracleBackend, OracleLevels

from apf_gunicorn.simulate import (
    ScenarioError,
    format_table,
    load_scenario,
    parse_scenario,
    simulate,
    to_json,
)
from apf_gunicorn.simulate.engine import EventLoop
from apf_gunicorn.simulate.harness import Admission, ExactIntegrator, SeatsTimeline, fair_alloc

HERE = os.path.dirname(os.path.abspath(__file__))
BORROWING = os.path.join(HERE, "scenarios", "borrowing")

BASE = {
    "queueSet": {"concurrencyLimit": 1, "queues": 9, "handSize": 3, "queueLengthLimit": 8},
    "clients": [{"name": "a", "hash": 1, "threads": 1, "calls": 3, "exec": "1s", "think": 0}],
    "evaluate": ["5s"],
}


def with_(path: str, value) -> dict:
    doc = json.loads(json.dumps(BASE))
    target = doc
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[int(k)] if isinstance(target, list) else target[k]
    last = keys[-1]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return doc


_DELETE = object()


# -- scenario validation --------------------------------------------------------------------------

def test_parses_durations_as_go_strings_or_seconds() -> None:
    s = parse_scenario(with_("clients.0.think", 0.5))
    assert s.clients[0].think_ns == 500_000_000
    s = parse_scenario(with_("clients.0.think", "-1ns"))
    assert s.clients[0].think_ns == -1
    assert parse_scenario(with_("evaluate", ["2184h"])).evaluate == (2184 * 3600 * 10**9,)


@pytest.mark.parametrize("path, value, field", [
    ("queueSet.queueLengthLimit", _DELETE, "queueSet.queueLengthLimit"),
    ("queueSet.handSize", 10, "queueSet.handSize"),
    ("queueSet.concurrencyLimit", -1, "queueSet.concurrencyLimit"),
    ("queueSet.queues", "nine", "queueSet.queues"),
    ("clients.0.exec", "1 second", "clients[0].exec"),
    ("clients.0.exec", "-1s", "clients[0].exec"),
    ("clients.0.hash", _DELETE, "clients[0].hash"),
    ("clients.0.hash", 1 << 64, "clients[0].hash"),
    ("clients.0.split", "yes", "clients[0].split"),
    ("clients.0.thinkk", "1s", "clients[0].thinkk"),
    ("clients.0.seats", 0, "clients[0].seats"),
    ("evaluate", ["2s", "1s"], "evaluate[1]"),
    ("evaluate", _DELETE, "evaluate"),
])
def test_validation_errors_name_the_field(path, value, field) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(with_(path, value))
    assert info.value.field == field
    assert str(info.value).startswith(field + ": ")


def test_an_unknown_field_names_the_closest_known_one() -> None:
    with pytest.raises(ScenarioError, match=r"unknown field; did you mean think\? \(allowed: "):
        parse_scenario(with_("clients.0.thinkk", "1s"))
    with pytest.raises(ScenarioError) as info:
        parse_scenario(with_("clients.0.zzzzzz", "1s"))
    assert "did you mean" not in str(info.value)


def test_dealer_errors_use_kubernetes_text() -> None:
    with pytest.raises(ScenarioError, match="handSize 10 is greater than deckSize 9"):
        parse_scenario(with_("queueSet.handSize", 10))


def test_duplicate_client_names_are_refused() -> None:
    doc = with_("clients", [BASE["clients"][0], BASE["clients"][0]])
    with pytest.raises(ScenarioError, match="duplicate client name"):
        parse_scenario(doc)


def test_count_expands_into_distinct_flows() -> None:
    doc = with_("clients", [{"name": "f", "count": 3, "calls": 1, "exec": "1s"}])
    clients = parse_scenario(doc).clients
    assert [c.name for c in clients] == ["f-0", "f-1", "f-2"]
    assert len({c.hash for c in clients}) == 3


def test_json_scenarios_load(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(BASE))
    assert load_scenario(str(path)).queue_set.concurrency_limit == 1


# -- engine, integrator, fairAlloc ----------------------------------------------------------------

def test_event_loop_runs_in_time_then_scheduling_order() -> None:
    loop = EventLoop()
    seen = []
    loop.at(20, lambda: seen.append(("b", loop.now)))
    loop.at(10, lambda: seen.append(("a", loop.now)))
    loop.at(20, lambda: (seen.append(("c", loop.now)), loop.at(5, lambda: seen.append(("past", loop.now)))))
    loop.at(31, lambda: seen.append(("late", loop.now)))
    loop.run_until(30)
    assert seen == [("a", 10), ("b", 20), ("c", 20), ("past", 20)]
    assert loop.now == 30
    loop.run()
    assert seen[-1] == ("late", 31)


def test_integrator_matches_kubernetes_vectors() -> None:
    # TestIntegrator: Add(3), 1 s -> {1 s, avg 3, dev 0, min 0, max 3}
    igr = ExactIntegrator(0)
    igr.add(3, 0)
    r = igr.reset(10**9)
    assert (r.duration, r.average, r.deviation, r.min, r.max) == (1.0, 3.0, 0.0, 0.0, 3.0)
    # Set(2) (here Add(-1)) -> duration 0, NaN average
    igr.add(-1, 10**9)
    r = igr.reset(10**9)
    assert r.duration == 0 and math.isnan(r.average) and (r.min, r.max) == (2.0, 3.0)
    # 1 ms at 2, Add(-1), 1 ms at 1 -> {0.002, 1.5, 0.5, min 1}
    igr.add(-1, 10**9 + 10**6)
    r = igr.reset(10**9 + 2 * 10**6)
    assert (r.duration, r.average, r.deviation, r.min) == (0.002, 1.5, 0.5, 1.0)


@pytest.mark.parametrize("demands, capacity, want", [
    ([0, 0], 42, [0, 0]),
    ([47, 0], 42, [42, 0]),
    ([1, 47], 42, [1, 41]),
    ([3, 7, 9, 1], 14, [3, 5, 5, 1]),
    ([1, 9, 7, 3], 21, [1, 9, 7, 3]),
])
def test_fair_alloc_matches_kubernetes_vectors(demands, capacity, want) -> None:
    assert fair_alloc(demands, capacity) == want


# -- harness semantics ----------------------------------------------------------------------------

class RecordingBackend:
    """Admits up to ``limit`` concurrent requests without queuing; records every admission."""

    name = "recording"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self.calls: list[tuple[int, int]] = []  # (now, flow hash)
        self.next = 0

    def admit(self, level, flow_hash, initial, final, additional_latency_ns, now):
        self.calls.append((now, flow_hash))
        if self.running >= self.limit:
            return Admission(None, "concurrency-limit", [])
        self.running += 1
        self.next += 1
        return Admission(self.next, "", [self.next])

    def finish(self, handle, now):
        self.running -= 1
        return [], 0

    def release(self, handle, now):
        return []

    def demand_stats(self, level, now):
        return None

    def epoch_advances(self):
        return 0


def test_thread_offsets_next_call_timing_and_rejected_threads_stop() -> None:
    doc = {
        "queueSet": {"concurrencyLimit": 3, "queues": 0},
        "clients": [
            {"name": "a", "hash": 1, "threads": 2, "calls": 3, "exec": "1s", "think": "500ms"},
            {"name": "b", "hash": 2, "threads": 2, "calls": 3, "exec": "1s", "think": "500ms"},
        ],
        "evaluate": ["10s"],
    }
    backend = RecordingBackend(limit=3)
    result = simulate(parse_scenario(doc), lambda qs, clients: backend)
    first = sorted(t for t, _ in backend.calls[:4])
    # thread j of client i starts at 90*j + 20*i ns
    assert first == [0, 20, 90, 110]
    # the 4th arrival (client b thread 1, at 110 ns) is rejected and that thread stops
    assert result.clients["b"].rejected["concurrency-limit"] == 1
    assert result.clients["b"].dispatched == 3
    assert result.clients["a"].dispatched == 6
    # next calls come at exec start + exec + think
    later = sorted(t for t, h in backend.calls if h == 1)
    assert later == [0, 90, 1_500_000_000, 1_500_000_090, 3_000_000_000, 3_000_000_090]
    # averages: a holds 2 seats for 3 s of the 10 s window
    doc_out = to_json(result)
    assert doc_out["evaluations"][0]["clients"]["a"]["averageExecutingSeats"] == pytest.approx(0.6)


def test_split_threads_start_at_the_first_evaluation_with_half_the_calls() -> None:
    doc = {
        "queueSet": {"concurrencyLimit": 10, "queues": -1},
        "clients": [{"name": "s", "hash": 1, "threads": 2, "calls": 4, "exec": "1s",
                     "think": "0s", "split": True}],
        "evaluate": ["4s", "8s"],
    }
    backend = RecordingBackend(limit=10)
    result = simulate(parse_scenario(doc), lambda qs, clients: backend)
    times = sorted(t for t, _ in backend.calls)
    assert times == [0, 10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9 + 90, 5 * 10**9 + 90]
    assert result.clients["s"].dispatched == 6
    w = to_json(result)["evaluations"]
    assert w[0]["clients"]["s"]["averageExecutingSeats"] == 1.0
    # thread 0 made its 4 calls by 4 s; thread 1 executes from 4 s + 90 ns for 2 s
    assert w[1]["clients"]["s"]["averageExecutingSeats"] == pytest.approx(0.5, abs=1e-7)


def test_lingering_seats_hold_the_limit_and_the_table_prints() -> None:
    doc = {
        "queueSet": {"concurrencyLimit": 1, "queues": 9, "handSize": 3, "queueLengthLimit": 8},
        "clients": [{"name": "a", "hash": 1001001001, "calls": 25, "exec": "1s", "think": "0s",
                     "finalSeats": 1, "additionalLatency": "1s"}],
        "evaluate": ["24s"],
    }

    def oracle(qs, clients):
        return OracleBackend(qs.queues, qs.hand_size, qs.queue_length_limit, qs.concurrency_limit)

    result = simulate(parse_scenario(doc), oracle)
    assert to_json(result)["evaluations"][0]["clients"]["a"]["averageExecutingSeats"] == 0.5
    table = format_table(result)
    assert "0.500000" in table and "matches" in table


# -- configuration form: Kubernetes' TestBorrowing ------------------------------------------------

with open(os.path.join(BORROWING, "expectations.json"), encoding="utf-8") as _fh:
    BORROWING_EXPECTATIONS = json.load(_fh)["scenarios"]


def _check_borrowing(doc: dict, exp: dict) -> None:
    window = doc["evaluations"][exp["window"]]
    for client, (lo, hi) in exp["ranges"].items():
        avg = window["clients"][client]["averageExecutingSeats"]
        assert lo <= avg <= hi, (client, avg, lo, hi)
    for level, limit in exp["levels"].items():
        assert window["priorityLevels"][level]["currentLimit"] == limit


@pytest.mark.parametrize("name", sorted(BORROWING_EXPECTATIONS))
def test_borrowing_on_reference_port(name: str) -> None:
    scenario = load_scenario(os.path.join(BORROWING, name))
    doc = to_json(simulate(scenario, levels_factory=OracleLevels))
    _check_borrowing(doc, BORROWING_EXPECTATIONS[name])


@pytest.mark.parametrize("name", sorted(BORROWING_EXPECTATIONS))
def test_borrowing_on_production_ledger(name: str) -> None:
    scenario = load_scenario(os.path.join(BORROWING, name))
    doc = to_json(simulate(scenario))
    _check_borrowing(doc, BORROWING_EXPECTATIONS[name])


def test_configuration_errors_are_scenario_errors() -> None:
    doc = {"serverConcurrencyLimit": 10,
           "objects": [{"apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                        "kind": "PriorityLevelConfiguration", "metadata": {"name": "x"},
                        "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": -1}}}],
           "clients": [{"name": "a", "user": "u", "path": "/", "calls": 1, "exec": "1s"}],
           "evaluate": ["1s"]}
    with pytest.raises(ScenarioError) as info:
        simulate(parse_scenario(doc), levels_factory=OracleLevels)
    assert info.value.field == "objects" and "nominalConcurrencyShares" in str(info.value)


# -- CLI ------------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apf_gunicorn", "simulate", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_invalid_scenario_exits_1_naming_the_field(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("queueSet: {concurrencyLimit: 1, queues: 9, handSize: 3}\n"
                    "clients: [{name: a, hash: 1, calls: 1, exec: 1s}]\nevaluate: [1s]\n")
    proc = _cli(str(path))
    assert proc.returncode == 1
    assert "queueSet.queueLengthLimit: required" in proc.stderr


def test_cli_missing_file_exits_1(tmp_path) -> None:
    proc = _cli(str(tmp_path / "nope.yaml"))
    assert proc.returncode == 1 and "nope.yaml" in proc.stderr


def test_every_scenario_error_is_reported_at_once() -> None:
    doc = {"queueSet": {"concurrencyLimit": 4, "queues": 9, "handSize": 20,
                        "queueLengthLimit": 0},
           "clients": [{"name": "a", "hash": 1, "threads": 0, "calls": 3, "exec": "1x"},
                       {"name": "b", "threads": 1, "calls": 3, "exec": "1s", "thinkk": 1},
                       {"name": "c", "count": 2, "hash": 5, "calls": 1, "exec": "1s"}],
           "evaluate": ["2s", "1s"], "bogus": 1}
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc)
    fields = [e.field for e in info.value.errors]
    assert fields == ["bogus", "queueSet.queueLengthLimit", "queueSet.handSize",
                      "clients[0].threads", "clients[0].exec", "clients[1].thinkk",
                      "clients[1].hash", "clients[2].hash", "evaluate[1]"]
    assert info.value.field == "bogus"  # the first, as a single error would say
    assert str(info.value).splitlines()[2] == "queueSet.handSize: handSize 20 is greater than deckSize 9"


def test_cli_lists_every_error_and_prints_a_legend(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("queueSet: {concurrencyLimit: 1, queues: 9, handSize: 3}\n"
                    "clients: [{name: a, hash: 1, calls: 1, exec: 1x}]\nevaluate: [1s]\n")
    proc = _cli(str(path))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"apf-gunicorn simulate: {path}: 2 errors:",
        "  queueSet.queueLengthLimit: required",
        "  clients[0].exec: invalid duration '1x'"]
    good = os.path.join(os.path.dirname(__file__), "scenarios", "kubernetes",
                        "k8s-06-uniform-flows-hand-size-1.yaml")
    proc = _cli(good)
    assert proc.returncode == 0, proc.stderr
    legend, table = proc.stdout.split("\n\n", 1)
    for term in ("avg seats", "demand", "fair share", "seat demand", "queue-full", "conc-limit",
                 "time-out"):
        assert term in legend, term
    assert table.startswith("fairness: queueSet kubernetes\n\nwindow 0s .. 50s")


# -- choosing the fairness (issue 12) -------------------------------------------------------------

KUBERNETES_SCENARIOS = os.path.join(HERE, "scenarios", "kubernetes")


def test_queue_set_fairness_defaults_to_kubernetes() -> None:
    assert parse_scenario(BASE).queue_set.fairness == "kubernetes"
    assert parse_scenario(with_("queueSet.fairness", "maxmin")).queue_set.fairness == "maxmin"
    names = [n for n in os.listdir(KUBERNETES_SCENARIOS) if n.endswith(".yaml")]
    assert len(names) == 39
    for name in names:  # Kubernetes' harness scenarios: no field, Kubernetes' fairness
        scenario = load_scenario(os.path.join(KUBERNETES_SCENARIOS, name))
        assert scenario.queue_set.fairness == "kubernetes", name


@pytest.mark.parametrize("doc, field", [
    (with_("queueSet.fairness", "fifo"), "queueSet.fairness"),
    (with_("queueSet.fairness", "MaxMin"), "queueSet.fairness"),
    (with_("fairness", "maxmin"), "fairness"),  # the queueSet form keeps it under queueSet
])
def test_fairness_errors_name_the_field(doc, field) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc)
    assert info.value.field == field


def test_the_scenario_or_the_override_chooses_the_fairness() -> None:
    """maxmin runs when the scenario or the override asks for it (and is reported), and the
    override wins over the scenario."""
    for scenario, override in ((parse_scenario(with_("queueSet.fairness", "maxmin")), None),
                               (parse_scenario(BASE), "maxmin")):
        assert simulate(scenario, fairness=override).fairness == {"queueSet": "maxmin"}
    result = simulate(parse_scenario(with_("queueSet.fairness", "maxmin")), fairness="kubernetes")
    assert result.fairness == {"queueSet": "kubernetes"}
    assert to_json(result)["fairness"] == {"queueSet": "kubernetes"}
    with pytest.raises(ScenarioError):
        simulate(parse_scenario(BASE), fairness="fifo")


CONFIGURED = {
    "serverConcurrencyLimit": 10,
    "objects": [{"apiVersion": "flowcontrol.apiserver.k8s.io/v1",
                 "kind": "PriorityLevelConfiguration",
                 "metadata": {"name": "tenants"},
                 "spec": {"type": "Limited", "limited": {
                     "nominalConcurrencyShares": 10, "limitResponse": {
                         "type": "Queue",
                         "queuing": {"queues": 8, "handSize": 2, "queueLengthLimit": 5}}}}},
                {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
                 "metadata": {"name": "tenants"},
                 "spec": {"priorityLevelConfiguration": {"name": "tenants"},
                          "matchingPrecedence": 500, "distinguisherMethod": {"type": "ByUser"},
                          "rules": [{"subjects": [{"kind": "Group", "group": {
                              "name": "system:authenticated"}}],
                              "nonResourceRules": [{"verbs": ["*"],
                                                    "nonResourceURLs": ["*"]}]}]}}],
    "clients": [{"name": "a", "user": "u", "path": "/", "calls": 2, "exec": "1s"}],
    "evaluate": ["2s"],
}


def _configured(fairness: str | None = None, annotation: str | None = None) -> dict:
    doc = json.loads(json.dumps(CONFIGURED))
    if fairness is not None:
        doc["fairness"] = fairness
    if annotation is not None:
        doc["objects"][0]["metadata"]["annotations"] = {"apf-gunicorn.io/fairness": annotation}
    return doc


def test_configuration_form_fairness_and_annotations() -> None:
    result = simulate(parse_scenario(_configured()))
    assert result.fairness == {"tenants": "kubernetes", "exempt": None,
                               "catch-all": "kubernetes"}
    assert parse_scenario(_configured("maxmin")).config.fairness == "maxmin"
    with pytest.raises(ScenarioError) as info:
        parse_scenario(_configured("fifo"))
    assert info.value.field == "fairness"
    # the annotation names the level's fairness; it beats the scenario's (and --fairness)
    result = simulate(parse_scenario(_configured(annotation="maxmin")), fairness="kubernetes")
    assert result.fairness == {"tenants": "maxmin", "exempt": None, "catch-all": "kubernetes"}
    result = simulate(parse_scenario(_configured("kubernetes", annotation="kubernetes")))
    assert result.fairness["tenants"] == "kubernetes"
    result = simulate(parse_scenario(_configured(annotation="kubernetes")), fairness="maxmin")
    assert result.fairness == {"tenants": "kubernetes", "exempt": None, "catch-all": "maxmin"}


def test_cli_fairness_override_and_timeline(tmp_path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(BASE))
    proc = _cli(str(path), "--fairness", "maxmin", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fairness"] == {"queueSet": "maxmin"}
    assert _cli(str(path), "--fairness", "fifo").returncode == 2
    proc = _cli(str(path), "--fairness", "kubernetes", "--timeline", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["fairness"] == {"queueSet": "kubernetes"}
    tl = doc["timeline"]
    assert (tl["stepSeconds"], tl["endSeconds"]) == (1.0, 5.0)
    # one thread, exec 1 s, no think: 3 calls back to back from 0 s, then nothing
    assert tl["clients"]["a"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert _cli(str(path), "--timeline", "0").returncode == 1
    big = os.path.join(HERE, "scenarios", "scale", "10k-flows.yaml")
    proc = _cli(big, "--timeline", "101")
    assert proc.returncode == 1 and "10000 clients x 101 steps" in proc.stderr


# -- the per-client seats timeline ------------------------------------------------------------------

def test_timeline_integrates_exactly_with_bounded_memory() -> None:
    tl = SeatsTimeline(["a", "b"], end_ns=10, points=4)  # steps of 3 ns: [0,3) [3,6) [6,9) [9,10)
    assert (tl.width_ns, tl.points) == (3, 4)
    tl.add(0, 2, 1)     # a: 2 seats from 1 ns
    tl.add(0, -1, 4)    # 1 seat from 4 ns
    tl.add(1, 1, 8)     # b: 1 seat from 8 ns
    tl.add(0, -1, 12)   # a: done after the end: not recorded beyond 10 ns
    tl.close(20)
    assert tl.series(0) == [(2 * 2) / 3, (2 * 1 + 1 * 2) / 3, 3 / 3, 1 / 1]
    assert tl.series(1) == [0.0, 0.0, 1 / 3, 1.0]
    assert tl.times() == [0.0, 3e-9, 6e-9, 9e-9]
    with pytest.raises(ValueError):
        SeatsTimeline(["a"], end_ns=10, points=0)


def test_timeline_agrees_with_the_window_averages() -> None:
    """TestWindup on the production ledger: per step, the flows never hold more than the
    limit, and each window's mean of the steps is the harness's exact window average."""
    scenario = load_scenario(os.path.join(KUBERNETES_SCENARIOS, "k8s-13-windup-upper-bound.yaml"))
    result = simulate(scenario, timeline=400)
    tl = result.timeline
    assert tl.points == 400 and tl.width_ns == 100_000_000
    series = {name: tl.series(i) for i, name in enumerate(tl.names)}
    for k in range(tl.points):
        assert sum(s[k] for s in series.values()) <= 3 + 1e-9
    for w, (lo, hi) in zip(result.windows, ((0, 200), (200, 400)), strict=True):
        for name, s in series.items():
            assert sum(s[lo:hi]) / (hi - lo) == pytest.approx(
                w.clients[name].average_executing_seats, abs=1e-12)
    assert simulate(scenario).timeline is None


def test_configuration_form_schema_may_name_an_undefined_mandatory_level() -> None:
    """As in check, explain and the server: the mandatory levels exist without being defined,
    so the client's schema sends it to exempt (before: dangling, and catch-all took it)."""
    doc = _configured()
    doc["objects"] = doc["objects"][1:]
    doc["objects"][0]["spec"]["priorityLevelConfiguration"]["name"] = "exempt"
    levels = simulate(parse_scenario(doc)).windows[0].priority_levels
    assert levels["exempt"]["averageExecutingSeats"] > 0
    assert levels["catch-all"]["averageExecutingSeats"] == 0
