"""What the real-server fairness tests share: the fairnesses they run under, and the
arithmetic that turns the app's own records into each flow's executing seats.

``FAIRNESS`` lists the ``APF_FAIRNESS`` values the tests start servers with. Adding a fairness
is one line here; a fairness in ``MAXMIN`` must also meet the max-min bounds
(tests/test_server_fairness.py, tests/test_server_apf.py's light client).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

FAIRNESS = ["kubernetes", "maxmin"]  # APF_FAIRNESS values under test
MAXMIN = {"maxmin"}  # the fairnesses that are max-min fair between flows


def maxmin_split(limit: float, demands: Mapping[str, float]) -> dict[str, float]:
    """The max-min fair split of ``limit`` seats (water-filling): every flow gets the same
    share, except that one demanding less gets its demand and the rest is shared out again.

        >>> maxmin_split(24, {"a": 100, "b": 100, "c": 100})
        {'a': 8.0, 'b': 8.0, 'c': 8.0}
        >>> maxmin_split(24, {"a": 2, "b": 100, "c": 100})
        {'a': 2.0, 'b': 11.0, 'c': 11.0}
    """
    share: dict[str, float] = {}
    left, open_ = float(limit), dict(demands)
    while open_:
        each = left / len(open_)
        small = {k: d for k, d in open_.items() if d <= each}
        if not small:
            share.update({k: each for k in open_})
            break
        for k, d in small.items():
            share[k] = float(d)
            left -= d
            del open_[k]
    return {k: share[k] for k in demands}


def average_seats(spans: Iterable[tuple[str, int, int, int]], t0: int, t1: int
                  ) -> dict[str, float]:
    """Each flow's average executing seats over ``[t0, t1)`` (nanoseconds), from
    ``(flow, seats, start_ns, end_ns)`` spans: the seat-time inside the window over its
    length. Flows with no span inside the window are absent."""
    total: dict[str, float] = {}
    for flow, seats, start, end in spans:
        inside = min(end, t1) - max(start, t0)
        if inside > 0:
            total[flow] = total.get(flow, 0.0) + seats * inside
    return {flow: st / (t1 - t0) for flow, st in total.items()}


def peak_seats(spans: Iterable[tuple[str, int, int, int]]) -> int:
    """The most seats executing at any instant (a span ending at the instant another starts
    does not overlap it)."""
    events = []
    for _flow, seats, start, end in spans:
        events.append((start, 1, seats))
        events.append((end, 0, -seats))  # ends sort before starts at the same instant
    now = peak = 0
    for _t, _kind, delta in sorted(events):
        now += delta
        peak = max(peak, now)
    return peak
