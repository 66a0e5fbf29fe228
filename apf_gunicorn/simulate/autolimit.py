"""``concurrencyLimit: auto`` in the simulator: the production controller in virtual time.

:class:`AutoLimit` feeds :class:`apf_gunicorn.control.adaptive.AdaptiveLimit` once a tick
with what the harness saw (each kind of request's finished count and summed service time, the
average seats executing, whether anything waited) and applies each new limit through
``apply(limit, now)``: the one level's ``set_limits`` in the queueSet form,
:func:`apf_gunicorn.flowcontrol.relimit.follow_server_limit` in the configuration form.

    auto = AutoLimit(scenario.auto, lambda limit, now: backend.handles_of(
        backend.ledger.set_limits({0: limit}, now)))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from apf_gunicorn.control.adaptive import AdaptiveLimit, AdaptiveSettings, KindSample, Tick

from .scenario import AutoSpec


class AutoLimit:
    """The adaptive server limit as the harness's :class:`~.harness.AutoTicker`.

    Attributes:
        series: ``(virtual ns, limit)`` at the start and after every tick.
        decisions: ``(virtual ns, Decision)`` per tick (the controller's reasons).
    """

    def __init__(self, spec: AutoSpec, apply: Callable[[int, int], list],
                 settings: AdaptiveSettings | None = None) -> None:
        """
        Args:
            spec: the scenario's bounds, start and tick.
            apply: ``apply(limit, now)`` sets the server limit, returning the handles it
                dispatched.
            settings: the controller's constants (its defaults, bounded by ``spec``).
        """
        bounded = replace(settings or AdaptiveSettings(), minimum=spec.minimum,
                          maximum=spec.maximum)
        self.controller = AdaptiveLimit(bounded, spec.start)
        self.tick_ns = spec.tick_ns
        self.bounds = (spec.minimum, spec.maximum)
        self.apply = apply
        self.series: list[tuple[int, int]] = [(0, self.controller.limit)]
        self.decisions: list = []

    def tick(self, now: int, kinds: dict, concurrency: float, waiting: bool) -> list:
        before = self.controller.limit
        limit = self.controller.update(Tick(now, {k: KindSample(c, t) for k, (c, t) in
                                                  kinds.items()}, concurrency, waiting))
        self.decisions.append((now, self.controller.last))
        self.series.append((now, limit))
        return self.apply(limit, now) if limit != before else []
