"""Discrete-event simulation of the production fair-queuing code in virtual time.

``apf-gunicorn simulate SCENARIO`` is a thin shell over :func:`simulate`::

    from apf_gunicorn.simulate import load_scenario, simulate, to_json
    result = simulate(load_scenario("tests/scenarios/kubernetes/k8s-03-baseline.yaml"))
    to_json(result)["evaluations"][0]["clients"]["client0"]["averageExecutingSeats"]  # 1.0

Modules: :mod:`.scenario` (format and validation), :mod:`.engine` (event loop),
:mod:`.harness` (Kubernetes' uniform client semantics), :mod:`.backends` (the production
ledger behind the harness), :mod:`.capacity` (a connection pool, shared cores: what executing
requests share inside the app), :mod:`.autolimit` (the adaptive limit, ``auto``),
:mod:`.report` (JSON and table output).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .backends import ledger_backend
from .harness import Backend, RunResult, UniformHarness
from .report import format_table, to_json
from .scenario import (
    ClientSpec,
    QueueSetSpec,
    Scenario,
    ScenarioError,
    load_scenario,
    parse_scenario,
    with_fairness,
)

__all__ = [
    "Scenario", "ScenarioError", "RunResult", "load_scenario",
    "parse_scenario", "simulate", "to_json", "format_table", "with_fairness",
]

BackendFactory = Callable[[QueueSetSpec, Sequence[ClientSpec]], Backend]


def simulate(scenario: Scenario, backend_factory: BackendFactory | None = None,
             levels_factory: Callable | None = None, *, fairness: str | None = None,
             timeline: int | None = None) -> RunResult:
    """Run ``scenario`` to the end (every event drained) and return the result.

    Args:
        scenario: what to run.
        backend_factory: builds the fair-queuing backend for a ``queueSet`` scenario; the
            default is the production ledger.
        levels_factory: ``levels_factory(level_specs, clients)`` does the same for the
            configuration form (see :func:`.configured.run_configured`).
        fairness: the fairness to run instead of the scenario's (``--fairness``; see
            :func:`.scenario.with_fairness`).
        timeline: record each client's executing seats over time, at most this many steps
            per client (:class:`.harness.SeatsTimeline`; ``result.timeline``).

    Returns:
        The windows, the per-client totals, and per level the fairness it ran
        (``result.fairness``).

    Raises:
        ScenarioError: the configuration form's objects are invalid, or ``fairness`` is not
            one of :data:`~apf_gunicorn.flowcontrol.fairness.NAMES`.
    """
    if fairness is not None:
        scenario = with_fairness(scenario, fairness)
    if scenario.queue_set is None:
        from .configured import run_configured  # the configuration form

        return run_configured(scenario, levels_factory, timeline=timeline)
    qs = scenario.queue_set
    backend = (backend_factory or ledger_backend)(qs, scenario.clients)
    auto = None
    if qs.auto is not None:
        from .autolimit import AutoLimit

        auto = AutoLimit(qs.auto, lambda limit, now: backend.handles_of(
            backend.ledger.set_limits({0: limit}, now)))
    harness = UniformHarness(
        scenario.clients, scenario.evaluate, backend,
        routes=[(0, c.hash) for c in scenario.clients],
        capacity=float(qs.concurrency_limit),
        check_levels={"queueSet": 0},
        timeline=timeline, model=scenario.backend, auto=auto,
    )
    result = harness.run()
    result.fairness = {"queueSet": qs.fairness if qs.queues >= 0 else None}
    return result
