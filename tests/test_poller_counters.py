"""The poller's settings and counters: APF_HEAD_CONNECTIONS and APF_HEAD_BUFFER_LIMIT as the
settings loader reads them, and connections dropped counted in the ledger's server counters,
exported as ``apf_connections_dropped_total{reason}``."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from apf_gunicorn.flowcontrol.borrowing import BorrowingStates
from apf_gunicorn.master.metrics import LedgerCollector, MasterView
from apf_gunicorn.server.settings import (
    DEFAULT_HEAD_BUFFER_LIMIT,
    DEFAULT_HEAD_CONNECTIONS,
    SettingsError,
    load_settings,
)
from tests.test_ledger_stats import make
from tests.test_metrics import SnapLedger, _k, _scrape


def test_head_settings_defaults_and_values():
    s = load_settings({})
    assert s.head_connections == DEFAULT_HEAD_CONNECTIONS == 512
    assert s.head_buffer_limit == DEFAULT_HEAD_BUFFER_LIMIT == 16 << 20
    s = load_settings({"APF_HEAD_CONNECTIONS": "20", "APF_HEAD_BUFFER_LIMIT": "4MiB"})
    assert (s.head_connections, s.head_buffer_limit) == (20, 4 << 20)
    for raw, n in (("500k", 500_000), ("1048576", 1 << 20), ("2 MB", 2_000_000)):
        assert load_settings({"APF_HEAD_BUFFER_LIMIT": raw}).head_buffer_limit == n


@pytest.mark.parametrize("var,value", [
    ("APF_HEAD_CONNECTIONS", "0"), ("APF_HEAD_CONNECTIONS", "x"),
    ("APF_HEAD_BUFFER_LIMIT", "1k"), ("APF_HEAD_BUFFER_LIMIT", "1.5M"),
    ("APF_HEAD_BUFFER_LIMIT", "16 parsecs"),
])
def test_bad_head_settings_say_what_is_allowed(var, value):
    with pytest.raises(SettingsError, match=var):
        load_settings({var: value})


def test_dropped_connections_are_counted_server_wide_by_reason():
    led, _, _ = make()
    assert led.connections_dropped == {"head-connections": 0, "head-buffer": 0}
    led.count_connection_dropped("head-connections")
    led.count_connection_dropped("head-buffer")
    led.count_connection_dropped("head-buffer")
    assert led.connections_dropped == {"head-connections": 1, "head-buffer": 2}
    assert led.snapshot(0).connections_dropped == led.connections_dropped
    assert led.head_timeouts == 0  # a word of its own
    with pytest.raises(ValueError, match="unknown reason"):
        led.count_connection_dropped("bored")


def test_dropped_connections_are_exported_by_reason():
    snap = NS(now=0, head_timeouts=0, flow_schema_names=[], levels=[],
              connections_dropped={"head-connections": 5, "head-buffer": 2})
    view = MasterView(ledger=SnapLedger(snap), level_limits={}, borrowing=BorrowingStates(),
                      workers=1)
    got = _scrape(LedgerCollector("apf", lambda: view))
    assert got[_k("apf_connections_dropped_total", reason="head-connections")] == 5
    assert got[_k("apf_connections_dropped_total", reason="head-buffer")] == 2
