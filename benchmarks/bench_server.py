"""Overhead of APF on gunicorn: bare gthread vs gthread + apf_gunicorn, same workers and threads,
load below the concurrency limit (every request takes the fast path), paired runs in one go.

    .venv/bin/python benchmarks/bench_server.py [--duration 1] [--rounds 30] [--workers 1,2]
                                                [--threads 64] [--connections 16,64] [--pin]
    .venv/bin/python benchmarks/bench_server.py --micro-only [--baseline DIR [--reps 20]]

Uses ``wrk`` when installed (``apt-get install -y wrk``), else a Python load generator (which
is itself CPU-bound on 2 cores, so its ratios are less sharp). Both servers run at once and
are loaded in turns (order alternating), so a change in the machine's load hits both alike.
Prints, per round and over all rounds: throughput ratio (APF / bare), the workers' CPU time
per request (from /proc), p50 and p99 latency added, and each worker's RSS with and without
APF after all its threads were started. Everything binds 127.0.0.1; every server is
stopped and its /dev/shm segment checked.

On a shared machine a single round's ratio swings by ±30% (the machine's speed drifts, and
each wrk run spreads its connections over the workers anew), so the summary is the median of
many short paired rounds with a 95% bootstrap interval: read the interval, not one round.
Two setups by default. One worker with 16 connections: the sharpest ratio (paired rounds
differ by ~8%). Two workers with 64 connections: the cross-process lock really contended;
noisier (~25%), because stock gthread's accept race splits each wrk run's connections
unevenly and anew (16 connections: from 8/8 to 16/0, which halves a round's throughput);
with 64 connections both workers stay busy whatever the split.
``--pin`` places the processes. ``spread`` (default): with several workers, worker *i* runs
on CPU *i* mod the CPU count, the load generator where the kernel puts it (one worker is left
alone: pinned, it shares its core with the load generator half the time); left alone, the kernel at times runs two
GIL-bound workers on one core for a while, which made paired 2-worker rounds differ by ~25%
(~10% spread). ``split``: the servers on all CPUs but the last, the load generator on the last.
``none``: no pinning.
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.apps.procs import children, free_port, rss_kib  # noqa: E402

GUNICORN = str(Path(sys.executable).parent / "gunicorn")

# One queuing level that every request lands in; with the limit set high enough no request
# ever waits, so the run measures the fast path.
BENCH_CONFIG = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: bench}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 100
    limitResponse:
      type: Queue
      queuing: {queues: 64, handSize: 6, queueLengthLimit: 50}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: bench}
spec:
  matchingPrecedence: 500
  priorityLevelConfiguration: {name: bench}
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects:
    - {kind: Group, group: {name: system:unauthenticated}}
    - {kind: Group, group: {name: system:authenticated}}
    nonResourceRules:
    - {verbs: ["*"], nonResourceURLs: ["*"]}
"""


# --pin split: CPU sets for the servers and for the load generator (None: not pinned)
SERVER_CPUS: set[int] | None = None
LOAD_CPUS: set[int] | None = None
SPREAD = False  # --pin spread: each worker on its own CPU (see spread_workers)


def _pinned(cpus: set[int] | None):
    """A ``preexec_fn`` that pins the child (and everything it starts) to ``cpus``."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def pin_split() -> tuple[set[int], set[int]] | None:
    """(server CPUs, load-generator CPUs): all but the last, and the last; None on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return set(cpus[:-1]), {cpus[-1]}


def spread_workers(master_pid: int) -> None:
    """Pin worker *i* (every thread it has; threads it starts later inherit the main thread's
    CPU) to CPU *i* mod the CPU count."""
    cpus = sorted(os.sched_getaffinity(0))
    for i, pid in enumerate(sorted(children(master_pid))):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {cpus[i % len(cpus)]})
            except OSError:  # a thread that just ended
                pass


class Server:
    def __init__(self, apf: bool, workers: int, threads: int, config_path: str):
        self.port = free_port()
        self.instance = "bench" + uuid.uuid4().hex[:8]
        env = dict(os.environ, PYTHONPATH=str(ROOT), APF_INSTANCE=self.instance,
                   APF_ADMIN_BIND="off", APF_CONFIG=config_path,
                   APF_CONCURRENCY_LIMIT=str(workers * threads))
        conf = (["-c", "python:apf_gunicorn.conf"] if apf
                else ["-k", "gthread", "--no-control-socket"])
        cmd = [GUNICORN, *conf, "-w", str(workers), "--threads", str(threads),
               "-b", f"127.0.0.1:{self.port}", "--log-level", "warning",
               "tests.apps.app:app"]
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=_pinned(SERVER_CPUS))
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/hello")
                if c.getresponse().status == 200:
                    c.close()
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.1)
        if SPREAD and workers > 1:
            spread_workers(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(5)
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"apf_{self.instance}_")]
        if left:
            print(f"WARNING: /dev/shm entries left behind: {left}", file=sys.stderr)


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")


def wrk(port: int, duration: float, connections: int, path: str = "/hello",
        timeout: float = 2.0, headers: tuple[str, ...] = ()) -> dict:
    """One ``wrk`` run: requests/s, p50 and p99 latency (s), and its counts: ``requests``
    answered in ``seconds``, ``non2xx`` of them (wrk: not 2xx or 3xx), ``errors`` (socket
    errors: connect, read, write, time-outs after ``timeout`` seconds). ``headers``: extra
    request headers (``"Name: value"``; ``"Connection: close"`` makes wrk reconnect for every
    request)."""
    out = subprocess.run(
        ["wrk", "-t2", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency",
         f"--timeout={timeout:g}s", *(a for h in headers for a in ("-H", h)),
         f"http://127.0.0.1:{port}{path}"], capture_output=True,
        text=True, timeout=duration + timeout + 30, preexec_fn=_pinned(LOAD_CPUS)).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M))
    done = re.search(r"(\d+) requests in ([\d.]+\w+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       out)
    return {"rps": rps, "p50": _seconds(lat.get("50", "nan")),
            "p99": _seconds(lat.get("99", "nan")), "requests": int(done.group(1)),
            "seconds": _seconds(done.group(2)), "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "errors": sum(int(g) for g in errors.groups()) if errors else 0}


def pyload(port: int, duration: float, connections: int, path: str = "/hello") -> dict:
    """Like ``wrk``, from threads of this process (GIL-bound: its rate is its own limit)."""
    lats: list[float] = []
    statuses: list[int] = []
    lock = threading.Lock()
    stop = time.monotonic() + duration

    def run():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        mine, codes = [], []
        while time.monotonic() < stop:
            t0 = time.monotonic()
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            mine.append(time.monotonic() - t0)
            codes.append(resp.status)
        conn.close()
        with lock:
            lats.extend(mine)
            statuses.extend(codes)

    threads = [threading.Thread(target=run) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lats.sort()
    return {"rps": len(lats) / duration, "p50": lats[len(lats) // 2],
            "p99": lats[int(len(lats) * 0.99)], "requests": len(lats), "seconds": duration,
            "non2xx": sum(1 for s in statuses if not 200 <= s < 400), "errors": 0}


def median_interval(values: list[float], reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values`` (seeded: the same input, the same
    interval)."""
    rng = random.Random(1)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(reps))
    return meds[int(reps * 0.025)], meds[int(reps * 0.975) - 1]


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of these processes, in clock ticks."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total


def measure(srv: Server, duration: float, connections: int, load) -> dict:
    """One wrk run against a running server, with its workers' CPU time per request."""
    pids = children(srv.proc.pid)
    before = cpu_ticks(pids)
    result = load(srv.port, duration, connections)
    ticks = cpu_ticks(pids) - before
    served = result["rps"] * duration
    result["cpu_us"] = ticks / os.sysconf("SC_CLK_TCK") * 1e6 / served if served else float("nan")
    return result


def worker_rss(srv: Server, all_threads: int, load) -> list[int]:
    """Start every thread of every worker, then read the workers' RSS (KiB)."""
    load(srv.port, 1.0, all_threads)
    return sorted(rss_kib(p) for p in children(srv.proc.pid))


def micro(config_path: str, n: int = 50_000) -> tuple[float, float]:
    """CPU per request (µs) of a trivial WSGI app called directly, and through the
    middleware with a real shm ledger and ProcessLock (fast path: admit, run, finish)."""
    sys.path.insert(0, str(ROOT))
    from apf_gunicorn.admission.dispatcher import Parking
    from apf_gunicorn.flowcontrol.limits import compute_limits
    from apf_gunicorn.flowcontrol.loader import load_configuration
    from apf_gunicorn.flowcontrol.matching import Classifier
    from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
    from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
    from apf_gunicorn.ledger.layout import Capacity
    from apf_gunicorn.ledger.ledger import Ledger
    from apf_gunicorn.ledger.lock import ProcessLock
    from apf_gunicorn.server import shm
    from apf_gunicorn.server.dumps import encode_detail
    from apf_gunicorn.server.generation import level_specs
    from apf_gunicorn.server.state import Generation

    cfg = load_configuration(config_path)
    gen = Generation(cfg, compute_limits(cfg.priority_levels.values(), 64), Classifier(cfg),
                     {}, {})
    seg = shm.Segment.create("micro" + uuid.uuid4().hex[:6], Ledger.size(Capacity()))
    try:
        led = Ledger.create(seg.ledger_buffer, Capacity(), lock=ProcessLock())
        levels, schemas = led.configure(level_specs(gen), [f.name for f in cfg.flow_schemas],
                                        time.monotonic_ns())
        ctx = WorkerContext(ledger=led, resolver=RequestInfoResolver(), classifier=gen.classifier,
                            level_index=levels, fs_index=schemas, owner=0, parking=Parking(),
                            deliver=lambda g: None, add_linger=lambda *a: None,
                            queue_wait_limit_ns=15 * 10**9, alive=lambda: True,
                            encode_detail=encode_detail)

        def app(environ, start_response):
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"hello"]

        mw = APFMiddleware(app, ctx)
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/hello", "QUERY_STRING": "",
                   "REMOTE_ADDR": "127.0.0.1", "SERVER_PROTOCOL": "HTTP/1.1"}

        def sr(status, headers, exc_info=None):
            return None

        def run(wsgi):
            # this thread's CPU time, not wall time: other processes competing for the
            # cores (a shared build machine) do not count, only what a request costs
            t0 = time.thread_time()
            for _ in range(n):
                body = wsgi(environ, sr)
                for _chunk in body:
                    pass
                close = getattr(body, "close", None)
                if close:
                    close()
            return (time.thread_time() - t0) / n * 1e6

        bare = min(run(app) for _ in range(3))
        apf = min(run(mw) for _ in range(5))
        led.close()
        return bare, apf
    finally:
        seg.unlink()


def _micro_child(root: str, config_path: str) -> None:
    """--serve: run ``micro`` of the checkout at ``root`` once per line of stdin (n)."""
    sys.path.insert(0, root)
    import apf_gunicorn

    if not apf_gunicorn.__file__.startswith(root):
        raise SystemExit(f"imported {apf_gunicorn.__file__}, not the checkout at {root}")
    for line in sys.stdin:
        bare, apf = micro(config_path, n=int(line))
        print(apf - bare, flush=True)


def micro_ab(baseline: str, config_path: str, reps: int, n: int = 4000) -> None:
    """Added µs per request of this checkout and of ``baseline`` (another checkout, e.g.
    ``git worktree add /tmp/base <commit>``), one child process each, measured in turns so
    both see the same machine load; prints min and median of ``reps`` turns each."""
    me = Path(__file__).resolve()
    roots = [str(ROOT), str(Path(baseline).resolve())]
    kids = [subprocess.Popen([sys.executable, str(me), "--serve", root, config_path],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for root in roots]
    added: list[list[float]] = [[], []]
    try:
        for i in range(reps):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                kids[k].stdin.write(f"{n}\n")
                kids[k].stdin.flush()
                added[k].append(float(kids[k].stdout.readline()))
    finally:
        for kid in kids:
            kid.stdin.close()
            kid.wait(30)
    for name, vals in (("this checkout", added[0]), (baseline, added[1])):
        print(f"added µs per request, {name}: min {min(vals):.2f}, median "
              f"{statistics.median(vals):.2f} ({reps} turns)")
    print(f"ratio this/baseline: min {min(added[0]) / min(added[1]):.3f}, median "
          f"{statistics.median(added[0]) / statistics.median(added[1]):.3f}")


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve"]:
        _micro_child(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per round (wrk: whole)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--workers", default="1,2",
                    help="comma list: one setup per value (default 1,2)")
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--connections", default="16,64",
                    help="comma list, one per --workers value, or one for all")
    ap.add_argument("--pin", choices=("spread", "split", "none"), default="spread",
                    help="spread: worker i on CPU i (default); split: servers on all CPUs "
                         "but the last, the load generator on the last; none")
    ap.add_argument("--micro-only", action="store_true",
                    help="only the in-process CPU cost per request")
    ap.add_argument("--baseline", metavar="DIR",
                    help="with --micro-only: compare with the checkout in DIR, in turns")
    ap.add_argument("--reps", type=int, default=20, help="--baseline: turns each")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        Path(config_path).write_text(BENCH_CONFIG)
        if args.baseline:
            micro_ab(args.baseline, config_path, args.reps)
            return 0
        bare_us, apf_us = micro(config_path)
        print(f"in-process CPU per request: app alone {bare_us:.2f} µs, through APF "
              f"{apf_us:.2f} µs, added {apf_us - bare_us:.2f} µs (fast path, real shm ledger)")
    if args.micro_only:
        return 0
    global SERVER_CPUS, LOAD_CPUS, SPREAD
    if args.pin == "split":
        split = pin_split()
        if split is None:
            print("--pin split: only one CPU available; running unpinned")
        else:
            SERVER_CPUS, LOAD_CPUS = split
    SPREAD = args.pin == "spread"
    load = wrk if shutil.which("wrk") else pyload
    setups = _setups(args.workers, args.connections)
    print(f"load generator: {'wrk' if load is wrk else 'python (install wrk for sharper numbers)'}; "
          f"{args.threads} threads per worker; per setup {args.rounds} rounds of "
          f"{args.duration:g} s on each server, both servers up, order alternating"
          + (f"; servers on CPUs {sorted(SERVER_CPUS)}, load on {sorted(LOAD_CPUS)}"
             if SERVER_CPUS else "; with several workers, worker i on CPU i" if SPREAD
             else ""))
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        Path(config_path).write_text(BENCH_CONFIG)
        summaries = [run_setup(workers, connections, args, load, config_path)
                     for workers, connections in setups]
    print("\nsummary (target: throughput ratio >= 0.90, RSS added <= 15 MiB per worker)")
    for line in summaries:
        print(line)
    return 0


def _setups(workers: str, connections: str) -> list[tuple[int, int]]:
    """``--workers 1,2 --connections 16,64`` -> [(1, 16), (2, 64)]."""
    ws = [int(w) for w in workers.split(",")]
    cs = [int(c) for c in connections.split(",")]
    if len(cs) == 1:
        cs *= len(ws)
    if len(cs) != len(ws):
        raise SystemExit("--connections: one value, or one per --workers value")
    return list(zip(ws, cs, strict=True))


def run_setup(workers: int, connections: int, args, load, config_path: str) -> str:
    """Paired rounds on a bare and an APF server with ``workers`` workers; prints the rounds
    and the setup's results, returns its one-line summary."""
    print(f"\n== {workers} worker(s) x {args.threads} threads, {connections} connections")
    bare = Server(False, workers, args.threads, config_path)
    try:
        apf = Server(True, workers, args.threads, config_path)
    except BaseException:
        bare.stop()
        raise
    try:
        for srv in (bare, apf):
            load(srv.port, 1.0, connections)  # warm-up
        runs: dict[str, list[dict]] = {"bare": [], "apf": []}
        for i in range(args.rounds):
            order = (("bare", bare), ("apf", apf))
            for name, srv in (order if i % 2 == 0 else order[::-1]):
                runs[name].append(measure(srv, args.duration, connections, load))
            b, a = runs["bare"][-1], runs["apf"][-1]
            print(f"round {i + 1}: bare {b['rps']:.0f} req/s ({b['cpu_us']:.0f} µs CPU/req, "
                  f"p50 {b['p50'] * 1e3:.2f} ms, p99 {b['p99'] * 1e3:.2f} ms) | apf "
                  f"{a['rps']:.0f} req/s ({a['cpu_us']:.0f} µs CPU/req, p50 "
                  f"{a['p50'] * 1e3:.2f} ms, p99 {a['p99'] * 1e3:.2f} ms) | ratio "
                  f"{a['rps'] / b['rps']:.3f}")
        rss_bare = worker_rss(bare, workers * args.threads, load)
        rss_apf = worker_rss(apf, workers * args.threads, load)
    finally:
        apf.stop()
        bare.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    ratios = [a["rps"] / b["rps"] for a, b in zip(runs["apf"], runs["bare"], strict=True)]
    total = sum(r["rps"] for r in runs["apf"]) / sum(r["rps"] for r in runs["bare"])
    cpu_b, cpu_a = med("bare", "cpu_us"), med("apf", "cpu_us")
    ratio = statistics.median(ratios)
    lo, hi = median_interval(ratios)
    print(f"throughput ratio APF/bare: median of rounds {ratio:.3f} (95% interval "
          f"{lo:.3f}-{hi:.3f}), all requests {total:.3f}  (target >= 0.90)")
    print(f"worker CPU per request (median): bare {cpu_b:.0f} µs, apf {cpu_a:.0f} µs, "
          f"ratio {cpu_b / cpu_a:.3f} (bare/apf: the throughput a CPU-bound server keeps)")
    p50 = (med("apf", "p50") - med("bare", "p50")) * 1e3
    p99 = (med("apf", "p99") - med("bare", "p99")) * 1e3
    print(f"p50 added: {p50:+.2f} ms   p99 added: {p99:+.2f} ms  (medians)")
    rb, ra = statistics.median(rss_bare) / 1024, statistics.median(rss_apf) / 1024
    print(f"worker RSS at {args.threads} threads: bare {rb:.1f} MiB, apf {ra:.1f} MiB, "
          f"added {ra - rb:+.1f} MiB  (target <= 15 MiB)")
    return (f"{workers} worker(s), {connections} connections: throughput ratio {ratio:.3f} "
            f"(95% {lo:.3f}-{hi:.3f}, all requests {total:.3f}), CPU/request ratio "
            f"{cpu_b / cpu_a:.3f}, p50 {p50:+.2f} ms, p99 {p99:+.2f} ms, RSS {ra - rb:+.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
