"""Draw the README's picture of what APF does, from a real run (``docs/images/effect.png``).

    .venv/bin/pip install '.[plot]'              # matplotlib, only for this script
    .venv/bin/python benchmarks/plot_effect.py [--out docs/images/effect.png] [--json FILE]

Two real gunicorn servers on 127.0.0.1, one after the other, with the same workers and threads
(2 x 20: with the 2 kept per worker for exempt requests, 36 threads hold the flood's 32
connections and the light user's) and the same app (``benchmarks/effect_app.py``: a backend that does 8 things at once,
as a database with a pool of 8 connections; each query holds a connection 50 ms):

* **without APF**: ``gunicorn -k gthread``;
* **with APF**: ``gunicorn -c python:apf_gunicorn.conf`` with the built-in configuration and
  ``APF_CONCURRENCY_LIMIT=10`` (its "users" level gets 8 seats, the pool's size), identities
  from ``X-Remote-User`` (``APF_TRUSTED_PROXIES=127.0.0.1`` stands for an auth proxy).

Against each, for 16 s: a **light user** ("alice", one connection, one query then 200 ms of
think time) all along, and from 4 s to 10 s a **flood** from another user ("bob", 32
connections in a process of their own, each re-sending as soon as it has an answer, or 20 ms
after a 429). Alice's latency per request, and the flood's answers per second by status, are
drawn; the numbers are printed and written beside the picture (``effect.json``; every event
too with ``--json FILE``). Total run time about 40 s.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
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
from tests.apps.procs import free_port  # noqa: E402

GUNICORN = str(Path(sys.executable).parent / "gunicorn")
WORKERS, THREADS, POOL, QUERY_MS = 2, 20, 8, 50
DURATION, FLOOD_START, FLOOD_END = 16.0, 4.0, 10.0
FLOOD_CONNECTIONS, LIGHT_THINK, REJECT_PAUSE = 32, 0.2, 0.02
PATH = f"/query?ms={QUERY_MS}"


@contextlib.contextmanager
def server(apf: bool, tmp: Path):
    """A gunicorn on a free port serving effect_app, with or without APF; stopped after."""
    env = {"APF_CONCURRENCY_LIMIT": "10", "APF_ADMIN_BIND": "off"} if apf else None
    with gunicorn(tmp, env, label="apf" if apf else "bare") as (port, _sem):
        yield port


@contextlib.contextmanager
def gunicorn(tmp: Path, apf_env: dict | None, *, workers: int = WORKERS, threads: int = THREADS,
             label: str = "apf"):
    """A gunicorn on a free port serving effect_app with a fresh pool of POOL "connections";
    with APF (and ``apf_env``'s settings) unless ``apf_env`` is None. Yields ``(port,
    semaphore)``: acquiring permits of the semaphore shrinks the pool at run time. Stopped
    after."""
    import posix_ipc

    port = free_port()
    sem_name = f"/apf-effect-{uuid.uuid4().hex[:8]}"
    sem = posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, initial_value=POOL)
    env = dict(os.environ, EFFECT_SEMAPHORE=sem_name, EFFECT_POOL=str(POOL),
               PYTHONPATH=str(ROOT))
    if apf_env is not None:
        env.update(APF_TRUSTED_PROXIES="127.0.0.1", APF_INSTANCE="effect" + uuid.uuid4().hex[:6])
        env.update(apf_env)
        conf = ["-c", "python:apf_gunicorn.conf"]
    else:
        conf = ["-k", "gthread", "--no-control-socket"]
    cmd = [GUNICORN, *conf, "-w", str(workers), "--threads", str(threads), "-b",
           f"127.0.0.1:{port}", "--pythonpath", str(ROOT / "benchmarks"), "--graceful-timeout",
           "3", "effect_app:app"]
    try:
        with running(cmd, env, tmp / f"gunicorn-{label}.log", port):
            yield port, sem
    finally:
        sem.unlink()
        sem.close()


@contextlib.contextmanager
def running(cmd: list[str], env: dict, log_path: Path, port: int):
    """Runs the gunicorn ``cmd`` (its own session, output to ``log_path``) and waits until
    ``GET /ok`` on ``port`` answers 200 (30 s at most: then, or if it exits, RuntimeError
    naming the log). Yields the process; stops it after (SIGTERM, then SIGKILL to its session
    if it lingers). Shared with ``bench_asgi.py``."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited: see {log.name}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/ok")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn did not answer: see {log.name}")
            time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def _client_loop(port: int, user: str, t0: float, start: float, end: float, think: float,
                 events: list, path: str = PATH) -> None:
    """One keep-alive connection: ``GET path`` until ``end`` (seconds after ``t0``); appends
    (sent at, latency, status) per answer, status 0 for a connection error."""
    while time.monotonic() - t0 < start:
        time.sleep(0.005)
    conn = None
    while (sent := time.monotonic()) - t0 < end:
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", path, headers={"X-Remote-User": user})
            resp = conn.getresponse()
            resp.read()
            status = resp.status
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            status = 0
            if conn is not None:
                conn.close()
            conn = None
        done = time.monotonic()
        events.append((sent - t0, done - sent, status))
        if think:
            time.sleep(think)
        elif status != 200:
            time.sleep(REJECT_PAUSE)
    if conn is not None:
        conn.close()


def _flood(port: int, t0: float, out, start: float = FLOOD_START, end: float = FLOOD_END,
           connections: int = FLOOD_CONNECTIONS, path: str = PATH) -> None:
    """The flood's process: ``connections`` threads of bob's from ``start`` to ``end``; sends
    their events back through ``out`` (time.monotonic is system-wide, so ``t0`` means the same
    here)."""
    events: list = []
    threads = [threading.Thread(target=_client_loop,
                                args=(port, "bob", t0, start, end, 0.0, events, path))
               for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send(events)
    out.close()


def run(port: int) -> dict:
    """The light user and the flood against one server; their events."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t0 = time.monotonic() + 0.5
    flood = ctx.Process(target=_flood, args=(port, t0, send))
    flood.start()
    light: list = []
    _client_loop(port, "alice", t0, 0.0, DURATION, LIGHT_THINK, light)
    heavy = recv.recv()
    flood.join()
    return {"light": light, "flood": heavy}


def summary(events: dict) -> dict:
    """Alice's median and p99 latency alone and during the flood; the flood's answers. A
    window in which alice sent nothing (a short run on a loaded machine: one slow answer can
    span it) has NaN for its latencies."""
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def median(xs):
        return statistics.median(xs) if xs else float("nan")

    during = [lat for t, lat, s in events["light"] if FLOOD_START + 0.5 <= t < FLOOD_END]
    alone = [lat for t, lat, s in events["light"] if t < FLOOD_START]
    statuses: dict[str, int] = {}
    for _, _, s in events["flood"]:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    return {
        "light_alone_p50_ms": round(median(alone) * 1000, 1),
        "light_flood_p50_ms": round(median(during) * 1000, 1),
        "light_flood_p99_ms": round(pct(during, 0.99) * 1000, 1),
        "light_requests": len(events["light"]),
        "light_not_200": sum(1 for _, _, s in events["light"] if s != 200),
        "flood_statuses": statuses,
    }


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"bare": "#c0392b", "apf": "#2471a3"}
    names = {"bare": "without APF (gthread)", "apf": "with APF"}
    fig = plt.figure(figsize=(9, 6.2), dpi=90)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.15, 1], hspace=0.45, wspace=0.22)
    ax = fig.add_subplot(grid[0, :])
    for key in ("bare", "apf"):
        pts = [(t, lat * 1000) for t, lat, s in results[key]["light"]]
        s = results[key]["summary"]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", ms=3, lw=0.8,
                color=colors[key], label=f"{names[key]}: median {s['light_flood_p50_ms']:.0f} ms "
                f"during the flood, {s['light_alone_p50_ms']:.0f} ms alone")
    ax.axvspan(FLOOD_START, FLOOD_END, color="#999999", alpha=0.18, lw=0,
               label=f"bob floods with {FLOOD_CONNECTIONS} connections")
    ax.set_yscale("log")
    ticks = [30, 50, 100, 200, 500, 1000]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(30, 1500)
    ax.set_xlim(0, DURATION)
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_xlabel("seconds")
    ax.set_title("A light user's requests (alice: one query, then 200 ms of thinking)",
                 fontsize=11, loc="left")
    ax.legend(fontsize=8.5, loc="upper left", framealpha=0.9)
    ax.grid(True, alpha=0.25)

    bins = range(int(FLOOD_START) - 1, int(FLOOD_END) + 2)
    top = 0
    axes = []
    for col, key in enumerate(("bare", "apf")):
        bx = fig.add_subplot(grid[1, col])
        axes.append(bx)
        served = [0] * len(bins)
        rejected = [0] * len(bins)
        for t, _, s in results[key]["flood"]:
            i = int(t) - bins[0]
            if 0 <= i < len(bins):
                (served if s == 200 else rejected)[i] += 1
        xs = [b + 0.5 for b in bins]
        bx.bar(xs, served, width=0.8, color=colors[key], label="served (200)")
        bx.bar(xs, rejected, width=0.8, bottom=served, color="#f5b041",
               label="rejected (429, Retry-After)")
        top = max(top, *(a + b for a, b in zip(served, rejected, strict=True)))
        bx.set_title(f"bob's flood, {names[key]}", fontsize=10, loc="left")
        bx.set_xlabel("seconds")
        bx.grid(True, axis="y", alpha=0.25)
        if col == 0:
            bx.set_ylabel("answers per second")
        handles, labels = bx.get_legend_handles_labels()
        keep = [i for i, lab in enumerate(labels) if any(rejected) or "429" not in lab]
        bx.legend([handles[i] for i in keep], [labels[i] for i in keep], fontsize=8,
                  loc="upper right", framealpha=0.9)
    for bx in axes:
        bx.set_ylim(0, top * 1.4)
    fig.suptitle(f"One gunicorn, {WORKERS} workers x {THREADS} threads, a backend that does "
                 f"{POOL} queries at once ({QUERY_MS} ms each)", fontsize=10, y=0.995)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight", pil_kwargs={"optimize": True})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "effect.png"))
    parser.add_argument("--json", help="also write the events and numbers to this file")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is missing: .venv/bin/pip install '.[plot]'", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in ("bare", "apf"):
            with server(key == "apf", Path(tmp)) as port:
                results[key] = run(port)
            results[key]["summary"] = summary(results[key])
            print(key, json.dumps(results[key]["summary"]))
    out = Path(args.out)
    plot(results, out)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    numbers = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "cpus": os.cpu_count(), "workers": WORKERS, "threads": THREADS, "pool": POOL,
               "query_ms": QUERY_MS, "flood_connections": FLOOD_CONNECTIONS,
               "flood_seconds": [FLOOD_START, FLOOD_END],
               **{key: results[key]["summary"] for key in ("bare", "apf")}}
    out.with_suffix(".json").write_text(json.dumps(numbers, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.json')}")
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
