"""A light user beside a flood of equal requests (issue 27), on a real gunicorn + apf_gunicorn.

    .venv/bin/python benchmarks/bench_lockstep.py [--seconds 10] [--warmup 2]

The server: 2 workers x 64 threads, ``APF_CONCURRENCY_LIMIT=20`` (the level ``users`` of the
built-in configuration executes 16), ``tests/apps/app.py``; ``APF_TRUSTED_PROXIES=127.0.0.1``
so the clients name themselves (``X-Remote-User``: every client is a signed-in user in
``users``). Five light users (``light-0`` .. ``light-4``), each one request at a time on a
kept-alive connection to ``GET /work?ms=1`` with 100 ms of thought after each answer; a flood
(``flood``): 30 kept-alive connections re-sending ``GET /work?ms=200`` the moment each answer
arrives, or with ``±20 %`` uniform jitter on the 200 ms. One server per fairness
(``APF_FAIRNESS=maxmin`` and ``kubernetes``, both up at once and loaded in turns, so that
a change in the machine's load hits both alike); per server three windows of ``--seconds``
each: the light users alone, beside the flood, beside the jittered flood (the first
``--warmup`` seconds of each window are not counted: the flood starts all its connections at
once, which is where a lockstep comes from). About 6 x (seconds + warmup) + boot in all:
~80 s by default.

Prints per window the light users' p50 and p99 latency and how many answers each stands on,
and the flood's 200s per second; then each "Done means" line of the issue as met/MISSED:

* maxmin, beside the flood: light p50 <= alone + 20 ms and p99 <= alone + 60 ms (each over
  >= 100 answers); the flood's 200s/s >= 0.95 x 16 seats / 200 ms;
* maxmin, beside the jittered flood: p50 and p99 no worse than under ``kubernetes`` beside
  the same flood (Kubernetes' dispatch is unchanged, and behaved as ``maxmin`` did before the
  lockstep hold: the issue's table), with 5 ms of slack for the machine's noise. For the real
  "before", copy this file into a checkout of the older commit (it needs only
  ``tests/conftest.py`` and ``tests/apps/app.py``) and run it there: its ``maxmin`` rows are
  the old code's. On a loaded machine a p99 of ~430 answers swings by tens of ms between
  runs of the same code: rerun before reading a MISSED there.

The load generators are Python threads sharing the machine's cores with the server: on a busy
machine every latency grows. Traffic goes to 127.0.0.1 only; every server is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.conftest import serve  # noqa: E402

WORKERS, THREADS, LIMIT, SEATS = 2, 64, 20, 16
LIGHT_USERS, THINK_S, LIGHT_PATH = 5, 0.100, "/work?ms=1"
FLOOD, FLOOD_MS, JITTER = 30, 200.0, 0.2


class Client(threading.Thread):
    """One connection's closed loop: a request, its answer, ``think`` seconds, again. Keeps
    the latency of each 200 answered after ``count_from`` (monotonic seconds)."""

    def __init__(self, port: int, user: str, path, think: float, stop: threading.Event,
                 count_from: float) -> None:
        super().__init__(daemon=True)
        self.port, self.headers, self.path, self.think = port, {"X-Remote-User": user}, path, think
        self.stop, self.count_from = stop, count_from
        self.latencies: list[float] = []
        self.other: Counter = Counter()  # answers other than 200 by status, "error" for none

    def run(self) -> None:
        conn = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                t0 = time.monotonic()
                conn.request("GET", self.path(), headers=self.headers)
                resp = conn.getresponse()
                resp.read()
                t1 = time.monotonic()
                if t0 >= self.count_from:
                    if resp.status == 200:
                        self.latencies.append(t1 - t0)
                    else:
                        self.other[resp.status] += 1
            except (OSError, http.client.HTTPException):
                self.other["error"] += 1
                if conn is not None:
                    conn.close()
                conn = None
            if self.think:
                self.stop.wait(self.think)
        if conn is not None:
            conn.close()


def rank(values: list[float], q: float) -> float:
    """Nearest-rank quantile (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, -(-int(q * 1000) * len(ordered) // 1000) - 1)]


def window(port: int, seconds: float, warmup: float, flood: bool, jitter: float) -> dict:
    """One window: the light users, and the flood if asked; returns what each got."""
    stop = threading.Event()
    start = time.monotonic()
    count_from = start + warmup
    rnd = random.Random(27)

    def flood_path() -> str:
        return f"/work?ms={FLOOD_MS * (1 + rnd.uniform(-jitter, jitter)):.1f}"

    floods = [Client(port, "flood", flood_path, 0.0, stop, count_from)
              for _ in range(FLOOD)] if flood else []
    lights = [Client(port, f"light-{i}", lambda: LIGHT_PATH, THINK_S, stop, count_from)
              for i in range(LIGHT_USERS)]
    for c in floods + lights:
        c.start()
    time.sleep(warmup + seconds)  # the window's length (measured, not a synchronisation)
    stop.set()
    for c in floods + lights:
        c.join(60)
        if c.is_alive():
            raise RuntimeError("a load generator thread did not stop")
    light = [x for c in lights for x in c.latencies]
    return {"p50": rank(light, 0.5), "p99": rank(light, 0.99), "n": len(light),
            "light_other": dict(sum((c.other for c in lights), Counter())),
            "flood_per_s": sum(len(c.latencies) for c in floods) / seconds,
            "flood_other": dict(sum((c.other for c in floods), Counter()))}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def run(seconds: float, warmup: float) -> dict:
    """Both fairnesses, three windows each, the two servers up together and loaded in turns
    (each window under ``maxmin``, then the same under ``kubernetes``), so that a change in
    the machine's load hits both alike; returns ``{fairness: {window: result}}``."""
    results: dict = {"maxmin": {}, "kubernetes": {}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = {}
        for fairness in results:
            env = {"APF_CONCURRENCY_LIMIT": str(LIMIT), "APF_FAIRNESS": fairness}
            servers[fairness] = stack.enter_context(serve(
                Path(tmp), workers=WORKERS, threads=THREADS, env=env, config="builtin:webapp"))
        for name, flood, jitter in (("alone", False, 0.0), ("flood", True, 0.0),
                                    ("jitter", True, JITTER)):
            for fairness, srv in servers.items():
                srv.idle(60)
                r = results[fairness][name] = window(srv.port, seconds, warmup, flood, jitter)
                print(f"{fairness:10} {name:7} light p50 {ms(r['p50'])} p99 {ms(r['p99'])}"
                      f" over {r['n']:5} answers (others {r['light_other'] or 0})  flood "
                      f"{r['flood_per_s']:5.1f} 200s/s (others {r['flood_other'] or 0})",
                      flush=True)
    return results


def verdicts(results: dict) -> list[tuple[str, bool]]:
    """The issue's "Done means" lines, each with whether it holds."""
    mm, k8s = results["maxmin"], results["kubernetes"]
    alone, fl, jit = mm["alone"], mm["flood"], mm["jitter"]
    need = 0.95 * SEATS / (FLOOD_MS / 1000)
    return [
        (f"maxmin beside the flood: light p50 {ms(fl['p50'])} <= alone {ms(alone['p50'])} + 20 ms"
         f" (over {fl['n']} >= 100)", fl["p50"] <= alone["p50"] + 0.020 and fl["n"] >= 100),
        (f"maxmin beside the flood: light p99 {ms(fl['p99'])} <= alone {ms(alone['p99'])} + 60 ms"
         f" (over {fl['n']} >= 100)", fl["p99"] <= alone["p99"] + 0.060 and fl["n"] >= 100),
        (f"maxmin: the flood's 200s/s {fl['flood_per_s']:.1f} >= 0.95 x 16 / 200 ms = {need:.1f}",
         fl["flood_per_s"] >= need),
        (f"maxmin beside the jittered flood: p50 {ms(jit['p50'])} <= kubernetes "
         f"{ms(k8s['jitter']['p50'])} + 5 ms", jit["p50"] <= k8s["jitter"]["p50"] + 0.005),
        (f"maxmin beside the jittered flood: p99 {ms(jit['p99'])} <= kubernetes "
         f"{ms(k8s['jitter']['p99'])} + 5 ms", jit["p99"] <= k8s["jitter"]["p99"] + 0.005),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="counted seconds per window")
    ap.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds per window")
    args = ap.parse_args(argv)
    if not (0 < args.seconds <= 60 and 0 <= args.warmup <= 30):
        ap.error("--seconds must be in (0, 60] and --warmup in [0, 30]")
    print(f"== light users (5, {LIGHT_PATH}, {THINK_S * 1000:g} ms think) beside a flood "
          f"({FLOOD} connections, {FLOOD_MS:g} ms, then ±{JITTER:.0%}): {WORKERS} workers x "
          f"{THREADS} threads, APF_CONCURRENCY_LIMIT={LIMIT} (users: {SEATS} seats), "
          f"{args.seconds:g} s per window after {args.warmup:g} s", flush=True)
    results = run(args.seconds, args.warmup)
    print("\nDone means (issue 27):")
    for text, ok in verdicts(results):
        print(f"  {'met   ' if ok else 'MISSED'} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
