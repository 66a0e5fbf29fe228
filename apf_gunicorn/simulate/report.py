"""Turn a simulation result into the SPEC section 9 JSON document or a readable table.

    doc = to_json(result)          # {"evaluations": [...], "clients": {...}, ...}
    print(format_table(result))
"""

from __future__ import annotations

import math
from typing import Any

from apf_gunicorn.flowcontrol.gomath import duration_seconds, format_duration

from .harness import REJECT_REASONS, RunResult


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _num(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def to_json(result: RunResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` document. Keys beyond the SPEC's: per window ``start``, per client
    ``demand`` and ``fairShare`` (Kubernetes' fairAlloc ideal), ``seatDemand`` (the backend's
    seat-demand integrator against the harness's own); top level ``fairness`` (per level, the
    fairness it ran; null for an exempt level), ``timeline`` (when recorded: per
    client the average executing seats of each ``stepSeconds`` step up to ``endSeconds``),
    ``epochAdvances``,
    ``virtualEnd``, ``events``, ``requests`` and anything in ``extra``. With a ``backend``:
    per window ``latency`` (per client ``completed``, ``throughput`` per second, ``p50``,
    ``p99``, ``max`` in seconds); with an ``auto`` limit: per window ``concurrencyLimit``
    (``start``, ``end``, ``min``, ``max``, time-weighted ``mean``) and top level
    ``concurrencyLimit`` (``min``, ``max`` bounds and ``series``, ``[seconds, limit]`` at the
    start and after every tick)."""
    evaluations = []
    for w in result.windows:
        entry: dict[str, Any] = {
            "start": duration_seconds(w.start_ns),
            "end": duration_seconds(w.end_ns),
            "clients": {
                name: {"averageExecutingSeats": _num(c.average_executing_seats),
                       "demand": c.demand, "fairShare": c.fair_share}
                for name, c in w.clients.items()
            },
        }
        if w.priority_levels:
            entry["priorityLevels"] = w.priority_levels
        if w.latency:
            entry["latency"] = w.latency
        if w.limit is not None:
            entry["concurrencyLimit"] = w.limit
        if w.seat_demand:
            entry["seatDemand"] = {
                name: {k: (_num(v) if isinstance(v, float) else v) for k, v in d.items()}
                for name, d in w.seat_demand.items()
            }
        evaluations.append(entry)
    clients = {}
    for name, t in result.clients.items():
        rejected = {reason: t.rejected.get(reason, 0) for reason in REJECT_REASONS}
        rejected.update({k: v for k, v in t.rejected.items() if k not in rejected})
        clients[name] = {"dispatched": t.dispatched, "completed": t.completed,
                         "rejected": rejected}
    doc: dict[str, Any] = {
        "evaluations": evaluations,
        "clients": clients,
        "fairness": dict(result.fairness),
        "epochAdvances": result.epoch_advances,
        "virtualEnd": duration_seconds(result.end_ns),
        "events": result.events,
        "requests": result.requests,
    }
    tl = result.timeline
    if tl is not None:
        doc["timeline"] = {
            "stepSeconds": duration_seconds(tl.width_ns), "endSeconds": duration_seconds(tl.end_ns),
            "clients": {name: tl.series(i) for i, name in enumerate(tl.names)},
        }
    if result.limits is not None:
        low, high = result.limit_bounds or (None, None)
        doc["concurrencyLimit"] = {
            "mode": "auto", "min": low, "max": high,
            "series": [[duration_seconds(t), v] for t, v in result.limits]}
    if extra:
        doc.update(extra)
    return doc


def limit_changes(series: list[tuple[int, int]]) -> str:
    """``0s 32, 1s 24, ...``: the limit at the start and at each tick that changed it."""
    out, last = [], None
    for t, v in series:
        if v != last:
            out.append(f"{format_duration(t)} {v}")
            last = v
    return ", ".join(out)


def format_table(result: RunResult, max_clients: int = 50) -> str:
    """Per window, each client's average executing seats beside its demand and fair share;
    then each client's totals. Only the first ``max_clients`` clients are listed per table."""
    lines: list[str] = []
    if result.fairness:
        lines.append("fairness: " + ", ".join(f"{level} {name or 'none (exempt)'}"
                                              for level, name in result.fairness.items()))
        lines.append("")
    names = list(result.clients)
    shown = names[:max_clients]
    width = max([6, *(len(n) for n in shown)])
    for w in result.windows:
        lines.append(f"window {format_duration(w.start_ns)} .. {format_duration(w.end_ns)}")
        lines.append(f"  {'client':<{width}}  {'avg seats':>12}  {'demand':>10}  {'fair share':>10}")
        for name in shown:
            c = w.clients[name]
            lines.append(f"  {name:<{width}}  {c.average_executing_seats:>12.6f}  "
                         f"{c.demand:>10.4f}  {c.fair_share:>10.4f}")
        if w.latency:
            lines.append(f"  {'client':<{width}}  {'completed':>9}  {'per s':>8}  "
                         f"{'p50 ms':>8}  {'p99 ms':>8}")
            for name in shown:
                d = w.latency[name]
                lines.append(f"  {name:<{width}}  {d['completed']:>9}  {d['throughput']:>8.1f}"
                             f"  {_ms(d['p50']):>8}  {_ms(d['p99']):>8}")
        if w.limit is not None:
            d = w.limit
            lines.append(f"  concurrency limit (auto): {d['start']} at the start, {d['end']} "
                         f"at the end, {d['min']}..{d['max']}, mean {d['mean']:.2f}")
        for level, d in w.priority_levels.items():
            lines.append(f"  level {level}: avg seats {d.get('averageExecutingSeats', 0):.4f}, "
                         f"current limit {d.get('currentLimit')}")
        for level, d in w.seat_demand.items():
            if d.get("checked"):
                verdict = "matches" if d.get("match") else "DIFFERS from"
                lines.append(f"  seat demand ({level}): backend {verdict} harness "
                             f"(avg {d['average']:.6f}, max {d['max']:g})")
        lines.append("")
    lines.append(f"  {'client':<{width}}  {'dispatched':>10}  {'completed':>9}  "
                 f"{'queue-full':>10}  {'conc-limit':>10}  {'time-out':>8}")
    for name in shown:
        t = result.clients[name]
        r = t.rejected
        lines.append(f"  {name:<{width}}  {t.dispatched:>10}  {t.completed:>9}  "
                     f"{r.get('queue-full', 0):>10}  {r.get('concurrency-limit', 0):>10}  "
                     f"{r.get('time-out', 0):>8}")
    if len(names) > len(shown):
        tot = {"dispatched": 0, "completed": 0}
        rej = dict.fromkeys(REJECT_REASONS, 0)
        for t in result.clients.values():
            tot["dispatched"] += t.dispatched
            tot["completed"] += t.completed
            for k in rej:
                rej[k] += t.rejected.get(k, 0)
        lines.append(f"  ... {len(names) - len(shown)} more clients; all {len(names)}: "
                     f"dispatched {tot['dispatched']}, completed {tot['completed']}, "
                     f"rejected {rej}")
    if result.limits is not None:
        lines.append("")
        low, high = result.limit_bounds or ("?", "?")
        end = result.windows[-1].end_ns if result.windows else result.end_ns
        lines.append(f"concurrency limit auto:{low}-{high} over time (to the last window's "
                     f"end): {limit_changes([p for p in result.limits if p[0] <= end])}")
    lines.append("")
    lines.append(f"epoch advances: {result.epoch_advances}; virtual end "
                 f"{format_duration(result.end_ns)}; {result.requests} requests, "
                 f"{result.events} events")
    return "\n".join(lines)
