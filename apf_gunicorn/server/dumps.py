"""The Kubernetes APF debug dumps, and our fairness state, from a ledger snapshot.

``dump_priority_levels``, ``dump_queues`` and ``dump_requests`` produce exactly the text of
kube-apiserver's ``/debug/api_priority_and_fairness/dump_*`` endpoints (``apf_controller_debug.go``):
comma-terminated cells aligned as Go's ``text/tabwriter`` (minwidth 8, padding 1) aligns them.

    snap = ledger.snapshot(time.monotonic_ns())
    print(dump_priority_levels(snap), end="")

The fairness of each level (``kubernetes`` or ``maxmin``, docs/fairness.md) and the
virtual time it orders by are added the way Kubernetes adds request details: columns appended
after Kubernetes' own, only when asked (``include_fairness=True``, the endpoint's
``?includeFairness=1``), so the default text stays Kubernetes' byte for byte. Kubernetes' dumps
have no flows; :func:`dump_flows` (``dump_flows``) lists every active flow of each ``maxmin``
level: its start tag relative to the level's V, its requests and seats, its learnt service time.
:func:`dump_pools` (``dump_pools``, not Kubernetes') lists the app's connection pools the
workers found (``signals/``), summed over the workers.
Under ``maxmin`` the queues only decide admission, and the per-queue ``NextDispatchR`` word is
not maintained: ``dump_queues`` leaves that cell empty on ``maxmin`` levels.

Request details (user, verb, path, ...) come from the opaque ``detail`` bytes the middleware
stores with each slot. :func:`encode_detail` writes them and :func:`decode_detail` reads them
back; both live here so the format has one owner. The blob is a msgpack *stream* of alternating
key and value objects (not one map), in order of importance, so a blob cut short by the slot's
capacity still decodes up to the cut:

    ``d`` distinguisher, ``u`` user, ``v`` verb, ``p`` path, ``ns`` namespace, ``n`` name,
    ``g`` API group, ``ver`` API version, ``r`` resource, ``sr`` subresource.

The ledger keeps monotonic nanoseconds; times print as wall-clock RFC3339Nano through an offset
``time.time_ns() - time.monotonic_ns()`` captured once at import (pass ``wall_offset_ns`` to
override, as the golden tests do).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from apf_gunicorn.flowcontrol.gomath import format_duration, format_rfc3339nano
from apf_gunicorn.flowcontrol.matching import flow_distinguisher
from apf_gunicorn.flowcontrol.objects import FlowSchema, RequestAttributes

WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()
DETAIL_CAPACITY = 256  # the ledger's default Capacity.detail_bytes

DETAIL_KEYS = ("d", "u", "v", "p", "ns", "n", "g", "ver", "r", "sr")
_ATTR_FIELDS = (  # RequestAttributes field for each detail key after the distinguisher
    ("u", "user"), ("v", "verb"), ("p", "path"), ("ns", "namespace"), ("n", "name"),
    ("g", "api_group"), ("ver", "api_version"), ("r", "resource"), ("sr", "subresource"),
)
_SS_SCALE = 100_000_000  # SeatSeconds fixed point: 1e-8 seat-seconds
_NS_PER_SS_UNIT = 10  # maxmin's tags and V are seat-ns: 10 seat-ns per SeatSeconds unit
_U64 = (1 << 64) - 1
MAXMIN = "maxmin"

LEVEL_HEADERS = (
    "PriorityLevelName", "ActiveQueues", "IsIdle", "IsQuiescing", "WaitingRequests",
    "ExecutingRequests", "DispatchedRequests", "RejectedRequests", "TimedoutRequests",
    "CancelledRequests",
)
QUEUE_HEADERS = (
    "PriorityLevelName", "Index", "PendingRequests", "ExecutingRequests", "SeatsInUse",
    "NextDispatchR", "InitialSeatsSum", "MaxSeatsSum", "TotalWorkSum",
)
REQUEST_HEADERS = (
    "PriorityLevelName", "FlowSchemaName", "QueueIndex", "RequestIndexInQueue",
    "FlowDistingsher",  # sic: Kubernetes' spelling
    "ArriveTime", "InitialSeats", "FinalSeats", "AdditionalLatency", "StartTime",
)
REQUEST_DETAIL_HEADERS = (
    "UserName", "Verb", "APIPath", "Namespace", "Name", "APIVersion", "Resource", "SubResource",
)
# appended with include_fairness (not Kubernetes' columns)
LEVEL_FAIRNESS_HEADERS = ("Fairness", "VirtualTime", "ActiveFlows", "ReservedFlow", "Reservations")
QUEUE_FAIRNESS_HEADERS = ("Fairness", "VirtualTime")
# appended with seats (the endpoint's ?includeSeats=1): nominal (the configuration's share of
# the server limit), current (after borrowing: what the ledger enforces), in use
LEVEL_SEAT_HEADERS = ("NominalSeats", "CurrentSeats", "SeatsInUse")
FLOW_HEADERS = (
    "PriorityLevelName", "FlowHash", "FlowSchemaName", "FlowDistinguisher", "StartTag",
    "WaitingRequests", "ExecutingRequests", "SeatsInUse", "ServiceEstimate", "Parked", "Reserved",
)


# -- request detail blobs ---------------------------------------------------------------------

def encode_detail(attrs: Any, classification: Any = None, max_bytes: int = DETAIL_CAPACITY) -> bytes:
    """The detail blob of one request from its ``RequestAttributes`` and ``Classification``.

    The distinguisher is the flow's name on every level (:func:`flow_distinguisher`: the user
    or namespace by the FlowSchema's method), also where Kubernetes leaves it empty because the
    level has a single queue or none. Empty fields are left out; long fields are shortened so
    the blob fits ``max_bytes`` (the path first, as it is the longest and least needed)."""
    fs = getattr(classification, "flow_schema", None)
    if isinstance(fs, FlowSchema) and isinstance(attrs, RequestAttributes):
        distinguisher = flow_distinguisher(fs, attrs)
    else:
        distinguisher = getattr(classification, "distinguisher", "") or ""
    fields = {"d": distinguisher}
    for key, attr in _ATTR_FIELDS:
        fields[key] = getattr(attrs, attr, "") or ""
    return _pack(fields, max_bytes)


def encode_detail_fields(max_bytes: int = DETAIL_CAPACITY, **fields: str) -> bytes:
    """Like :func:`encode_detail` from keyword fields named by :data:`DETAIL_KEYS`."""
    unknown = set(fields) - set(DETAIL_KEYS)
    if unknown:
        raise ValueError(f"unknown detail keys {sorted(unknown)}")
    return _pack(fields, max_bytes)


def _pack(fields: dict[str, str], max_bytes: int) -> bytes:
    values = {k: str(fields.get(k) or "") for k in DETAIL_KEYS}
    while True:
        out = b"".join(
            msgpack.packb(k) + msgpack.packb(v) for k, v in values.items() if v
        )
        if len(out) <= max_bytes:
            return out
        # shorten the longest field by what is over (at least a quarter of it), then retry
        longest = max(values, key=lambda k: len(values[k]))
        text = values[longest]
        cut = max(len(out) - max_bytes, len(text) // 4, 1)
        values[longest] = text[: max(0, len(text) - cut)]


def decode_detail(blob: bytes | bytearray | memoryview) -> dict[str, str]:
    """Every detail key -> its text ("" when absent). Never raises: a truncated or garbled
    blob yields what could be read."""
    out = dict.fromkeys(DETAIL_KEYS, "")
    if not blob:
        return out
    unpacker = msgpack.Unpacker(raw=False, unicode_errors="replace")
    try:
        unpacker.feed(bytes(blob))
        key = None
        for obj in unpacker:
            if key is None:
                key = obj
                continue
            if isinstance(key, str) and key in out and isinstance(obj, str):
                out[key] = obj
            key = None
    except Exception:  # garbage after the readable part
        pass
    return out


# -- formatting -------------------------------------------------------------------------------

def format_seat_seconds(value: int) -> str:
    """Kubernetes ``SeatSeconds.String()``: ``<int>.<8 digits>ss``."""
    value = int(value) & 0xFFFF_FFFF_FFFF_FFFF  # uint64, as Go
    quo, rem = divmod(value, _SS_SCALE)
    return f"{quo}.{rem:08d}ss"


def tabwrite(rows: Sequence[Sequence[str]]) -> str:
    """Rows joined by ``",\\t"`` through Go's tabwriter (minwidth 8, tabwidth 0, padding 1):
    every cell but the last of a row carries its comma and is padded to the column width."""
    ncols = max((len(r) for r in rows), default=0)
    widths = [8] * ncols
    for r in rows:
        for i, cell in enumerate(r[:-1]):
            widths[i] = max(widths[i], len(cell) + 2)  # cell + comma + padding 1
    lines = []
    for r in rows:
        parts = [(cell + ",").ljust(widths[i]) for i, cell in enumerate(r[:-1])]
        parts.append(r[-1] if r else "")
        lines.append("".join(parts) + "\n")
    return "".join(lines)


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _sorted_levels(snapshot: Any) -> list:
    return sorted(snapshot.levels, key=lambda lv: lv.name)


# -- the fairness state ------------------------------------------------------------------------

def level_fairness(lv: Any) -> str:
    """The fairness of a level's snapshot: ``"kubernetes"`` or ``"maxmin"``, or ``""`` for a
    level that never queues (exempt, or ``limitResponse.type: Reject``), which has no fairness
    to run."""
    if getattr(lv, "desired_queues", 0) <= 0:
        return ""
    return getattr(lv, "fairness", None) or "kubernetes"


def virtual_time(lv: Any) -> int | None:
    """The virtual time a level's fairness orders by, in SeatSeconds units (1e-8 seat-seconds):
    Kubernetes' R under ``kubernetes`` (as of the level's last operation), V under ``maxmin``
    (the start tag in service; seat-ns modulo 2^64, shown to 1e-8); None on a level without a
    fairness or without ``maxmin`` state in the snapshot."""
    fairness = level_fairness(lv)
    if fairness == MAXMIN:
        mm = getattr(lv, "maxmin", None)
        return None if mm is None else (mm["v"] & _U64) // _NS_PER_SS_UNIT
    return lv.current_r if fairness else None


def tag_minus_v_ns(tag: int, v: int) -> int:
    """A start tag relative to V, in seat-ns: the uint64 words' signed difference (the way the
    ledger compares them, so it is right across a wrap)."""
    d = (tag - v) & _U64
    return d - (1 << 64) if d >> 63 else d


def format_signed_seat_seconds(ns: int) -> str:
    """Seat-ns as SeatSeconds text with a sign when negative: ``-0.25000000ss``."""
    units = abs(ns) // _NS_PER_SS_UNIT
    return ("-" if ns < 0 and units else "") + format_seat_seconds(units)


def format_flow_hash(h: int) -> str:
    """A flow's 64-bit hash as 16 hex digits (the ``FlowHash`` and ``ReservedFlow`` cells)."""
    return f"{h & _U64:016x}"


def reserved_head_seats(lv: Any) -> int:
    """The seats the reserved flow's head (its oldest waiting request) needs on a ``maxmin``
    level: the seats the level is holding free for it. 0 when nothing is reserved (or the
    reserved flow has nothing waiting left, after a cancel)."""
    mm = getattr(lv, "maxmin", None)
    if level_fairness(lv) != MAXMIN or not mm or mm.get("reserved") is None:
        return 0
    flow = mm["reserved"]
    waiting = [r for r in lv.requests if r.flow_hash == flow and _state(r) == "waiting"]
    if not waiting:
        return 0
    head = min(waiting, key=lambda r: (r.arrive_ns, r.slot))
    return max(head.initial_seats, head.final_seats)


def _level_fairness_cells(lv: Any) -> list[str]:
    fairness = level_fairness(lv)
    vt = virtual_time(lv)
    cells = [fairness, "" if vt is None else format_seat_seconds(vt)]
    mm = getattr(lv, "maxmin", None)
    if fairness == MAXMIN and mm is not None:
        reserved = mm.get("reserved")
        cells += [str(len(mm["flows"])), "" if reserved is None else format_flow_hash(reserved),
                  str(mm.get("reservations", 0))]
    else:
        cells += ["", "", ""]
    return cells


# -- the dumps --------------------------------------------------------------------------------

def dump_priority_levels(snapshot: Any, include_fairness: bool = False,
                         seats: Mapping[str, Any] | None = None,
                         configuration: str | None = None) -> str:
    """Kubernetes' ``dump_priority_levels``: one row per level, by name.

    Args:
        snapshot: a :class:`~apf_gunicorn.ledger.records.Snapshot`.
        include_fairness: append ``Fairness`` (the level's fairness; empty on exempt and reject
            levels), ``VirtualTime`` (R or V, :func:`virtual_time`), and under ``maxmin``
            ``ActiveFlows``, ``ReservedFlow`` (hash of the flow seats are held for, empty when
            none) and ``Reservations`` (reservations made so far).
        seats: when given, the running configuration's limits per level name (objects with a
            ``nominal``, as ``LevelLimits``): append ``NominalSeats`` (empty for a level it
            does not name, e.g. one draining after a reload), ``CurrentSeats`` (the ledger's
            limit, after borrowing) and ``SeatsInUse``.
        configuration: with ``seats``, what the running configuration is (its generation and
            digest): a last line ``# configuration <it>`` under the table.
    Returns:
        The text, Kubernetes' exact layout when ``include_fairness`` is false and ``seats``
        None.
    """
    rows = [list(LEVEL_HEADERS) + (list(LEVEL_FAIRNESS_HEADERS) if include_fairness else [])
            + (list(LEVEL_SEAT_HEADERS) if seats is not None else [])]
    for lv in _sorted_levels(snapshot):
        active = sum(1 for q in lv.queues if q.waiting > 0)
        idle = lv.requests_waiting == 0 and lv.requests_executing == 0
        row = [
            lv.name, str(active), _bool(idle), _bool(lv.quiescing), str(lv.requests_waiting),
            str(lv.requests_executing), str(lv.dispatched), str(lv.rejected), str(lv.timedout),
            str(lv.cancelled),
        ]
        if include_fairness:
            row += _level_fairness_cells(lv)
        if seats is not None:
            nominal = getattr(seats.get(lv.name), "nominal", None)
            row += ["" if nominal is None else str(int(nominal)), str(lv.concurrency_limit),
                    str(lv.seats_in_use)]
        rows.append(row)
    if seats is not None and configuration:
        return tabwrite(rows) + f"# configuration {configuration}\n"
    return tabwrite(rows)


def dump_queues(snapshot: Any, include_fairness: bool = False) -> str:
    """Kubernetes' ``dump_queues``: one row per queue of each queuing level.

    ``NextDispatchR`` is empty on ``maxmin`` levels (that fairness orders flows, not queues, and
    does not keep the word; see :func:`dump_flows`).

    Args:
        snapshot: a :class:`~apf_gunicorn.ledger.records.Snapshot`.
        include_fairness: append ``Fairness`` and ``VirtualTime`` (the level's R or V, to read
            each queue's ``NextDispatchR`` against).
    Returns:
        The text, Kubernetes' exact layout when ``include_fairness`` is false.
    """
    rows = [list(QUEUE_HEADERS) + (list(QUEUE_FAIRNESS_HEADERS) if include_fairness else [])]
    for lv in _sorted_levels(snapshot):
        maxmin = level_fairness(lv) == MAXMIN
        extra = _level_fairness_cells(lv)[:2] if include_fairness else []
        for q in sorted(lv.queues, key=lambda q: q.index):
            rows.append([
                lv.name, str(q.index), str(q.waiting), str(q.executing), str(q.seats_in_use),
                "" if maxmin else format_seat_seconds(q.next_dispatch_r),
                str(q.initial_seats_sum), str(q.max_seats_sum),
                format_seat_seconds(q.total_work_sum), *extra,
            ])
    return tabwrite(rows)


def dump_flows(snapshot: Any) -> str:
    """Every active flow (a request waiting or executing) of every ``maxmin`` level, by level
    name then start tag (the dispatch order among backlogged flows); other levels have no rows.

    Columns: ``FlowHash`` (16 hex digits, as ``ReservedFlow``), ``FlowSchemaName`` and
    ``FlowDistinguisher`` (from one of the flow's requests), ``StartTag`` (tag − V, seat-seconds:
    how far ahead of the level's virtual time the flow is), ``WaitingRequests``,
    ``ExecutingRequests``, ``SeatsInUse``, ``ServiceEstimate`` (its learnt service time, empty
    until its first request finishes), ``Parked`` (a new flow held at its equal share),
    ``Reserved`` (seats are being held free for its head).

    Args:
        snapshot: a :class:`~apf_gunicorn.ledger.records.Snapshot`.
    Returns:
        The text, in the dumps' tabwriter layout.
    """
    fs_names = list(snapshot.flow_schema_names)
    rows = [list(FLOW_HEADERS)]
    for lv in _sorted_levels(snapshot):
        mm = getattr(lv, "maxmin", None)
        if level_fairness(lv) != MAXMIN or not mm:
            continue
        v = mm["v"]
        sample: dict[int, Any] = {}
        for req in lv.requests:
            if req.flow_hash not in sample or _state(req) == "waiting":
                sample[req.flow_hash] = req
        flows = sorted(mm["flows"].items(),
                       key=lambda kv: (tag_minus_v_ns(kv[1]["tag"], v), kv[0]))
        for h, f in flows:
            req = sample.get(h)
            fs = detail = ""
            if req is not None:
                if 0 <= req.fs_index < len(fs_names):
                    fs = fs_names[req.fs_index]
                detail = decode_detail(req.detail)["d"]
            est = f["estimate_ns"]
            rows.append([
                lv.name, format_flow_hash(h), fs, detail,
                format_signed_seat_seconds(tag_minus_v_ns(f["tag"], v)), str(f["waiting"]),
                str(f["executing"]), str(f["seats"]), "" if est is None else format_duration(est),
                _bool(f["parked"]), _bool(h == mm.get("reserved")),
            ])
    return tabwrite(rows)


POOL_HEADERS = ("PoolName", "Kind", "Workers", "Capacity", "InUse", "Waiting", "WaitSeconds",
                "Waits")


def dump_pools(pools: Mapping[str, Any]) -> str:
    """The app's pools server-wide (``signals.table.PoolTotals`` by name), a row each, in the
    dumps' layout: the live workers that have it, their summed capacity (``unbounded`` when
    nothing bounds it), connections in use and requests waiting as of each worker's last
    window, and the cumulative time waited and waits. A pool no live worker has shows ``-``
    for what it has now."""
    from apf_gunicorn.signals.pools import UNBOUNDED

    rows = [list(POOL_HEADERS)]
    for name in sorted(pools):
        t = pools[name]
        if t.workers:
            now = ["unbounded" if t.capacity == UNBOUNDED else str(t.capacity),
                   str(t.in_use), str(t.waiting)]
        else:
            now = ["-", "-", "-"]
        rows.append([name, t.kind or "-", str(t.workers), *now, f"{t.wait_ns / 1e9:.3f}",
                     str(t.waits)])
    return tabwrite(rows)


CPU_HEADERS = ("Worker", "CpuShare", "WantedShare", "CpuPerRequestMs", "Requests")


def dump_cpu(state: Any) -> str:
    """The CPU (``signals.cpu.CpuState``): a row per live worker (its pid, its share of its
    GIL, the share of the window it ran or waited for a core, its CPU per served request over
    its last window, and the requests it served in it), then the workers summed and the host
    (its busy share of all its cores, and the share busy with other processes than our
    workers; ``-`` where ``/proc/stat`` is not read)."""
    rows = [list(CPU_HEADERS)]
    if state is None:
        return tabwrite(rows)

    def ms(ns: float | None) -> str:
        return "-" if ns is None else f"{ns / 1e6:.3f}"

    for w in sorted(state.windows, key=lambda w: w.pid):
        rows.append([str(w.pid), f"{w.share:.3f}", f"{w.wanted:.3f}", ms(w.cpu_per_request_ns),
                     str(w.requests)])
    sample = state.sample
    rows.append(["workers", f"{sample.busy:.3f}", f"{sample.wanted or 0.0:.3f}",
                 ms(sample.cpu_per_request_ns), str(sum(w.requests for w in state.windows))])
    host, others = sample.host_share, sample.others_share
    rows.append([f"host ({sample.cores or '-'} cores)", "-" if host is None else f"{host:.3f}",
                 "-", "-", "-"])
    rows.append(["host: not ours", "-" if others is None else f"{others:.3f}", "-", "-", "-"])
    return tabwrite(rows)


def _state(req: Any) -> str:
    st = req.state
    if isinstance(st, int):
        return {0: "free", 1: "waiting", 2: "executing", 3: "lingering"}.get(st, str(st))
    return str(st)


def _api_version(group: str, version: str) -> str:
    return f"{group}/{version}" if group else version  # schema.GroupVersion.String()


def dump_requests(
    snapshot: Any, include_details: bool = False, wall_offset_ns: int | None = None
) -> str:
    """One row per waiting or executing request; lingering requests (main phase over, seats
    held for their additional latency) are not listed, as upstream."""
    offset = WALL_OFFSET_NS if wall_offset_ns is None else wall_offset_ns
    fs_names = list(snapshot.flow_schema_names)
    headers = list(REQUEST_HEADERS) + (list(REQUEST_DETAIL_HEADERS) if include_details else [])
    rows = [headers]

    def row(lv: Any, req: Any, queue: int, pos: int) -> list[str]:
        detail = decode_detail(req.detail)
        fs = fs_names[req.fs_index] if 0 <= req.fs_index < len(fs_names) else ""
        cells = [
            lv.name, fs, str(queue), str(pos), detail["d"],
            format_rfc3339nano(req.arrive_ns + offset), str(req.initial_seats),
            str(req.final_seats), format_duration(req.additional_latency_ns),
            format_rfc3339nano(req.start_ns + offset if req.start_ns else 0),
        ]
        if include_details:
            cells += [
                detail["u"], detail["v"], detail["p"], detail["ns"], detail["n"],
                _api_version(detail["g"], detail["ver"]), detail["r"], detail["sr"],
            ]
        return cells

    for lv in _sorted_levels(snapshot):
        waiting: dict[int, list] = {}
        executing: dict[int, list] = {}
        queueless: list = []
        for req in lv.requests:
            st = _state(req)
            if st == "waiting":
                waiting.setdefault(req.queue, []).append(req)
            elif st == "executing":
                if req.queue >= 0:
                    executing.setdefault(req.queue, []).append(req)
                else:
                    queueless.append(req)
        for qi in sorted(set(waiting) | set(executing)):
            for pos, req in enumerate(sorted(waiting.get(qi, []), key=lambda r: r.index_in_queue)):
                rows.append(row(lv, req, qi, pos))
            for req in sorted(executing.get(qi, []), key=lambda r: r.start_ns):
                rows.append(row(lv, req, qi, -1))
        for req in sorted(queueless, key=lambda r: r.start_ns):
            rows.append(row(lv, req, -1, -1))
    return tabwrite(rows)
