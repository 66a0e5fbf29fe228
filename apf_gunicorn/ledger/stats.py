"""Per-request statistics kept inside the ledger: the stats table's layout and its read side.

Every request event (admit, dispatch, rejection, finish) is counted by the ledger operation
that causes it, under the lock that operation already holds, into a fixed table of entries in
the ledger buffer, one entry per (priority level, FlowSchema) pair. The counts are therefore
exact and server-wide, and no per-process metric files are needed::

    for st in led.request_stats():          # list[RequestStats], read under the lock
        st.work.counts, st.dispatched, st.rejected["queue-full"], st.execution_watch.sum

Entry layout (8-byte words, see ``E_*``): the owning level's serial (a level index is reused
after a level is dropped; the serial is not), the level index, the FlowSchema index, the
length of the level name captured at creation (the name itself lives in a parallel byte area),
then the counters. ``delayed`` counts, per rejection reason, the 429s of the pair that a worker's
poller held before writing them (``gthread/pollreject.py``; a subset of ``rejected``).
``dispatched`` is not counted on its own: every non-exempt dispatch observes
the execute="true" wait histogram, which otherwise only time-outs and cancels observe, so
dispatched = exempt dispatches (``E_DISPATCHED``) + that histogram's count − time-outs −
cancels − thread-share removals, one word write less per request. Histogram buckets are
stored per bucket (non-cumulative) as int64 counts; sums are float64 seconds (durations) or
int64 seats (work). A histogram's count is the sum of its buckets.

Entries are created on first use and never move or disappear, so counters never go backwards.
Regular entries may fill the table up to ``stats_entries - levels``; past that, a new pair is
folded into its level's overflow entry (FlowSchema index -1, reported as ``(overflow)``),
which may use the remaining ``levels`` entries; if even those are used up, everything new goes
to one catch-all entry past the end (level and FlowSchema both ``(overflow)``).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

# rejection reasons, in their word order inside an entry
# (thread-reserve: turned away by a worker before admit, to keep its last threads for exempt
# requests; gthread/worker.py. thread-share: a waiting request taken out of its queue so that a
# request of a flow holding fewer parked threads gets its thread; gthread/threadshare.py)
REASONS = ("queue-full", "concurrency-limit", "time-out", "cancelled", "no-slot",
           "thread-reserve", "thread-share")
(R_QUEUE_FULL, R_CONCURRENCY_LIMIT, R_TIME_OUT, R_CANCELLED, R_NO_SLOT,
 R_THREAD_RESERVE, R_THREAD_SHARE) = range(7)
REASON_INDEX = {name: i for i, name in enumerate(REASONS)}

WORK_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 100)  # seats; Kubernetes' request_concurrency buckets
DURATION_BOUNDS_S = (0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0)
DURATION_BOUNDS_NS = tuple(round(b * 1_000_000_000) for b in DURATION_BOUNDS_S)
NW = len(WORK_BOUNDS) + 1  # buckets incl. +Inf
ND = len(DURATION_BOUNDS_NS) + 1

OVERFLOW = "(overflow)"

# -- entry layout (word offsets inside an entry) ------------------------------------------------
E_SERIAL = 0  # level serial (0: unused / the catch-all)
E_LEVEL = 1
E_FS = 2
E_NAME_LEN = 3
E_WORK = 4  # NW buckets
E_WORK_SUM = E_WORK + NW  # int64 seats
E_DISPATCHED = E_WORK_SUM + 1  # only dispatches without a wait observation (exempt)
E_REJECTED = E_DISPATCHED + 1  # len(REASONS) counters
E_WAIT_X = E_REJECTED + len(REASONS)  # execute=true: ND buckets then a float64 sum
E_WAIT_R = E_WAIT_X + ND + 1  # execute=false
E_EXEC_R = E_WAIT_R + ND + 1  # type=regular
E_EXEC_W = E_EXEC_R + ND + 1  # type=watch (must follow E_EXEC_R by ND + 1: see EXEC_STRIDE)
E_DELAYED = E_EXEC_W + ND + 1  # len(REASONS) counters: rejections held before written
ENTRY_WORDS = E_DELAYED + len(REASONS)
EXEC_STRIDE = E_EXEC_W - E_EXEC_R  # the slot stores 2*entry + watch; exec hist = E_EXEC_R + watch*stride

_DUR = DURATION_BOUNDS_NS


def duration_bucket(ns: int) -> int:
    """Index of the bucket a duration of ``ns`` falls in (Prometheus ``le``: value <= bound)."""
    return bisect_left(_DUR, ns)


def work_bucket(seats: int) -> int:
    return bisect_left(WORK_BOUNDS, seats)


class Hist(NamedTuple):
    """A histogram: ``counts`` per bucket, non-cumulative, the last one is +Inf."""

    bounds: tuple
    counts: tuple
    sum: float
    count: int


class RequestStats(NamedTuple):
    """Cumulative per-request counters of one (priority level, FlowSchema) pair."""

    level: str
    flow_schema: str
    work: Hist  # max(initial, final) seats at every admit
    dispatched: int
    rejected: dict  # reason -> count, every reason in REASONS present
    wait_executed: Hist  # execute="true"
    wait_rejected: Hist  # execute="false"
    execution_regular: Hist
    execution_watch: Hist
    delayed: dict  # reason -> 429s held by a worker's poller, every reason in REASONS present


def _hist(words: list, floats: list, at: int, n: int, bounds: tuple) -> Hist:
    counts = tuple(words[at: at + n])
    return Hist(bounds, counts, floats[at + n], sum(counts))


def read_entry(words: list, floats: list, level: str, flow_schema: str) -> RequestStats:
    """Turn one entry's words (as ``int64`` and ``float64`` lists) into plain objects."""
    work_counts = tuple(words[E_WORK: E_WORK + NW])
    wait_x = _hist(words, floats, E_WAIT_X, ND, DURATION_BOUNDS_S)
    return RequestStats(
        level, flow_schema,
        Hist(tuple(float(b) for b in WORK_BOUNDS), work_counts, float(words[E_WORK_SUM]),
             sum(work_counts)),
        words[E_DISPATCHED] + wait_x.count - words[E_REJECTED + R_TIME_OUT]
        - words[E_REJECTED + R_CANCELLED] - words[E_REJECTED + R_THREAD_SHARE],
        {name: words[E_REJECTED + i] for i, name in enumerate(REASONS)},
        wait_x,
        _hist(words, floats, E_WAIT_R, ND, DURATION_BOUNDS_S),
        _hist(words, floats, E_EXEC_R, ND, DURATION_BOUNDS_S),
        _hist(words, floats, E_EXEC_W, ND, DURATION_BOUNDS_S),
        {name: words[E_DELAYED + i] for i, name in enumerate(REASONS)},
    )
