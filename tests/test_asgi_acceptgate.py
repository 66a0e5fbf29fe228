"""The ASGI workers' accept gate (apf_gunicorn/asgi/acceptgate.py) on real servers: a burst of
connects is split evenly over the workers, and a worker that does not accept does not hold
the others' connections back. Plus the ledger's connection counts it reads."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest

from apf_gunicorn.ledger import layout as L
from tests.test_asgi_server import WORKERS, serve_asgi

N = 16  # connections in the burst
SLOW_MS = 2000  # each holds a request this long: every connection is open at once


@pytest.fixture(params=WORKERS, ids=["uvicorn", "gunicorn-asgi"])
def worker_class(request) -> str:
    if request.param.endswith("UvicornWorker"):
        pytest.importorskip("uvicorn_worker")
    return request.param


def _published(srv) -> list[int]:
    """The connection counts the live workers published (the ledger's W_CONNS words, 1 + the
    count; 0: not taking part)."""
    with srv.attached_ledger() as led:
        lay = led._lay
        base = lay.worker_base + L.W_CONNS
        words = led._w[base: base + lay.cap.workers * L.WORKER_WORDS: L.WORKER_WORDS].tolist()
    return [w - 1 for w in words if w]


def _read_pid(sock: socket.socket) -> int:
    answer = b""
    while b"pid=" not in answer or not answer.endswith(b"\n"):
        chunk = sock.recv(4096)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    return int(re.search(rb"pid=(\d+)", answer).group(1))


def _gates_up(srv, workers: int):
    return srv.wait_for(lambda: len(_published(srv)) == workers, 60)


@pytest.mark.server
@pytest.mark.slow
def test_a_burst_of_connections_is_split_evenly_over_the_asgi_workers(tmp_path, worker_class):
    """asyncio's server accepts every pending connection at each wake-up, so a burst of
    connects lands in the worker that woke first (and its kept-alive requests stay there).
    The burst is queued while both workers are stopped, so whichever runs first finds all of
    it; with the gate each worker takes about half."""
    env = {"APF_CONCURRENCY_LIMIT": "64"}  # every request of the burst runs at once
    with serve_asgi(tmp_path, worker_class, workers=2, env=env) as srv:
        pids = srv.workers()
        assert len(pids) == 2
        assert _gates_up(srv, 2), (_published(srv), srv.log()[-2000:])
        socks = []
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            for _ in range(N):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
                s.sendall(f"GET /work?ms={SLOW_MS} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                socks.append(s)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        try:
            # every connection open at once, then counted where it landed
            split = srv.wait_for(lambda: sorted(_published(srv)) if sum(_published(srv)) == N
                                 else None, 60)
            served = [_read_pid(s) for s in socks]
        finally:
            for s in socks:
                s.close()
        per_worker = sorted(served.count(pid) for pid in pids)
        assert sum(per_worker) == N
        assert split == per_worker, (split, per_worker)
        assert abs(per_worker[0] - N // 2) <= 2, per_worker


@pytest.mark.server
@pytest.mark.slow
def test_a_worker_that_does_not_accept_holds_no_connection_back(tmp_path):
    """The gate keeps a worker with more connections from accepting while another has fewer;
    if that other one does not accept (its loop blocked, here stopped), the first accepts
    anyway once the backlog has waited MAX_DEFER_S: every connection is served."""
    worker = WORKERS[0] if importlib_has("uvicorn_worker") else WORKERS[1]
    # (kept-alive connections stay open: a keep-alive timeout would free the running worker's
    # room without the gate's help)
    with serve_asgi(tmp_path, worker, workers=2, args=("--keep-alive", "60")) as srv:
        pids = srv.workers()
        assert _gates_up(srv, 2), (_published(srv), srv.log()[-2000:])
        stopped = pids[1]
        os.kill(stopped, signal.SIGSTOP)
        socks = []
        try:
            # each connection kept open: the running worker holds 1, 2, 3 ... while the
            # stopped one published 0
            for _ in range(4):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
                socks.append(s)
                s.sendall(b"GET /work?ms=1 HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_pid(s) == pids[0]
            assert sorted(_published(srv)) == [0, 4], _published(srv)
        finally:
            os.kill(stopped, signal.SIGCONT)
            for s in socks:
                s.close()


def importlib_has(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def test_the_ledger_says_the_fewest_connections_of_the_other_workers(shm_ledger):
    led, _mm = shm_ledger
    assert led.fewest_connections_elsewhere(0) is None  # nobody takes part
    led.set_worker_connections(0, 5)
    assert led.fewest_connections_elsewhere(0) is None  # only itself
    assert led.fewest_connections_elsewhere(1) == 5
    led.set_worker_connections(1, 0)
    led.set_worker_connections(2, 3)
    assert led.fewest_connections_elsewhere(0) == 0
    assert led.fewest_connections_elsewhere(1) == 3
    led.set_worker_connections(1, None)  # stopped: no longer counted
    assert led.fewest_connections_elsewhere(0) == 3
    led.register_worker(2, os.getpid(), time.monotonic_ns())
    led.reap_worker(2, time.monotonic_ns())
    assert led.fewest_connections_elsewhere(0) is None  # a reaped worker's count is cleared


@pytest.mark.server
@pytest.mark.slow
def test_the_gate_serves_tls_with_the_servers_context(tmp_path, worker_class):
    """The gate hands each accepted socket to the loop with the server's TLS context: a TLS
    request is answered (and a plain-text one is not served as HTTP)."""
    from tests.apps.tlsclient import make_cert

    certfile, keyfile = make_cert(tmp_path)
    with serve_asgi(tmp_path, worker_class, workers=1,
                    args=("--certfile", certfile, "--keyfile", keyfile)) as srv:
        status, _, body = srv.request("/work?ms=1")
        assert (status, body.startswith(b"pid=")) == (200, True), (status, body)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as plain:
            plain.sendall(b"GET /work?ms=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                answer = plain.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert not answer.startswith(b"HTTP/1.1 200"), answer
