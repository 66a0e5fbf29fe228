"""Retry-After tracker: Kubernetes' sequence and independence tests (k8s-apf-config.md 6.4)."""

from __future__ import annotations

import threading

from apf_gunicorn.flowcontrol.retryafter import RetryAfterTracker

T0 = 1_700_000_000
SEQUENCE = [  # seconds elapsed, drops in that second, expected Retry-After afterwards
    (0, 5, 1), (1, 11, 2), (2, 1, 2), (3, 11, 4), (4, 1, 4), (7, 1, 8), (11, 1, 8),
    (15, 1, 7), (17, 1, 6), (21, 14, 5), (22, 1, 10),
]


def test_kubernetes_sequence_one_drop_at_a_time() -> None:
    tr = RetryAfterTracker()
    for elapsed, drops, want in SEQUENCE:
        for _ in range(drops):
            tr.record("pl", T0 + elapsed)
        assert tr.retry_after("pl") == want, (elapsed, drops)


def test_kubernetes_sequence_batched_counts() -> None:
    tr = RetryAfterTracker()
    for elapsed, drops, want in SEQUENCE:
        tr.record("pl", T0 + elapsed, count=drops)
        assert tr.retry_after("pl") == want, elapsed


def test_server_wide_totals_give_the_same_sequence() -> None:
    """A worker fed the ledger's cumulative counter sees what one server-wide tracker sees."""
    tr = RetryAfterTracker()
    total = 0
    tr.observe_total("pl", 0, T0 - 100)  # baseline before any drop
    for elapsed, drops, want in SEQUENCE:
        total += drops
        assert tr.observe_total("pl", total, T0 + elapsed) == want, elapsed


def test_levels_are_independent() -> None:
    tr = RetryAfterTracker()
    names = [f"pl-{i}" for i in range(10)]
    for sec in range(10):
        for n in names:
            tr.record(n, T0 + sec)
        assert all(tr.retry_after(n) == 1 for n in names)
    for _ in range(5):
        tr.record("pl-0", T0 + 9)
    for n in names:
        tr.record(n, T0 + 10)
    assert tr.retry_after("pl-0") == 2
    assert all(tr.retry_after(n) == 1 for n in names[1:])
    assert tr.retry_after("unknown") == 1


def test_total_going_down_restarts_baseline() -> None:
    tr = RetryAfterTracker()
    tr.observe_total("pl", 100, T0)
    tr.observe_total("pl", 3, T0 + 1)  # level re-created: 3 new drops, not -97
    assert tr.observe_total("pl", 4, T0 + 2) == 2  # 3 drops in the last 1 s window -> doubled
    assert tr.observe_total("pl", 4, T0 + 3) == 2  # no increase: nothing recorded


def test_thread_safety_counts_every_drop() -> None:
    tr = RetryAfterTracker()

    def hammer() -> None:
        for _ in range(2000):
            tr.record("pl", T0)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tr._levels["pl"].current_count == 8000
