"""Two apf_gunicorn servers behind a real HAProxy, weighted by their agent-check reports.

``scripts/haproxy-example.sh`` runs this module; ``tests/test_haproxy.py`` reuses its pieces.

    python -m examples.haproxy_demo            # start everything, measure, print, stop
    python -m examples.haproxy_demo --serve    # start everything; Ctrl-C or SIGTERM stops it all

Server ``a`` has twice the concurrency limit of server ``b`` (6 and 3 seats by default; 2
workers x 6 threads each, the app of ``examples/app.py``, the APF configuration
``examples/haproxy-apf.yaml``). HAProxy (``examples/haproxy.cfg``) has two frontends on the
same two servers: ``fe_agent`` weighted by the servers' agent-check replies, ``fe_rr`` plain
round robin. The measurement floods each frontend in turn with the same closed-loop clients
(10 clients x 16 requests of ``/work?ms=250``; a client that gets a 429 pauses 50 ms) and reports, per frontend, the
requests, the 429s and the per-server split from HAProxy's own stats; while the agent frontend
is flooded it also times the agent port of server ``a``; then it stops server ``b``
gracefully under traffic and reports how many new requests HAProxy still sent it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "examples" / "haproxy.cfg"
APF_CONFIG = ROOT / "examples" / "haproxy-apf.yaml"
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One apf_gunicorn server (a gunicorn master and its workers)."""

    name: str
    limit: int
    port: int
    agent_port: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


@dataclass
class Setup:
    """Everything one demo run started."""

    servers: list[Server]
    agent_front: int
    rr_front: int
    stats_port: int
    haproxy: subprocess.Popen | None = None
    haproxy_log: Path | None = None
    env: dict = field(default_factory=dict)


def start_server(srv: Server, workdir: Path, *, workers: int = 2, threads: int = 6,
                 env: dict | None = None) -> None:
    """Start ``srv`` (gunicorn with apf_gunicorn's conf) and wait until it answers.

    Raises:
        RuntimeError: it exited or did not answer within 30 s (its log attached).
    """
    gunicorn = str(Path(sys.executable).parent / "gunicorn")
    full = dict(os.environ)
    full.update({
        "APF_INSTANCE": f"lb{srv.name}{os.getpid()}",
        "APF_CONFIG": str(APF_CONFIG),
        "APF_CONCURRENCY_LIMIT": str(srv.limit),
        "APF_QUEUE_WAIT_LIMIT": "1",
        "APF_ADMIN_BIND": "off",
        "APF_AGENT_BIND": f"{HOST}:{srv.agent_port}",
        "APF_AGENT_DRAIN_DELAY": "2",
        "APF_LOAD_REPORT": "orca",
        "PYTHONPATH": str(ROOT),
    })
    full.update(env or {})
    srv.log_path = workdir / f"server-{srv.name}.log"
    with open(srv.log_path, "wb") as log:
        srv.proc = subprocess.Popen(
            [gunicorn, "-c", "python:apf_gunicorn.conf", "-w", str(workers), "--threads",
             str(threads), "-b", srv.addr, "--graceful-timeout", "5", "examples.app:app"],
            cwd=str(ROOT), env=full, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server {srv.name} exited {srv.proc.returncode}:\n{srv.log()}")
        with contextlib.suppress(OSError):
            if http_get(srv.port, "/healthz")[0] == 200 and agent_query(srv.agent_port)[0]:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server {srv.name} did not answer in 30 s:\n{srv.log()}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """TERM, wait, then KILL whatever is left of its process group."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def haproxy_env(setup: Setup, agent_inter: str) -> dict:
    """The variables examples/haproxy.cfg reads."""
    a, b = setup.servers
    return {
        "HAPROXY_AGENT_FRONT": f"{HOST}:{setup.agent_front}",
        "HAPROXY_RR_FRONT": f"{HOST}:{setup.rr_front}",
        "HAPROXY_STATS": f"{HOST}:{setup.stats_port}",
        "APF_A_ADDR": a.addr, "APF_A_AGENT_HOST": HOST, "APF_A_AGENT_PORT": str(a.agent_port),
        "APF_B_ADDR": b.addr, "APF_B_AGENT_HOST": HOST, "APF_B_AGENT_PORT": str(b.agent_port),
        "AGENT_INTER": agent_inter,
    }


def start_haproxy(setup: Setup, workdir: Path, agent_inter: str = "100ms") -> None:
    """Start HAProxy on examples/haproxy.cfg and wait until both backends see both servers up.

    Raises:
        RuntimeError: ``haproxy`` is not installed, exited, or the servers never came up.
    """
    exe = shutil.which("haproxy")
    if exe is None:
        raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy)")
    setup.env = haproxy_env(setup, agent_inter)
    setup.haproxy_log = workdir / "haproxy.log"
    with open(setup.haproxy_log, "wb") as log:
        setup.haproxy = subprocess.Popen([exe, "-db", "-f", str(HAPROXY_CFG)],
                                         env={**os.environ, **setup.env}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        if setup.haproxy.poll() is not None:
            raise RuntimeError("haproxy exited:\n" + setup.haproxy_log.read_text())
        with contextlib.suppress(OSError, KeyError, ValueError):
            st = haproxy_stats(setup.stats_port)
            if all(st[(px, sv)]["status"].startswith("UP")
                   for px in ("be_agent", "be_rr") for sv in ("a", "b")):
                return
        if time.monotonic() > deadline:
            raise RuntimeError("HAProxy did not see both servers up in 20 s:\n"
                               + setup.haproxy_log.read_text())
        time.sleep(0.1)


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def haproxy_stats(stats_port: int) -> dict[tuple[str, str], dict[str, str]]:
    """HAProxy's CSV stats: {(proxy, server): {column: value}}."""
    status, body = http_get(stats_port, "/stats;csv")
    if status != 200:
        raise ValueError(f"stats answered {status}")
    text = body.decode().lstrip("# ")
    return {(row["pxname"], row["svname"]): row for row in csv.DictReader(io.StringIO(text))}


def agent_query(port: int, timeout: float = 2.0) -> tuple[str, float]:
    """(the agent's reply line, seconds from connect to the reply) -- as HAProxy asks."""
    t0 = time.perf_counter()
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    return data.decode().strip(), time.perf_counter() - t0


class Flood:
    """Closed-loop clients on keep-alive connections: each sends ``requests`` requests (or runs
    until :meth:`stop`), pausing ``pause_429`` s after a 429."""

    def __init__(self, port: int, clients: int, requests: int | None, path: str = "/work?ms=250",
                 pause_429: float = 0.05) -> None:
        self.port, self.path, self.requests, self.pause_429 = port, path, requests, pause_429
        self.statuses: Counter = Counter()
        self.errors: list[str] = []
        self.log: list[tuple[float, int]] = []  # (monotonic time of the answer, status)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def start(self) -> Flood:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float = 120.0) -> Flood:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        return self

    def _run(self) -> None:
        conn = None
        n = 0
        while not self._stop.is_set() and (self.requests is None or n < self.requests):
            n += 1
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(HOST, self.port, timeout=30)
                conn.request("GET", self.path)
                resp = conn.getresponse()
                resp.read()
                status = resp.status
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as e:
                with self._lock:
                    self.errors.append(repr(e))
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
                continue
            with self._lock:
                self.statuses[status] += 1
                self.log.append((time.monotonic(), status))
            if status == 429:
                time.sleep(self.pause_429)
        if conn is not None:
            conn.close()


def _served(stats: dict, proxy: str, server: str) -> int:
    return int(stats[(proxy, server)]["stot"] or 0)


def flood_frontend(setup: Setup, proxy: str, port: int, clients: int, requests: int,
                   path: str = "/work?ms=250",
                   probe_agent: Server | None = None) -> dict:
    """Flood one frontend; its requests, 429s, per-server split (HAProxy's counts) and, with
    ``probe_agent``, the agent port's reply times during the flood."""
    before = haproxy_stats(setup.stats_port)
    flood = Flood(port, clients, requests, path=path).start()
    probes: list[float] = []
    replies: Counter = Counter()
    if probe_agent is not None:
        # In its own process, so the flood's client threads do not hold its GIL: what is
        # timed is the master's answer (connect to reply, as HAProxy sees it).
        time.sleep(0.3)  # let the flood build up
        probe = subprocess.Popen(
            [sys.executable, "-m", "examples.haproxy_demo", "--probe",
             str(probe_agent.agent_port)], cwd=str(ROOT), stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        flood.join()
        probe.terminate()
        for line in probe.communicate(timeout=30)[0].splitlines():
            seconds, reply = line.split(" ", 1)
            probes.append(float(seconds))
            replies[reply.split()[-1] if reply.startswith("up") else reply] += 1
    flood.join()
    after = haproxy_stats(setup.stats_port)
    split = {sv: _served(after, proxy, sv) - _served(before, proxy, sv) for sv in ("a", "b")}
    rejected = {sv: int(after[(proxy, sv)]["hrsp_4xx"] or 0)
                - int(before[(proxy, sv)]["hrsp_4xx"] or 0) for sv in ("a", "b")}
    out = {"requests": sum(flood.statuses.values()), "429": flood.statuses.get(429, 0),
           "statuses": dict(flood.statuses), "errors": len(flood.errors), "split": split,
           "429_by_server": rejected}
    if probes:
        probes.sort()
        out["agent_ms"] = {"n": len(probes), "p50": 1000 * probes[len(probes) // 2],
                           "p99": 1000 * probes[min(len(probes) - 1, int(len(probes) * 0.99))],
                           "max": 1000 * probes[-1],
                           "over_10ms": sum(1 for p in probes if p > 0.010)}
        out["agent_replies"] = dict(replies)
    return out


def drain_under_traffic(setup: Setup, clients: int = 6, delay_s: float = 2.0) -> dict:
    """SIGTERM server b while traffic flows through ``fe_agent``; how many new requests HAProxy
    sent it during its drain delay (first 0.5 s excluded: HAProxy's next agent check), what its
    agent answered, and what the clients got."""
    a, b = setup.servers
    flood = Flood(setup.agent_front, clients, None, path="/work?ms=50").start()
    time.sleep(1.0)
    t_term = time.monotonic()
    b.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    st1 = haproxy_stats(setup.stats_port)
    reply, _ = agent_query(b.agent_port)
    state = st1[("be_agent", "b")]["status"]
    time.sleep(max(0.1, delay_s - 0.8))
    st2 = haproxy_stats(setup.stats_port)
    with contextlib.suppress(subprocess.TimeoutExpired):
        b.proc.wait(timeout=15)
    stopped_after = time.monotonic() - t_term
    time.sleep(0.5)
    flood.stop()
    flood.join()
    return {
        "b_agent_reply": reply, "b_haproxy_status": state,
        "b_new_requests_while_draining": _served(st2, "be_agent", "b")
        - _served(st1, "be_agent", "b"),
        "a_requests_meanwhile": _served(st2, "be_agent", "a") - _served(st1, "be_agent", "a"),
        "b_stopped_after_s": round(stopped_after, 2),
        "client_statuses": dict(flood.statuses), "client_errors": len(flood.errors),
    }


def measure(setup: Setup, clients: int = 10, requests: int = 16) -> dict:
    """The whole comparison: round robin, agent weights (with the agent timed), drain."""
    rr = flood_frontend(setup, "be_rr", setup.rr_front, clients, requests)
    agent = flood_frontend(setup, "be_agent", setup.agent_front, clients, requests,
                           probe_agent=setup.servers[0])
    return {"round_robin": rr, "agent": agent, "drain": drain_under_traffic(setup)}


@contextlib.contextmanager
def running(workdir: Path, limits: tuple[int, int] = (6, 3), agent_inter: str = "100ms",
            ports: dict | None = None):
    """Start both servers and HAProxy; yield the :class:`Setup`; always stop everything."""
    ports = ports or {}
    servers = [Server("a", limits[0], ports.get("a", free_port()), ports.get("a_agent",
                                                                            free_port())),
               Server("b", limits[1], ports.get("b", free_port()), ports.get("b_agent",
                                                                            free_port()))]
    setup = Setup(servers, ports.get("agent_front", free_port()),
                  ports.get("rr_front", free_port()), ports.get("stats", free_port()))
    try:
        for srv in servers:
            start_server(srv, workdir)
        start_haproxy(setup, workdir, agent_inter)
        yield setup
    finally:
        stop_process(setup.haproxy, timeout=5)
        for srv in servers:
            stop_process(srv.proc)


def report(result: dict) -> str:
    """The measurement as text."""
    lines = []
    for name in ("round_robin", "agent"):
        r = result[name]
        a, b = r["split"]["a"], r["split"]["b"]
        lines.append(f"{name:12s} requests {r['requests']:4d}  429s {r['429']:4d}  "
                     f"errors {r['errors']}  split a:b = {a}:{b} ({a / max(b, 1):.2f})  "
                     f"429s a:b = {r['429_by_server']['a']}:{r['429_by_server']['b']}")
    ag = result["agent"].get("agent_ms")
    if ag:
        lines.append(f"agent port of a during the flood: {ag['n']} queries, p50 {ag['p50']:.2f} "
                     f"ms, p99 {ag['p99']:.2f} ms, max {ag['max']:.2f} ms, {ag['over_10ms']} over 10 ms; "
                     f"replies "
                     f"{result['agent']['agent_replies']}")
    d = result["drain"]
    lines.append(f"drain: b answered {d['b_agent_reply']!r}, HAProxy showed {d['b_haproxy_status']},"
                 f" new requests to b while draining {d['b_new_requests_while_draining']} (a: "
                 f"{d['a_requests_meanwhile']}), b stopped after {d['b_stopped_after_s']} s; "
                 f"clients got {d['client_statuses']}, {d['client_errors']} errors")
    return "\n".join(lines)


class Stopped(BaseException):
    """A stop signal arrived (SIGTERM, SIGINT, SIGHUP): unwind, stopping what was started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def raise_on_stop_signals() -> None:
    """Turn the first stop signal into :class:`Stopped`, raised wherever the main thread is, so
    ``running``'s cleanup stops HAProxy and both servers (they run in sessions of their own: a
    signal to this process alone never reaches them). Later stop signals are ignored, so they
    cannot cut that cleanup short."""
    def stop(signum, _frame):
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true",
                        help="start everything on fixed ports and wait for Ctrl-C or SIGTERM")
    parser.add_argument("--free-ports", action="store_true",
                        help="--serve: on free ports (printed) instead of the fixed ones")
    parser.add_argument("--workdir", default="/tmp/apf-haproxy-example")
    parser.add_argument("--probe", type=int, metavar="PORT",
                        help="(internal) query this agent port every 50 ms until terminated, "
                             "printing seconds and reply per query")
    args = parser.parse_args(argv)
    if args.probe:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        while True:
            reply, seconds = agent_query(args.probe)
            print(f"{seconds:.6f} {reply}", flush=True)
            time.sleep(0.05)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    raise_on_stop_signals()
    try:
        if args.serve:
            serve(workdir, None if args.free_ports else {
                "a": 8001, "b": 8002, "a_agent": 9201, "b_agent": 9202, "agent_front": 8080,
                "rr_front": 8081, "stats": 8404})
        else:
            with running(workdir) as setup:
                print(report(measure(setup)))
    except Stopped as e:
        print(f"stopped by {signal.Signals(e.signum).name}; HAProxy and both servers are "
              "stopped", flush=True)
        return 0 if e.signum == signal.SIGINT else 128 + e.signum
    return 0


def serve(workdir: Path, ports: dict | None) -> None:
    """Start everything and wait until a stop signal (:class:`Stopped`) stops it all."""
    with running(workdir, agent_inter="1s", ports=ports) as setup:
        a, b = setup.servers
        print(f"HAProxy: agent-weighted http://{HOST}:{setup.agent_front}/  round robin "
              f"http://{HOST}:{setup.rr_front}/  stats http://{HOST}:{setup.stats_port}"
              f"/stats\nservers: a {a.addr} (agent {HOST}:{a.agent_port}), b {b.addr} (agent "
              f"{HOST}:{b.agent_port}); logs in {workdir}; Ctrl-C or SIGTERM stops", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
