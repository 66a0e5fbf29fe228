"""A HUP between the master thread's read of the generation and its use (issue 25, item 12).

``on_reload`` replaces ``MasterState.generation`` and reconfigures the ledger under the
master's service lock; the borrowing round and the adaptive tick must read the generation
under that lock too, or a reload in between has the old levels' limits applied to the new
ledger. The reload is driven deterministically: a lock that runs the real ``on_reload`` (as
if the main thread took the lock first) when the master thread is about to acquire it.
"""

from __future__ import annotations

import shutil
import threading
from types import SimpleNamespace

from apf_gunicorn.flowcontrol.limits import compute_limits
from apf_gunicorn.flowcontrol.loader import builtin_path
from apf_gunicorn.ledger import Capacity, Ledger
from apf_gunicorn.ledger.lock import NullLock
from apf_gunicorn.master import hooks, master
from apf_gunicorn.master import reload as master_reload
from apf_gunicorn.master.autolimit import ServerAutoLimit
from apf_gunicorn.server import state
from apf_gunicorn.server.generation import configure_ledger, load_generation
from apf_gunicorn.server.resolver import build_resolver
from apf_gunicorn.server.settings import load_settings

S = 1_000_000_000

EXTRA_LEVEL = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata:
  name: extra
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 50
    limitResponse:
      type: Reject
"""


class RunOnAcquire:
    """A lock that, on its ``at``-th acquisition, first lets a HUP run (``reload``), as if the
    main thread had taken the lock just before the master thread."""

    def __init__(self, reload, at: int) -> None:
        self._lock = threading.Lock()
        self._reload = reload
        self._at = at
        self.acquired = 0

    def __enter__(self):
        self.acquired += 1
        if self.acquired == self._at:
            self._reload()
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def _add(self, msg, *args, **_kw) -> None:
        self.lines.append(msg % args if args else msg)

    info = warning = error = debug = exception = _add


def running_master(tmp_path, monkeypatch, limit: str):
    """A master state on a bytearray ledger, configured from a copy of the webapp set, and a
    ``reload()`` that adds a level to that directory and runs the real ``on_reload``."""
    config = tmp_path / "apf"
    shutil.copytree(builtin_path("webapp"), config)
    monkeypatch.setenv("APF_CONFIG", str(config))
    settings = load_settings({"APF_CONFIG": str(config), "APF_CONCURRENCY_LIMIT": limit},
                             workers=2, threads=80)
    gen = load_generation(settings)
    cap = Capacity()
    ledger = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    configure_ledger(ledger, gen, 1)
    m = SimpleNamespace(ledger=ledger, generation=gen, settings=settings, borrowing_states=None,
                        sender=None, reload_errors=0, reloads={}, restart_digest="",
                        threads=80, holds_threads=True,
                        resolver=build_resolver(settings, gen.configuration))
    monkeypatch.setattr(state, "MASTER", m)
    log = Log()
    server = SimpleNamespace(log=log, cfg=SimpleNamespace(workers=2, threads=80))

    def reload() -> None:
        (config / "extra.yaml").write_text(EXTRA_LEVEL)
        hooks.on_reload(server)
        assert m.generation.number == 2 and "extra" in m.generation.level_index, log.lines

    return m, reload


def test_a_reload_before_the_borrowing_round_takes_the_lock_is_what_it_applies(
        tmp_path, monkeypatch) -> None:
    m, reload = running_master(tmp_path, monkeypatch, "20")
    lock = RunOnAcquire(reload, at=1)
    monkeypatch.setattr(master, "SERVICE_LOCK", lock)
    services = master.MasterServices(m, Log())
    services.borrow_once()
    assert lock.acquired == 1 and services.rounds == 1
    # the round ran on the new generation: every level it holds, the new one too
    assert set(m.borrowing_states) == set(m.generation.level_index)
    extra = m.ledger.load(levels=(m.generation.level_index["extra"],))[0]
    assert extra.concurrency_limit == m.borrowing_states["extra"].current_limit


def test_a_reload_between_the_adaptive_tick_reading_and_applying_is_what_it_applies(
        tmp_path, monkeypatch) -> None:
    m, reload = running_master(tmp_path, monkeypatch, "auto:2-24")
    old = m.settings.concurrency_limit
    # the controller starts below the running limit: its first tick applies 12 seats
    auto = ServerAutoLimit(m.settings.concurrency_auto, 12, clock=lambda: 10 * S)
    lock = RunOnAcquire(reload, at=2)  # 1: reading the statistics; 2: applying the limit
    assert auto.tick(m, lock) == (old, 12)
    assert lock.acquired == 2
    gen = m.generation
    # the new generation's levels follow the new limit, the new level too
    expected = compute_limits(gen.configuration.priority_levels.values(), 12)
    assert {n: lim.nominal for n, lim in gen.limits.items()} == \
        {n: lim.nominal for n, lim in expected.items()}
    assert set(m.borrowing_states) == set(gen.level_index)
    for name, index in gen.level_index.items():
        load = m.ledger.load(levels=(index,))[0]
        if not load.exempt:
            assert load.concurrency_limit == m.borrowing_states[name].current_limit, name


def test_an_adaptive_tick_while_a_reload_loads_its_files_keeps_its_limit(
        tmp_path, monkeypatch) -> None:
    # on_reload reads the settings, loads the files, then takes the lock: a tick that moves
    # the limit in between (it took the lock first) must not be undone by the reload.
    m, reload = running_master(tmp_path, monkeypatch, "auto:2-24")
    old = m.settings.concurrency_limit
    auto = ServerAutoLimit(m.settings.concurrency_auto, 12, clock=lambda: 10 * S)
    ticks = []
    master_lock = threading.Lock()
    lock = RunOnAcquire(lambda: ticks.append(auto.tick(m, master_lock)), at=1)
    monkeypatch.setattr(master_reload, "SERVICE_LOCK", lock)  # the lock the reload takes
    reload()
    assert ticks == [(old, 12)] and lock.acquired == 1
    assert m.settings.concurrency_limit == 12
    gen = m.generation
    expected = compute_limits(gen.configuration.priority_levels.values(), 12)
    assert {n: lim.nominal for n, lim in gen.limits.items()} == \
        {n: lim.nominal for n, lim in expected.items()}
    for name, index in gen.level_index.items():
        load = m.ledger.load(levels=(index,))[0]
        if not load.exempt:
            assert load.concurrency_limit == expected[name].nominal, name
    # the next tick has nothing to put back
    assert auto.tick(m, master_lock) is None
