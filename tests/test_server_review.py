"""Review of the gunicorn integration under failure: one test per bug found, each failing
before its fix (see the commit that adds it).

Unit tests drive the hooks with small stand-ins for gunicorn's ``Arbiter`` and ``Worker`` and a
real ledger in a bytearray; the others run a real gunicorn on 127.0.0.1 (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import time
import types

import pytest

from apf_gunicorn.gthread.worker import ApfThreadWorker
from apf_gunicorn.ledger.layout import Capacity
from apf_gunicorn.ledger.ledger import Ledger
from apf_gunicorn.ledger.lock import ProcessLock
from apf_gunicorn.master import hooks
from apf_gunicorn.master.master import MasterServices
from apf_gunicorn.server import state
from tests.conftest import children


@pytest.fixture
def master(monkeypatch):
    """A MasterState over an in-memory ledger, installed as ``state.MASTER``."""
    cap = Capacity(levels=4, queues=16, slots=32, workers=8, flow_schemas=8, stats_entries=16)
    ledger = Ledger.create(mmap.mmap(-1, Ledger.size(cap)), cap, lock=ProcessLock(),
                           owner_pid=os.getpid())
    m = state.MasterState(settings=None, token="review", segment=None, ledger=ledger,
                          capacity=cap, resolver=None, generation=None, master_pid=os.getpid())
    monkeypatch.setattr(state, "MASTER", m)
    return m


def _server():
    """gunicorn's Arbiter as the hooks see it: a log, the worker class, a config without TLS."""
    return types.SimpleNamespace(log=logging.getLogger("test.review"),
                                 worker_class=ApfThreadWorker,
                                 cfg=types.SimpleNamespace(is_ssl=False))


def _fork(server, pid):
    """What gunicorn does around a fork, seen from the master: pre_fork, then the pid."""
    worker = types.SimpleNamespace(pid="[booting]", age=1)
    hooks.pre_fork(server, worker)
    worker.pid = pid
    return worker


def test_index_of_a_restarted_worker_is_freed_even_if_refresh_ran_while_it_booted(master):
    """max_requests / SIGKILL restarts: the replacement worker reuses the dead worker's index.
    The master's 1 s refresh must not copy the *dead* worker's pid (still in the ledger's worker
    table, state GONE) onto the booting replacement: child_exit would then never free the
    index, and every such restart would leak one index until the ledger's worker table
    (256 entries) overflows."""
    server = _server()
    services = MasterServices(master, server.log)
    now = time.monotonic_ns()

    first = _fork(server, 1001)
    assert first.apf_index == 0
    master.ledger.register_worker(0, 1001, now)
    hooks.child_exit(server, first)  # dies (max_requests); the ledger marks index 0 GONE

    second = _fork(server, 1002)
    assert second.apf_index == 0
    services.refresh_workers()  # the master's tick while the replacement loads the app
    assert master.workers[0] in (0, 1002)
    hooks.child_exit(server, second)  # dies before (or after) registering

    third = _fork(server, 1003)
    assert third.apf_index == 0, f"index leaked: workers table {master.workers}"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.server
def test_a_process_the_app_forked_does_not_keep_the_grant_socket_from_the_next_worker(
        server_factory):
    """An app that forks (multiprocessing's default on Linux) gave the child the worker's grant
    socket. After the worker died, the child still held the abstract name, the replacement
    worker's bind failed with EADDRINUSE in post_worker_init, and gunicorn halted the whole
    server ("Worker failed to boot")."""
    import json

    with server_factory(workers=1, threads=4) as srv:
        status, _, body = srv.request("/fork?s=30")
        assert status == 200
        info = json.loads(body)
        try:
            _kill(info["pid"])  # the worker dies (OOM killer, timeout kill ...)
            new = srv.wait_for(lambda: [p for p in srv.workers()
                                        if p not in (info["pid"], info["child"])], 30)
            assert srv.proc.poll() is None, f"gunicorn halted:\n{srv.log()}"
            assert new, f"no replacement worker:\n{srv.log()}"

            def serves():
                try:
                    return srv.request("/hello", timeout=2)[0] == 200
                except OSError:
                    return False
            assert srv.wait_for(serves, 30), srv.log()
            assert srv.proc.poll() is None, f"gunicorn halted:\n{srv.log()}"
        finally:
            _kill(info["child"])


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.server
def test_admin_endpoint_comes_back_in_the_new_master_after_a_usr2_upgrade(server_factory,
                                                                          tmp_path):
    """USR2: the new master finds the admin port held by the old one and runs without it. Once
    the operator stops the old master (the end of every upgrade), /metrics must come back: the
    new master has to bind the port when it frees up, not stay without an endpoint for life."""
    import http.client

    from tests.conftest import free_port

    aport = free_port()
    pidfile = tmp_path / "gunicorn.pid"

    def admin_ok() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", aport, timeout=2)
            try:
                conn.request("GET", "/healthz")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        except OSError:
            return False

    with server_factory(workers=1, threads=4, env={"APF_ADMIN_BIND": f"127.0.0.1:{aport}"},
                        args=("--pid", str(pidfile))) as srv:
        assert srv.wait_for(admin_ok, 30)
        old = srv.pid
        os.kill(old, signal.SIGUSR2)

        def new_master():
            for path in (pidfile, tmp_path / "gunicorn.pid.2"):  # gunicorn names it either way
                try:
                    pid = int(path.read_text().strip() or 0)
                except (OSError, ValueError):
                    continue
                if pid and pid != old:
                    return pid
            return 0
        new = srv.wait_for(new_master, 60)
        try:
            assert new, srv.log()
            def new_serves():
                try:
                    srv.request("/hello", timeout=2)
                except OSError:
                    return False
                return any(children(c) == [] for c in children(new))  # a worker of the new master
            assert srv.wait_for(new_serves, 60), srv.log()
            os.kill(old, signal.SIGTERM)  # the operator ends the upgrade
            srv.proc.wait(timeout=20)
            assert srv.wait_for(admin_ok, 30), f"no admin endpoint after the upgrade:\n{srv.log()}"
        finally:
            if new:
                _kill_master(new)


def _kill_master(pid: int) -> None:
    """TERM a master that is not our child and wait until it is gone (it unlinks its segment)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _pid_gone(pid):
        time.sleep(0.1)
    if not _pid_gone(pid):
        _kill(pid)


def test_grant_socket_names_of_two_servers_never_collide():
    """Two servers on one host, instances ``a`` (master pid 1234) and ``a1`` (master pid 234),
    got the same token ``a1234``: the second server's workers failed to bind their grant
    sockets (the server halts) or, bound first, received the other server's grants."""
    from apf_gunicorn.admission.channel import address, grant_token

    pairs = [("a", 1234), ("a1", 234), ("", 11234), ("1", 1234), ("g", 1234), ("a_1", 234),
             ("a", 1234_0), ("a-1", 234)]
    names = {address(grant_token(inst, pid), 0, 1) for inst, pid in pairs}
    assert len(names) == len(pairs)


def test_dispatcher_survives_a_failing_delivery():
    """One unexpected exception in the dispatcher loop (here: sending the grants a lock repair
    left behind fails) ended the thread for good: no more cross-worker grants, no backstop
    scan, no lingering-seat releases, so every later parked request waited out its limit and
    the lingering seats were never returned."""
    from apf_gunicorn.admission.channel import GrantInbox, GrantSender
    from apf_gunicorn.admission.dispatcher import GRANTED, Dispatcher, Parking

    class Ledger:
        pending_grants = [(3, 1, 1)]

        def owned_slots(self, owner):
            return []

    calls = []

    def deliver(granted):
        calls.append(list(granted))
        if len(calls) == 1:
            raise OSError(1, "Operation not permitted")

    token = f"review{os.getpid()}"
    inbox = GrantInbox(token, 0)
    parking = Parking()
    d = Dispatcher(parking, inbox, Ledger(), owner=0, deliver=deliver, alive=lambda: True)
    d.start()
    sender = GrantSender(token, {0: inbox.name}.get)
    try:
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        # (the failing delivery raises right after it is recorded: a thread it killed is dead
        # before it could read the grant below)
        assert calls, "the dispatcher never ticked"
        w = parking.park(4, 2)
        sender.send(0, [[4, 2]])
        assert w.event.wait(30) and w.outcome == GRANTED, "the dispatcher thread died"
        parking.unpark(w)
    finally:
        d.stop()
        d.join(2)
        sender.close()
        inbox.close()


def test_worker_indices_beyond_the_ledger_worker_table_are_not_handed_out(master):
    """pre_fork handed out index N >= Capacity.workers (e.g. -w 200 then HUP: 400 live
    indices for 256 entries); register_worker/reap_worker then wrote past the worker table
    into the stats table of the shared ledger, silently corrupting the counters."""
    server = _server()
    cap = master.capacity.workers
    forked = [_fork(server, 2000 + i) for i in range(cap)]
    assert [w.apf_index for w in forked] == list(range(cap))
    extra = _fork(server, 3000)
    assert extra.apf_index is None  # this worker serves without APF (logged), nothing corrupted
    hooks.child_exit(server, extra)  # and its exit is harmless
    hooks.child_exit(server, forked[3])
    assert _fork(server, 3001).apf_index == 3


@pytest.mark.server
def test_a_configuration_larger_than_the_ledger_fails_start_cleanly(server_factory, tmp_path):
    """A valid configuration with more priority levels than the ledger holds (64): the ledger's
    ValueError escaped on_starting after the segment was created, so gunicorn died with a
    traceback instead of an "apf:" error, and /dev/shm kept the segment."""
    docs = []
    for i in range(70):
        docs.append(f"""apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {{name: pl{i}}}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 10
    limitResponse: {{type: Reject}}
""")
    cfg = tmp_path / "many.yaml"
    cfg.write_text("---\n".join(docs))
    with server_factory(workers=1, threads=4, config=str(cfg), expect_fail=True,
                        boot_timeout=20) as srv:
        assert srv.proc.returncode not in (0, None)
        log = srv.log()
        assert srv.shm_entries() == [], "segment left in /dev/shm"
        assert "apf: " in log and "Traceback" not in log, log


def test_index_is_freed_when_a_restart_happens_during_the_refresh(master, monkeypatch):
    """The same leak through a narrower window: the master thread read the worker table (the
    old worker still ALIVE), then the main thread reaped that worker and forked its
    replacement on the same index, then the refresh copied the old pid onto the replacement.
    child_exit must free an index by which worker holds it, not by a pid learned on the side."""
    server = _server()
    services = MasterServices(master, server.log)
    now = time.monotonic_ns()
    first = _fork(server, 1001)
    master.ledger.register_worker(0, 1001, now)
    forked = []
    real = master.ledger.workers

    def workers_then_restart():
        table = real()
        hooks.child_exit(server, first)  # the main thread runs while this thread is here
        forked.append(_fork(server, 1002))
        return table

    monkeypatch.setattr(master.ledger, "workers", workers_then_restart)
    services.refresh_workers()
    monkeypatch.setattr(master.ledger, "workers", real)
    second = forked[0]
    assert second.apf_index == 0
    hooks.child_exit(server, second)
    assert _fork(server, 1003).apf_index == 0, f"index leaked: {master.workers}"
    hooks.child_exit(server, first)  # a late duplicate for the old worker frees nothing
    assert _fork(server, 1004).apf_index == 1, "the live worker's index was freed"


def test_refresh_does_not_bring_back_an_index_child_exit_just_freed(master):
    """refresh_workers iterated a copy of the index table and wrote pids back into it; a worker
    reaped by the main thread in between (its index popped) came back with its dead pid, and
    nothing would ever free that index again."""
    server = _server()
    services = MasterServices(master, server.log)
    worker = _fork(server, 1001)
    master.ledger.register_worker(0, 1001, time.monotonic_ns())

    class Racing(dict):
        def items(self):
            snapshot = list(super().items())
            hooks.child_exit(server, worker)  # the main thread reaps it right after the copy
            return snapshot

    master.workers = Racing(master.workers)
    services.refresh_workers()
    assert 0 not in master.workers, f"index resurrected: {dict(master.workers)}"


@pytest.mark.server
def test_max_requests_restarts_reuse_worker_indices_on_real_gunicorn(server_factory):
    """End to end for the index leak: a worker restarted by max_requests again and again must
    keep getting index 0 (one worker), whatever the master's 1 s refresh saw while it booted."""
    with server_factory(workers=1, threads=4, args=("--max-requests", "2")) as srv:
        for restart in range(12):
            before = srv.workers()

            def restarted(b=before):
                # requests until the worker reached its max_requests and was replaced
                if not (srv.workers() and srv.workers() != b):
                    with contextlib.suppress(OSError):
                        srv.request("/hello", timeout=5)
                return srv.workers() and srv.workers() != b

            assert srv.wait_for(restarted, 60), f"restart {restart} did not happen:\n{srv.log()}"
            # spacing, not a wait: the master's 1 s refresh ticks land at varying points of
            # the workers' boots
            time.sleep(0.4)
        owners = sorted(o for o, _pid, st, _hb in _ledger_workers(srv) if st == 1)
        indices = sorted(o for o, _pid, _st, _hb in _ledger_workers(srv))
        assert owners and max(indices) <= 1, f"indices in use grew to {indices}:\n{srv.log()}"


def _ledger_workers(srv):
    import mmap as _mmap

    import posix_ipc

    from apf_gunicorn.server import shm

    name = shm.segment_name(srv.instance, srv.pid)
    mem = posix_ipc.SharedMemory("/" + name)
    mm = _mmap.mmap(mem.fd, mem.size)
    mem.close_fd()
    view = memoryview(mm)[shm.HEADER_SIZE:]
    led = Ledger.attach(view, lock=ProcessLock())
    try:
        return led.workers()
    finally:
        led.close()
        view.release()
        mm.close()


def test_a_worker_that_never_boots_stops_counting_as_having_room(master, monkeypatch):
    """A booting worker counts as having room (so the others do not turn requests away for
    threads it is about to bring); one stuck before registering stops counting after
    BOOT_ROOM_S, so the others accept on their exempt reserve again."""
    from apf_gunicorn.master import master as master_mod

    server = _server()
    services = MasterServices(master, server.log)
    stuck = _fork(server, 2001)
    ok = _fork(server, 2002)
    master.ledger.register_worker(ok.apf_index, 2002, time.monotonic_ns())
    services.refresh_workers()
    assert master.ledger.other_worker_has_room(ok.apf_index)  # the booting one, for now
    assert list(master.booting) == [stuck.apf_index]
    monkeypatch.setattr(master_mod, "BOOT_ROOM_S", 0.0)
    services.refresh_workers()
    assert not master.ledger.other_worker_has_room(ok.apf_index)
    assert master.booting == {}
