"""Shared fixtures: a real gunicorn with apf_gunicorn's conf on a free 127.0.0.1 port.

``serve(...)`` starts ``gunicorn -c python:apf_gunicorn.conf tests.apps.app:app`` in its own
session, waits until it answers, yields a :class:`Server`, and always stops it (TERM, then KILL
of the whole process group) and checks that no ``/dev/shm`` entry of that server is left.
"""

from __future__ import annotations

import contextlib
import http.client
import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import posix_ipc
import pytest

from apf_gunicorn.ledger import Capacity, Ledger, ProcessLock
from tests.apps.procs import children, free_port  # noqa: F401 - tests import these from here

ROOT = Path(__file__).resolve().parent.parent
APPS = Path(__file__).resolve().parent / "apps"
GUNICORN = str(Path(sys.executable).parent / "gunicorn")


class Server:
    def __init__(self, proc, port, instance, log_path, counter_path):
        self.proc = proc
        self.port = port
        self.instance = instance
        self.log_path = log_path
        self.counter_path = counter_path
        self.tls = None  # an ssl.SSLContext for request() when the server serves TLS

    @property
    def pid(self) -> int:
        return self.proc.pid

    def workers(self) -> list[int]:
        return children(self.pid)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def shm_entries(self) -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"apf_{self.instance}_")]

    def request(self, path: str, headers: dict | None = None, timeout: float = 30.0,
                method: str = "GET"):
        """(status, headers dict, body bytes) of one request on a fresh connection."""
        conn = (http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
                if self.tls is None else
                http.client.HTTPSConnection("127.0.0.1", self.port, timeout=timeout,
                                            context=self.tls))
        try:
            conn.request(method, path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def counters(self) -> dict:
        from tests.apps.app import read_counters
        return read_counters(self.counter_path)

    def reset_counters(self) -> None:
        with open(self.counter_path, "r+b") as f:
            f.write(bytes(256))

    @contextlib.contextmanager
    def attached_ledger(self):
        """The server's ledger, attached from its shared memory (with the ledger's own lock),
        for the duration of the ``with`` block."""
        import mmap

        import posix_ipc

        from apf_gunicorn.ledger.ledger import Ledger
        from apf_gunicorn.ledger.lock import ProcessLock
        from apf_gunicorn.server import shm

        name = shm.segment_name(self.instance, self.pid)
        mem = posix_ipc.SharedMemory("/" + name)
        mm = mmap.mmap(mem.fd, mem.size)
        mem.close_fd()
        view = memoryview(mm)[shm.HEADER_SIZE:]
        led = Ledger.attach(view, lock=ProcessLock())
        try:
            yield led
        finally:
            led.close()
            view.release()
            mm.close()

    def ledger_snapshot(self):
        """A snapshot of the server's ledger, read from its shared memory."""
        with self.attached_ledger() as led:
            return led.snapshot(time.monotonic_ns())

    def ledger_repairs(self) -> int:
        """How many times a locker found the ledger lock's holder dead (or the ledger dirty)
        and repaired it: the ledger header's repair count."""
        from apf_gunicorn.ledger import layout as L
        with self.attached_ledger() as led:
            return int(led.repair_view().w[L.H_REPAIRS])

    def level(self, name: str):
        return next(lv for lv in self.ledger_snapshot().levels if lv.name == name)

    def idle(self, timeout: float = 30.0):
        """Wait until no level has seats in use or requests waiting; returns the snapshot."""
        def check():
            snap = self.ledger_snapshot()
            busy = [lv for lv in snap.levels if lv.seats_in_use or lv.requests_waiting
                    or lv.requests_executing]
            return None if busy else snap
        return self.wait_for(check, timeout)

    def wait_for_answers(self, clients, more: int = 20, timeout: float = 60.0) -> bool:
        """Wait until ``clients`` (``tests.apps.loadgen.Client``) got ``more`` answers than they
        have now: the server is serving them (under load, between a kill or reload and the
        next step). Returns whether they did within ``timeout``."""
        def answers() -> int:
            return sum(len(c.statuses) for c in clients)

        seen = answers()
        return bool(self.wait_for(lambda: answers() >= seen + more, timeout))

    def wait_for(self, predicate, timeout: float = 30.0, step: float = 0.05):
        """``predicate()``'s first truthy value, polled every ``step`` s; its last value (falsy)
        once ``timeout`` s have passed. The caller checks the result. The default deadline is
        generous: a loaded machine is slow, and a condition met returns at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(step)
        return predicate()


@contextlib.contextmanager
def serve(tmp_path, *, workers: int = 2, threads: int = 8, env: dict | None = None,
          args: tuple = (), config: str | None = None, ready_path: str = "/healthz",
          boot_timeout: float = 30.0, expect_fail: bool = False,
          conf: tuple = ("-c", "python:apf_gunicorn.conf"), worker: str | None = None,
          app: str | None = None):
    """``conf=("-k", "gthread", "--no-control-socket")`` runs the app without APF.
    ``worker``: an ASGI worker class (``-k``, e.g. ``apf_gunicorn.asgi.UvicornWorker``), which
    serves tests/apps/asgi_app.py (the same routes, async) instead; ``threads`` is then unused.
    ``config=""`` leaves ``APF_CONFIG`` unset (the built-in configuration); ``app``: what
    gunicorn serves, if not the test app of the worker's kind."""
    port = free_port()
    instance = (env or {}).get("APF_INSTANCE") or "t" + uuid.uuid4().hex[:10]
    log_path = tmp_path / f"gunicorn-{instance}.log"
    counter_path = tmp_path / f"counter-{instance}.bin"
    counter_path.write_bytes(bytes(256))
    full_env = dict(os.environ)
    full_env.update({
        "APF_INSTANCE": instance,
        "APF_ADMIN_BIND": "off",
        "APF_CONFIG": str(APPS / "apf.yaml") if config is None else config,
        "APF_CONCURRENCY_LIMIT": "16",
        "APF_TRUSTED_PROXIES": "127.0.0.1",
        "APP_COUNTER": str(counter_path),
        "PYTHONPATH": str(ROOT),
    })
    if config == "":
        del full_env["APF_CONFIG"]
    full_env.update(env or {})
    kind = ("-k", worker) if worker else ("--threads", str(threads))
    app = app or ("tests.apps.asgi_app:app" if worker else "tests.apps.app:app")
    cmd = [GUNICORN, *conf, *kind, "-w", str(workers), "-b", f"127.0.0.1:{port}",
           "--graceful-timeout", "5", "--log-level", "info", *args, app]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=full_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    server = Server(proc, port, instance, log_path, counter_path)
    if "--certfile" in args:  # (a test's self-signed certificate: tests/apps/tlsclient.py)
        from tests.apps.tlsclient import client_context
        server.tls = client_context()
    try:
        if expect_fail:
            proc.wait(timeout=boot_timeout)
            yield server
            return
        deadline = time.monotonic() + boot_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited {proc.returncode}:\n{server.log()}")
            try:
                # Wait for the answer as long as the boot may take: a probe given up on while no
                # worker has accepted it yet stays in the listen backlog and is served (and
                # counted, in the exempt level) later, behind the back of a test that took its
                # baseline after the probe that was answered.
                status, _, _ = server.request(ready_path,
                                              timeout=max(0.5, deadline - time.monotonic()))
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn did not answer in {boot_timeout}s:\n{server.log()}")
            time.sleep(0.1)
        # The first answer can come before the master forked the other workers (gunicorn sleeps
        # up to 100 ms between spawns, longer on a loaded machine): a test that acts on "the
        # workers" (kills them, counts them) must see them all.
        if not server.wait_for(lambda: len(server.workers()) >= workers,
                               max(1.0, deadline - time.monotonic())):
            raise RuntimeError(f"gunicorn forked {len(server.workers())} of {workers} workers "
                               f"in {boot_timeout}s:\n{server.log()}")
        yield server
    finally:
        stop(proc)
        log.close()
        leftovers = server.shm_entries()
        for name in leftovers:
            import posix_ipc
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory("/" + name)
        if leftovers and not expect_fail:
            pytest.fail(f"/dev/shm entries left behind: {leftovers}")


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    # Whatever is left of the group (workers of a killed master): kill it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@pytest.fixture
def server_factory(tmp_path):
    """``with server_factory(workers=4, threads=16) as srv: ...``"""
    return lambda **kw: serve(tmp_path, **kw)


#: the capacity of :func:`shm_ledger`'s ledger
SHM_CAP = Capacity(levels=2, queues=16, slots=64, workers=4, flow_schemas=2, detail_bytes=8)


@pytest.fixture
def shm_ledger():
    """A ledger with a ProcessLock on real POSIX shared memory: ``(ledger, mmap)``."""
    name = f"/apf_test_lock_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    size = Ledger.size(SHM_CAP)
    seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    mm = mmap.mmap(seg.fd, size)
    seg.close_fd()
    led = Ledger.create(mm, SHM_CAP, lock=ProcessLock())
    try:
        yield led, mm
    finally:
        try:  # (a failed test can leave the mapping busy: unlink the segment anyway)
            led.close()
            mm.close()
        finally:
            posix_ipc.unlink_shared_memory(name)
    assert not os.path.exists(f"/dev/shm{name}")
