"""Load reports for the balancer in front: the weight formula, the ORCA header (parsed here with
a parser written from Envoy's published TEXT format), the lock-free ledger read, the settings,
and ORCA headers on a real server."""

from __future__ import annotations

import math

import pytest

from apf_gunicorn.admission.loadreport import (
    ORCA_HEADER,
    OrcaReport,
    RateMeter,
    ServerLoad,
    demand,
    orca_text,
    summarize,
    weight_percent,
)
from apf_gunicorn.ledger import Capacity, Ledger, LevelSpec, NullLock
from apf_gunicorn.server.settings import SettingsError, load_settings
from tests.apps.loadgen import Client
from tests.conftest import APPS

# -- a parser of ORCA's TEXT encoding, from the published format ---------------------------------
# endpoint-load-metrics: "TEXT " then comma-separated "name=value" entries (Envoy also accepts
# "name:value"), whitespace around entries ignored; names are the OrcaLoadReport fields
# (cpu_utilization, mem_utilization, application_utilization, rps_fractional, eps) or
# "named_metrics.<key>" / "utilization.<key>" / "request_cost.<key>" with a non-empty key; values
# are doubles, neither NaN nor infinite; a name may appear once.

ORCA_FIELDS = {"cpu_utilization", "mem_utilization", "application_utilization",
               "rps_fractional", "eps"}
ORCA_MAPS = ("named_metrics.", "utilization.", "request_cost.")


def parse_orca_text(value: str) -> dict:
    if not value.startswith("TEXT "):
        raise ValueError(f"not the TEXT format: {value[:5]!r}")
    report: dict = {}
    seen = set()
    for entry in value[5:].split(","):
        entry = entry.strip()
        if not entry:
            raise ValueError("empty entry")
        sep = "=" if "=" in entry else ":"
        name, _, raw = entry.partition(sep)
        name, raw = name.strip(), raw.strip()
        if not name or not raw:
            raise ValueError(f"empty name or value in {entry!r}")
        if name in seen:
            raise ValueError(f"duplicate metric {name!r}")
        seen.add(name)
        number = float(raw)
        if math.isnan(number) or math.isinf(number):
            raise ValueError(f"{name} is not finite")
        prefix = next((p for p in ORCA_MAPS if name.startswith(p)), None)
        if prefix is not None:
            key = name[len(prefix):]
            if not key:
                raise ValueError(f"empty key in {name!r}")
            report.setdefault(prefix[:-1], {})[key] = number
        elif name in ORCA_FIELDS:
            report[name] = number
        else:
            raise ValueError(f"unsupported metric name {name!r}")
    return report


def test_parser_rejects_what_envoy_rejects():
    for bad in ("JSON {}", "TEXT ", "TEXT foo=1", "TEXT application_utilization=x",
                "TEXT eps=1, eps=2", "TEXT named_metrics.=1", "TEXT eps=nan"):
        with pytest.raises(ValueError):
            parse_orca_text(bad)
    assert parse_orca_text("TEXT cpu_utilization:0.7, named_metrics.foo=123") == {
        "cpu_utilization": 0.7, "named_metrics": {"foo": 123.0}}


# -- the weight formula -------------------------------------------------------------------------

def load(limit, in_use, waiting=0, queuing_demand=0.0):
    return ServerLoad(limit, in_use, waiting, 1 if queuing_demand else 0, queuing_demand, 0, 0,
                      ())


def test_weight_idle_is_100_and_falls_with_every_seat():
    assert weight_percent(load(8, 0)) == 100
    weights = [weight_percent(load(8, n)) for n in range(9)]
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == 9
    assert weight_percent(load(8, 4)) == 32  # half busy: 100 * 10 ** -0.5
    assert weight_percent(load(8, 8)) == 10  # full, nothing queued


def test_weight_keeps_falling_past_saturation_down_to_the_floor():
    full = weight_percent(load(4, 4))
    half_queue = weight_percent(load(4, 4, 2, 1.5))
    assert full > half_queue > 1
    assert weight_percent(load(4, 4, 4, 2.0)) == 1
    assert weight_percent(load(4, 4, 400, 101.0)) == 1


def test_a_queuing_level_counts_with_its_own_demand():
    # One small level full and queuing, the server mostly idle: it rejects that level next.
    rows = [_row(0, False, 2, 2, 2, 2), _row(1, False, 30, 0, 0, 0), _row(2, True, 0, 5, 0, 0)]
    s = summarize(rows)
    assert s.limit == 32 and s.seats_in_use == 2 and s.queuing_levels == 1
    assert demand(s) == 2.0 and weight_percent(s) == 1
    # exempt seats are not part of the limit
    idle = summarize([_row(0, False, 4, 0, 0, 0), _row(1, True, 0, 9, 0, 0)])
    assert weight_percent(idle) == 100


def test_no_limit_at_all():
    assert weight_percent(load(0, 0)) == 100
    assert weight_percent(load(0, 1)) == 1


def _row(index, exempt, limit, in_use, seats_waiting, waiting, dispatched=0, rejected=0):
    from apf_gunicorn.ledger import LevelLoad
    return LevelLoad(index, exempt, limit, in_use, seats_waiting, waiting, dispatched, rejected)


# -- rate, header, cache ------------------------------------------------------------------------

def test_rate_meter_windows():
    m = RateMeter(window_ns=1_000_000_000)
    assert m.observe(100, 0) == 0.0
    assert m.observe(150, 500_000_000) == 0.0  # window not complete
    assert m.observe(300, 2_000_000_000) == 100.0  # 200 over 2 s
    assert m.observe(310, 2_500_000_000) == 100.0
    assert m.observe(5, 3_000_000_000) == 100.0  # went backwards: new window
    assert m.observe(25, 4_000_000_000) == 20.0


def test_orca_text_is_parseable_and_exact():
    s = summarize([_row(0, False, 8, 2, 0, 0, 10), _row(1, False, 4, 4, 1, 1, 5),
                   _row(2, True, 0, 3, 0, 0, 7)])
    text = orca_text(s, 12.3456, {0: "workload-low", 1: "global-default", 2: "exempt"})
    report = parse_orca_text(text)
    assert report["application_utilization"] == 0.5  # 6 of 12 seats
    assert report["rps_fractional"] == 12.346
    assert report["named_metrics"] == {"workload-low_utilization": 0.25,
                                       "global-default_utilization": 1.0}


def test_orca_report_is_cached_and_survives_read_failures():
    calls = []
    rows = [_row(0, False, 4, 1, 0, 0, 0)]

    def read():
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("the buffer does not hold a valid apf_gunicorn ledger")
        return rows

    orca = OrcaReport(read, {0: "work"}, refresh_ns=100)
    base = [("X-A", "1")]
    first = orca.extend(base, 1000)
    assert base == [("X-A", "1")] and first[0] == ("X-A", "1") and first[1][0] == ORCA_HEADER
    assert parse_orca_text(first[1][1])["application_utilization"] == 0.25
    orca.extend(base, 1050)
    assert len(calls) == 1  # within refresh_ns: cached
    rows = [_row(0, False, 4, 4, 0, 0, 0)]
    assert parse_orca_text(orca.extend(base, 1100)[1][1])["application_utilization"] == 1.0
    kept = orca.extend(base, 1200)[1][1]  # the read fails: previous value kept
    assert len(calls) == 3 and parse_orca_text(kept)["application_utilization"] == 1.0
    rejected = orca.reject_headers(1201)
    assert ("x-envoy-ratelimited", "true") in rejected


# -- the ledger's lock-free read ----------------------------------------------------------------

def test_ledger_load_matches_its_snapshot():
    cap = Capacity(levels=4, queues=16, slots=32, workers=4, flow_schemas=4, stats_entries=16)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    now = 1_000_000_000
    levels, _ = led.configure([LevelSpec("work", 2, 1, 4, 3), LevelSpec("exempt", -1, 0, 0, 0)],
                              ["fs"], now)
    results = [led.admit(levels["work"], h, 1, 0, 0, 0, now + h) for h in range(6)]
    led.admit(levels["exempt"], 9, 1, 0, 0, 0, now)
    assert [r.outcome for r in results].count("rejected") == 0
    rows = {r.index: r for r in led.load()}
    for lv in led.snapshot(now + 10).levels:
        row = rows[lv.index]
        assert (row.concurrency_limit, row.seats_in_use, row.seats_waiting,
                row.requests_waiting, row.dispatched, row.rejected) == (
            lv.concurrency_limit, lv.seats_in_use, lv.seats_waiting, lv.requests_waiting,
            lv.dispatched, lv.rejected)
        assert row.exempt == (lv.desired_queues < 0)
    assert rows[levels["work"]].seats_in_use == 3 and rows[levels["work"]].requests_waiting == 3
    # only the levels asked for (unknown or unused indices skipped)
    assert [r.index for r in led.load((levels["exempt"], 3, 99, -1))] == [levels["exempt"]]


def test_ledger_load_refuses_a_clobbered_buffer():
    cap = Capacity(levels=2, queues=4, slots=4, workers=2, flow_schemas=2, stats_entries=4)
    buf = bytearray(Ledger.size(cap))
    led = Ledger.create(buf, cap, lock=NullLock())
    buf[0:8] = bytes(8)
    with pytest.raises(ValueError):
        led.load()


# -- settings -----------------------------------------------------------------------------------

def test_settings_defaults_and_values():
    s = load_settings({})
    assert (s.agent_bind, s.agent_drain_delay_s, s.load_report, s.load_report_interval_s) == (
        None, 3.0, "off", 0.1)
    assert load_settings({"APF_LOAD_REPORT_INTERVAL": "2"}).load_report_interval_s == 2.0
    s = load_settings({"APF_AGENT_BIND": "[::1]:9200", "APF_AGENT_DRAIN_DELAY": "0",
                       "APF_LOAD_REPORT": "ORCA"})
    assert (s.agent_bind, s.agent_drain_delay_s, s.load_report) == (("::1", 9200), 0.0, "orca")
    assert load_settings({"APF_AGENT_BIND": "off"}).agent_bind is None


@pytest.mark.parametrize("var,value,words", [
    ("APF_AGENT_BIND", "9200", "host:port"),
    ("APF_AGENT_BIND", "127.0.0.1:70000", "127.0.0.1:9200"),
    ("APF_AGENT_DRAIN_DELAY", "soon", "seconds from 0 to 300"),
    ("APF_AGENT_DRAIN_DELAY", "301", "seconds from 0 to 300"),
    ("APF_LOAD_REPORT", "json", "'orca'"),
    ("APF_LOAD_REPORT_INTERVAL", "0", "seconds from 0.001 to 60"),
])
def test_bad_settings_name_the_variable(var, value, words):
    with pytest.raises(SettingsError) as e:
        load_settings({var: value})
    assert var in str(e.value) and value in str(e.value) and words in str(e.value)


# -- a real server ------------------------------------------------------------------------------

@pytest.mark.server
def test_orca_headers_on_a_real_server(server_factory):
    env = {"APF_LOAD_REPORT": "orca", "APF_QUEUE_WAIT_LIMIT": "0.5"}
    with server_factory(config=str(APPS / "tight.yaml"), env=env) as srv:
        status, headers, _ = srv.request("/work?ms=1")
        assert status == 200
        report = parse_orca_text(headers[ORCA_HEADER])
        assert set(report) == {"application_utilization", "rps_fractional", "named_metrics"}
        assert set(report["named_metrics"]) >= {"work_utilization", "other_utilization"}
        assert "exempt_utilization" not in report["named_metrics"]
        # probes (exempt) went through APF too: they carry it
        assert ORCA_HEADER in srv.request("/healthz")[1]
        # "work" has 8 seats and queues 2 x 2: 16 clients of 5 s fill it and get 429s (the 4
        # queued ones after the 0.5 s wait limit)
        clients = [Client(srv.port, "/work?ms=5000", user=f"u{i}", count=1) for i in range(16)]
        for c in clients:
            c.start()
        assert srv.wait_for(lambda: srv.level("work").seats_in_use == 8, timeout=30)

        def full_report():
            # a worker's report is cached for 100 ms: ask until one shows the full level
            status, headers, _ = srv.request("/other?ms=1")
            report = parse_orca_text(headers[ORCA_HEADER])
            return report["named_metrics"]["work_utilization"] == 1.0 and report

        report = srv.wait_for(full_report, timeout=30)
        assert report, "no report showed the full level while its 8 seats were in use"
        assert 0 < report["application_utilization"] < 1
        for c in clients:
            c.join(60)
        answers = [(s, h) for c in clients for s, h in zip(c.statuses, c.headers, strict=False)]
        rejected = [h for s, h in answers if s == 429]
        assert rejected, [s for s, _ in answers]
        for h in rejected:
            assert h.get("x-envoy-ratelimited") == "true"
            parse_orca_text(h[ORCA_HEADER])
        for s, h in answers:
            if s == 200:
                assert "x-envoy-ratelimited" not in h
                parse_orca_text(h[ORCA_HEADER])


@pytest.mark.server
def test_no_orca_header_unless_asked(server_factory):
    with server_factory(workers=1, threads=4) as srv:
        status, headers, _ = srv.request("/hello")
        assert status == 200 and ORCA_HEADER not in headers
