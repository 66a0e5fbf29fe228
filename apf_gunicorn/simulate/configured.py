"""The configuration form of a scenario: classify clients, run every level, borrow every 10 s.

The configuration (``config: PATH`` or inline ``objects:``) is loaded and validated by
:mod:`apf_gunicorn.flowcontrol.loader`, every client is classified once by
:class:`apf_gunicorn.flowcontrol.matching.Classifier` (its attributes do not change), every
priority level becomes one level of one ledger, starting at Kubernetes' initial limit
``nominal - lendable/2``, and :func:`apf_gunicorn.flowcontrol.borrowing.run_borrowing` adjusts
the limits every 10 s of virtual time exactly as the server's master does. With
``serverConcurrencyLimit: auto`` the adaptive controller moves the server limit every tick and
every level follows it (:func:`apf_gunicorn.flowcontrol.relimit.follow_server_limit`).

Each window then also reports, per priority level, the average initial seats its clients kept
executing and the limit in force at the window's end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import yaml

from apf_gunicorn.flowcontrol import (
    borrowing,
    fairness,
    limits,
    loader,
    matching,
    relimit,
    validation,
)

from .backends import LedgerBackend, concurrent_requests_bound
from .harness import RunResult, UniformHarness, Window
from .scenario import ClientSpec, Scenario, ScenarioError

#: per level (name, desired_queues, hand_size, queue_length_limit, initial limit, fairness)
LevelSpecs = list[tuple[str, int, int, int, int, str | None]]
ConfiguredBackendFactory = Callable[[LevelSpecs, Sequence[ClientSpec]], Any]


def _load(scenario: Scenario) -> Any:
    cfg = scenario.config
    assert cfg is not None
    try:
        if cfg.path is not None:
            return loader.load_configuration(cfg.path)
        objects, errors = loader.load_text(yaml.safe_dump_all(list(cfg.objects)), "objects")
        errors = [*errors, *loader.duplicate_errors(objects)]
        if errors:
            raise validation.ConfigErrors(errors)
        return loader.digest_objects(objects, sources=["objects"])
    except validation.ConfigErrors as exc:
        raise ScenarioError("config" if cfg.path else "objects", f"invalid configuration:\n{exc}") from None
    except OSError as exc:
        raise ScenarioError("config", str(exc)) from None


def ledger_factory(specs: LevelSpecs, clients: Sequence[ClientSpec]) -> LedgerBackend:
    return LedgerBackend.create(specs, slots=concurrent_requests_bound(clients))


def run_configured(scenario: Scenario,
                   backend_factory: ConfiguredBackendFactory | None = None,
                   timeline: int | None = None) -> RunResult:
    """Run a configuration-form scenario; ``backend_factory(level_specs, clients)`` must return
    a backend whose ``ledger`` has ``take_demand_stats`` and ``set_limits`` (the production
    ledger by default). Each level runs its ``apf-gunicorn.io/fairness`` annotation's fairness,
    else the scenario's ``fairness``; ``timeline`` as in :func:`apf_gunicorn.simulate.simulate`.
    """
    config = _load(scenario)
    server_limit = scenario.config.server_concurrency_limit
    level_limits = limits.compute_limits(config.priority_levels.values(), server_limit)
    levels = list(config.priority_levels.values())
    specs: LevelSpecs = []
    for pl in levels:
        lim = level_limits[pl.name]
        queuing = pl.queuing
        specs.append((pl.name, pl.desired_queues,
                      queuing.hand_size if queuing else 0,
                      queuing.queue_length_limit if queuing else 0,
                      lim.nominal - lim.lendable // 2,
                      fairness.level_fairness(pl, scenario.config.fairness)[0]))
    backend = (backend_factory or ledger_factory)(specs, scenario.clients)
    index = backend.levels  # level name -> ledger index
    classifier = matching.Classifier(config)
    routes, client_levels = [], []
    for client in scenario.clients:
        c = classifier.classify(client.attributes)
        routes.append((index[c.priority_level.name], c.flow_hash))
        client_levels.append(c.priority_level.name)
    states = borrowing.BorrowingStates()
    for pl in levels:
        states.state(pl.name, specs[levels.index(pl)][4])
    level_triples = [(pl.name, index[pl.name], pl.is_exempt) for pl in levels]

    def borrow(now: int) -> list:
        grants = borrowing.run_borrowing(backend.ledger, level_limits, states, now,
                                              server_limit=server_limit, levels=level_triples)
        return backend.handles_of(grants)

    auto = None
    if scenario.config.auto is not None:
        from .autolimit import AutoLimit

        def apply(limit: int, now: int) -> list:
            nonlocal level_limits, server_limit
            level_limits, grants = relimit.follow_server_limit(
                backend.ledger, levels, level_triples, states, limit, now)
            server_limit = limit
            return backend.handles_of(grants)

        auto = AutoLimit(scenario.config.auto, apply)

    used = {name for name in client_levels}
    by_index = {idx: name for name, idx in index.items()}

    def on_window(window: Window, now: int) -> None:
        for lvl, avg in harness.level_averages.items():
            name = by_index[lvl]
            window.priority_levels[name] = {
                "averageExecutingSeats": avg,
                "currentLimit": states[name].current_limit if name in states else None,
                "nominalLimit": level_limits[name].nominal,
            }
        window.priority_levels.update({
            name: {"averageExecutingSeats": 0.0, "currentLimit": states[name].current_limit,
                   "nominalLimit": level_limits[name].nominal}
            for name in index if name not in used and name in states})

    harness = UniformHarness(
        scenario.clients, scenario.evaluate, backend, routes=routes,
        capacity=float(server_limit), on_window=on_window,
        periodic=(borrowing.ADJUSTMENT_PERIOD_NS, borrow), timeline=timeline,
        model=scenario.backend, auto=auto,
    )
    result = harness.run()
    result.fairness = {spec[0]: spec[5] for spec in specs}
    return result
