"""Every ported Kubernetes queueset scenario, through the simulator, against expectations.json.

Each scenario runs twice: on the production ledger (what ``apf-gunicorn simulate`` uses) and on
the reference port in ``oracle_queueset.py`` (which validates the harness itself). The checks
are Kubernetes' own: per window and client ``gotFair == expectFair`` with the scenario's margin,
no rejection when ``expectAllRequests`` (otherwise some, all with ``rejectReason``), the
seat-demand integrator check, and the number of epoch advances.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from oracle_queueset import OracleBackend

from apf_gunicorn.simulate import load_scenario, simulate, to_json

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "scenarios", "kubernetes")
with open(os.path.join(SCENARIOS, "expectations.json"), encoding="utf-8") as _fh:
    EXPECTATIONS: dict = json.load(_fh)["scenarios"]
NAMES = sorted(EXPECTATIONS)


def oracle_factory(qs, clients):
    return OracleBackend(qs.queues, qs.hand_size, qs.queue_length_limit, qs.concurrency_limit)


def check(doc: dict, exp: dict) -> list[str]:
    """Every way ``doc`` (the --json output) misses ``exp``; empty when it meets them."""
    problems = []
    if len(doc["evaluations"]) != len(exp["windows"]):
        return [f"{len(doc['evaluations'])} evaluations, expected {len(exp['windows'])}"]
    for got, want in zip(doc["evaluations"], exp["windows"], strict=True):
        if got["end"] != want["end"]:
            problems.append(f"window ends at {got['end']}, expected {want['end']}")
        margin = want["margin"]
        for client, expected in want["expected"].items():
            avg = got["clients"][client]["averageExecutingSeats"]
            if expected == 0:
                fair = abs(avg) <= margin
            else:
                fair = abs(avg - expected) / expected <= margin
            if fair != want["expectFair"]:
                problems.append(
                    f"window ending {want['end']}s, {client}: average executing seats {avg!r}, "
                    f"expected {expected!r} within {margin} -> fair={fair}, "
                    f"want fair={want['expectFair']}")
        for level, demand in got.get("seatDemand", {}).items():
            if demand.get("checked") and not demand["match"]:
                problems.append(f"window ending {want['end']}s: seat demand of {level}: "
                                f"harness {demand} vs backend {demand['backend']}")
    reasons: dict[str, int] = {}
    for totals in doc["clients"].values():
        for reason, n in totals["rejected"].items():
            if n:
                reasons[reason] = reasons.get(reason, 0) + n
        if totals["dispatched"] != totals["completed"]:
            problems.append(f"dispatched {totals['dispatched']} != completed {totals['completed']}")
    if exp["expectAllRequests"]:
        if reasons:
            problems.append(f"rejections {reasons}, expected none")
    else:
        if not reasons:
            problems.append("no rejection, expected some")
        elif set(reasons) != {exp["rejectReason"]}:
            problems.append(f"rejections {reasons}, expected only {exp['rejectReason']}")
    for client, calls in exp.get("calls", {}).items():
        totals = doc["clients"][client]
        issued = totals["dispatched"] + sum(totals["rejected"].values())
        if exp["expectAllRequests"] and issued != calls:
            problems.append(f"{client}: {issued} calls made, expected {calls}")
    if doc["epochAdvances"] != exp.get("epochAdvances", 0):
        problems.append(f"{doc['epochAdvances']} epoch advances, expected "
                        f"{exp.get('epochAdvances', 0)}")
    return problems


def run(name: str, backend_factory=None) -> dict:
    return to_json(simulate(load_scenario(os.path.join(SCENARIOS, name)), backend_factory))


def test_every_scenario_file_has_expectations() -> None:
    files = sorted(f for f in os.listdir(SCENARIOS) if f.endswith(".yaml"))
    assert files == NAMES
    assert len(files) == 39  # 16 Kubernetes tests, TestSeparations has 24 cases


@pytest.mark.parametrize("name", NAMES)
def test_scenario_on_production_ledger(name: str) -> None:
    doc = run(name)
    assert check(doc, EXPECTATIONS[name]) == []


@pytest.mark.parametrize("name", NAMES)
def test_scenario_on_reference_port(name: str) -> None:
    assert check(run(name, oracle_factory), EXPECTATIONS[name]) == []


def test_rollover_advances_the_epoch_exactly_eight_times() -> None:
    name = "k8s-09-seat-seconds-rollover.yaml"
    assert run(name, oracle_factory)["epochAdvances"] == 8
    assert run(name)["epochAdvances"] == 8


class _FifoBackend(OracleBackend):
    """One queue for everybody: no fairness at all. The checks must notice."""

    def admit(self, level, flow_hash, initial, final, additional_latency_ns, now):
        return super().admit(level, 0, initial, final, additional_latency_ns, now)


def test_checks_catch_an_unfair_backend() -> None:
    def fifo(qs, clients):
        return _FifoBackend(qs.queues, 1, 10**6, qs.concurrency_limit)

    # Four flows of width 2 and one of width 7 (> the limit 6) with 15 threads each: one
    # shared FIFO lets the wide flow's head block everyone in turn (about 0.67 seats each for
    # the narrow flows); fair queuing gives each flow about 1.2.
    name = "k8s-12-too-wide.yaml"
    problems = check(run(name, fifo), EXPECTATIONS[name])
    assert any("client0" in p for p in problems), problems


def test_cli_json_end_to_end() -> None:
    path = os.path.join(SCENARIOS, "k8s-05-separation-16-think1s-pad500ms-final1-conc1-clients2.yaml")
    proc = subprocess.run([sys.executable, "-m", "apf_gunicorn", "simulate", path, "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["evaluations"][0]["end"] == 24.0
    assert doc["evaluations"][0]["clients"]["client0"]["averageExecutingSeats"] == 1 / 3
    assert doc["clients"]["client1"] == {
        "dispatched": 25, "completed": 25,
        "rejected": {"queue-full": 0, "concurrency-limit": 0, "time-out": 0}}
    assert check(doc, EXPECTATIONS[os.path.basename(path)]) == []
