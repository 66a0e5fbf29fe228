"""A light user beside a flood on ASGI servers (issue 28): bare uvicorn workers, uvicorn workers
with ``limit_concurrency``, and apf_gunicorn's ASGI worker, in one run.

    .venv/bin/pip install uvicorn-worker          # the peer's worker, and ours' base
    .venv/bin/python benchmarks/bench_asgi.py [--only bare,limited,apf] [--apf-worker uvicorn]
        [--apf-limit 10] [--alone 8] [--flood 14] [--plot FILE] [--json FILE]

The app is ``benchmarks/effect_asgi_app.py``: ``GET /query?ms=50`` awaits one of a backend's 8
connections for 50 ms (the backend is a process of its own, an asyncio server holding 8 permits,
shared by every worker; a fresh one per server), so a worker's event loop serves other requests
while its queries wait. Every server has 2 workers and runs on 127.0.0.1, one after the other:

* **bare**: ``gunicorn -k uvicorn_worker.UvicornWorker``;
* **limited**: uvicorn's own admission control, ``limit_concurrency`` per worker (the backend's
  8 split over the 2 workers: 4; ``--limit-concurrency``), which answers 503 beyond it
  (``-k effect_asgi_app.LimitedUvicornWorker``);
* **apf**: ``gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker``
  (``--apf-worker asgi``: ``apf_gunicorn.asgi.ASGIWorker``, on gunicorn's own ``-k asgi``)
  with ``APF_CONCURRENCY_LIMIT=10`` (``--apf-limit``): the built-in configuration gives its
  "users" level 80 % of it, the backend's 8; every client names itself in ``X-Remote-User``
  (``APF_TRUSTED_PROXIES=127.0.0.1`` stands for an auth proxy), so each is its own flow. A
  server whose worker class cannot be imported is skipped, and the output says so;
* **gasgi** (only with ``--only``, and by default beside ``--apf-worker asgi``): bare
  ``gunicorn -k asgi``, the flood's reference for that worker.

Against each: five light users (``light-1`` .. ``light-5``: one query, then 200 ms of thought,
on a kept-alive connection) from 0 s to ``--alone + --flood`` s; a flood (user ``bob``, 32
kept-alive connections in a process of their own, each re-sending ``/query?ms=50`` as soon as
it has an answer, 20 ms after an answer that is not 200) from ``--alone`` s to the end. Windows
(by the time a request was sent): **alone** from 1 s to ``--alone`` (the connections' start is
not counted), **flood** from ``--alone + 2`` s to the end (the flood's start is not counted).
Per server and window it prints the light users' p50/p99 over their 200s and how many there
are, every answer that was not 200 by status (``0``: no answer), and the flood's 200s per
second; then the issue's table, and its "Done means" lines (ours against its own alone window
and the bare server's flood) as met or MISSED. A p99 over fewer than 100 answers is missed.
The defaults take about 80 s for three servers (plus 5 s per server to start and stop).

The load generators are Python threads sharing the machine's cores with the servers: on a busy
machine every latency grows; compare the rows of one run, not runs. ``--plot FILE`` draws the
light users' latencies and the flood's answers per second of every server (matplotlib: the
``plot`` extra). Traffic goes to 127.0.0.1 only; every process started is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from plot_effect import _client_loop, _flood, running  # noqa: E402

from tests.apps.procs import free_port  # noqa: E402

GUNICORN = str(Path(sys.executable).parent / "gunicorn")
APP = ROOT / "benchmarks" / "effect_asgi_app.py"
WORKERS, POOL, QUERY = 2, 8, "/query?ms=50"
LIGHT_USERS, THINK, FLOOD_CONNECTIONS = 5, 0.2, 32
WARMUP, SETTLE = 1.0, 2.0  # uncounted seconds at the start of the alone and flood windows
ENOUGH = 100  # answers a p99 must stand on
APF_WORKERS = {"uvicorn": "apf_gunicorn.asgi.UvicornWorker", "asgi": "apf_gunicorn.asgi.ASGIWorker"}
NAMES = {"bare": "bare uvicorn workers", "limited": "uvicorn workers, limit_concurrency={lc} each",
         "gasgi": "bare gunicorn -k asgi workers",
         "apf": "ours ({cls}, APF_CONCURRENCY_LIMIT={lim})"}
SHORT = {"bare": "bare uvicorn", "limited": "limit_concurrency={lc}", "gasgi": "bare -k asgi",
         "apf": "ours (limit {lim})"}


@dataclass(frozen=True)
class Options:
    """One run's shape: the servers' knobs and the timeline (seconds)."""

    apf_worker: str = "uvicorn"  # a key of APF_WORKERS
    apf_limit: str = "10"
    limit_concurrency: int = POOL // WORKERS
    alone: float = 8.0  # the light users alone from 0 s; the flood from here
    flood: float = 14.0  # the flood's length
    warmup: float = WARMUP
    settle: float = SETTLE

    def windows(self) -> dict[str, tuple[float, float]]:
        return {"alone": (self.warmup, self.alone),
                "flood": (self.alone + self.settle, self.alone + self.flood)}

    def label(self, name: str, short: bool = False) -> str:
        return (SHORT if short else NAMES)[name].format(
            lc=self.limit_concurrency, cls=APF_WORKERS[self.apf_worker], lim=self.apf_limit)


def worker_args(name: str, opts: Options) -> tuple[list[str], str | None]:
    """The gunicorn arguments that make server ``name``, and why it cannot run here (None if it
    can): its worker class must be importable."""
    if name == "apf":
        cls = APF_WORKERS[opts.apf_worker]
        module, attr = cls.rsplit(".", 1)
        try:
            found = hasattr(importlib.import_module(module), attr)
        except ImportError as exc:
            return [], f"{cls} is missing ({exc})"
        if not found:
            return [], f"{cls} is missing ({module} has no {attr})"
        return ["-c", "python:apf_gunicorn.conf", "-k", cls], None
    if name == "gasgi":
        from gunicorn.workers import SUPPORTED_WORKERS
        if "asgi" not in SUPPORTED_WORKERS:
            return [], "this gunicorn has no -k asgi (gunicorn >= 24)"
        return ["-k", "asgi", "--no-control-socket"], None
    if importlib.util.find_spec("uvicorn_worker") is None:
        return [], "uvicorn-worker is not installed (pip install uvicorn-worker)"
    cls = ("uvicorn_worker.UvicornWorker" if name == "bare"
           else "effect_asgi_app.LimitedUvicornWorker")
    return ["-k", cls, "--no-control-socket"], None


@contextlib.contextmanager
def backend(tmp: Path, pool: int = POOL):
    """A fresh backend process of ``pool`` permits on a unix socket in ``tmp``; yields the
    socket's path once it accepts connections (10 s at most). Stopped after."""
    path = tmp / f"backend-{uuid.uuid4().hex[:8]}.sock"
    proc = subprocess.Popen([sys.executable, str(APP), "backend", "--socket", str(path),
                             "--pool", str(pool)], cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the backend exited with {proc.returncode}")
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the backend does not listen on {path}")
            time.sleep(0.05)
        yield str(path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def server(name: str, args: list[str], opts: Options, tmp: Path, backend_path: str):
    """Server ``name`` (gunicorn with ``args``, :data:`WORKERS` workers) on a free port of
    127.0.0.1, serving effect_asgi_app against ``backend_path``; yields the port."""
    port = free_port()
    env = dict(os.environ, EFFECT_BACKEND=backend_path,
               EFFECT_LIMIT_CONCURRENCY=str(opts.limit_concurrency),
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    if name == "apf":
        env.update(APF_CONCURRENCY_LIMIT=opts.apf_limit, APF_TRUSTED_PROXIES="127.0.0.1",
                   APF_ADMIN_BIND="off", APF_INSTANCE="asgi" + uuid.uuid4().hex[:6])
    cmd = [GUNICORN, *args, "-w", str(WORKERS), "-b", f"127.0.0.1:{port}",
           "--graceful-timeout", "3", "effect_asgi_app:app"]
    with running(cmd, env, tmp / f"gunicorn-{name}.log", port):
        yield port


def load(port: int, opts: Options) -> dict:
    """The light users all along and the flood from ``opts.alone`` against one server; every
    answer as ``(sent at, latency, status)``, seconds from the start."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t0 = time.monotonic() + 0.5
    end = opts.alone + opts.flood
    flood = ctx.Process(target=_flood, args=(port, t0, send, opts.alone, end,
                                             FLOOD_CONNECTIONS, QUERY))
    flood.start()
    light: list = []
    users = [threading.Thread(target=_client_loop, args=(port, f"light-{i + 1}", t0, 0.0, end,
                                                         THINK, light, QUERY))
             for i in range(LIGHT_USERS)]
    for u in users:
        u.start()
    # the flood sends its answers when it ends; each request is bounded by a 30 s timeout
    if not recv.poll(end + 60):
        flood.kill()
        raise RuntimeError("the flood process sent no answers (it failed, or hangs)")
    heavy = recv.recv()
    flood.join()
    for u in users:
        u.join()
    return {"light": sorted(light), "flood": sorted(heavy)}


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank quantile (NaN when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def _statuses(events: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, _, s in events:
        counts[str(s)] = counts.get(str(s), 0) + 1
    return dict(sorted(counts.items()))


def summary(events: dict, opts: Options) -> dict:
    """Per window: the light users' p50/p99 (ms) over their 200s and how many, their answers by
    status, the flood's 200s per second and its answers by status; ``run``: every answer of
    the whole run by status, per client."""
    out: dict = {}
    for window, (start, end) in opts.windows().items():
        light = [e for e in events["light"] if start <= e[0] < end]
        heavy = [e for e in events["flood"] if start <= e[0] < end]
        ok = [lat for _, lat, s in light if s == 200]
        out[window] = {"light_p50_ms": round(_pct(ok, 0.5) * 1000, 1),
                       "light_p99_ms": round(_pct(ok, 0.99) * 1000, 1), "light_n": len(ok),
                       "light_statuses": _statuses(light),
                       "flood_200_per_s": round(sum(1 for e in heavy if e[2] == 200)
                                                / (end - start), 1),
                       "flood_statuses": _statuses(heavy)}
    out["run"] = {who: _statuses(events[who]) for who in ("light", "flood")}
    return out


def measure(names: list[str], opts: Options, tmp: Path, out=print) -> tuple[dict, dict]:
    """Every server of ``names`` in turn, each with a fresh backend; returns ``(events,
    numbers)`` by server name. A server that cannot run here is printed as skipped, one that
    fails to start as failed with its log's last lines; both are left out."""
    events: dict = {}
    numbers: dict = {}
    for name in names:
        args, missing = worker_args(name, opts)
        if missing:
            out(f"{name:8} SKIPPED: {missing}")
            continue
        try:
            with backend(tmp) as path, server(name, args, opts, tmp, path) as port:
                events[name] = load(port, opts)
        except RuntimeError as exc:  # a server that does not start: the others still run
            log = tmp / f"gunicorn-{name}.log"
            tail = log.read_text(errors="replace").splitlines()[-8:] if log.exists() else []
            out(f"{name:8} FAILED: {exc}" + "".join(f"\n    {line}" for line in tail))
            continue
        numbers[name] = s = summary(events[name], opts)
        for window in ("alone", "flood"):
            w = s[window]
            flood = (f"; flood {w['flood_200_per_s']:6.1f} 200s/s, answers {w['flood_statuses']}"
                     if window == "flood" else "")
            out(f"{name:8} {window:5}: light p50 {w['light_p50_ms']:6.1f} ms p99 "
                f"{w['light_p99_ms']:6.1f} ms over {w['light_n']:4} 200s, answers "
                f"{w['light_statuses']}{flood}")
    return events, numbers


def reference(numbers: dict, opts: Options) -> str | None:
    """The bare server ours' flood is held against: bare gunicorn -k asgi for
    ``--apf-worker asgi`` when it ran, else bare uvicorn workers (None if neither ran)."""
    if opts.apf_worker == "asgi" and "gasgi" in numbers:
        return "gasgi"
    return "bare" if "bare" in numbers else None


def verdicts(numbers: dict, opts: Options) -> list[tuple[bool, str]]:
    """Issue 28's "Done means" lines this benchmark decides, as ``(met, text)``; none when
    ours did not run."""
    if "apf" not in numbers:
        return []
    alone, flood = numbers["apf"]["alone"], numbers["apf"]["flood"]
    enough = alone["light_n"] >= ENOUGH and flood["light_n"] >= ENOUGH
    bound = 1.3 * alone["light_p99_ms"] + 10
    lines = [(enough and flood["light_p99_ms"] <= bound,
              f"ours beside the flood: light p99 {flood['light_p99_ms']} ms (n={flood['light_n']})"
              f" <= 1.3 x alone {alone['light_p99_ms']} ms (n={alone['light_n']}) + 10 = "
              f"{bound:.1f} ms"),
             (enough, f">= {ENOUGH} light 200s per window: alone {alone['light_n']}, beside "
              f"the flood {flood['light_n']}")]
    ref = reference(numbers, opts)
    if ref is not None:
        need = 0.9 * numbers[ref]["flood"]["flood_200_per_s"]
        lines.append((flood["flood_200_per_s"] >= need,
                      f"ours: flood {flood['flood_200_per_s']} 200s/s >= 0.9 x {ref}'s "
                      f"{numbers[ref]['flood']['flood_200_per_s']} = {need:.1f}"))
    else:
        lines.append((False, "ours: flood 200s/s against a bare server's: no bare server ran"))
    return lines


def _not_200(statuses: dict[str, int]) -> str:
    return ", ".join(f"{n:,} × {s}" for s, n in statuses.items() if s != "200")


def table(numbers: dict, opts: Options) -> str:
    """The issue's table (markdown), a row per server that ran: light p50 / p99 alone and
    beside the flood (over how many 200s), the light users' answers beside the flood, the
    flood's 200s/s and the answers that were not 200 in the flood window."""
    rows = ["| server | light p50 / p99 alone | light p50 / p99 beside the flood | light answers "
            "beside the flood | flood 200s/s |", "|---|---|---|---|---|"]
    for name, s in numbers.items():
        a, f = s["alone"], s["flood"]

        def cell(w: dict) -> str:
            if not w["light_n"]:
                return "none served"
            return f"{w['light_p50_ms']:.0f} / {w['light_p99_ms']:.0f} ms (n={w['light_n']})"

        answers = ", ".join(f"{n:,} × {st}" for st, n in f["light_statuses"].items())
        others = _not_200(f["flood_statuses"])
        rows.append(f"| {opts.label(name)} | {cell(a)} | {cell(f)} | {answers or 'none'} | "
                    f"{f['flood_200_per_s']:.0f}{f' (and {others})' if others else ''} |")
    return "\n".join(rows)


def plot(events: dict, numbers: dict, opts: Options, out: Path) -> None:
    """The README picture's layout, a column per server: above, every light answer's latency
    over time (200s as dots, others as crosses); below, the flood's answers per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"bare": "#c0392b", "limited": "#7d3c98", "gasgi": "#b9770e", "apf": "#2471a3"}
    names = list(events)
    end = opts.alone + opts.flood
    fig = plt.figure(figsize=(3.2 * max(3, len(names)), 6.4), dpi=90)
    grid = fig.add_gridspec(2, len(names), height_ratios=[1.15, 1], hspace=0.5, wspace=0.25)
    ax = fig.add_subplot(grid[0, :])
    for name in names:
        ok = [(t, lat * 1000) for t, lat, s in events[name]["light"] if s == 200]
        bad = [(t, max(lat * 1000, 1.0)) for t, lat, s in events[name]["light"] if s != 200]
        w, short = numbers[name]["flood"], opts.label(name, short=True)
        answers = sum(w["light_statuses"].values())
        label = (f"{short}: p99 {w['light_p99_ms']:.0f} ms beside the flood, "
                 f"{numbers[name]['alone']['light_p99_ms']:.0f} alone ({w['light_n']} of "
                 f"{answers} answers 200)" if w["light_n"]
                 else f"{short}: none served beside the flood")
        ax.plot([p[0] for p in ok], [p[1] for p in ok], ".", ms=2.5, color=colors[name],
                label=label)
        if bad:
            ax.plot([p[0] for p in bad], [p[1] for p in bad], "x", ms=3, color=colors[name],
                    label=f"{short}: answers not 200 ({_not_200(numbers[name]['run']['light'])})")
    ax.axvspan(opts.alone, end, color="#999999", alpha=0.18, lw=0,
               label=f"bob floods with {FLOOD_CONNECTIONS} connections")
    ax.set_yscale("log")
    ticks = [1, 3, 10, 30, 50, 100, 200, 500, 1000]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(0.8, 20000)  # the legend's room above the answers
    ax.set_xlim(0, end)
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_xlabel("seconds")
    ax.set_title(f"{LIGHT_USERS} light users' requests (one query, then "
                 f"{THINK * 1000:.0f} ms of thinking)", fontsize=11, loc="left")
    ax.legend(fontsize=7.5, loc="upper left", framealpha=0.9)
    ax.grid(True, alpha=0.25)
    bins = range(int(opts.alone) - 1, int(end) + 1)
    top = 1
    axes = []
    for col, name in enumerate(names):
        bx = fig.add_subplot(grid[1, col])
        axes.append(bx)
        served, rejected = [0] * len(bins), [0] * len(bins)
        for t, _, s in events[name]["flood"]:
            i = int(t) - bins[0]
            if 0 <= i < len(bins):
                (served if s == 200 else rejected)[i] += 1
        xs = [b + 0.5 for b in bins]
        bx.bar(xs, served, width=0.8, color=colors[name], label="served (200)")
        bx.bar(xs, rejected, width=0.8, bottom=served, color="#f5b041",
               label="not 200 (" + (", ".join(s for s in numbers[name]["run"]["flood"]
                                               if s != "200") or "none") + ")")
        top = max(top, *(a + b for a, b in zip(served, rejected, strict=True)))
        bx.set_title(f"bob's flood: {name}", fontsize=9, loc="left")
        bx.set_xlabel("seconds")
        bx.grid(True, axis="y", alpha=0.25)
        if col == 0:
            bx.set_ylabel("answers per second")
        bx.legend(fontsize=7, loc="upper right", framealpha=0.9)
    for bx in axes:
        bx.set_yscale("symlog", linthresh=100)
        bx.set_ylim(0, top * 3)
    fig.suptitle(f"gunicorn, {WORKERS} ASGI workers, a backend that does {POOL} queries at once "
                 f"(50 ms each, awaited)", fontsize=10, y=0.995)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight", pil_kwargs={"optimize": True})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="servers to run, comma-separated, of bare, limited, apf, "
                    "gasgi (default bare,limited,apf; with --apf-worker asgi, and gasgi)")
    ap.add_argument("--apf-worker", choices=sorted(APF_WORKERS), default="uvicorn",
                    help="ours on uvicorn-worker (default) or on gunicorn's -k asgi")
    ap.add_argument("--apf-limit", default="10", help="APF_CONCURRENCY_LIMIT for ours "
                    "(default 10: the users level's 80 %% is the backend's 8)")
    ap.add_argument("--limit-concurrency", type=int, default=POOL // WORKERS,
                    help="the peer's limit_concurrency per worker (default 4)")
    ap.add_argument("--alone", type=float, default=8.0, help="seconds of light users alone")
    ap.add_argument("--flood", type=float, default=14.0, help="seconds of flood after that")
    ap.add_argument("--plot", help="draw the picture to this PNG file (matplotlib)")
    ap.add_argument("--json", help="write the numbers and every answer to this file")
    args = ap.parse_args(argv)
    names = (args.only.split(",") if args.only else
             ["bare", "limited", "apf"] + (["gasgi"] if args.apf_worker == "asgi" else []))
    unknown = sorted(set(names) - set(NAMES))
    if unknown or not names:
        ap.error(f"--only takes bare, limited, apf, gasgi; not {unknown or args.only!r}")
    if not (WARMUP + 1 <= args.alone <= 120 and SETTLE + 1 <= args.flood <= 120):
        ap.error(f"--alone must be in [{WARMUP + 1:g}, 120] and --flood in [{SETTLE + 1:g}, 120]")
    if args.limit_concurrency < 1:
        ap.error("--limit-concurrency must be >= 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: .venv/bin/pip install '.[plot]'")
    opts = Options(apf_worker=args.apf_worker, apf_limit=args.apf_limit,
                   limit_concurrency=args.limit_concurrency, alone=args.alone, flood=args.flood)
    windows = opts.windows()
    print(f"== {LIGHT_USERS} light users ({QUERY}, {THINK * 1000:g} ms think) alone "
          f"{windows['alone'][0]:g}-{windows['alone'][1]:g} s, then beside a flood of "
          f"{FLOOD_CONNECTIONS} connections counted {windows['flood'][0]:g}-"
          f"{windows['flood'][1]:g} s; {WORKERS} workers, a backend of {POOL}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        events, numbers = measure(names, opts, Path(tmp),
                                  out=lambda line: print(line, flush=True))
    print(f"\n{round(time.monotonic() - began)} s; load after {os.getloadavg()[0]:.2f}\n")
    if numbers:
        print(table(numbers, opts))
    print("\nDone means (issue 28):")
    lines = verdicts(numbers, opts)
    if not lines:
        print(f"  not decided: ours ({APF_WORKERS[opts.apf_worker]}) did not run")
    for met, text in lines:
        print(f"  {'met   ' if met else 'MISSED'} {text}")
    if "limited" in numbers:
        f = numbers["limited"]["flood"]
        print(f"  the peer beside it: light answers {f['light_statuses']}, flood "
              f"{f['flood_200_per_s']} 200s/s and {_not_200(f['flood_statuses']) or 'no others'}"
              f" in the flood window")
    if args.json:
        Path(args.json).write_text(json.dumps({"numbers": numbers, "events": events}))
    if args.plot and events:
        plot(events, numbers, opts, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
