"""The adaptive concurrency limit (``APF_CONCURRENCY_LIMIT=auto``) on real servers, against
hand-tuned and default fixed limits (issue 19; docs/adaptive.md).

    .venv/bin/python benchmarks/bench_adaptive.py [--quick] [--json FILE] [--out PNG]

Real gunicorn servers on 127.0.0.1, one after the other, serving ``benchmarks/effect_app.py``
with the built-in configuration (alice and bob are both in its "users" level):

* **pool**: 2 workers x 20 threads; a backend of 8 "connections" shared by every worker (a
  POSIX semaphore), 50 ms a query. alice sends one query, then thinks 200 ms, all along; bob
  floods with 32 connections all along. The pool holds 8, then 4 for 7 s (this script holds 4
  of the semaphore's permits), then 8 again. Limits: 10 (tuned by hand to the pool), the
  default (20: workers x threads / 2) and ``auto``.
* **cpu**: 2 workers x 8 threads; each request runs 5 ms of Python (``/cpu?ms=5``: under the
  GIL a worker runs one at a time). alice as above; bob floods with 16 connections. Limits: 2,
  8 (also the default: 2 x 8 / 2) and ``auto``.

The full run also runs ``auto`` with a controller tick of 0.5 s (``APF_ADAPTIVE_TICK``)
instead of 1 s. Per window it reports alice's p99 latency and bob's 200s per second, the answers that were
not 200 (5xx are counted apart), and for ``auto`` its limit sampled every second from the
admin endpoint's ``apf_server_concurrency_limit_seats``; a full run ends with issue 19's
Done-means, met or MISSED, for each ``auto`` run (:func:`verdicts`). ``--quick`` runs a short
form (the pool drop 3 s long). The picture (``docs/images/adaptive-server.png``) is drawn only when
matplotlib is installed (the ``plot`` extra). A full run takes about 4 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from plot_effect import _client_loop, _flood, gunicorn  # noqa: E402

from tests.apps.procs import free_port  # noqa: E402

QUERY = "/query?ms=50"
CPU = "/cpu?ms=5"
THINK = 0.2


def scenarios(quick: bool) -> dict:
    """Each scenario's shape: workers, threads, path, flood connections, duration, the
    pool-drop interval (None: none), its windows and the limits to compare."""
    if quick:
        pool = {"duration": 11.0, "drop": (4.0, 7.0),
                "windows": [("pool 8", 1.0, 4.0), ("pool 4", 4.0, 7.0),
                            ("pool 8 again", 7.0, 11.0), ("recovery 3 s", 7.0, 10.0)]}
        cpu = {"duration": 8.0, "windows": [("start", 1.0, 4.0), ("later", 4.0, 8.0)]}
    else:
        pool = {"duration": 24.0, "drop": (8.0, 15.0),
                "windows": [("pool 8", 2.0, 8.0), ("pool 4", 8.0, 15.0),
                            ("pool 4 from 10 s", 10.0, 15.0), ("pool 8 again", 15.0, 24.0),
                            ("recovery 3 s", 15.0, 18.0)]}
        cpu = {"duration": 20.0, "windows": [("0-10 s", 1.0, 10.0), ("10-20 s", 10.0, 20.0)]}
    # (label, APF_CONCURRENCY_LIMIT, APF_ADAPTIVE_TICK)
    fast = [] if quick else [("auto, tick 0.5 s", "auto", "0.5")]
    pool.update(workers=2, threads=20, path=QUERY, flood=32,
                limits=[("hand-tuned 10", "10", None), ("default 20", None, None),
                        ("auto", "auto", None), *fast])
    cpu.update(workers=2, threads=8, path=CPU, flood=16, drop=None,
               limits=[("static 2", "2", None), ("static 8 (default)", None, None),
                       ("auto", "auto", None), *fast])
    return {"pool": pool, "cpu": cpu}


def _metric(admin: int, name: str) -> float | None:
    with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=2)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{}"):
                return float(line.rsplit(" ", 1)[1])
    return None


def run_one(shape: dict, limit: str | None, tmp: Path, label: str,
            tick: str | None = None) -> dict:
    """One server, alice and bob against it; the pool drop if any; the limit sampled."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}"}
    if limit is not None:
        env["APF_CONCURRENCY_LIMIT"] = limit
    if tick is not None:
        env["APF_ADAPTIVE_TICK"] = tick
    with gunicorn(tmp, env, workers=shape["workers"], threads=shape["threads"],
                  label=label) as (port, sem):
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        t0 = time.monotonic() + 0.5
        duration = shape["duration"]
        flood = ctx.Process(target=_flood, args=(port, t0, send, 0.0, duration, shape["flood"],
                                                 shape["path"]))
        flood.start()
        samples: list = []
        stop = threading.Event()

        def sample() -> None:
            while time.monotonic() < t0:
                time.sleep(0.01)
            k = 0
            while not stop.is_set():
                value = _metric(admin, "apf_server_concurrency_limit_seats")
                ratio = _metric(admin, "apf_adaptive_latency_ratio")
                samples.append((round(time.monotonic() - t0, 2), value, ratio))
                k += 1
                stop.wait(max(0.0, t0 + k - time.monotonic()))

        def pool_drop() -> None:
            start, end = shape["drop"]
            while time.monotonic() - t0 < start:
                time.sleep(0.005)
            for _ in range(4):  # the pool drops to 4: this process holds 4 connections
                sem.acquire()
            while time.monotonic() - t0 < end:
                time.sleep(0.005)
            for _ in range(4):
                sem.release()

        helpers = [threading.Thread(target=sample)]
        if shape["drop"] is not None:
            helpers.append(threading.Thread(target=pool_drop))
        for h in helpers:
            h.start()
        light: list = []
        _client_loop(port, "alice", t0, 0.0, duration, THINK, light, shape["path"])
        heavy = recv.recv()
        flood.join()
        stop.set()
        for h in helpers:
            h.join()
    return {"light": light, "flood": heavy, "limit": samples}


def _p99(xs: list) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)] if xs else float("nan")


def summary(result: dict, windows: list) -> dict:
    """Per window: alice's p99 (ms) and requests, bob's 200s per second; over the run: the
    answers that were not 200, and the 5xx among them."""
    out = {}
    for name, start, end in windows:
        light = [lat for t, lat, s in result["light"] if start <= t < end]
        served = sum(1 for t, _, s in result["flood"] if start <= t < end and s == 200)
        limits = [v for t, v, _ in result["limit"] if start <= t < end and v is not None]
        out[name] = {"light_p99_ms": round(_p99(light) * 1000, 1), "light_requests": len(light),
                     "flood_200_per_s": round(served / (end - start), 1),
                     "limit_mean": round(sum(limits) / len(limits), 1) if limits else None}
    statuses: dict[str, dict[str, int]] = {}
    for who in ("light", "flood"):
        counts: dict[str, int] = {}
        for _, _, s in result[who]:
            counts[str(s)] = counts.get(str(s), 0) + 1
        statuses[who] = counts
    out["statuses"] = statuses
    out["5xx"] = sum(n for who in statuses.values() for s, n in who.items() if s.startswith("5"))
    out["limit_per_second"] = [v for _, v, _ in result["limit"]]
    out["latency_ratio_per_second"] = [None if r is None else round(r, 2)
                                       for _, _, r in result["limit"]]
    return out


def verdicts(numbers: dict) -> list[tuple[bool, str]]:
    """Issue 19's Done-means, window by window, for each ``auto`` run of a full run: ``(met,
    line)`` pairs. alice's p99 over 20-35 requests is about her slowest request: a verdict
    near its bound is noise-sized.

    Args:
        numbers: what :func:`main` records (``numbers["pool"][label][window]`` and the same
            for ``cpu``).
    Returns:
        One ``(met, text)`` per target and ``auto`` run, in the issue's order.
    """
    out: list[tuple[bool, str]] = []

    def check(met: bool, text: str) -> None:
        out.append((met, text))

    pool, cpu = numbers.get("pool"), numbers.get("cpu")
    if pool and "hand-tuned 10" in pool:
        hand = pool["hand-tuned 10"]
        for label in (k for k in pool if k.startswith("auto")):
            auto = pool[label]
            a8, h8 = auto["pool 8"], hand["pool 8"]
            bound = 1.3 * h8["light_p99_ms"] + 10
            check(a8["light_p99_ms"] <= bound,
                  f"{label}, pool 8: alice p99 {a8['light_p99_ms']} <= {bound:.1f} ms")
            bound = 0.9 * h8["flood_200_per_s"]
            check(a8["flood_200_per_s"] >= bound,
                  f"{label}, pool 8: flood {a8['flood_200_per_s']} >= {bound:.1f}/s")
            # after the drop, once the controller had two ticks to see it (as the simulator's
            # test); over all of 8-15 s too, for information: its first requests met the drop
            # at the old limit, hand-tuned or not
            for window, note in (("pool 4 from 10 s", ""), ("pool 4", " (information)")):
                bound = 0.8 * hand[window]["light_p99_ms"]
                check(auto[window]["light_p99_ms"] <= bound,
                      f"{label}, {window}: alice p99 {auto[window]['light_p99_ms']} <= "
                      f"{bound:.1f} ms{note}")
            bound = 0.85 * hand["recovery 3 s"]["flood_200_per_s"]
            got = auto["recovery 3 s"]["flood_200_per_s"]
            check(got >= bound, f"{label}, recovery 3 s: flood {got} >= {bound:.1f}/s")
            light = set(auto["statuses"]["light"])
            check(light <= {"200"} and auto["5xx"] == 0,
                  f"{label}: alice only 200s ({sorted(light)}), 5xx {auto['5xx']}")
            before, during = auto["pool 8"]["limit_mean"], auto["pool 4 from 10 s"]["limit_mean"]
            after = auto["pool 8 again"]["limit_mean"]
            check(None not in (before, during, after) and during < before and after > during,
                  f"{label}: limit {before} (pool 8) > {during} (pool 4) < {after} (pool 8)")
    if cpu and "static 2" in cpu:
        statics = [cpu[k] for k in cpu if k.startswith("static")]
        for label in (k for k in cpu if k.startswith("auto")):
            auto = cpu[label]
            for window in (w for w in auto if isinstance(auto[w], dict) and "flood_200_per_s"
                           in auto[w]):
                bound = 0.9 * max(st[window]["flood_200_per_s"] for st in statics)
                got = auto[window]["flood_200_per_s"]
                check(got >= bound, f"{label}, cpu {window}: flood {got} >= {bound:.1f}/s")
                bound = 1.3 * max(st[window]["light_p99_ms"] for st in statics) + 5
                got = auto[window]["light_p99_ms"]
                check(got <= bound, f"{label}, cpu {window}: alice p99 {got} <= {bound:.1f} ms")
            check(auto["5xx"] == 0, f"{label}, cpu: 5xx {auto['5xx']}")
    return out


def plot(results: dict, shapes: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(11, 8.5), dpi=90, sharex="col")
    colors = ["#7f8c8d", "#c0392b", "#2471a3", "#27ae60"]
    for col, key in enumerate(("pool", "cpu")):
        shape = shapes[key]
        for i, (label, _, _) in enumerate(shape["limits"]):
            r = results[key][label]
            c = colors[i]
            pts = [(t, lat * 1000) for t, lat, s in r["light"]]
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], ".-", ms=2, lw=0.6,
                              color=c, label=label)
            bins = int(shape["duration"])
            served = [0] * bins
            for t, _, s in r["flood"]:
                if s == 200 and 0 <= int(t) < bins:
                    served[int(t)] += 1
            axes[1][col].step(range(bins), served, where="post", color=c, label=label)
            lim = [(t, v) for t, v, _ in r["limit"] if v is not None]
            axes[2][col].step([p[0] for p in lim], [p[1] for p in lim], where="post", color=c,
                              label=label)
        for ax in axes[:, col]:
            if shape["drop"] is not None:
                ax.axvspan(*shape["drop"], color="#999999", alpha=0.18, lw=0)
            ax.grid(True, alpha=0.25)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{key}: alice's latency (ms)" + (
            ", grey: the pool holds 4" if shape["drop"] else ""), fontsize=10, loc="left")
        axes[1][col].set_title("bob's 200s per second", fontsize=10, loc="left")
        axes[2][col].set_title("server concurrency limit (seats)", fontsize=10, loc="left")
        axes[2][col].set_xlabel("seconds")
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight", pil_kwargs={"optimize": True})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short form (about a minute)")
    parser.add_argument("--only", choices=("pool", "cpu"), help="run one scenario")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "adaptive-server.png"))
    parser.add_argument("--json", help="also write the numbers (and every event) to this file")
    args = parser.parse_args()
    shapes = scenarios(args.quick)
    if args.only:
        shapes = {args.only: shapes[args.only]}
    results: dict = {}
    numbers: dict = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "cpus": os.cpu_count(), "load_before": os.getloadavg(),
                     "quick": args.quick}
    with tempfile.TemporaryDirectory() as tmp:
        for key, shape in shapes.items():
            results[key] = {}
            numbers[key] = {}
            for i, (label, limit, tick) in enumerate(shape["limits"]):
                r = run_one(shape, limit, Path(tmp), f"{key}-{i}", tick)
                results[key][label] = r
                numbers[key][label] = s = summary(r, shape["windows"])
                print(f"{key} / {label}: " + json.dumps(
                    {w: s[w] for w, _, _ in shape["windows"]}), flush=True)
                print(f"   statuses {s['statuses']}, 5xx {s['5xx']}; limit per second "
                      f"{s['limit_per_second']}", flush=True)
    numbers["load_after"] = os.getloadavg()
    print(f"load average before {numbers['load_before']}, after {numbers['load_after']}")
    if not args.quick:
        for met, text in verdicts(numbers):
            print(f"{'met    ' if met else 'MISSED '} {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"numbers": numbers, "events": results}))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is missing: no picture (.venv/bin/pip install '.[plot]')")
        return 0
    if len(shapes) == 2:
        out = Path(args.out)
        plot(results, shapes, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
