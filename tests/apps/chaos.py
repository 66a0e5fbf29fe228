"""Faults at scale against a real gunicorn: the pieces of the chaos tests (short form,
``tests/test_server_chaos.py``) and of the soak script (long form, ``benchmarks/soak.py``).

    tally = Tally()
    with MixedLoad(srv.port, tally, connections=16):   # slow, timed-out, abandoned, probes
        kill_workers(srv, 100, every=0.3)               # random worker SIGKILLs meanwhile
    problems = after_the_storm(srv, tally, track, kills)  # [] when everything holds

What "holds" means (``after_the_storm``): nothing executing or waiting in the ledger, its
invariants intact (``ledger.verify``), every registered worker alive, the application never
running more requests of level "work" than its 8 seats (from the app's own start/end records,
a killed worker's request ending at its kill), no 500 anywhere, and the server's counters equal
to what the clients saw: every request that reached the server dispatched or rejected exactly
once (with kills or reloads, the requests cut off are the only slack).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import mmap
import os
import random
import signal
import socket
import threading
import time

from tests.apps.procs import rss_kib

WORK_SEATS = 8  # tests/apps/apf.yaml with APF_CONCURRENCY_LIMIT=16
KINDS = ("slow", "timeout", "abandon", "probe")


class Tally:
    """Thread-safe counts of what the clients saw: ``(kind, outcome)`` -> n, outcome an HTTP
    status, ``"error"`` (connection failed or cut) or ``"abandoned"`` (closed on purpose)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()

    def add(self, kind: str, outcome) -> None:
        with self._lock:
            self.counts[(kind, outcome)] += 1

    def total(self, *, kinds=None, outcomes=None) -> int:
        return sum(n for (k, o), n in self.counts.items()
                   if (kinds is None or k in kinds) and (outcomes is None or o in outcomes))


def get(port: int, path: str, headers: dict | None = None, timeout: float = 10.0):
    """One request on a fresh connection: its status, or "error"."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close", **(headers or {})})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return "error"
    finally:
        conn.close()


def abandon(port: int, path: str, user: str, after: float = 0.03) -> str:
    """Send a whole request, then close before the answer (a client giving up while queued)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Remote-User: {user}\r\n\r\n".encode())
            time.sleep(after)
        return "abandoned"
    except OSError:
        return "error"


class MixedLoad:
    """``connections`` client threads, each of one kind (in turn: slow 200 ms requests, the
    same with ``?timeout=400ms`` so they time out after 100 ms in a queue, abandoned ones, and
    exempt health checks), each sending request after request on fresh connections."""

    def __init__(self, port: int, tally: Tally, *, connections: int = 16,
                 ms: int = 200) -> None:
        self.port, self.tally, self.ms = port, tally, ms
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(connections)]

    def _run(self, i: int) -> None:
        kind = KINDS[i % len(KINDS)]
        user = f"u{i % 6}"
        path = f"/work/tracked?ms={self.ms}"
        while not self.stop.is_set():
            if kind == "slow":
                out = get(self.port, path, {"X-Remote-User": user})
            elif kind == "timeout":
                out = get(self.port, path + "&timeout=400ms", {"X-Remote-User": user})
            elif kind == "abandon":
                out = abandon(self.port, path, user)
            else:
                out = get(self.port, "/healthz")
                time.sleep(0.05)
            self.tally.add(kind, out)
            if out == "error":
                time.sleep(0.02)

    def __enter__(self) -> MixedLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def kill_workers(srv, n: int, every: float, rng: random.Random | None = None) -> dict[int, int]:
    """SIGKILL a random worker ``n`` times, ``every`` seconds apart, each time once the master
    has replaced the last one. Returns {pid: monotonic ns of its kill}."""
    rng = rng or random.Random(1)
    killed: dict[int, int] = {}
    want = len(srv.workers())
    for _ in range(n):
        pids = srv.wait_for(lambda: (p := srv.workers()) and len(p) >= want and p,
                            timeout=30)
        if not pids:
            raise RuntimeError(f"the master did not replace its workers:\n{srv.log()[-2000:]}")
        pid = rng.choice(pids)
        killed[pid] = time.monotonic_ns()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(every)
    return killed


def app_concurrency(track_path: str, killed: dict[int, int]) -> int:
    """The most tracked requests the application ran at once, from its start/end records; a
    request with no end record ended when its worker was killed."""
    starts: dict[str, tuple[int, int]] = {}
    events: list[tuple[int, int]] = []
    try:
        with open(track_path) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return 0
    for line in lines:
        parts = line.split()
        if len(parts) != 4:
            continue
        tag, pid, rid, t = parts[0], int(parts[1]), parts[2], int(parts[3])
        if tag == "S":
            starts[rid] = (pid, t)
        elif rid in starts:
            events.append((starts.pop(rid)[1], 1))
            events.append((t, -1))
    for rid, (pid, t) in starts.items():
        if pid not in killed:
            raise AssertionError(f"request {rid} of live worker {pid} never ended")
        events.append((t, 1))
        events.append((killed[pid], -1))
    cur = top = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at a tie
        cur += d
        top = max(top, cur)
    return top


@contextlib.contextmanager
def attached_ledger(srv):
    """The server's ledger, attached from its shared memory (for reads and ``verify``)."""
    import posix_ipc

    from apf_gunicorn.ledger.ledger import Ledger
    from apf_gunicorn.ledger.lock import ProcessLock
    from apf_gunicorn.server import shm

    mem = posix_ipc.SharedMemory("/" + shm.segment_name(srv.instance, srv.pid))
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


def ledger_problems(srv) -> list[str]:
    """Invariant violations, and registered workers whose process is gone."""
    from apf_gunicorn.ledger import layout as L
    from apf_gunicorn.ledger.repair import verify

    with attached_ledger(srv) as led:
        problems = verify(led)
        for owner, pid, st, _hb in led.workers():
            if st == L.WORKER_ALIVE and not os.path.exists(f"/proc/{pid}"):
                problems.append(f"worker {owner} (pid {pid}) registered alive but gone")
    return problems


def level_totals(srv, level: str) -> tuple[int, int]:
    """(dispatched, rejected) of ``level`` over all FlowSchemas, server-wide."""
    with attached_ledger(srv) as led:
        stats = [st for st in led.request_stats() if st.level == level]
    return (sum(st.dispatched for st in stats),
            sum(sum(st.rejected.values()) for st in stats))


def after_the_storm(srv, tally: Tally, track_path: str, killed: dict[int, int],
                    cut_off_allowed: bool) -> list[str]:
    """Every broken promise after a storm, as text; [] when everything holds.

    ``cut_off_allowed``: workers were killed or restarted, so requests in flight then may have
    failed on the client side (``error``) whether or not the server counted them."""
    problems: list[str] = []
    if srv.idle(timeout=20) is None:
        problems.append("requests still executing or waiting in the ledger")
    problems += ledger_problems(srv)
    top = app_concurrency(track_path, killed)
    if top > WORK_SEATS:
        problems.append(f"the app ran {top} requests of level work at once (limit "
                        f"{WORK_SEATS})")
    statuses = {o for (_k, o) in tally.counts if isinstance(o, int)}
    if 500 in statuses or any(isinstance(o, int) and o >= 500 and o != 503 for o in statuses):
        problems.append(f"5xx other than 503 seen: {sorted(statuses)}")
    work = ("slow", "timeout", "abandon")
    ok = tally.total(kinds=work, outcomes=(200,))
    refused = tally.total(kinds=work, outcomes=(429, 503))
    slack = tally.total(kinds=work, outcomes=("abandoned",))
    errors = tally.total(kinds=work, outcomes=("error",))
    dispatched, rejected = level_totals(srv, "work")
    seen = dispatched + rejected
    low, high = ok + refused, ok + refused + slack + (errors if cut_off_allowed else 0)
    if not (low <= seen <= high) or dispatched < ok or rejected < refused:
        problems.append(f"counters vs clients: dispatched {dispatched} + rejected {rejected} "
                        f"= {seen}, clients saw 200 x {ok}, 429/503 x {refused}, abandoned "
                        f"{slack}, errors {errors}")
    if not cut_off_allowed and errors:
        problems.append(f"{errors} client errors without a fault to explain them")
    probes_failed = tally.total(kinds=("probe",)) - tally.total(kinds=("probe",),
                                                                outcomes=(200,))
    if probes_failed and not cut_off_allowed:
        problems.append(f"{probes_failed} health checks failed")
    return problems


# -- hostile input ---------------------------------------------------------------------------

def hostile_payloads(rng: random.Random) -> list[tuple[str, bytes, bool]]:
    """(name, bytes to send, half-close after sending) of one round of hostile requests."""
    user = b"X-Remote-User"
    return [
        ("random bytes", os.urandom(rng.randint(1, 3000)), False),
        ("random head", b"GET /" + os.urandom(40) + b" HTTP/1.1\r\n\r\n", False),
        ("oversized line", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("oversized header", b"GET /hello HTTP/1.1\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
         False),
        ("duplicate identity", b"GET /work/tracked?ms=1 HTTP/1.1\r\nHost: x\r\n" + user
         + b": alice\r\n" + user + b": bob\r\nX-Remote-Group: a\r\nX-Remote-Group: b\r\n\r\n",
         False),
        ("non-UTF-8 identity", b"GET /work/tracked?ms=1 HTTP/1.1\r\nHost: x\r\n" + user
         + b": \xff\xfe\xc3\x28\r\nX-Remote-Group: \x80\x81\r\n\r\n", False),
        ("garbage timeout", b"GET /work/tracked?ms=1&timeout=" + rng.choice(
            [b"abc", b"-5s", b"99999999999999h", b"%00", b"1e400s", b"", b"5s5s"])
         + b" HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("pipelined", b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /work/tracked?ms=1 "
         b"HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("half-close", b"GET /work/tracked?ms=20 HTTP/1.1\r\nHost: x\r\n\r\n", True),
        ("cut head", b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Cut: ", True),
        ("bare LF", b"GET /hello HTTP/1.1\nHost: x\n\n", False),
        ("bad length", b"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", False),
        ("bad chunk", b"POST /hello HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"zz\r\n", True),
        ("absolute form", b"GET http://evil/hello HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("HTTP/1.0", b"GET /hello HTTP/1.0\r\n\r\n", False),
    ]


def send_hostile(port: int, payload: bytes, half_close: bool) -> list[int]:
    """Send ``payload`` on a fresh connection; the statuses of what came back."""
    out = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            s.settimeout(2)
            try:
                while chunk := s.recv(65536):
                    out += chunk
                    if not half_close and out.count(b"HTTP/1.") >= payload.count(b"HTTP/1."):
                        break
            except (TimeoutError, OSError):
                pass
    except OSError:
        return []
    statuses = []
    for part in out.split(b"HTTP/1.")[1:]:
        with contextlib.suppress(ValueError):
            statuses.append(int(part[2:5]))
    return statuses


# -- the scenarios (short form in tests/test_server_chaos.py, long form in benchmarks/soak.py) --

def settled_workers(srv, n: int = 2) -> list[int]:
    """The workers' pids once all ``n`` have booted (the server answers after the first)."""
    pids = srv.wait_for(lambda: len(p := srv.workers()) == n and p, timeout=30)
    if not pids:
        raise RuntimeError(f"{n} workers did not come up:\n{srv.log()[-2000:]}")
    return sorted(pids)


def scenario_kills(srv, track: str, kills: int, every: float = 0.3,
                   connections: int = 16) -> tuple[dict, list[str]]:
    """``kills`` random worker SIGKILLs under mixed load."""
    tally = Tally()
    with MixedLoad(srv.port, tally, connections=connections):
        time.sleep(0.5)
        killed = kill_workers(srv, kills, every=every)
        time.sleep(0.5)
    problems = after_the_storm(srv, tally, track, killed, cut_off_allowed=True)
    if get(srv.port, "/healthz") != 200:
        problems.append("no health check answered after the kills")
    return {"kills": len(killed), "clients": dict(tally.counts)}, problems


def scenario_soak(srv, track: str, requests: int, connections: int = 8,
                  rss_bound_kib: int = 5 * 1024) -> tuple[dict, list]:
    """``requests`` requests over keep-alive connections, connections abandoned while queued
    alongside; worker RSS before and after (the same workers throughout), each worker's growth
    at most ``rss_bound_kib``."""
    from tests.apps.loadgen import Client, run_clients

    run_clients([Client(srv.port, "/hello", count=200) for _ in range(connections)])
    pids = settled_workers(srv)
    rss0 = {p: rss_kib(p) for p in pids}
    tally = Tally()
    stop = threading.Event()

    def abandoner() -> None:
        while not stop.is_set():
            tally.add("abandon", abandon(srv.port, "/work/tracked?ms=20", "ab"))
            time.sleep(0.01)

    ab = threading.Thread(target=abandoner)
    ab.start()
    t0 = time.monotonic()
    clients = [Client(srv.port, "/work/tracked?ms=0", user=f"s{i}",
                      count=requests // connections) for i in range(connections)]
    run_clients(clients, timeout=max(300.0, requests / 50))
    seconds = time.monotonic() - t0
    stop.set()
    ab.join(30)
    for c in clients:
        for status in c.statuses:
            tally.add("slow", status)
        for _ in c.errors:
            tally.add("slow", "error")
    growth = {p: rss_kib(p) - rss0[p] for p in pids}
    problems = after_the_storm(srv, tally, track, {}, cut_off_allowed=False)
    if sorted(srv.workers()) != pids:
        problems.append("a worker restarted during the soak")
    if any(g > rss_bound_kib for g in growth.values()):
        problems.append(f"worker RSS grew more than {rss_bound_kib} KiB: {growth} KiB")
    return {"requests": tally.total(), "seconds": round(seconds, 1),
            "rss_growth_kib": growth, "clients": dict(tally.counts)}, problems


def scenario_hostile(srv, n: int, seed: int = 7) -> tuple[dict, list[str]]:
    """At least ``n`` hostile requests; no 5xx, no worker restart, nothing left behind."""
    pids = settled_workers(srv)
    rng = random.Random(seed)
    seen: collections.Counter = collections.Counter()
    sent = 0
    while sent < n:
        for name, payload, half in hostile_payloads(rng):
            for status in send_hostile(srv.port, payload, half):
                seen[(name, status)] += 1
            sent += 1
    problems = []
    if [k for k in seen if k[1] >= 500]:
        problems.append(f"5xx answered: {[k for k in seen if k[1] >= 500]}")
    if sorted(srv.workers()) != pids:
        problems.append("a worker restarted")
    if srv.idle() is None:
        problems.append("requests left executing or waiting")
    problems += ledger_problems(srv)
    if get(srv.port, "/work/tracked?ms=1", {"X-Remote-User": "alice"}) != 200:
        problems.append("a normal request failed afterwards")
    if "Traceback" in srv.log():
        problems.append("a traceback in the server log")
    return {"sent": sent, "answers": dict(sorted(seen.items()))}, problems


#: the server environment for :func:`scenario_hups`: it counts one reload per HUP, and the
#: master's file watcher (on by default) would apply each written file on its own as well
HUP_ONLY = {"APF_CONFIG_WATCH": "off"}


def scenario_hups(srv, track: str, config, valid: str, invalid: str,
                  hups: int) -> tuple[dict, list[str]]:
    """``hups`` HUPs under mixed load, alternating a valid and an invalid configuration, each
    sent once the master has read the previous one (the server runs with :data:`HUP_ONLY`)."""
    def reloads() -> int:
        log = srv.log()
        return log.count("reload rejected") + log.count("apf: configuration generation")

    tally = Tally()
    base = reloads()
    start = time.monotonic()
    problems: list[str] = []
    with MixedLoad(srv.port, tally, connections=12):
        for i in range(hups):
            config.write_text(invalid if i % 2 else valid)
            os.kill(srv.pid, signal.SIGHUP)
            if not srv.wait_for(lambda i=i: reloads() - base == i + 1, timeout=15):
                problems.append(f"HUP {i + 1} was not processed")
                break
        storm = time.monotonic() - start
        config.write_text(valid)
        time.sleep(1.0)
    rejected = srv.log().count("reload rejected")
    if rejected != hups // 2:
        problems.append(f"{rejected} reloads rejected, {hups // 2} invalid configurations sent")
    problems += after_the_storm(srv, tally, track, {}, cut_off_allowed=True)
    if get(srv.port, "/work/tracked?ms=1") != 200:
        problems.append("no request served after the storm")
    return {"hups": hups, "seconds": round(storm, 1), "clients": dict(tally.counts)}, problems


def port_is_free(port: int) -> bool:
    """Whether a new master could bind 127.0.0.1:``port`` (as gunicorn binds: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def scenario_master_kill(serve, rounds: int = 1) -> tuple[dict, list[str]]:
    """SIGKILL the master (its workers exit on their own once orphaned, freeing the port),
    then start a new server on the same ``APF_INSTANCE``, ``rounds`` times; ``serve(**kw)``
    starts a server (``tests.conftest.serve`` with its temporary directory bound)."""
    instance = "tchaos" + os.urandom(4).hex()
    env = {"APF_INSTANCE": instance}
    problems: list[str] = []
    for _ in range(rounds):
        with serve(workers=2, threads=4, env=env) as first:
            if get(first.port, "/work?ms=1") != 200:
                problems.append("the first server did not serve")
            workers = first.workers()
            os.kill(first.pid, signal.SIGKILL)
            first.proc.wait(10)
            if not first.wait_for(
                    lambda ws=workers: not any(os.path.exists(f"/proc/{w}") for w in ws), 15):
                problems.append("orphaned workers did not exit")
            elif not port_is_free(first.port):
                problems.append(f"port {first.port} still bound after the workers exited")
            # its segment stays behind (unless another server starting on this host meanwhile
            # already removed it as stale); the new master removes it
            with serve(workers=2, threads=4, env=env) as second:
                if [get(second.port, "/work?ms=1") for _ in range(5)] != [200] * 5:
                    problems.append("the restarted server did not serve")
                if second.shm_entries() != [f"apf_{instance}_{second.pid}"]:
                    problems.append(f"segments after the restart: {second.shm_entries()}")
                if second.idle() is None:
                    problems.append("requests left after the restart")
                problems += ledger_problems(second)
    return {"rounds": rounds}, problems
