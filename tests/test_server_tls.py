"""TLS (``--certfile``) through the accept-gated worker's poller on a real gunicorn: the
handshake and the request head are read there, non-blocking, like a plain connection's.

A request whose TLS record arrives in two TCP sends 0.3 s apart is answered (the first part
is "nothing yet", not the end of input), and a TLS connection gets a plain one's protections:
the head deadline (``408``), the head buffer budget (``431``) and a head that is read without
a thread. Stock gthread's outcome with the same split records is printed beside ours.
"""

from __future__ import annotations

import threading

import pytest

from tests.apps.tlsclient import SplitClient, make_cert, padded_head

pytestmark = pytest.mark.server

STOCK = ("-k", "gthread", "--no-control-socket")
SPLIT_REQUESTS = 100
PARALLEL = 10


@pytest.fixture
def tls_args(tmp_path) -> tuple:
    certfile, keyfile = make_cert(tmp_path)
    return ("--certfile", certfile, "--keyfile", keyfile)


def _split_requests(port: int, pad: int = 3000, n: int = SPLIT_REQUESTS) -> list:
    """``n`` TLS connections, ``PARALLEL`` at a time, each sending a first request whole and
    then a second (``pad`` + 60 bytes) as one TLS record in two TCP sends 0.3 s apart: the
    second's status, or the error, per connection."""
    outcomes: list = []
    lock = threading.Lock()

    def run(count: int) -> None:
        for _ in range(count):
            try:
                client = SplitClient(port)
                try:
                    first = client.request(padded_head(pad))
                    out = client.request(padded_head(pad), split_after=0.3)
                    if first != 200:
                        out = f"first request {first}"
                finally:
                    client.close()
            except (OSError, ValueError) as e:
                out = repr(e)
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=run, args=(n // PARALLEL,)) for _ in range(PARALLEL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return outcomes


def test_tls_record_in_two_parts_on_a_kept_alive_connection_is_answered(server_factory,
                                                                         tls_args):
    with server_factory(workers=1, threads=16, args=tls_args) as srv:
        outcomes = _split_requests(srv.port)
        print(f"APF worker: {outcomes.count(200)} of {SPLIT_REQUESTS} split requests "
              f"answered 200")
        assert outcomes == [200] * SPLIT_REQUESTS, [o for o in outcomes if o != 200][:5]
        assert "Traceback" not in srv.log()


def test_stock_gthread_with_a_tls_record_in_two_parts(server_factory, tls_args):
    """Stock ``-k gthread``, the same requests: its outcome is printed, not asserted."""
    with server_factory(workers=1, threads=16, args=tls_args, conf=STOCK) as srv:
        outcomes = _split_requests(srv.port)
    others = sorted({str(o) for o in outcomes if o != 200})
    print(f"stock gthread: {outcomes.count(200)} of {SPLIT_REQUESTS} split requests answered "
          f"200; otherwise {others[:3]}")


def test_tls_head_larger_than_a_read_in_one_record(server_factory, tls_args):
    """A 12 KB head in one TLS record, whole and in two parts: the poller reads what the TLS
    layer holds decrypted past its 8 KiB read (it would not make the socket readable)."""
    with server_factory(workers=1, threads=16, args=tls_args) as srv:
        outcomes = _split_requests(srv.port, pad=12000, n=PARALLEL)
        assert outcomes == [200] * PARALLEL, outcomes


def test_tls_head_deadline_answers_408(server_factory, tls_args):
    """A TLS client that sends half a head gets ``408`` once ``APF_HEADER_TIMEOUT`` passed,
    from the poller (stock gthread's thread would wait for the rest of the head)."""
    with server_factory(workers=1, threads=4, args=tls_args,
                        env={"APF_HEADER_TIMEOUT": "1"}) as srv:
        client = SplitClient(srv.port)
        try:
            client.send(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            assert client.response() == 408
        finally:
            client.close()


def test_tls_head_buffer_budget_answers_431(server_factory, tls_args):
    """A TLS head that never ends, larger than the worker's ``APF_HEAD_BUFFER_LIMIT`` (64
    KiB): ``431`` from the poller, and the worker serves the next TLS request."""
    with server_factory(workers=1, threads=4, args=tls_args,
                        env={"APF_HEAD_BUFFER_LIMIT": "64KiB"}) as srv:
        client = SplitClient(srv.port)
        try:
            client.send(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 7000) for i in range(10)))
            assert client.response() == 431
        finally:
            client.close()
        status, _, _ = srv.request("/hello")
        assert status == 200


def test_idle_tls_connections_hold_no_thread(server_factory, tls_args):
    """8 TLS connections that finish their handshake and send nothing, against 1 worker with
    2 threads: they cost sockets in the poller, so a TLS health check is still answered
    (stock gthread's threads would each make a handshake and then wait for a head)."""
    with server_factory(workers=1, threads=2, args=tls_args) as srv:
        idle = [SplitClient(srv.port) for _ in range(8)]
        try:
            status, _, body = srv.request("/healthz", timeout=15)
            assert (status, body) == (200, b"ok\n")
        finally:
            for client in idle:
                client.close()


def test_a_bad_certificate_fails_the_boot_naming_the_files(server_factory, tmp_path):
    """A certificate file that is not one: the master cannot make the TLS context, says
    which files, and the server does not start (stock gthread would boot and fail every
    connection)."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with server_factory(workers=1, threads=2, expect_fail=True, boot_timeout=60,
                        args=("--certfile", str(bad), "--keyfile", str(bad))) as srv:
        assert srv.proc.returncode not in (None, 0)
        assert f"cannot make the TLS context from certfile {bad}, keyfile {bad}" in srv.log()


def test_a_key_rotated_out_of_step_keeps_the_server_serving_tls(server_factory, tmp_path):
    """A certificate rotation that replaces the key before the certificate: a worker killed
    meanwhile (an OOM kill, a timeout) is replaced and serves TLS with the context the master
    made at start, and a HUP meanwhile logs the mismatch and keeps that context (each worker
    used to make its own: the replacement failed its boot and gunicorn halted the server)."""
    import os
    import shutil
    import signal

    certfile, keyfile = make_cert(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = make_cert(other)
    with server_factory(workers=1, threads=4,
                        args=("--certfile", certfile, "--keyfile", keyfile)) as srv:
        shutil.copyfile(other_key, keyfile)  # the key of another certificate
        first = srv.workers()
        os.kill(first[0], signal.SIGKILL)
        assert srv.wait_for(lambda: (w := srv.workers()) and w != first), srv.log()
        status, _, body = srv.request("/healthz", timeout=15)
        assert (status, body) == (200, b"ok\n")
        assert srv.proc.poll() is None
        before = srv.workers()
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "the workers keep serving with the TLS context made at"
                            in srv.log()), srv.log()
        assert f"cannot make the TLS context from certfile {certfile}, keyfile {keyfile}" \
            in srv.log()
        assert srv.wait_for(lambda: (w := srv.workers()) and not set(w) & set(before)), \
            srv.log()
        status, _, body = srv.request("/healthz", timeout=15)
        assert (status, body) == (200, b"ok\n")
        assert srv.proc.poll() is None
