"""The adaptive concurrency limit (``APF_CONCURRENCY_LIMIT=auto``) on real servers, against
hand-tuned and default fixed limits (issues 19 and 26; docs/adaptive.md).

    .venv/bin/python benchmarks/bench_adaptive.py [--quick] [--only NAME ...] [--json FILE]
                                                  [--out PNG] [--limits NAME=L,L ...]

    # issue 33's CPU-bound and wait-only lines, one command:
    .venv/bin/python benchmarks/bench_adaptive.py --only cpu wait

Real gunicorn servers on 127.0.0.1, one after the other, serving ``benchmarks/effect_app.py``
with the built-in configuration (every user is in its "users" level). Five light users
(``light-1`` .. ``light-5``, one request then 200 ms of thought each, all along) beside one
flood user (``bob``), so that every window's p99 stands on 100 or more light requests (the
output says how many). Scenarios:

* **pool**: 2 workers x 20 threads; a backend of 8 "connections" shared by every worker (a
  POSIX semaphore), 50 ms a query. The light users alone 0-4 s; bob's 32 connections from 4 s;
  the pool holds 8 until 18 s, 4 from 18 s to 28 s (this script holds 4 permits), 8 again until
  40 s. Windows: P8 12-18 s (steady), P4 20-28 s, R 28-33 s (the 5 s after the return), R8
  34-40 s (steady again). Limits: 10 (tuned by hand to the pool), the default (20: workers x
  threads / 2) and ``auto``.
* **busy**: the same while another process burns one core throughout (a busy host).
* **cpu**: 2 workers x 8 threads; each request runs 5 ms of Python (``/cpu?ms=5``: under the
  GIL a worker runs one at a time); bob's 16 connections from the start; the window 2-20 s.
  Limits: 2, 8 (also the default: 2 x 8 / 2) and ``auto``.
* **mixed**: the newcomer's app: a cheap route (``/ok``) and one that only sleeps 200 ms
  (``/sleep?ms=200``) under one FlowSchema, no shared resource; 2 workers x 64 threads; the
  light users on ``/ok``, bob's 30 connections on ``/sleep`` from 2 s; the window 7-16 s (the
  flood has run 5 s). Limits: the default (64) against ``auto``, 20 against ``auto:2-20``.
* **wait**: an app that only waits (issue 33): every request, the light users' too, sleeps
  200 ms (``/sleep?ms=200``), no shared resource; 2 workers x 64 threads; bob's 32 connections
  from 2 s; the window 5-16 s. Limits: workers x threads (128) against ``auto``.

Per window it reports the light users' p50 and p99 and how many requests they stand on, bob's
200s per second, the answers that were not 200 (5xx apart), and the limit sampled every second
from the admin endpoint's ``apf_server_concurrency_limit_seats``; a full run ends with issue
26's Done-means, met or MISSED (:func:`verdicts`). ``--quick`` runs every timeline at a third
of its length (to check that the benchmark works; its verdicts mean nothing). The picture
(``docs/images/adaptive-server.png``) is drawn only when matplotlib is installed (the ``plot``
extra). A full run takes about 7 minutes.
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
CHEAP = "/ok"
SLEEP = "/sleep?ms=200"
THINK = 0.2
LIGHT_USERS = 5
ENOUGH = 100  # light requests a p99 must stand on


def scenarios(quick: bool) -> dict:
    """Each scenario's shape: workers, threads, the light users' and the flood's paths, flood
    connections and start, duration, the pool-drop interval (None: none), a busy host, its
    windows and the limits to compare, as ``(label, APF_CONCURRENCY_LIMIT)``."""
    k = 1 / 3 if quick else 1.0
    pool = {"workers": 2, "threads": 20, "light_path": QUERY, "path": QUERY, "flood": 32,
            "flood_start": 4.0 * k, "duration": 40.0 * k, "drop": (18.0 * k, 28.0 * k),
            "busy": False,
            "windows": [("P8", 12.0 * k, 18.0 * k), ("P4", 20.0 * k, 28.0 * k),
                        ("R", 28.0 * k, 33.0 * k), ("R8", 34.0 * k, 40.0 * k)],
            "limits": [("hand-tuned 10", "10"), ("default 20", None), ("auto", "auto")]}
    busy = dict(pool, busy=True)
    cpu = {"workers": 2, "threads": 8, "light_path": CPU, "path": CPU, "flood": 16,
           "flood_start": 0.0, "duration": 20.0 * k, "drop": None, "busy": False,
           "windows": [("2-20 s", 2.0 * k, 20.0 * k)],
           "limits": [("static 2", "2"), ("static 8 (default)", None), ("auto", "auto")]}
    mixed = {"workers": 2, "threads": 64, "light_path": CHEAP, "path": SLEEP, "flood": 30,
             "flood_start": 2.0 * k, "duration": 16.0 * k, "drop": None, "busy": False,
             "windows": [("flood from 5 s", 7.0 * k, 16.0 * k)],
             "limits": [("default 64", None), ("auto", "auto"), ("static 20", "20"),
                        ("auto:2-20", "auto:2-20")]}
    wait = {"workers": 2, "threads": 64, "light_path": SLEEP, "path": SLEEP, "flood": 32,
            "flood_start": 2.0 * k, "duration": 16.0 * k, "drop": None, "busy": False,
            "windows": [("flood from 3 s", 5.0 * k, 16.0 * k)],
            "limits": [("static 128", "128"), ("auto", "auto")]}
    return {"pool": pool, "busy": busy, "cpu": cpu, "mixed": mixed, "wait": wait}


def override_limits(shapes: dict, specs: list[str]) -> None:
    """``--limits cpu=2,4,auto``: the limits a scenario compares (``default``: none set)."""
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or name not in shapes or not values:
            raise SystemExit(f"--limits {spec!r}: write NAME=L,L,... with NAME one of "
                             f"{', '.join(shapes)}")
        shapes[name]["limits"] = [
            ("default", None) if v == "default" else
            (v if v.startswith("auto") else f"static {v}", v) for v in values.split(",")]


def _metrics_lines(admin: int) -> list[str]:
    """The lines of the admin endpoint's ``/metrics``; none when it does not answer."""
    with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=2)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return text.splitlines()
    return []


def _metrics(admin: int) -> dict[str, float]:
    """Every series of the admin endpoint's ``/metrics``, the labelled ones summed per name."""
    out: dict[str, float] = {}
    with contextlib.suppress(ValueError):
        for line in _metrics_lines(admin):
            if line and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _burn(until: float) -> None:
    """Another process on the host: one core busy until ``until`` (time.monotonic)."""
    n = 0
    while time.monotonic() < until:
        n += 1


def run_one(shape: dict, limit: str | None, tmp: Path, label: str) -> dict:
    """One server, the light users and the flood against it; the pool drop if any; another
    process burning a core if the host is busy; the limit sampled every second."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}"}
    if limit is not None:
        env["APF_CONCURRENCY_LIMIT"] = limit
    ctx = multiprocessing.get_context("fork")
    burner = None
    if shape["busy"]:  # from before the server starts to after it stops
        burner = ctx.Process(target=_burn, args=(time.monotonic() + shape["duration"] + 60,))
        burner.start()
    try:
        with gunicorn(tmp, env, workers=shape["workers"], threads=shape["threads"],
                      label=label) as (port, sem):
            recv, send = ctx.Pipe(duplex=False)
            t0 = time.monotonic() + 0.5
            duration = shape["duration"]
            flood = ctx.Process(target=_flood, args=(port, t0, send, shape["flood_start"],
                                                     duration, shape["flood"], shape["path"]))
            flood.start()
            samples: list = []
            stop = threading.Event()

            def sample() -> None:
                while time.monotonic() < t0:
                    time.sleep(0.01)
                k = 0
                while not stop.is_set():
                    m = _metrics(admin)
                    # (the CPU: the workers' shares of their GILs summed, their shares run
                    # or waiting for a core summed, the host's busy share and the share not
                    # ours)
                    samples.append((round(time.monotonic() - t0, 2),
                                    m.get("apf_server_concurrency_limit_seats"),
                                    m.get("apf_adaptive_latency_ratio"),
                                    tuple(round(m[k], 2) if k in m else None for k in (
                                        "apf_worker_cpu_share", "apf_worker_cpu_wanted_share",
                                        "apf_host_cpu_share",
                                        "apf_host_cpu_others_share"))))
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

            light: list = []
            helpers = [threading.Thread(target=sample)]
            if shape["drop"] is not None:
                helpers.append(threading.Thread(target=pool_drop))
            helpers += [threading.Thread(target=_client_loop, args=(
                port, f"light-{i + 1}", t0, 0.0, duration, THINK, light, shape["light_path"]))
                for i in range(LIGHT_USERS)]
            for h in helpers:
                h.start()
            heavy = recv.recv()
            flood.join()
            for h in helpers[1:]:
                h.join()
            stop.set()
            helpers[0].join()
    finally:
        if burner is not None:
            burner.terminate()
            burner.join()
    log = tmp / f"gunicorn-{label}.log"
    moves = [line.split("apf: ", 1)[1] for line in log.read_text(errors="replace").splitlines()
             if "concurrency limit" in line and "apf: " in line] if log.exists() else []
    return {"light": sorted(light), "flood": heavy, "limit": samples, "moves": moves}


def _pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def summary(result: dict, windows: list) -> dict:
    """Per window: the light users' p50 and p99 (ms) and how many requests they stand on,
    bob's 200s per second, the limit's mean and its samples; over the run: the answers that
    were not 200, and the 5xx among them."""
    out = {}
    for name, start, end in windows:
        light = [lat for t, lat, s in result["light"] if start <= t < end]
        served = sum(1 for t, _, s in result["flood"] if start <= t < end and s == 200)
        limits = [v for t, v, *_ in result["limit"] if start <= t < end and v is not None]
        out[name] = {"light_p50_ms": round(_pct(light, 0.5) * 1000, 1),
                     "light_p99_ms": round(_pct(light, 0.99) * 1000, 1),
                     "light_requests": len(light),
                     "flood_200_per_s": round(served / (end - start), 1),
                     "limit_mean": round(sum(limits) / len(limits), 1) if limits else None,
                     "limits": limits}
    statuses: dict[str, dict[str, int]] = {}
    for who in ("light", "flood"):
        counts: dict[str, int] = {}
        for _, _, s in result[who]:
            counts[str(s)] = counts.get(str(s), 0) + 1
        statuses[who] = counts
    out["statuses"] = statuses
    out["5xx"] = sum(n for who in statuses.values() for s, n in who.items() if s.startswith("5"))
    out["limit_per_second"] = [v for _, v, *_ in result["limit"]]
    out["latency_ratio_per_second"] = [None if r is None else round(r, 2)
                                       for _, _, r, *_ in result["limit"]]
    out["cpu_per_second"] = [c for *_, c in result["limit"]]
    out["moves"] = result.get("moves", [])
    return out


def verdicts(numbers: dict) -> list[tuple[bool, str]]:
    """Issue 26's Done-means for one full run: ``(met, line)`` pairs. A latency line whose
    p99 stands on fewer than ``ENOUGH`` light requests is missed (not proven).

    Args:
        numbers: what :func:`main` records (``numbers[scenario][label][window]``).
    Returns:
        One ``(met, text)`` per line, in the issue's order.
    """
    out: list[tuple[bool, str]] = []

    def check(met: bool, text: str) -> None:
        out.append((met, text))

    def p99(row: dict) -> str:
        return f"{row['light_p99_ms']} ms (n={row['light_requests']})"

    def enough(*rows: dict) -> bool:
        return all(r["light_requests"] >= ENOUGH for r in rows)

    for key in ("pool", "busy"):
        runs = numbers.get(key)
        if not runs or "hand-tuned 10" not in runs or "auto" not in runs:
            continue
        hand, auto = runs["hand-tuned 10"], runs["auto"]
        for w in ("P8", "R8"):
            a, h = auto[w], hand[w]
            bound = 1.2 * h["light_p99_ms"] + 5
            check(enough(a, h) and a["light_p99_ms"] <= bound,
                  f"{key} {w}: auto's light p99 {p99(a)} <= 1.2 x hand-tuned {p99(h)} + 5 "
                  f"= {bound:.1f}")
            bound = 0.9 * h["flood_200_per_s"]
            check(a["flood_200_per_s"] >= bound,
                  f"{key} {w}: flood {a['flood_200_per_s']}/s >= 0.9 x {h['flood_200_per_s']}")
        a, h = auto["P4"], hand["P4"]
        bound = 0.8 * h["light_p99_ms"]
        check(enough(a, h) and a["light_p99_ms"] <= bound,
              f"{key} P4: auto's light p99 {p99(a)} <= 0.8 x hand-tuned {p99(h)} = {bound:.1f}")
        a, h = auto["R"], hand["R"]
        check(a["flood_200_per_s"] >= 0.85 * h["flood_200_per_s"],
              f"{key} R: flood {a['flood_200_per_s']}/s >= 0.85 x {h['flood_200_per_s']}")
        means = [auto[w]["limit_mean"] for w in ("P8", "P4", "R8")]
        check(None not in means and means[1] < min(means[0], means[2]),
              f"{key}: auto's limit P4 {means[1]} < P8 {means[0]} and R8 {means[2]}")
    cpu = numbers.get("cpu")
    if cpu and "auto" in cpu:
        w = "2-20 s"
        # the two: other static limits (--limits) are for reading, not the verdict
        statics = [cpu[k][w] for k in ("static 2", "static 8", "static 8 (default)")
                   if k in cpu]
        a = cpu["auto"][w]
        best = max(st["flood_200_per_s"] for st in statics)
        check(a["flood_200_per_s"] >= 0.95 * best,
              f"cpu: auto's flood {a['flood_200_per_s']}/s >= 0.95 x the better static {best}")
        worse = max(st["light_p99_ms"] for st in statics)
        check(enough(a, *statics) and a["light_p99_ms"] <= 1.3 * worse + 5,
              f"cpu: auto's light p99 {p99(a)} <= 1.3 x the worse static {worse} + 5 = "
              f"{1.3 * worse + 5:.1f}")
    wait = numbers.get("wait")
    if wait and "auto" in wait and "static 128" in wait:
        w = "flood from 3 s"
        a, st = wait["auto"][w], wait["static 128"][w]
        for q in ("p50", "p99"):
            got, ref = a[f"light_{q}_ms"], st[f"light_{q}_ms"]
            check(enough(a, st) and got <= 1.2 * ref + 2,
                  f"wait auto: light {q} {got} ms (n={a['light_requests']}) <= 1.2 x static "
                  f"128's {ref} (n={st['light_requests']}) + 2")
        check(a["flood_200_per_s"] >= 0.9 * st["flood_200_per_s"],
              f"wait auto: flood {a['flood_200_per_s']}/s >= 0.9 x static 128's "
              f"{st['flood_200_per_s']}")
    mixed = numbers.get("mixed")
    if mixed:
        w = "flood from 5 s"
        for static, auto_label in (("default 64", "auto"), ("static 20", "auto:2-20")):
            if static not in mixed or auto_label not in mixed:
                continue
            a, st = mixed[auto_label][w], mixed[static][w]
            for q in ("p50", "p99"):
                got, ref = a[f"light_{q}_ms"], st[f"light_{q}_ms"]
                check(enough(a, st) and got <= 1.2 * ref + 2,
                      f"mixed {auto_label}: light {q} {got} ms (n={a['light_requests']}) <= "
                      f"1.2 x {static}'s {ref} + 2")
            check(a["flood_200_per_s"] >= 0.9 * st["flood_200_per_s"],
                  f"mixed {auto_label}: flood {a['flood_200_per_s']}/s >= 0.9 x {static}'s "
                  f"{st['flood_200_per_s']}")
            lim = a["limits"]
            swings = [(x, y) for x, y in zip(lim, lim[1:], strict=False)
                      if abs(y - x) >= 0.25 * x]
            check(len(lim) > 1 and not swings,
                  f"mixed {auto_label}: the limit moves by less than a quarter a second "
                  f"({lim}{'; swings ' + str(swings) if swings else ''})")
    for key, runs in numbers.items():
        if not isinstance(runs, dict):
            continue
        for label, row in runs.items():
            if isinstance(row, dict) and label.startswith("auto"):
                light = set(row["statuses"]["light"])
                check(light <= {"200"} and row["5xx"] == 0,
                      f"{key} {label}: light users only 200s ({sorted(light)}), 5xx {row['5xx']}")
    return out


def tables(runs: list[dict]) -> str:
    """Markdown tables of several full runs' numbers (``--json`` files), for docs/adaptive.md:
    per scenario and limit, per window, the light users' p99 (ms, and how many requests it
    stands on), the flood's 200s per second and the limit's mean; then every Done-means line
    per run."""
    out: list[str] = []
    first = runs[0]
    for key in ("pool", "busy", "cpu", "mixed", "wait"):
        if key not in first:
            continue
        labels = list(first[key])
        windows = [w for w in first[key][labels[0]] if isinstance(first[key][labels[0]][w], dict)
                   and "light_p99_ms" in first[key][labels[0]][w]]
        out.append(f"**{key}**: light p50 / p99 ms (requests) / flood 200s per s / limit mean, "
                   f"runs {'; '.join(str(i + 1) for i in range(len(runs)))}\n")
        out.append("| limit | " + " | ".join(windows) + " |")
        out.append("|---|" + "---|" * len(windows))
        for label in labels:
            cells = []
            for w in windows:
                parts = []
                for run in runs:
                    row = run[key][label][w]
                    lim = "" if row["limit_mean"] is None or not label.startswith("auto") \
                        else f" / {row['limit_mean']}"
                    parts.append(f"{row['light_p50_ms']:.0f} / {row['light_p99_ms']:.0f} "
                                 f"({row['light_requests']}) / {row['flood_200_per_s']:.0f}{lim}")
                cells.append("; ".join(parts))
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("| Done-means line (numbers of run 1) | "
               + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |")
    out.append("|---|" + "---|" * len(runs))
    per_run = [run.get("verdicts") or verdicts(run) for run in runs]
    for i, (_met, text) in enumerate(per_run[0]):
        marks = ["met" if len(v) > i and v[i][0] else "**MISSED**" for v in per_run]
        out.append(f"| {text} | " + " | ".join(marks) + " |")
    return "\n".join(out)


def plot(results: dict, shapes: dict, out: Path) -> None:
    """Per scenario (a column): the light users' latency, the flood's 200s per second and the
    limit over time, one colour per limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in shapes if k in results]
    fig, axes = plt.subplots(3, len(keys), figsize=(4.2 * len(keys), 8.5), dpi=90,
                             sharex="col", squeeze=False)
    colors = ["#7f8c8d", "#c0392b", "#2471a3", "#27ae60"]
    for col, key in enumerate(keys):
        shape = shapes[key]
        for i, (label, _) in enumerate(shape["limits"]):
            r = results[key][label]
            c = colors[i % len(colors)]
            pts = [(t, lat * 1000) for t, lat, s in r["light"]]
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=1.5,
                              color=c, label=label)
            bins = int(shape["duration"])
            served = [0] * bins
            for t, _, s in r["flood"]:
                if s == 200 and 0 <= int(t) < bins:
                    served[int(t)] += 1
            axes[1][col].step(range(bins), served, where="post", color=c, label=label)
            lim = [(t, v) for t, v, *_ in r["limit"] if v is not None]
            axes[2][col].step([p[0] for p in lim], [p[1] for p in lim], where="post", color=c,
                              label=label)
        for ax in axes[:, col]:
            if shape["drop"] is not None:
                ax.axvspan(*shape["drop"], color="#999999", alpha=0.18, lw=0)
            ax.grid(True, alpha=0.25)
        axes[0][col].set_yscale("log")
        title = {"pool": "pool 8 (grey: 4)", "busy": "pool, busy host (grey: 4)",
                 "cpu": "CPU-bound", "mixed": "/ok beside /sleep, one FlowSchema"}.get(key, key)
        axes[0][col].set_title(f"{title}: light latency (ms)", fontsize=9, loc="left")
        axes[1][col].set_title("flood's 200s per second", fontsize=9, loc="left")
        axes[2][col].set_title("server concurrency limit (seats)", fontsize=9, loc="left")
        axes[2][col].set_xlabel("seconds")
        axes[0][col].legend(fontsize=7, markerscale=4)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight", pil_kwargs={"optimize": True})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="every timeline at a third of its length (a smoke run)")
    parser.add_argument("--only", nargs="+", choices=("pool", "busy", "cpu", "mixed", "wait"),
                        help="run these scenarios only")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "adaptive-server.png"))
    parser.add_argument("--json", help="also write the numbers (and every event) to this file")
    parser.add_argument("--limits", nargs="+", default=[], metavar="NAME=L,L",
                        help="the limits a scenario compares, e.g. cpu=2,4,8,auto")
    parser.add_argument("--tables", nargs="+", metavar="JSON",
                        help="print markdown tables of these runs' --json files and exit")
    args = parser.parse_args()
    if args.tables:
        print(tables([json.loads(Path(f).read_text())["numbers"] for f in args.tables]))
        return 0
    shapes = scenarios(args.quick)
    override_limits(shapes, args.limits)
    if args.only:
        shapes = {k: v for k, v in shapes.items() if k in args.only}
    results: dict = {}
    numbers: dict = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "cpus": os.cpu_count(), "load_before": os.getloadavg(),
                     "quick": args.quick}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for key, shape in shapes.items():
            results[key] = {}
            numbers[key] = {}
            for i, (label, limit) in enumerate(shape["limits"]):
                r = run_one(shape, limit, Path(tmp), f"{key}-{i}")
                results[key][label] = r
                numbers[key][label] = s = summary(r, shape["windows"])
                print(f"{key} / {label}: " + json.dumps(
                    {w: {k: v for k, v in s[w].items() if k != "limits"}
                     for w, _, _ in shape["windows"]}), flush=True)
                print(f"   statuses {s['statuses']}, 5xx {s['5xx']}; limit per second "
                      f"{s['limit_per_second']}", flush=True)
                print(f"   cpu per second (workers' GIL shares, run or waiting, host, not ours) "
                      f"{s['cpu_per_second']}; load {os.getloadavg()[0]:.1f}", flush=True)
                for line in s["moves"]:
                    print(f"   log: {line}", flush=True)
    numbers["load_after"] = os.getloadavg()
    numbers["seconds"] = round(time.monotonic() - began)
    print(f"load average before {numbers['load_before']}, after {numbers['load_after']}; "
          f"{numbers['seconds']} s")
    lines = verdicts(numbers)
    numbers["verdicts"] = lines
    for met, text in lines:
        print(f"{'met    ' if met else 'MISSED '} {text}")
    if args.quick:
        print("(--quick: short windows, the verdicts mean nothing)")
    else:
        print(f"{sum(1 for met, _ in lines if met)} of {len(lines)} lines met")
    if args.json:
        Path(args.json).write_text(json.dumps({"numbers": numbers, "events": results}))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is missing: no picture (.venv/bin/pip install '.[plot]')")
        return 0
    if not args.quick and len(shapes) > 1:
        out = Path(args.out)
        plot(results, shapes, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
