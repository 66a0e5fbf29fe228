"""The ledger's fixed binary layout: capacities, record fields and where every table lives.

Everything is a table of 8-byte words so one buffer can be read through three
``memoryview.cast`` views (``"q"`` int64, ``"Q"`` uint64, ``"d"`` float64) with plain word
indices; name and detail areas are raw bytes. A field address is
``table_base + record * stride + FIELD``.

    >>> lay = Layout(Capacity())
    >>> lay.size < 16 * 1024 * 1024
    True

Word stores through a memoryview are single 8-byte writes, so a reader without the lock never
sees a half-zeroed field (unlike ``struct.pack_into``, see gunicorn-ipc.md 3.5). Multi-field
reads still need the lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from apf_gunicorn.ledger.stats import ENTRY_WORDS

MAGIC = 0x3152474C46504100  # "\0APFLGR1" little-endian
# 6: the undo log (H_UNDO_N, UNDO_PAIRS pairs after the header), the server counters after
# it (C_HEAD_TIMEOUTS), thread-reserve rejections in the stats entries, W_ROOM;
# 7: thread-share rejections in the stats entries;
# 8: held (delayed) 429s per reason in the stats entries instead of one server counter
VERSION = 9
WORD = 8
NAME_BYTES = 256  # one length byte + up to 253 bytes of UTF-8 (a DNS subdomain), padded

# -- header (word indices) ------------------------------------------------------------------
(
    H_MAGIC, H_VERSION, H_CAP_LEVELS, H_CAP_QUEUES, H_CAP_SLOTS, H_CAP_WORKERS, H_CAP_FS,
    H_CAP_DETAIL, H_SIZE, H_OWNER_PID, H_GENERATION, H_SERVICE_NS, H_FREE_HEAD, H_FREE_COUNT,
    H_FS_COUNT, H_HOLDER_PID, H_DIRTY, H_REPAIRS, H_LEVELS_USED,
    H_CAP_STATS, H_STATS_COUNT, H_LEVEL_SERIAL, H_SERVICE_ADAPT, H_UNDO_N,
) = range(24)
H_MUTEX = 24  # 64 bytes (8 words) for a pthread_mutex_t (40 bytes on x86_64 glibc)
MUTEX_BYTES = 64
HEADER_WORDS = 32
# The undo log (ledger.py ``_log``, repair.py ``rollback``): (word address, value before the
# write) pairs of the event in progress, H_UNDO_N of them; 0 when no event is half done.
UNDO_PAIRS = 32
# Server-wide counters, after the undo log, written under the lock and read lock-free:
# C_HEAD_TIMEOUTS = connections the workers answered 408 for a request head that did not arrive
# within APF_HEADER_TIMEOUT (gthread/worker.py); C_DROPPED_HEAD_CONNECTIONS, C_DROPPED_HEAD_BUFFER =
# connections a worker's poller closed past APF_HEAD_CONNECTIONS (the oldest idle) and past
# APF_HEAD_BUFFER_LIMIT (the largest incomplete head, 431). The rest are spare (429s held by
# a poller are counted per level and FlowSchema in the stats entries: stats.E_DELAYED).
C_HEAD_TIMEOUTS = 0
C_DROPPED_HEAD_CONNECTIONS = 1
C_DROPPED_HEAD_BUFFER = 2
COUNTER_WORDS = 8

# -- level record -----------------------------------------------------------------------------
# Ordered for the fast paths (ledger.py): each reads one prefix of the record and writes back
# one run from L_R: finish the 13 fields L_R..L_I_LAST, admit those and L_ROBIN..L_DISPATCHED.
# Nothing after L_DISPATCHED is on the per-request path.
(
    L_USED, L_QUIESCING, L_NAME_LEN, L_DESIRED, L_HAND, L_QLL, L_C,
    L_QBASE, L_QCAP, L_NQ, L_TBASE, L_TP, L_SERIAL,
    L_WAITING, L_SEATS_WAITING,
    L_R, L_LAST_NS, L_EXECUTING, L_SEATS_IN_USE, L_ACTIVE_QUEUES, L_QSEATS,
    L_I_T, L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR, L_I_LAST,
    L_ROBIN, L_ENQUEUES, L_DISPATCHED,
    L_REJECTED, L_TIMEDOUT, L_CANCELLED, L_EPOCH_OK, L_EPOCH_FAIL, L_REJECTED_SHADOW,
    L_SERVICE_NS, L_SERVICE_N, L_FAIRNESS,
) = range(40)
LEVEL_WORDS = 40
# float64 fields (read through the "d" view); L_R is uint64 (the "Q" view); the rest int64
LEVEL_FLOAT_FIELDS = (L_I_T, L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR)

MODE_EXEMPT, MODE_REJECT, MODE_QUEUE = "exempt", "reject", "queue"
# L_FAIRNESS: the level's fairness (configuration: LevelSpec.fairness)
FAIRNESS_KUBERNETES, FAIRNESS_MAXMIN = 0, 1
FAIRNESS_NAMES = {FAIRNESS_KUBERNETES: "kubernetes", FAIRNESS_MAXMIN: "maxmin"}
FAIRNESS_CODES = {name: code for code, name in FAIRNESS_NAMES.items()}

# -- the maxmin fairness (maxmin.py, docs/fairness.md) --------------------------------------------
# per level (Layout.maxmin_base + level * MM_WORDS): the virtual time V (uint64 seat-ns), the
# backlog sequence, the pairing heap's root flow, the parked flows' list, the reserved flow
(M_V, M_SEQ, M_ROOT, M_PARK_HEAD, M_PARK_TAIL, M_RESERVE, M_NFLOWS, M_RESERVES) = range(8)
MM_WORDS = 8
# the flow table's header (Layout.flow_header): free entries, idle entries (LRU), evictions
(FH_FREE, FH_IDLE_HEAD, FH_IDLE_TAIL, FH_EVICTIONS) = range(4)
FLOW_HEADER_WORDS = 8
# a flow entry (Layout.flow_base + entry * FLOW_WORDS); F_HASH and F_TAG are uint64
(
    F_LEVEL, F_HASH, F_TAG, F_SEQ, F_WAITING, F_EXEC, F_SEATS, F_HEAD, F_TAIL, F_EST, F_N,
    F_WHERE, F_CHILD, F_NEXT, F_PREV, F_PACE,
) = range(16)
FLOW_WORDS = 16
# F_PACE: the earliest time (monotonic ns) at which the flow's next seat handed straight back to
# it may free without a hold (maxmin.py, "hold_locked"); written only on the general path
# F_WHERE: nowhere (executing only), in the level's heap, parked, on the idle list
FW_NOWHERE, FW_HEAP, FW_PARKED, FW_IDLE = range(4)
# per slot (Layout.xslot_base + slot * XSLOT_WORDS): its flow entry, the flow FIFO's links, and
# when a lingering slot's seats free
X_FLOW, X_FPREV, X_FNEXT, X_END = range(4)
XSLOT_WORDS = 4

# -- queue record -----------------------------------------------------------------------------
(
    Q_NDR, Q_HEAD, Q_TAIL, Q_WAITING, Q_INIT_SUM, Q_MAX_SUM, Q_WORK_SUM, Q_EXECUTING, Q_SEATS,
) = range(9)
QUEUE_WORDS = 9  # Q_NDR and Q_WORK_SUM are uint64

# -- slot record ------------------------------------------------------------------------------
(
    S_STATE, S_GEN, S_OWNER, S_LEVEL, S_QUEUE, S_PREV, S_NEXT,
    S_INITIAL, S_FINAL, S_AL, S_MAX_SEATS, S_HELD,
    S_INIT_WORK, S_FINAL_WORK, S_TOTAL_WORK, S_ARRIVAL_R,
    S_ARRIVAL_NS, S_START_NS, S_HASH, S_FS, S_SEQ, S_DETAIL_LEN, S_STATS, S_SERVICE_NS,
) = range(24)
SLOT_WORDS = 24  # S_*_WORK, S_ARRIVAL_R and S_HASH are uint64
# S_MAX_SEATS = max(initial, final) as requested (what waiting sums count);
# S_HELD = the seats actually held once dispatched (after the final-seat cap)
# S_STATS = 2 * (word address of the request's stats entry) + (1 if a watch else 0)
# L_SERIAL = a number unique over the ledger's life for each level created (stats entries key)
# L_REJECTED_SHADOW = a copy of L_REJECTED for lock-free readers, written with a plain word
#   store and never inside a struct.pack_into run (which zero-fills before it writes, so a
#   lock-free read of a word in the run could see 0, gunicorn-ipc.md 3.5); the fast paths'
#   runs end at L_DISPATCHED, before both
# L_SERVICE_NS = the level's G, the estimated service time charged at dispatch (Kubernetes'
#   fixed 3 ms, or learnt from finished requests when H_SERVICE_ADAPT is 1; see ledger.py);
# L_SERVICE_N = how many finished requests it has learnt from, up to 16
# S_SERVICE_NS = the G charged to this request, which its completion corrects

FREE, WAITING, EXECUTING, LINGERING = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", WAITING: "waiting", EXECUTING: "executing", LINGERING: "lingering"}

# -- worker record ----------------------------------------------------------------------------
W_PID, W_STATE, W_HEARTBEAT, W_ROOM, W_GRANT_NAME, W_CONNS = range(6)
WORKER_WORDS = 6
# W_ROOM = 1 while the worker has a thread free for a non-exempt request (gthread/worker.py:
#   a worker without one accepts only while no other worker has one); written and read
#   lock-free, cleared when the worker is reaped
# W_GRANT_NAME = the random part of the worker's grant socket name, drawn per process
#   (admission/channel.py; 0: none bound yet); written by the worker, read lock-free by senders
# W_CONNS = 1 + the connections an ASGI worker holds open (asgi/acceptgate.py: a worker above
#   the least-loaded other one stops accepting); 0: the worker does not take part (gthread,
#   booting, stopping); written and read lock-free, cleared when the worker is reaped
WORKER_FREE, WORKER_ALIVE, WORKER_GONE = 0, 1, 2

NIL = -1  # "no slot" / "no queue" in link and index fields


@dataclass(frozen=True, slots=True)
class Capacity:
    """Fixed table sizes; all are settings. Running out of slots rejects with ``no-slot``."""

    levels: int = 64
    queues: int = 8192  # total over all levels
    slots: int = 8192  # requests waiting, executing or lingering at once, server-wide
    workers: int = 256
    flow_schemas: int = 1024
    detail_bytes: int = 256  # per-slot opaque request description for dumps
    stats_entries: int = 1024  # (level, FlowSchema) pairs with their own request counters

    def __post_init__(self) -> None:
        for name in ("levels", "queues", "slots", "workers", "flow_schemas", "stats_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"Capacity.{name} must be at least 1")
        if self.detail_bytes < 0:
            raise ValueError("Capacity.detail_bytes must not be negative")


class Layout:
    """Word offsets (and byte offsets for the raw areas) of every table for a capacity."""

    __slots__ = (
        "cap", "undo_base", "counters_base", "level_base", "queue_base", "tree_base", "tree_words", "slot_base",
        "worker_base", "stats_base", "maxmin_base", "flow_header", "flow_base", "flow_index",
        "flow_index_words", "xslot_base", "level_names", "fs_names", "details", "detail_stride",
        "stats_names", "size",
    )

    def __init__(self, cap: Capacity) -> None:
        self.cap = cap
        pos = HEADER_WORDS
        self.undo_base = pos
        pos += 2 * UNDO_PAIRS
        self.counters_base = pos
        pos += COUNTER_WORDS
        self.level_base = pos
        pos += cap.levels * LEVEL_WORDS
        self.queue_base = pos
        pos += cap.queues * QUEUE_WORDS
        # per level a min-segment tree of 2*P words, P = next power of two >= its queue region;
        # sum(2P) <= 4 * queues
        self.tree_base = pos
        self.tree_words = 4 * cap.queues
        pos += self.tree_words
        self.slot_base = pos
        pos += cap.slots * SLOT_WORDS
        self.worker_base = pos
        pos += cap.workers * WORKER_WORDS
        # per-request stats: stats_entries entries plus one catch-all (see stats.py)
        self.stats_base = pos
        pos += (cap.stats_entries + 1) * ENTRY_WORDS
        # the maxmin fairness: per-level words, the flow table (as many entries as slots: an
        # active flow holds a slot), its open-addressing index (entry + 1, 0 empty; a power of
        # two at least twice the entries), per-slot words
        self.maxmin_base = pos
        pos += cap.levels * MM_WORDS
        self.flow_header = pos
        pos += FLOW_HEADER_WORDS
        self.flow_base = pos
        pos += cap.slots * FLOW_WORDS
        n = 1
        while n < 2 * cap.slots:
            n *= 2
        self.flow_index = pos
        self.flow_index_words = n
        pos += n
        self.xslot_base = pos
        pos += cap.slots * XSLOT_WORDS
        byte = pos * WORD
        self.level_names = byte
        byte += cap.levels * NAME_BYTES
        self.fs_names = byte
        byte += cap.flow_schemas * NAME_BYTES
        self.details = byte
        self.detail_stride = (cap.detail_bytes + WORD - 1) // WORD * WORD
        byte += cap.slots * self.detail_stride
        self.stats_names = byte  # the level name each stats entry captured at creation
        byte += (cap.stats_entries + 1) * NAME_BYTES
        self.size = byte

    def level(self, index: int) -> int:
        return self.level_base + index * LEVEL_WORDS

    def slot(self, index: int) -> int:
        return self.slot_base + index * SLOT_WORDS

    def worker(self, index: int) -> int:
        return self.worker_base + index * WORKER_WORDS

    def stats_entry(self, index: int) -> int:
        return self.stats_base + index * ENTRY_WORDS


# -- the C header ---------------------------------------------------------------------------
# ``_fastpath.c`` includes ``_layout.h``, generated from the constants above, instead of
# copying them by hand. Regenerate after changing this module (tests/test_ledger_layout.py
# fails while the committed header is stale):
#
#     .venv/bin/python scripts/layout_header.py
#
# The header also carries LAYOUT_DIGEST, a digest of every constant, which the extension
# exports; ledger.py uses the extension only when it equals :func:`digest` (so an extension
# built before a layout change is never bound, whichever constants it reads).

_STATE_PREFIX = "ST_"  # FREE -> ST_FREE in C: a bare FREE/WAITING is too generic a name
# Constants of other ledger modules that _fastpath.c's arithmetic needs, as (module, name):
# their source of truth stays in those modules, and the header (and its digest) carries them
# too, so a change there makes the committed header stale and an extension built before it
# unused. Read at call time: service.py imports this module.
_ARITHMETIC = (
    ("seatseconds", "EXACT_BOUND"),  # below it, float seat-ns products are exact
    ("seatseconds", "HIGH_R"),  # the virtual clock's epoch advance threshold
    ("service", "SERVICE_WINDOW"),  # a learnt G averages about this many requests
    ("service", "MAX_SERVICE_ESTIMATE_NS"),  # a learnt G never exceeds this
)


def c_constants() -> list[tuple[str, int]]:
    """Every integer constant this module defines, as the C header names it.

    Returns:
        ``(name, value)`` pairs in definition order: upper-case module names bound to an
        ``int`` here (names imported from ``stats``, such as ``ENTRY_WORDS``, excluded), the
        slot states (``FREE`` ...) prefixed ``ST_``, then the arithmetic constants of
        ``seatseconds`` and ``service`` that ``_fastpath.c`` uses (``HIGH_R``,
        ``SERVICE_WINDOW``, ...), under their Python names.
    """
    import importlib

    from apf_gunicorn.ledger import stats

    states = {name.upper() for name in STATE_NAMES.values()}
    out = []
    for name, value in globals().items():
        if (not name.isupper() or name.startswith("_") or type(value) is not int
                or name in vars(stats)):
            continue
        out.append((_STATE_PREFIX + name if name in states else name, value))
    for module, name in _ARITHMETIC:
        out.append((name, getattr(importlib.import_module(f"apf_gunicorn.ledger.{module}"), name)))
    return out


def digest() -> str:
    """A short digest of :func:`c_constants` (the header's ``LAYOUT_DIGEST``).

    Returns:
        16 hex digits of SHA-256 over ``NAME=value`` lines.
    """
    import hashlib

    text = "".join(f"{name}={value}\n" for name, value in c_constants())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def c_header() -> str:
    """The text of ``_layout.h``.

    Returns:
        A C header: an include guard, an ``enum`` of every constant in the ``int`` range,
        a ``#define`` for any other: ``INT64_C`` in the ``int64_t`` range (``MAGIC``,
        ``MAX_SERVICE_ESTIMATE_NS``), else ``UINT64_C`` (``HIGH_R``), and ``LAYOUT_DIGEST``.
    """
    lines = [
        "/* Generated from apf_gunicorn/ledger/layout.py; do not edit. Regenerate with",
        " *     .venv/bin/python scripts/layout_header.py",
        " * (tests/test_ledger_layout.py fails while this file is stale). */",
        "#ifndef APF_LEDGER_LAYOUT_H",
        "#define APF_LEDGER_LAYOUT_H",
        "",
        "enum {",
    ]
    wide = []
    for name, value in c_constants():
        if -(1 << 31) <= value < (1 << 31):
            lines.append(f"    {name} = {value},")
        else:
            wide.append((name, value))
    lines.append("};")
    lines.append("")
    for name, value in wide:
        if -(1 << 63) <= value < (1 << 63):
            lines.append(f"#define {name} INT64_C({value:#x})")
        elif value < (1 << 64):
            lines.append(f"#define {name} UINT64_C({value:#x})")
        else:
            raise ValueError(f"layout constant {name} = {value} does not fit in 64 bits")
    lines.append(f'#define LAYOUT_DIGEST "{digest()}"')
    lines.append("")
    lines.append("#endif")
    return "\n".join(lines) + "\n"

