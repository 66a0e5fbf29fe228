"""A client that ignores Retry-After, beside one that does not: what a storm of retries costs the
server and the others (issue 20), on a real gunicorn + apf_gunicorn.

    .venv/bin/python benchmarks/bench_storm.py [--seconds 8] [--quick] [--only storm|address]

The server: 2 workers x 16 threads, ``APF_CONCURRENCY_LIMIT=8``, the built-in configuration
(``APF_CONFIG`` unset), ``tests/apps/app.py``; ``APF_TRUSTED_PROXIES=127.0.0.1`` so the
clients name themselves (``X-Remote-User``: alice and mallory are both in the level
``users``). Every request is ``GET /work?ms=20``. Scenarios, ``--seconds`` each:

1. alice alone: one request at a time on a kept-alive connection (she waits Retry-After after
   a 429, as a well-behaved client does).
2. alice beside mallory: ``wrk -c32`` on kept-alive connections, re-sending the moment each
   answer arrives (wrk never honours Retry-After).
3. alice beside mallory with a new connection per request (``wrk -H 'Connection: close'``).

For each: alice's answers, p50, p99 and 429s; the server's CPU (user + sys of the master and
its workers from ``/proc``, over wall time, in cores); mallory's 200s and 429s per second; the
429s the server held (``apf_rejections_delayed_total``). Targets (issue 20, 2 cores shared):
alice never rejected; her p99 <= 1.5 x alone + 5 ms (new connections: 2 x + 5 ms); the server
<= 0.5 core (new connections: 0.8); mallory's 200s/s >= 0.7 x (seats of users - 1) / 20 ms.

4. Per-address fairness: a second server with ``APF_USER_FROM=address``; a sequential client
   at one address (``X-Forwarded-For``, trusted from 127.0.0.1) alone, then beside a
   30-connection ``wrk`` flood from another address: its completions against alone (target
   >= 0.8), its 429s (target 0), its p50 against alone, and the ``anonymous`` level's seats
   during the flood. With only unverified identities the built-in configuration is
   ``builtin:public``, whose ``anonymous`` level has 8 of the 8 seats.

``--only storm`` runs scenarios 1-3, ``--only address`` scenario 4.

``--quick`` (2 s per scenario) is what ``tests/test_bench_storm.py`` runs in CI. Needs ``wrk``
(``apt-get install -y wrk``; ``scripts/test.sh`` installs it when it can). The load generators
share the machine's cores with the server: on a loaded machine every latency grows; the
server's CPU is its own processes' time only.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bench_server import wrk  # noqa: E402
from tests.apps.overload import scrape, total  # noqa: E402
from tests.conftest import children, free_port, serve  # noqa: E402

WORKERS, THREADS, LIMIT = 2, 16, 8
PATH = "/work?ms=20"
WORK_S = 0.020
STORM = 32  # mallory's connections
FLOOD = 30  # the per-address flood's connections
CLIENT, FLOODER = "203.0.113.2", "203.0.113.66"


def cpu_seconds(pid: int) -> float:
    """User + sys CPU seconds of ``pid`` and its children (the workers) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    used = 0
    for p in [pid, *children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return used / tick


class Sequential:
    """One client, one request at a time on a kept-alive connection; waits Retry-After after a
    429 (a well-behaved client)."""

    def __init__(self, port: int, headers: dict) -> None:
        self.port = port
        self.headers = headers
        self.latencies: list[float] = []
        self.rejected = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                t0 = time.monotonic()
                conn.request("GET", PATH, headers=self.headers)
                resp = conn.getresponse()
                resp.read()
                took = time.monotonic() - t0
                if resp.status == 429:
                    self.rejected += 1
                    self._stop.wait(float(resp.getheader("Retry-After") or 1))
                elif resp.status == 200:
                    self.latencies.append(took)
                else:
                    self.errors += 1
            except (OSError, http.client.HTTPException):
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Sequential:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        n = len(lat)
        return {"answers": n, "rejected": self.rejected, "errors": self.errors,
                "p50": statistics.median(lat) if lat else float("nan"),
                "p99": lat[min(n - 1, int(n * 0.99))] if lat else float("nan")}


class LimitSampler:
    """The current limit of one priority level (``apf_current_limit_seats``), scraped twice a
    second while a window runs: the borrowing rounds move it every 10 s."""

    def __init__(self, admin: int, level: str) -> None:
        self.admin, self.level = admin, level
        self.seen: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.seen.append(total(scrape(self.admin), "apf_current_limit_seats",
                                       priority_level=self.level))
            except OSError:
                continue

    def __enter__(self) -> LimitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(15)


def window(srv, admin: int, seconds: float, client_headers: dict, storm_headers: tuple | None,
           connections: int = STORM, level: str = "users") -> dict:
    """``seconds`` of the sequential client, beside a wrk storm when ``storm_headers`` is not
    None: the client's summary, the server's CPU, the storm's counts, the held 429s, and the
    seats of ``level`` (its current limit at the end, and the lowest and highest seen)."""
    before = scrape(admin)
    cpu0, t0 = cpu_seconds(srv.pid), time.monotonic()
    with Sequential(srv.port, client_headers) as client, LimitSampler(admin, level) as seen:
        if storm_headers is None:
            time.sleep(seconds)
            storm = None
        else:
            storm = wrk(srv.port, seconds, connections, PATH, timeout=10.0,
                        headers=storm_headers)
    wall = time.monotonic() - t0
    cores = (cpu_seconds(srv.pid) - cpu0) / wall
    after = scrape(admin)
    out = {"client": client.summary(), "cores": cores, "wall": wall,
           "delayed": (total(after, "apf_rejections_delayed_total")
                       - total(before, "apf_rejections_delayed_total")),
           "seats": total(after, "apf_current_limit_seats", priority_level=level),
           "seats_seen": (min(seen.seen), max(seen.seen)) if seen.seen else None}
    if storm is not None:
        ok = storm["requests"] - storm["non2xx"]
        out["storm"] = {"ok_per_s": ok / storm["seconds"],
                        "rejected_per_s": storm["non2xx"] / storm["seconds"],
                        "errors": storm["errors"]}
    return out


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def seats_text(res: dict) -> str:
    """A window's level seats: ``2`` when steady, ``1-2`` when a borrowing round moved them."""
    seen = res["seats_seen"]
    if seen is None or seen[0] == seen[1]:
        return f"{res['seats']:.0f}"
    return f"{seen[0]:.0f}-{seen[1]:.0f}"


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def storm_report(name: str, res: dict, alone: dict, p99_factor: float, cores_max: float) -> None:
    c = res["client"]
    p99_target = p99_factor * alone["client"]["p99"] + 0.005
    line = (f"  {name:22s} alice {c['answers']:4d} answers, p50 {ms(c['p50'])}, "
            f"p99 {ms(c['p99'])} (target <= {ms(p99_target)}: "
            f"{verdict(c['p99'] <= p99_target)}), 429s {c['rejected']} "
            f"({verdict(c['rejected'] == 0)}); server {res['cores']:.2f} cores (target <= "
            f"{cores_max}: {verdict(res['cores'] <= cores_max)})")
    s = res.get("storm")
    if s is not None:
        target = 0.7 * (res["seats"] - 1) / WORK_S
        line += (f"; mallory {s['ok_per_s']:.0f} 200s/s (target >= {target:.0f} with "
                 f"{res['seats']:.0f} seats: {verdict(s['ok_per_s'] >= target)}), "
                 f"{s['rejected_per_s']:.0f} 429s/s, {s['errors']} socket errors; "
                 f"{res['delayed']:.0f} 429s held")
    print(line, flush=True)


def run(seconds: float, only: str | None = None) -> dict:
    """The scenarios (all, or only ``"storm"`` or ``"address"``); returns their results
    (``tests/test_bench_storm.py`` reads them)."""
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if only in (None, "storm"):
            results.update(run_storm(Path(tmp), seconds))
        if only in (None, "address"):
            results.update(run_address(Path(tmp), seconds))
    return results


def run_storm(tmp: Path, seconds: float) -> dict:
    """Scenarios 1-3: alice alone, beside a keep-alive storm, beside a new-connection storm."""
    results: dict = {}
    alice = {"X-Remote-User": "alice"}
    mallory = ("X-Remote-User: mallory",)
    admin = free_port()
    env = {"APF_CONCURRENCY_LIMIT": str(LIMIT), "APF_ADMIN_BIND": f"127.0.0.1:{admin}"}
    print(f"== alice (sequential) beside mallory (wrk -c{STORM}, ignores Retry-After): "
          f"{WORKERS} workers x {THREADS} threads, limit {LIMIT}, built-in configuration, "
          f"{PATH}, {seconds:g} s each", flush=True)
    with serve(tmp, workers=WORKERS, threads=THREADS, env=env, config="builtin:webapp") as srv:
        results["alone"] = window(srv, admin, seconds, alice, None)
        srv.idle(30)
        results["keepalive"] = window(srv, admin, seconds, alice, mallory)
        srv.idle(30)
        results["reconnect"] = window(srv, admin, seconds, alice,
                                      (*mallory, "Connection: close"))
    storm_report("alone", results["alone"], results["alone"], 1.5, 0.5)
    storm_report("keep-alive storm", results["keepalive"], results["alone"], 1.5, 0.5)
    storm_report("new-connection storm", results["reconnect"], results["alone"], 2.0, 0.8)
    return results


def run_address(tmp: Path, seconds: float) -> dict:
    """Scenario 4: per-address fairness with ``APF_USER_FROM=address``."""
    results: dict = {}
    admin = free_port()
    # APF_CONFIG unset: with only unverified identities the built-in one is builtin:public
    env = {"APF_CONCURRENCY_LIMIT": str(LIMIT), "APF_USER_FROM": "address",
           "APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONFIG": ""}
    print(f"== per-address fairness (APF_USER_FROM=address): a sequential client at "
          f"{CLIENT} beside a {FLOOD}-connection wrk flood from {FLOODER}: {WORKERS} workers x "
          f"{THREADS} threads, limit {LIMIT}, built-in configuration (builtin:public), {PATH}, "
          f"{seconds:g} s each",
          flush=True)
    with serve(tmp, workers=WORKERS, threads=THREADS, env=env) as srv:
        me = {"X-Forwarded-For": CLIENT}
        results["address_alone"] = window(srv, admin, seconds, me, None)
        srv.idle(30)
        results["address_flood"] = window(srv, admin, seconds, me,
                                          (f"X-Forwarded-For: {FLOODER}",), FLOOD, "anonymous")
    alone = results["address_alone"]["client"]
    got = results["address_flood"]["client"]
    share = got["answers"] / alone["answers"] if alone["answers"] else float("nan")
    flood = results["address_flood"]["storm"]
    print(f"  client alone {alone['answers']} answers (p50 {ms(alone['p50'])}); beside the "
          f"flood {got['answers']} ({share:.2f} of alone, target >= 0.8: "
          f"{verdict(share >= 0.8)}), 429s {got['rejected']} ({verdict(got['rejected'] == 0)}), "
          f"p50 {ms(got['p50'])}, p99 {ms(got['p99'])}; flood {flood['ok_per_s']:.0f} 200s/s, "
          f"{flood['rejected_per_s']:.0f} 429s/s; server "
          f"{results['address_flood']['cores']:.2f} cores; anonymous level's seats "
          f"{seats_text(results['address_flood'])}", flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per scenario")
    ap.add_argument("--quick", action="store_true", help="2 s per scenario (CI)")
    ap.add_argument("--only", choices=("storm", "address"),
                    help="run only scenarios 1-3 (storm) or only scenario 4 (address)")
    args = ap.parse_args(argv)
    if not shutil.which("wrk"):
        print("wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    run(2.0 if args.quick else args.seconds, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
