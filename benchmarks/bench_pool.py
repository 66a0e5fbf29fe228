"""The default limit in front of a real PostgreSQL pool (issue 33's first Done-means line).

    .venv/bin/python benchmarks/bench_pool.py [--kinds sqlalchemy psycopg_pool django]
                                              [--duration 18] [--json FILE] [--neighbour]
    .venv/bin/python benchmarks/bench_pool.py --worker uvicorn [--kinds asyncpg psycopg_async]

Starts a throwaway PostgreSQL (``tests/apps/pgserver.py``; Debian's ``postgresql`` package,
which ``scripts/test.sh`` installs), then per pool kind real gunicorn servers on 127.0.0.1,
one after the other: 2 workers x 20 threads serving ``benchmarks/pool_bench_app.py`` (Flask;
each ``/query`` one ``SELECT pg_sleep(0.05)`` on a pooled connection, 4 per worker: 8
server-wide) with the built-in configuration (identities from a trusted ``X-Remote-User``).
Five light users (one request, then 200 ms of thought) all along; a 32-connection flood (one
user, retrying 20 ms after a 429) from 2 s. Rows:

* **before**: ``APF_CONCURRENCY_LIMIT=20``, the default of this shape without the pools (what
  the default was before it read them);
* **nothing set**: no ``APF_CONCURRENCY_LIMIT``: the default, which follows the pools;
* **tuned 10**: ``APF_CONCURRENCY_LIMIT=10``, tuned by hand;
* **auto**: ``APF_CONCURRENCY_LIMIT=auto``: the pools first, then the CPU, latency the fallback.

Per row, over the window from 4 s after the flood starts to the end: the light users' p50 and
p99 and how many requests they stand on, the flood's 200s per second, answers that were not
200, 5xx, and the limit sampled each second from the admin endpoint. Verdicts per kind: the
nothing-set row's light p99 <= 1.2 x tuned's + 5 ms, its flood 200s >= 0.9 x tuned's, no 5xx,
and each p99 on at least 100 light requests. The machine's load average is printed before
each row: on a shared host, read the numbers with it.

``--worker uvicorn``: the same under ``-k apf_gunicorn.asgi.UvicornWorker`` (2 workers), with
the app's async pools (a Starlette app: ``asyncpg``'s pool, psycopg_pool's
``AsyncConnectionPool``; 4 connections per worker). A request waiting there holds no thread,
so the default without the pools is workers x 32 = 64 seats, which is the "before" row.

``--neighbour`` (capacity that moves, issue 33): the same servers, rows "nothing set",
"tuned 10" and "auto", 38 s each (the verdicts judge "nothing set"); in each worker a neighbour tenant (``tests/apps/neighbour.py``: another
tenant's job in the app, checking its connections out of the app's own pool and holding them)
takes 2 of the 4 connections from 14 s to 26 s. Why that and not the alternatives: it takes
half the pool's capacity from the requests while the pool's size stays, which is what another
tenant sharing a pool does; a small ``max_connections`` would make a checkout fail to connect
(a 500 under SQLAlchemy) and only bite when a pool opens a connection, and a loaded database
only makes queries slower (the latency rule's case). Per phase (before 6-14 s, neighbour
14-26 s, after 26-38 s): the light users' p50/p99 (n), the flood's 200s per second, the users
level's seats (min-max); the limit and the seats sampled every 0.25 s; the verdicts: the seats
follow (at most one above the connections left) within 5 s of when the neighbour held its
connections and come back (to the seats before, or the pool's size) within 5 s of when it gave
them back, no 5xx, the light users only 200s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from bench_adaptive import _metrics_lines, _pct  # noqa: E402
from plot_effect import GUNICORN, _client_loop, _flood, running  # noqa: E402

from tests.apps import neighbour  # noqa: E402
from tests.apps.pgserver import PostgresServer  # noqa: E402
from tests.apps.procs import children, free_port  # noqa: E402

WORKERS, THREADS, FLOOD, LIGHT_USERS, THINK = 2, 20, 32, 5, 0.2
FLOOD_START, SETTLE = 2.0, 4.0
PATH = "/query?ms=50"
ENOUGH = 100
ROWS = [("before", "20"), ("nothing set", None), ("tuned 10", "10"), ("auto", "auto")]
KINDS = ("sqlalchemy", "psycopg_pool", "django")
#: --worker uvicorn: the async pools, and the ASGI default without them (2 workers x 32)
ASYNC_KINDS = ("asyncpg", "psycopg_async")
ASYNC_ROWS = [("before", "64"), ("nothing set", None), ("tuned 10", "10")]
UVICORN = "apf_gunicorn.asgi.UvicornWorker"


def run_row(dsn: str, kind: str, limit: str | None, duration: float, tmp: Path,
            worker: str = "gthread", env_extra: dict | None = None,
            timeline: Sequence[tuple[float, Callable]] = (), sample_every: float = 1.0) -> dict:
    """One server and the traffic against it: the events and the limit every
    ``sample_every`` seconds as ``(t, server limit, the users level's nominal seats)``;
    ``timeline``'s callables run at their second of the run. ``worker``: ``gthread`` (2 x 20
    threads) or ``uvicorn`` (the async kinds)."""
    admin, port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), POOL_BENCH_KIND=kind, POOL_BENCH_DSN=dsn,
               APF_TRUSTED_PROXIES="127.0.0.1", APF_ADMIN_BIND=f"127.0.0.1:{admin}",
               APF_INSTANCE="pool" + uuid.uuid4().hex[:6], **(env_extra or {}))
    env.pop("APF_CONCURRENCY_LIMIT", None)
    if limit is not None:
        env["APF_CONCURRENCY_LIMIT"] = limit
    kind_args = ["-k", UVICORN] if worker == "uvicorn" else ["--threads", str(THREADS)]
    cmd = [GUNICORN, "-c", "python:apf_gunicorn.conf", "-w", str(WORKERS), *kind_args,
           "-b", f"127.0.0.1:{port}", "--pythonpath", str(ROOT / "benchmarks"),
           "--graceful-timeout", "3", "pool_bench_app:app"]
    log = tmp / f"gunicorn-{kind}-{limit}.log"
    split: list[int] = []
    with running(cmd, env, log, port) as proc:
        if worker == "uvicorn":
            _wait_for_every_worker(log)
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        t0 = time.monotonic() + 0.5
        flood = ctx.Process(target=_flood, args=(port, t0, send, FLOOD_START, duration, FLOOD,
                                                 PATH))
        flood.start()
        samples: list = []
        stop = threading.Event()

        def sample() -> None:
            k = 0
            while not stop.is_set():
                samples.append((round(time.monotonic() - t0, 2), *_limit_and_seats(admin)))
                k += 1
                if len(samples) * sample_every >= FLOOD_START + SETTLE + 1 and not split:
                    split.extend(connection_split(proc.pid, port))  # the flood's, in the window
                stop.wait(max(0.0, t0 + k * sample_every - time.monotonic()))

        def play() -> None:
            for at, action in timeline:
                if stop.wait(max(0.0, t0 + at - time.monotonic())):
                    return
                action()

        light: list = []
        threads = [threading.Thread(target=sample), threading.Thread(target=play)] + [
            threading.Thread(target=_client_loop, args=(port, f"light-{i + 1}", t0, 0.0,
                                                        duration, THINK, light, PATH))
            for i in range(LIGHT_USERS)]
        for t in threads:
            t.start()
        heavy = recv.recv()
        flood.join()
        for t in threads[2:]:
            t.join()
        stop.set()
        threads[0].join()
        threads[1].join()
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if "concurrency limit" in ln and "->" in ln]
    return {"light": light, "flood": heavy, "limit": samples, "log": lines, "split": split,
            "t0": t0}


def _wait_for_every_worker(log: Path, timeout: float = 30.0) -> None:
    """Wait until every uvicorn worker has started serving (its lifespan done, its accept gate
    up): ``running`` returns when the first one answers, and connections accepted before the
    second one joins stay on the first (docs/asgi.md, the accept gate), which on a loaded host
    (a worker's boot takes seconds) decided the rows' split instead of the server."""
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count("Application startup complete.") < WORKERS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every worker started: see {log}")
        time.sleep(0.05)


def connection_split(master: int, port: int) -> list[int]:
    """The client connections each worker of ``master`` holds on ``port`` now, most first
    (from /proc). Under the uvicorn worker the flood's connections can land mostly in one
    worker, whose own pool then bounds what its seats serve: read a row with its split."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cells = row.split()
            if cells[3] == "01" and int(cells[1].rsplit(":", 1)[1], 16) == port:  # ESTABLISHED
                inodes.add(cells[9])
    counts = []
    for pid in children(master):
        held = 0
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            held += link.startswith("socket:[") and link[8:-1] in inodes
        counts.append(held)
    return sorted(counts, reverse=True)


def _limit_and_seats(admin: int) -> tuple[float | None, float | None]:
    """The server limit and the ``users`` level's nominal seats, from one ``/metrics``."""
    limit = seats = None
    with contextlib.suppress(ValueError):
        for line in _metrics_lines(admin):
            if line.startswith("apf_server_concurrency_limit_seats "):
                limit = float(line.rsplit(" ", 1)[1])
            elif line.startswith('apf_nominal_limit_seats{priority_level="users"}'):
                seats = float(line.rsplit(" ", 1)[1])
    return limit, seats


def summarize(result: dict, start: float, end: float) -> dict:
    light = [lat for t, lat, _ in result["light"] if start <= t < end]
    served = sum(1 for t, _, s in result["flood"] if start <= t < end and s == 200)
    statuses: dict[str, int] = {}
    for who in ("light", "flood"):
        for _, _, s in result[who]:
            key = f"{who} {s}"
            statuses[key] = statuses.get(key, 0) + 1
    return {"light_p50_ms": round(_pct(light, 0.5) * 1000, 1),
            "light_p99_ms": round(_pct(light, 0.99) * 1000, 1), "light_n": len(light),
            "flood_200_per_s": round(served / (end - start), 1), "statuses": statuses,
            "5xx": sum(n for k, n in statuses.items() if k.split()[1].startswith("5")),
            "light_not_200": sum(n for k, n in statuses.items()
                                 if k.startswith("light") and not k.endswith(" 200")),
            "limit": [v for _, v, _ in result["limit"]], "changes": result["log"],
            "connections_per_worker": result.get("split", [])}


def verdicts(rows: dict) -> list[tuple[bool, str]]:
    """The Done-means line for one kind: ``(met, text)`` pairs."""
    d, t = rows["nothing set"], rows["tuned 10"]
    bound = round(1.2 * t["light_p99_ms"] + 5, 1)
    return [
        (d["light_n"] >= ENOUGH and t["light_n"] >= ENOUGH,
         f"p99s on >= {ENOUGH} light requests (n={d['light_n']}, {t['light_n']})"),
        (d["light_p99_ms"] <= bound,
         f"light p99 {d['light_p99_ms']} <= 1.2 x {t['light_p99_ms']} + 5 = {bound} ms"),
        (d["flood_200_per_s"] >= 0.9 * t["flood_200_per_s"],
         f"flood {d['flood_200_per_s']}/s >= 0.9 x {t['flood_200_per_s']}/s"),
        (all(r["5xx"] == 0 for r in rows.values()), "no 5xx"),
        (d["light_not_200"] == 0, "the light users get only 200s"),
    ]


# --neighbour: another tenant takes half of the pool's connections for a while
SIZE = 4  # pool_bench_app.py's connections per worker
HOLD = SIZE // 2  # the neighbour's, in each worker
TAKE, GIVE, NEIGHBOUR_DURATION = 14.0, 26.0, 38.0
PHASES = [("before", FLOOD_START + SETTLE, TAKE), ("neighbour", TAKE, GIVE),
          ("after", GIVE, NEIGHBOUR_DURATION)]
NEIGHBOUR_ROWS = [("nothing set", None), ("tuned 10", "10"), ("auto", "auto")]
WITHIN = 5.0  # seconds for the limit to follow, and to come back
FOLLOWED = WORKERS * (SIZE - HOLD) + 1  # users seats: at most one above the connections left


def run_neighbour(dsn: str, kind: str, limit: str | None, tmp: Path) -> dict:
    """One server whose workers each run the neighbour tenant (``tests/apps/neighbour.py``): it
    holds :data:`HOLD` of each worker's connections from :data:`TAKE` to :data:`GIVE`. The
    limit is sampled every 0.25 s; ``moves`` are the neighbour's own times (seconds of the
    run, pid, connections held) from when each worker's holders had them or gave them back."""
    ctl = str(tmp / f"neighbour-{kind}-{limit}")
    neighbour.tell(ctl, 0)
    result = run_row(dsn, kind, limit, NEIGHBOUR_DURATION, tmp,
                     env_extra={"POOL_BENCH_NEIGHBOUR": ctl},
                     timeline=[(TAKE, lambda: neighbour.tell(ctl, HOLD)),
                               (GIVE, lambda: neighbour.tell(ctl, 0))], sample_every=0.25)
    moves = neighbour.moves(ctl, result["t0"])
    result["moves"] = moves
    return result


def summarize_neighbour(result: dict) -> dict:
    """Per phase the light users' p50/p99 (and n), the flood's 200s per second and the users
    level's seats (min-max); over the run the answers that were not 200 and the 5xx; and the
    timing: when the neighbour had its connections (``took``) and gave them back (``gave``),
    seconds of the run, the last worker's, and how long the limit took to follow (the users
    level's seats at most :data:`FOLLOWED`) and to come back (to their median before the
    take, or the pool's size if that is less), from the samples."""
    whole = summarize(result, 0, NEIGHBOUR_DURATION)
    out = {k: whole[k] for k in ("statuses", "5xx", "light_not_200", "changes")}
    samples = [(t, lim, seats) for t, lim, seats in result["limit"] if seats is not None]
    for name, start, end in PHASES:
        row = summarize(result, start, end)
        seats = [x for t, _, x in samples if start <= t < end]
        out[name] = {k: row[k] for k in ("light_p50_ms", "light_p99_ms", "light_n",
                                          "flood_200_per_s")}
        out[name]["seats"] = [min(seats), max(seats)] if seats else None
    took = [t for t, _, held in result["moves"] if held == HOLD]
    gave = [t for t, _, held in result["moves"] if held == 0 and took and t > min(took)]
    out["took"] = round(max(took), 2) if len(took) == WORKERS else None
    out["gave"] = round(max(gave), 2) if len(gave) == WORKERS else None
    before = sorted(x for t, _, x in samples if PHASES[0][1] <= t < PHASES[0][2])
    out["seats_before"] = before[len(before) // 2] if before else None
    out["follow_s"] = out["back_s"] = None
    out["down_to"], out["back_to"] = FOLLOWED, min(out["seats_before"] or 0, WORKERS * SIZE)
    if out["took"] is not None:
        out["follow_s"] = next((round(t - out["took"], 2) for t, _, x in samples
                                if t >= out["took"] and x <= FOLLOWED), None)
        if out["gave"] is not None and out["follow_s"] is not None:  # (back from down)
            out["back_s"] = next((round(t - out["gave"], 2) for t, _, x in samples
                                  if t >= out["gave"] and x >= out["back_to"]), None)
    out["timeline"] = [(t, lim, x) for t, lim, x in result["limit"]]
    return out


def neighbour_verdicts(row: dict, tuned: dict | None) -> list[tuple[bool, str]]:
    """Issue 33's "capacity that moves" line for the nothing-set row."""
    n = [row[p]["light_n"] for p, _, _ in PHASES]
    out = [
        (row["took"] is not None and row["gave"] is not None,
         f"the neighbour took and gave back in every worker (at {row['took']}, "
         f"{row['gave']} s)"),
        (row["follow_s"] is not None and row["follow_s"] <= WITHIN,
         f"the limit follows within {WITHIN:.0f} s: {row['follow_s']} s (users seats "
         f"{row['seats_before']} -> <= {row['down_to']}; in the phase {row['neighbour']['seats']})"),
        (row["back_s"] is not None and row["back_s"] <= WITHIN,
         f"the limit comes back within {WITHIN:.0f} s: {row['back_s']} s (users seats >= "
         f"{row['back_to']})"),
        (min(n) >= ENOUGH, f"p99s on >= {ENOUGH} light requests per phase (n={n})"),
        (row["5xx"] == 0 and (tuned is None or tuned["5xx"] == 0), "no 5xx"),
        (row["light_not_200"] == 0, "the light users get only 200s"),
    ]
    return out


def main_neighbour(kinds: list[str], rows: list[str], out: dict) -> bool:
    """``--neighbour``: per kind the rows of :data:`NEIGHBOUR_ROWS` with the neighbour."""
    ok = True
    with tempfile.TemporaryDirectory(prefix="apf-bench-pool-") as tmp, \
            PostgresServer.start() as pg:
        pg.wait_ready()
        for kind in kinds:
            out[kind] = {}
            for label, limit in NEIGHBOUR_ROWS:
                if label not in rows:
                    continue
                load = os.getloadavg()[0]
                row = summarize_neighbour(run_neighbour(pg.dsn, kind, limit, Path(tmp)))
                row["load_before"] = round(load, 2)
                out[kind][label] = row
                print(f"{kind:13} {label:12} load {load:4.1f}  neighbour took "
                      f"{row['took']} s, gave {row['gave']} s; limit followed in "
                      f"{row['follow_s']} s, back in {row['back_s']} s; 5xx {row['5xx']}, "
                      f"light not 200: {row['light_not_200']}", flush=True)
                for name, start, end in PHASES:
                    ph = row[name]
                    print(f"{'':16}{name:10} {start:4.0f}-{end:2.0f} s  light p50 "
                          f"{ph['light_p50_ms']:6.1f} p99 {ph['light_p99_ms']:6.1f} ms "
                          f"(n={ph['light_n']})  flood {ph['flood_200_per_s']:6.1f}/s  users "
                          f"seats {ph['seats']}")
                for line in row["changes"][:12]:
                    print(f"{'':16}{line.split('apf: ', 1)[-1]}")
            if "nothing set" in out[kind]:
                for met, text in neighbour_verdicts(out[kind]["nothing set"],
                                                    out[kind].get("tuned 10")):
                    ok &= met
                    print(f"  {'met   ' if met else 'MISSED'} {kind}: {text}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("gthread", "uvicorn"), default="gthread",
                    help="gthread: the sync pools (Flask); uvicorn: the async pools (Starlette)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS + ASYNC_KINDS,
                    help=f"default: {' '.join(KINDS)} (gthread), {' '.join(ASYNC_KINDS)} "
                         "(uvicorn)")
    ap.add_argument("--rows", nargs="+", choices=[r for r, _ in ROWS],
                    default=[r for r, _ in ROWS])
    ap.add_argument("--duration", type=float, default=18.0,
                    help="seconds of traffic per row (the window is from %.0f s)"
                    % (FLOOD_START + SETTLE))
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--neighbour", action="store_true",
                    help="capacity that moves: another tenant holds half of each worker's "
                    f"connections from {TAKE:.0f} s to {GIVE:.0f} s of a "
                    f"{NEIGHBOUR_DURATION:.0f} s run (rows: nothing set, tuned 10, auto)")
    args = ap.parse_args()
    fits, rows = (ASYNC_KINDS, ASYNC_ROWS) if args.worker == "uvicorn" else (KINDS, ROWS)
    args.kinds = args.kinds or list(fits)
    wrong = [k for k in args.kinds if k not in fits]
    if wrong:
        ap.error(f"--worker {args.worker} serves the kinds {', '.join(fits)}, not "
                 f"{', '.join(wrong)}")
    if args.neighbour:
        if args.worker != "gthread":
            ap.error("--neighbour runs the sync pools under gthread only")
        out: dict = {}
        ok = main_neighbour(args.kinds, args.rows, out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0 if ok else 1
    if args.duration <= FLOOD_START + SETTLE + 2:
        ap.error(f"--duration must be more than {FLOOD_START + SETTLE + 2} s")
    out: dict = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="apf-bench-pool-") as tmp, \
            PostgresServer.start() as pg:
        pg.wait_ready()
        for kind in args.kinds:
            out[kind] = {}
            for label, limit in rows:
                if label not in args.rows:
                    continue
                load = os.getloadavg()[0]
                result = run_row(pg.dsn, kind, limit, args.duration, Path(tmp), args.worker)
                row = summarize(result, FLOOD_START + SETTLE, args.duration)
                row["load_before"] = round(load, 2)
                out[kind][label] = row
                print(f"{kind:13} {label:12} load {load:4.1f}  light p50 {row['light_p50_ms']:6.1f}"
                      f" p99 {row['light_p99_ms']:6.1f} ms (n={row['light_n']})  flood "
                      f"{row['flood_200_per_s']:6.1f}/s  5xx {row['5xx']}  limit "
                      f"{row['limit'][-1] if row['limit'] else '-'}  connections per worker "
                      f"{'/'.join(map(str, row['connections_per_worker'])) or '-'}", flush=True)
                for line in row["changes"][:6]:
                    print(f"{'':28}{line.split('apf: ', 1)[-1]}")
            if {"nothing set", "tuned 10"} <= out[kind].keys():
                for met, text in verdicts(out[kind]):
                    ok &= met
                    print(f"  {'met   ' if met else 'MISSED'} {kind}: {text}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
