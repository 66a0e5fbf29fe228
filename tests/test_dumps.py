"""Golden tests of the three debug dumps (k8s-apf-config.md 7.1, 7.2) and the detail blobs."""

from __future__ import annotations

from types import SimpleNamespace as NS

import msgpack

from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.server.dumps import (
    FLOW_HEADERS,
    LEVEL_HEADERS,
    QUEUE_HEADERS,
    decode_detail,
    dump_flows,
    dump_priority_levels,
    dump_queues,
    dump_requests,
    encode_detail,
    encode_detail_fields,
    format_seat_seconds,
    format_signed_seat_seconds,
    reserved_head_seats,
    tabwrite,
    tag_minus_v_ns,
)

SEC = 1_000_000_000


def level(name, **kw):
    base = dict(index=0, name=name, desired_queues=0, concurrency_limit=0, quiescing=False,
                seats_in_use=0, seats_waiting=0, requests_waiting=0, requests_executing=0,
                current_r=0, dispatched=0, rejected=0, timedout=0, cancelled=0, queues=[],
                requests=[])
    base.update(kw)
    return NS(**base)


def queue(index, **kw):
    base = dict(index=index, waiting=0, executing=0, seats_in_use=0, next_dispatch_r=0,
                initial_seats_sum=0, max_seats_sum=0, total_work_sum=0)
    base.update(kw)
    return NS(**base)


def request(**kw):
    base = dict(slot=0, queue=-1, index_in_queue=-1, flow_hash=0, fs_index=0, owner=0,
                arrive_ns=0, start_ns=0, initial_seats=1, final_seats=0,
                additional_latency_ns=0, state="executing", detail=b"")
    base.update(kw)
    return NS(**base)


def test_priority_levels_matches_the_kubernetes_example() -> None:
    snap = NS(now=0, flow_schema_names=["exempt"], levels=[
        level("exempt", desired_queues=-1, requests_executing=1, dispatched=12),
        level("catch-all"),
    ])
    assert dump_priority_levels(snap) == (
        "PriorityLevelName, ActiveQueues, IsIdle, IsQuiescing, WaitingRequests, ExecutingRequests, DispatchedRequests, RejectedRequests, TimedoutRequests, CancelledRequests\n"
        "catch-all,         0,            true,   false,       0,               0,                 0,                  0,                0,                0\n"
        "exempt,            0,            false,  false,       0,               1,                 12,                 0,                0,                0\n"
    )


def test_priority_levels_active_queues_and_quiescing() -> None:
    snap = NS(now=0, flow_schema_names=[], levels=[
        level("workload-low", desired_queues=4, quiescing=True, requests_waiting=3,
              requests_executing=2, dispatched=7, rejected=5, cancelled=1,
              queues=[queue(0, waiting=2), queue(1), queue(2, waiting=1), queue(3)]),
    ])
    out = dump_priority_levels(snap).splitlines()[1]
    assert out.replace(" ", "").split(",") == [
        "workload-low", "2", "false", "true", "3", "2", "7", "5", "0", "1"]


def test_queues_layout_and_seat_seconds() -> None:
    assert format_seat_seconds(0) == "0.00000000ss"
    assert format_seat_seconds(123_456_789_012) == "1234.56789012ss"
    snap = NS(now=0, flow_schema_names=[], levels=[
        level("global-default", desired_queues=2, queues=[
            queue(1, executing=1, seats_in_use=1, next_dispatch_r=300_000),
            queue(0, waiting=2, next_dispatch_r=150_000_000, initial_seats_sum=2,
                  max_seats_sum=3, total_work_sum=600_000),
        ]),
        level("exempt", desired_queues=-1),
    ])
    assert dump_queues(snap) == (
        "PriorityLevelName, Index,  PendingRequests, ExecutingRequests, SeatsInUse, NextDispatchR, InitialSeatsSum, MaxSeatsSum, TotalWorkSum\n"
        "global-default,    0,      2,               0,                 0,          1.50000000ss,  2,               3,           0.00600000ss\n"
        "global-default,    1,      0,               1,                 1,          0.00300000ss,  0,               0,           0.00000000ss\n"
    )


def test_requests_order_times_and_details() -> None:
    offset = 1_714_557_600 * SEC  # 2024-05-01T10:00:00Z at monotonic 0
    d_alice = encode_detail_fields(d="alice", u="alice", v="list", p="/api/v1/namespaces/ns1/pods",
                                   ns="ns1", ver="v1", r="pods")
    d_bob = encode_detail_fields(d="bob", u="bob", v="get", p="/apis/apps/v1/deployments",
                                 g="apps", ver="v1", r="deployments", n="web", sr="status")
    snap = NS(now=0, flow_schema_names=["exempt", "catch-all", "global-default"], levels=[
        level("global-default", desired_queues=8, requests=[
            request(queue=3, index_in_queue=1, fs_index=2, arrive_ns=2 * SEC + 5,
                    state="waiting", detail=d_alice),
            request(queue=3, index_in_queue=0, fs_index=2, arrive_ns=1 * SEC + 123_456_789,
                    state="waiting", detail=d_bob, additional_latency_ns=5_000_000,
                    final_seats=2),
            request(queue=1, fs_index=2, arrive_ns=SEC, start_ns=SEC + 500_000_000,
                    initial_seats=3, detail=d_alice),
            request(queue=1, fs_index=2, arrive_ns=SEC, start_ns=SEC, state="lingering"),
        ]),
        level("exempt", desired_queues=-1, requests=[
            request(fs_index=0, arrive_ns=0, start_ns=90 * SEC, detail=b""),
        ]),
    ])
    assert dump_requests(snap, wall_offset_ns=offset) == (
        "PriorityLevelName, FlowSchemaName, QueueIndex, RequestIndexInQueue, FlowDistingsher, ArriveTime,                     InitialSeats, FinalSeats, AdditionalLatency, StartTime\n"
        "exempt,            exempt,         -1,         -1,                  ,                2024-05-01T10:00:00Z,           1,            0,          0s,                2024-05-01T10:01:30Z\n"
        "global-default,    global-default, 1,          -1,                  alice,           2024-05-01T10:00:01Z,           3,            0,          0s,                2024-05-01T10:00:01.5Z\n"
        "global-default,    global-default, 3,          0,                   bob,             2024-05-01T10:00:01.123456789Z, 1,            2,          5ms,               0001-01-01T00:00:00Z\n"
        "global-default,    global-default, 3,          1,                   alice,           2024-05-01T10:00:02.000000005Z, 1,            0,          0s,                0001-01-01T00:00:00Z\n"
    )
    lines = dump_requests(snap, include_details=True, wall_offset_ns=offset).splitlines()
    assert [line[186:] for line in lines] == [
        "UserName, Verb,   APIPath,                     Namespace, Name,   APIVersion, Resource,    SubResource",
        ",         ,       ,                            ,          ,       ,           ,            ",
        "alice,    list,   /api/v1/namespaces/ns1/pods, ns1,       ,       v1,         pods,        ",
        "bob,      get,    /apis/apps/v1/deployments,   ,          web,    apps/v1,    deployments, status",
        "alice,    list,   /api/v1/namespaces/ns1/pods, ns1,       ,       v1,         pods,        ",
    ]
    assert lines[0][:186] == (
        "PriorityLevelName, FlowSchemaName, QueueIndex, RequestIndexInQueue, FlowDistingsher, ArriveTime,                     InitialSeats, FinalSeats, AdditionalLatency, StartTime,              "
    )


def test_tabwriter_counts_code_points_and_minimum_width() -> None:
    assert tabwrite([["a", "b"], ["ü", "c"]]) == "a,      b\nü,      c\n"
    assert tabwrite([["abcdefghij", "x"]]) == "abcdefghij, x\n"


def test_detail_round_trip_truncation_and_garbage() -> None:
    attrs = RequestAttributes(user="system:serviceaccount:kube-system:x", groups=("g",),
                              verb="create", path="/apis/coordination.k8s.io/v1/leases",
                              is_resource=True, api_group="coordination.k8s.io",
                              api_version="v1", resource="leases", namespace="kube-system",
                              name="lease-1")
    blob = encode_detail(attrs, NS(distinguisher="system:serviceaccount:kube-system:x"))
    d = decode_detail(blob)
    assert d == {"d": "system:serviceaccount:kube-system:x", "u": attrs.user, "v": "create",
                 "p": attrs.path, "ns": "kube-system", "n": "lease-1",
                 "g": "coordination.k8s.io", "ver": "v1", "r": "leases", "sr": ""}
    # the ledger cuts blobs at its capacity: what precedes the cut survives
    cut = decode_detail(blob[:60])
    assert cut["d"] == attrs.user and cut["g"] == ""
    # a huge path is shortened to fit instead of losing the later fields
    big = encode_detail(RequestAttributes(user="u", groups=(), verb="get", path="/x" * 500,
                                          resource="r"), None, max_bytes=100)
    assert len(big) <= 100
    got = decode_detail(big)
    assert got["u"] == "u" and got["r"] == "r" and got["p"].startswith("/x/x")
    # trailing zero padding, garbage, non-UTF-8 and wrong types never raise
    assert decode_detail(blob + b"\0" * 20) == d
    assert decode_detail(b"\xc1\xff\x00garbage")["u"] == ""
    assert decode_detail(msgpack.packb("u") + msgpack.packb(5))["u"] == ""
    assert decode_detail(msgpack.packb("u") + b"\xa2\xff\xfe")["u"] == "\ufffd\ufffd"


def test_distinguisher_filled_on_every_level():
    """Kubernetes computes a distinguisher only for levels with more than one queue; the dump
    names the flow on every level (single queue, Reject, exempt) by the FlowSchema's method."""
    import dataclasses

    from apf_gunicorn.flowcontrol.loader import load_configuration
    from apf_gunicorn.flowcontrol.matching import Classifier
    from apf_gunicorn.flowcontrol.objects import QueuingConfig

    cfg = load_configuration("builtin:webapp")
    one_queue = dataclasses.replace(cfg.priority_levels["anonymous"],
                                    queuing=QueuingConfig(1, 1, 12))
    cfg = dataclasses.replace(cfg, priority_levels={**cfg.priority_levels,
                                                    "anonymous": one_queue})
    classifier = Classifier(cfg)
    anon = RequestAttributes("addr:127.0.0.2", ("system:unauthenticated",), "get", "/x")
    c = classifier.classify(anon)
    assert c.priority_level.queuing.queues == 1 and c.distinguisher == ""  # Kubernetes
    assert decode_detail(encode_detail(anon, c))["d"] == "addr:127.0.0.2"
    probe = RequestAttributes("bob", ("system:authenticated",), "get", "/healthz")
    c = classifier.classify(probe)
    assert c.priority_level.is_exempt and c.flow_schema.distinguisher is None
    assert decode_detail(encode_detail(probe, c))["d"] == ""  # no method: one flow


# -- the fairness columns and dump_flows (not Kubernetes') ------------------------------

def _fairness_ledger():
    """A real ledger with a maxmin level (C=4) holding a reservation for a 4-seat head, a
    kubernetes level with requests waiting, and an exempt level."""
    from apf_gunicorn.ledger import Capacity, Ledger, LevelSpec
    from apf_gunicorn.ledger.lock import NullLock

    cap = Capacity(slots=32, levels=4, queues=64)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    names, _ = led.configure([LevelSpec("mm", 8, 2, 8, 4, "maxmin"),
                              LevelSpec("k8s", 8, 2, 8, 4),
                              LevelSpec("exempt", -1, 0, 0, 0, None)], ["fs", "other"], 0)
    mm, k8s = names["mm"], names["k8s"]
    alice = [led.admit(mm, 1, 1, 0, 0, 0, 10, detail=encode_detail_fields(d="alice"))
             for _ in range(3)]
    assert led.admit(mm, 2, 4, 0, 0, 0, 20, detail=encode_detail_fields(d="bob")).outcome == \
        "queued"  # 4 seats, 1 free: reserved
    assert led.admit(mm, 3, 1, 0, 0, 0, 30, fs_index=1,
                     detail=encode_detail_fields(d="carol")).outcome == "queued"
    led.finish(alice[0].slot, alice[0].gen, SEC)  # alice learns 1 s; carol may not backfill
    for _ in range(6):
        led.admit(k8s, 5, 1, 0, 0, 0, 40)
    return led


def test_default_dumps_keep_kubernetes_columns_on_every_fairness() -> None:
    snap = _fairness_ledger().snapshot(2 * SEC)
    levels = [[c.strip() for c in line.split(",")]
              for line in dump_priority_levels(snap).splitlines()]
    assert levels[0] == list(LEVEL_HEADERS) and all(len(r) == 10 for r in levels)
    assert [r[0] for r in levels[1:]] == ["exempt", "k8s", "mm"]
    queues = [[c.strip() for c in line.split(",")] for line in dump_queues(snap).splitlines()]
    assert queues[0] == list(QUEUE_HEADERS) and all(len(r) == 9 for r in queues)
    # maxmin keeps no per-queue virtual time: its NextDispatchR is left empty, not stale
    assert {r[5] for r in queues[1:] if r[0] == "mm"} == {""}
    k8s = [r[5] for r in queues[1:] if r[0] == "k8s"]
    assert len(k8s) == 8 and all(c.endswith("ss") for c in k8s) and "0.00000000ss" in k8s
    assert max(k8s) > "0.00000000ss"


def test_fairness_columns_name_the_fairness_and_its_virtual_time() -> None:
    snap = NS(now=0, flow_schema_names=[], levels=[
        level("global-default", desired_queues=2, current_r=150_000_000, fairness="kubernetes",
              queues=[queue(0, next_dispatch_r=300_000_000)]),
        level("workload-low", desired_queues=1, fairness="maxmin", maxmin={
            "v": 2_500_000_000, "reserved": 0xBEEF, "reservations": 3,
            "flows": {0xBEEF: {}, 7: {}}}, queues=[queue(0, next_dispatch_r=999)]),
        level("exempt", desired_queues=-1, fairness="kubernetes"),
    ])
    assert dump_priority_levels(snap, include_fairness=True).splitlines()[0].endswith(
        "CancelledRequests, Fairness,   VirtualTime,  ActiveFlows, ReservedFlow,     "
        "Reservations")
    text = dump_priority_levels(snap, include_fairness=True)
    at = text.index("Fairness")  # Kubernetes' columns come first, as without the flag
    assert text.splitlines()[0][:at].rstrip(" ,") == dump_priority_levels(snap).splitlines()[0]
    rows = [line[at:] for line in text.splitlines()]
    assert rows == [
        "Fairness,   VirtualTime,  ActiveFlows, ReservedFlow,     Reservations",
        ",           ,             ,            ,                 ",
        "kubernetes, 1.50000000ss, ,            ,                 ",
        "maxmin,     2.50000000ss, 2,           000000000000beef, 3",
    ]
    assert dump_queues(snap, include_fairness=True) == (
        "PriorityLevelName, Index,  PendingRequests, ExecutingRequests, SeatsInUse, NextDispatchR, InitialSeatsSum, MaxSeatsSum, TotalWorkSum, Fairness,   VirtualTime\n"
        "global-default,    0,      0,               0,                 0,          3.00000000ss,  0,               0,           0.00000000ss, kubernetes, 1.50000000ss\n"
        "workload-low,      0,      0,               0,                 0,          ,              0,               0,           0.00000000ss, maxmin,     2.50000000ss\n"
    )


def test_dump_flows_lists_each_maxmin_flow_against_v() -> None:
    led = _fairness_ledger()
    snap = led.snapshot(2 * SEC)
    rows = [[c.strip() for c in line.split(",")] for line in dump_flows(snap).splitlines()]
    assert rows[0] == list(FLOW_HEADERS)
    mm = next(lv for lv in snap.levels if lv.name == "mm").maxmin
    v = mm["v"]
    by_name = {r[3]: r for r in rows[1:]}
    assert [r[0] for r in rows[1:]] == ["mm"] * 3  # kubernetes and exempt levels: no rows
    assert by_name["bob"][1:3] == ["0000000000000002", "fs"]
    assert by_name["carol"][2] == "other"
    # bob and carol wait at V; alice runs ahead by her two charged requests
    assert by_name["bob"][4] == by_name["carol"][4] == "0.00000000ss"
    alice_tag = mm["flows"][1]["tag"]
    assert by_name["alice"][4] == format_signed_seat_seconds(alice_tag - v)
    assert by_name["alice"][4] != "0.00000000ss"
    assert [r[3] for r in rows[1:]][-1] == "alice"  # ordered by start tag
    assert by_name["alice"][5:9] == ["0", "2", "2", "999.99999ms"]  # learnt from the finish
    assert by_name["bob"][5:9] == ["1", "0", "0", ""]  # nothing finished: no estimate yet
    assert [r[10] for r in rows[1:]].count("true") == 1 and by_name["bob"][10] == "true"
    levels = [[c.strip() for c in line.split(",")]
              for line in dump_priority_levels(snap, include_fairness=True).splitlines()]
    mm_row = next(r for r in levels if r[0] == "mm")
    assert mm_row[10:] == ["maxmin", format_seat_seconds(v // 10), "3", "0000000000000002", "1"]
    assert reserved_head_seats(next(lv for lv in snap.levels if lv.name == "mm")) == 4


def test_signed_seat_seconds_and_tags_across_the_wrap() -> None:
    assert format_signed_seat_seconds(-250_000_000) == "-0.25000000ss"
    assert format_signed_seat_seconds(1_500_000_000) == "1.50000000ss"
    assert format_signed_seat_seconds(-5) == "0.00000000ss"  # below 1e-8: no "-0"
    top = (1 << 64) - 1_000_000_000  # V one seat-second before the uint64 wrap
    assert tag_minus_v_ns(1_000_000_000, top) == 2_000_000_000
    assert tag_minus_v_ns(top, 1_000_000_000) == -2_000_000_000
