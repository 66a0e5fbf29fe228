"""APF's overhead in machine instructions: a real gunicorn worker under callgrind, bare vs APF.

    .venv/bin/python benchmarks/bench_instructions.py [--requests 400] [--baseline DIR]
                                                      [--fairness kubernetes|maxmin|both]
                                                      [--rejecting] [--orca] [--keep-dumps DIR]
    .venv/bin/python benchmarks/bench_instructions.py --asgi [--requests 400] [--fairness ...]
                                                      [--rejecting] [--pf-headers-off]
    .venv/bin/python benchmarks/bench_instructions.py --fastapi [--pf-headers-off]

Wall-clock ratios on a shared 2-core machine swing by ±30% between rounds (bench_server.py
pairs and repeats its rounds for that reason). Instruction counts do not: the same code, inputs
and environment give the same count whatever else the machine runs. This benchmark starts one
gunicorn (1 worker, 8 threads, the example app, the same config as bench_server.py) under
``valgrind --tool=callgrind``, warms it up, zeroes the worker's counters, sends ``--requests``
requests over 4 keep-alive connections, dumps the counters and divides: user-space
instructions per request in the worker (all its threads), for bare gthread and for APF under
each fairness (``--fairness``, passed to the server as ``APF_FAIRNESS``; the default is
both when this build has ``maxmin``, else ``kubernetes``, and the output says which). The
measured requests never wait (64 seats, 8 threads), so this is each fairness's admit-at-once
path with everything else a request costs. With ``--baseline DIR`` also APF in another
checkout (``git worktree add DIR <commit>``; its C extension is compiled on the fly when a
compiler is present) under each fairness it has: a baseline that lacks one (it predates
``APF_FAIRNESS`` or ``maxmin``) runs ``kubernetes`` instead, once, and the output says so; the
ratios this commit / baseline are printed per fairness. With ``--orca`` also for APF with ``APF_LOAD_REPORT=orca``, twice: with the value
recomputed every 100 ms as shipped, and reused for the whole run (``APF_LOAD_REPORT_INTERVAL=60``),
which separates the per-response cost of the ``endpoint-load-metrics`` header from the cost of
one recomputation (a time-based cost, which valgrind's ~50x slowdown would otherwise spread
over far fewer requests than a real server answers in 100 ms). Kernel time and cache effects
are not counted: this is the CPU work APF adds, the one part of its overhead this code
controls. Needs valgrind (``apt-get install -y valgrind``);
takes about a minute per server. Everything binds 127.0.0.1.

``--rejecting`` and ``--orca`` run APF under the server's default fairness when it is measured
(else the first one), and compare with that fairness's served request.
``--rejecting`` adds the cost of a 429: APF again, its level with one seat
(``APF_CONCURRENCY_LIMIT=1``) and ``limitResponse: Reject``, that seat held by one long
``/work`` request started before the counters are zeroed, so every measured ``/hello`` is
answered 429 at admission (reason concurrency-limit) on its keep-alive connection, at once
(``APF_HELD_REJECTIONS=0``: the client re-sends at once, and holding its 429s for their
Retry-After would charge ~100 s of the worker's time-based work to 400 requests); printed
next to a served ``/hello`` (issue 34's target: a 429 costs at most 1/30 of it). ``--keep-dumps DIR``
keeps each worker's callgrind dump there (``callgrind_annotate DIR/<name>.callgrind``).

``--pf-headers-off`` adds APF with ``APF_PF_HEADERS=off`` and prints what the two
``X-Kubernetes-PF-*`` headers cost per response (``bench_pf_headers.py`` counts the servers'
own header code alone, without timers).

``--asgi`` measures the ASGI front end instead (issue 34: ours at most 1.06 x bare per
``/hello`` on uvicorn-worker, 1.08 on gunicorn's ``asgi``):
one worker serving the plain ASGI app ``benchmarks/asgi_hello_app.py``, the same requests over
the same keep-alive connections after the same warm-up, for uvicorn-worker's
``uvicorn_worker.UvicornWorker`` bare and ``apf_gunicorn.asgi.UvicornWorker``, then gunicorn's
``asgi`` worker bare and ``apf_gunicorn.asgi.ASGIWorker`` (ours under each fairness); it prints
ours / bare per front end and fairness with the target and a verdict. Callgrind counts every
thread of the worker: ours includes the dispatcher thread (idle in ``epoll`` but for its 100 ms
tick) and both include the event loop's own timers, time-based work charged to the requests
measured while it ran (each row prints how long they took under valgrind). So each server is
then counted idle for ``--idle`` seconds (default 5): the idle rate times the measured seconds is
printed as the row's time-based share, and the ratios are printed without it too (the verdict
stays on the counts as measured; at valgrind's ~50x slowdown the timers weigh ~50x more per
request than on a real server at full load). Needs uvicorn-worker
(``pip install 'apf_gunicorn[asgi]'``). With ``--rejecting`` it adds ours answering every
``/hello`` 429 per front end (the level's one seat held by ``/work?ms=...`` of the hello app),
with ``--pf-headers-off`` ours without the PF headers. ``--fastapi`` does the same for a small
FastAPI endpoint (``benchmarks/fastapi_items_app.py``, ``GET /items/42`` returning a pydantic
model) on uvicorn-worker's class, bare and ours (target at most 1.03 x bare). Neither
combines with ``--baseline`` or ``--orca``.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from apf_gunicorn.flowcontrol import fairness  # noqa: E402
from benchmarks.bench_server import BENCH_CONFIG  # noqa: E402
from benchmarks.checkouts import (  # noqa: E402
    CHOICES,
    Checkout,
    build_extension,
    choose_fairness,
    inspect_checkout,
)
from tests.apps.procs import children, free_port  # noqa: E402

GUNICORN = str(Path(sys.executable).parent / "gunicorn")
ASGI_APP = "benchmarks.asgi_hello_app:app"
FASTAPI_APP = "benchmarks.fastapi_items_app:app"
# front end -> (bare server's options, APF server's options, the app they serve)
FRONT_ENDS = {
    "gthread": (["-k", "gthread", "--no-control-socket"], ["-c", "python:apf_gunicorn.conf"],
                "tests.apps.app:app"),
    "uvicorn": (["-k", "uvicorn_worker.UvicornWorker", "--no-control-socket"],
                ["-c", "python:apf_gunicorn.conf", "-k", "apf_gunicorn.asgi.UvicornWorker"],
                ASGI_APP),
    "asgi": (["-k", "asgi", "--no-control-socket"],
             ["-c", "python:apf_gunicorn.conf", "-k", "apf_gunicorn.asgi.ASGIWorker"], ASGI_APP),
    "fastapi": (["-k", "uvicorn_worker.UvicornWorker", "--no-control-socket"],
                ["-c", "python:apf_gunicorn.conf", "-k", "apf_gunicorn.asgi.UvicornWorker"],
                FASTAPI_APP),
}
# the request measured, by front end (else GET /hello)
REQUEST_PATH = {"fastapi": "/items/42"}
# --asgi: the worker classes compared, as printed
ASGI_CLASSES = {
    "uvicorn": ("uvicorn_worker.UvicornWorker", "apf_gunicorn.asgi.UvicornWorker"),
    "asgi": ("gunicorn's asgi", "apf_gunicorn.asgi.ASGIWorker"),
}
# --fastapi: the FastAPI endpoint on uvicorn-worker's class, bare and ours
FASTAPI_CLASSES = {
    "fastapi": ("uvicorn_worker.UvicornWorker + FastAPI",
                "apf_gunicorn.asgi.UvicornWorker + FastAPI"),
}
# issue 34's targets, ours / bare per request
ASGI_TARGETS = {"uvicorn": 1.06, "asgi": 1.08, "fastapi": 1.03}
REJECT_TARGET = 1 / 30  # issue 34: a 429 costs at most 1/30 of a served request
ELAPSED: dict[str, float] = {}  # instance -> seconds the measured requests took
IDLE: dict[str, float] = {}  # instance -> the idle worker's instructions per second (idle_s)
CONNECTIONS = 4
HOLD_PATH = "/work?ms=900000"  # --rejecting: holds the level's one seat for the whole run

# BENCH_CONFIG with its level cut to the seats APF_CONCURRENCY_LIMIT gives it, and no queues
_QUEUE = "      type: Queue\n      queuing: {queues: 64, handSize: 6, queueLengthLimit: 50}\n"
_REJECT = "      type: Reject\n"
assert _QUEUE in BENCH_CONFIG
REJECT_CONFIG = BENCH_CONFIG.replace(
    "    nominalConcurrencyShares: 100\n",
    "    nominalConcurrencyShares: 100\n    lendablePercent: 0\n    borrowingLimitPercent: 0\n"
).replace(_QUEUE, _REJECT)


def _get(conn: http.client.HTTPConnection, status: int = 200, path: str = "/hello") -> None:
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    if resp.status != status:
        raise RuntimeError(f"GET {path} answered {resp.status}, not {status}")


def _load(port: int, n: int, status: int = 200, path: str = "/hello") -> None:
    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for _ in range(n // CONNECTIONS):
            _get(conn, status, path)
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _hold(port: int) -> None:
    """Start a request that holds the (one) seat, in a thread; return once /hello is 429.

    The level rejects instead of queuing, so a poll that holds the seat when the holding
    request arrives gets that one answered 429: it is sent again until it holds the seat.
    """
    def run() -> None:
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1000)
            try:
                conn.request("GET", HOLD_PATH)
                resp = conn.getresponse()
                resp.read()
            except OSError:  # the server stops first
                return
            finally:
                conn.close()
            if resp.status != 429:
                return
            time.sleep(0.1)

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 120
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/hello")
        resp = conn.getresponse()
        resp.read()
        conn.close()
        if resp.status == 429:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the holding request never took the seat")
        time.sleep(0.5)


def instructions_per_request(root: Path, apf: bool, config_path: str, requests: int,
                             out_dir: str, *, rejecting: bool = False,
                             extra_env: dict | None = None,
                             front_end: str = "gthread",
                             idle_s: float = 0.0) -> tuple[float, str]:
    """Instructions per request in one worker under callgrind, and its dump's path.

    Args:
        root: the checkout to run (its ``apf_gunicorn`` and ``tests/apps/app.py``, or
            ``benchmarks/asgi_hello_app.py`` for an ASGI front end).
        apf: run with apf_gunicorn's conf and worker (else the bare worker).
        config_path: the APF configuration (``REJECT_CONFIG`` when ``rejecting``).
        requests: measured requests (a multiple of 4 is used).
        out_dir: where callgrind writes its dumps.
        rejecting: one seat, held; every measured request is answered 429.
        extra_env: more environment for the server (e.g. APF_LOAD_REPORT).
        front_end: a key of ``FRONT_ENDS``: ``gthread`` (the WSGI app), ``uvicorn``
            (uvicorn-worker's class, or ours built on it) or ``asgi`` (gunicorn's ASGI worker,
            or ours built on it), both serving ``asgi_hello_app``, or ``fastapi`` (uvicorn-worker's
            class or ours serving ``fastapi_items_app``, measured with ``GET /items/42``).
        idle_s: after the measured requests, count the idle worker for this long (its
            timers, our dispatcher's tick): instructions per second in ``IDLE[instance]``.
    Returns:
        (instructions per request, path of the worker's dump).
    Raises:
        RuntimeError: the server did not start or answered something unexpected.
    """
    port = free_port()
    instance = "benchi" + uuid.uuid4().hex[:8]
    env = dict(os.environ, PYTHONPATH=str(root), APF_INSTANCE=instance, APF_ADMIN_BIND="off",
               APF_CONFIG=config_path, APF_CONCURRENCY_LIMIT="1" if rejecting else "64",
               **(extra_env or {}))
    bare_conf, apf_conf, app = FRONT_ENDS[front_end]
    path = REQUEST_PATH.get(front_end, "/hello")
    conf = apf_conf if apf else bare_conf
    prefix = os.path.join(out_dir, f"cg.{instance}")
    # --rejecting: the held request would keep a graceful stop waiting for 30 s
    stop = ["--graceful-timeout", "2"] if rejecting else []
    cmd = ["valgrind", "--tool=callgrind", "--trace-children=yes",
           f"--callgrind-out-file={prefix}.%p", sys.executable, GUNICORN, *conf, "-w", "1",
           "--threads", "8", "-b", f"127.0.0.1:{port}", "--log-level", "warning",
           "--timeout", "600", *stop, app]
    proc = subprocess.Popen(cmd, cwd=str(root), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                _get(http.client.HTTPConnection("127.0.0.1", port, timeout=60), path=path)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server under valgrind did not start") from None
                time.sleep(1)
        status = 200
        if rejecting:
            _hold(port)
            status = 429
        _load(port, 200, status, path)  # warm-up: threads started, caches filled, shapes classified
        workers = [p for p in children(proc.pid) if p != proc.pid]
        if len(workers) != 1:
            raise RuntimeError(f"expected one worker, found {workers}")
        worker = workers[0]
        subprocess.run(["callgrind_control", "-z", str(worker)], check=True,
                       capture_output=True)
        t0 = time.monotonic()
        _load(port, requests, status, path)
        ELAPSED[instance] = time.monotonic() - t0
        subprocess.run(["callgrind_control", "-d", str(worker)], check=True,
                       capture_output=True)
        dump = _newest_dump(prefix, worker)
        per_request = _dump_total(dump) / (requests // CONNECTIONS * CONNECTIONS)
        if idle_s > 0:
            subprocess.run(["callgrind_control", "-z", str(worker)], check=True,
                           capture_output=True)
            t1 = time.monotonic()
            time.sleep(idle_s)  # the measurement itself: what the idle worker does meanwhile
            seconds = time.monotonic() - t1
            subprocess.run(["callgrind_control", "-d", str(worker)], check=True,
                           capture_output=True)
            IDLE[instance] = _dump_total(_newest_dump(prefix, worker)) / seconds
        return per_request, dump
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"apf_{instance}_")]
        if left:
            print(f"WARNING: /dev/shm entries left behind: {left}", file=sys.stderr)


def _newest_dump(prefix: str, worker: int) -> str:
    return sorted(glob.glob(f"{prefix}.{worker}.*"), key=os.path.getmtime)[-1]


def _dump_total(path: str) -> int:
    """The instruction total of a callgrind dump."""
    text = Path(path).read_text()
    return int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1))


def plan_runs(fairness_names: list[str], side: str, baseline: Checkout | None, *,
              rejecting: bool = False, orca: bool = False,
              pf_off: bool = False) -> tuple[list, dict, list]:
    """The servers to measure: bare once, this checkout under each fairness, the baseline under
    each fairness it has (kubernetes, once, for those it lacks), then --rejecting and --orca.

    Args:
        fairness_names: the fairnesses to measure here (from ``choose_fairness``).
        side: the fairness the --rejecting and --orca servers run.
        baseline: the --baseline checkout, or None.
        rejecting: add the 429 server.
        orca: add the two ORCA servers.
        pf_off: add APF with ``APF_PF_HEADERS=off`` (``apf nopf``).
    Returns:
        ``(runs, against, notes)``: runs as ``(name, checkout, apf, rejecting, environment)``;
        ``{fairness: name of the baseline run it is compared with}``; lines to print (a baseline
        that lacks a fairness). ``APF_FAIRNESS`` goes to every APF server of this checkout, and
        to the baseline's when it reads that variable (it has flowcontrol/fairness.py).
    """
    runs = [("bare", ROOT, False, False, None)]
    runs += [(f"apf {p}", ROOT, True, False, {"APF_FAIRNESS": p}) for p in fairness_names]
    against: dict[str, str] = {}
    notes = []
    if baseline is not None:
        for p in fairness_names:
            base_fairness, why = baseline.runs(p)
            if why:
                notes.append(why)
            name = f"apf@{baseline.root} {base_fairness}"
            if name not in against.values():
                env = {"APF_FAIRNESS": base_fairness} if baseline.selectable else None
                runs.append((name, baseline.root, True, False, env))
            against[p] = name
    if rejecting:
        # Its client re-sends the moment each 429 arrives, so the storm throttle would hold
        # every 429 for its 1 s Retry-After: the run would then last ~100 s of wall time, and
        # the worker's time-based work (the dispatcher's 100 ms tick, the heartbeat) would be
        # charged to the few 429s answered meanwhile. The 429 is measured as answered at once;
        # holding one adds a heap entry and one more poll pass.
        runs.append(("apf 429", ROOT, True, True, {"APF_FAIRNESS": side,
                                                   "APF_HELD_REJECTIONS": "0"}))
    if pf_off:
        runs.append(("apf nopf", ROOT, True, False, {"APF_FAIRNESS": side,
                                                     "APF_PF_HEADERS": "off"}))
    if orca:
        runs.append(("apf+orca", ROOT, True, False, {"APF_LOAD_REPORT": "orca",
                                                    "APF_FAIRNESS": side}))
        runs.append(("apf+orca60", ROOT, True, False, {"APF_LOAD_REPORT": "orca",
                                                        "APF_LOAD_REPORT_INTERVAL": "60",
                                                        "APF_FAIRNESS": side}))
    return runs, against, notes


def side_fairness(fairness_names: list[str]) -> str:
    """The fairness the extra servers (429, ORCA, PF headers off) run, and the served request
    they are compared with: the server's default when it is measured, else the first one."""
    return (fairness.SERVER_DEFAULT if fairness.SERVER_DEFAULT in fairness_names
            else fairness_names[0])


def plan_asgi_runs(fairness_names: list[str], front_ends: tuple[str, ...] = tuple(ASGI_CLASSES),
                   *, pf_off: bool = False, rejecting: bool = False
                   ) -> list[tuple[str, str, bool, dict | None, bool]]:
    """``--asgi`` / ``--fastapi``: per front end, the bare worker, then ours under each fairness,
    then (``pf_off``) ours without the PF headers and (``rejecting``) ours answering 429, both
    under the first fairness.

    Returns:
        ``(name, front end, apf, environment, rejecting)`` per server, e.g. ``("uvicorn apf
        maxmin", "uvicorn", True, {"APF_FAIRNESS": "maxmin"}, False)``; the extra rows are
        named ``<front end> apf <fairness> nopf`` and ``<front end> apf 429``.
    """
    runs: list[tuple[str, str, bool, dict | None, bool]] = []
    side = side_fairness(fairness_names)
    for front_end in front_ends:
        runs.append((f"{front_end} bare", front_end, False, None, False))
        runs += [(f"{front_end} apf {p}", front_end, True, {"APF_FAIRNESS": p}, False)
                 for p in fairness_names]
        if pf_off:
            runs.append((f"{front_end} apf {side} nopf", front_end, True,
                         {"APF_FAIRNESS": side, "APF_PF_HEADERS": "off"}, False))
        if rejecting:
            runs.append((f"{front_end} apf 429", front_end, True, {"APF_FAIRNESS": side}, True))
    return runs


def asgi_report(counts: dict[str, float], elapsed: dict[str, float], fairness_names: list[str],
                requests: int, idle: dict[str, float] | None = None,
                classes: dict[str, tuple[str, str]] = ASGI_CLASSES) -> list[str]:
    """``--asgi``'s lines: each server's instructions per request, then ours / bare per front
    end and fairness against ``ASGI_TARGETS`` with a verdict (on the counts as measured); with
    ``idle``, also each row's time-based share and the ratios without it; the PF headers' cost
    (``nopf`` rows) and a 429's share of a served request (``429`` rows) when measured.

    Args:
        counts: instructions per request by run name (``plan_asgi_runs``' names).
        elapsed: seconds the measured requests took under valgrind, by run name.
        fairness_names: the fairnesses ours ran.
        requests: the measured requests per server.
        idle: the idle worker's instructions per second by run name (``--idle``), or None.
        classes: the front ends measured (``ASGI_CLASSES`` or ``FASTAPI_CLASSES``).
    """
    # the time-based work charged to each request: the idle rate over the measured seconds
    timed = {name: idle[name] * elapsed[name] / requests for name in counts} if idle else None
    width = max(len(name) for name in counts)
    apps = sorted({FRONT_ENDS[f][2] for f in classes})
    lines = [f"user-space instructions per request in the worker ({requests} requests over "
             f"{CONNECTIONS} keep-alive connections, 1 worker, callgrind; ASGI app "
             f"{', '.join(apps)}):"]
    for name, n in counts.items():
        front_end = name.split()[0]
        bare = counts[f"{front_end} bare"]
        what = (classes[front_end][0] if name.endswith(" bare") else
                f"{classes[front_end][1]}; added {n - bare:+,.0f} ({n / bare - 1:+.1%})")
        when = f"in {elapsed[name]:5.1f} s"
        if timed:
            when += f", idle {idle[name]:9,.0f}/s: {timed[name]:6,.0f} of it time-based"
        lines.append(f"  {name:{width}s} {n:12,.0f}  {when}  ({what})")
    lines.append("ours / bare per request:")
    for front_end, (bare_class, ours_class) in classes.items():
        target = ASGI_TARGETS[front_end]
        verdicts = []
        for p in fairness_names:
            ours, bare = f"{front_end} apf {p}", f"{front_end} bare"
            ratio = counts[ours] / counts[bare]
            verdict = f"{p} {ratio:.3f} {'ok' if ratio <= target else 'MISSED'}"
            if timed:
                net = (counts[ours] - timed[ours]) / (counts[bare] - timed[bare])
                verdict += f" (without the time-based work {net:.3f})"
            verdicts.append(verdict)
        lines.append(f"  {ours_class} / {bare_class} (target <= {target:.2f}): "
                     f"{', '.join(verdicts)}")
    side = side_fairness(fairness_names)
    for front_end in classes:
        served = counts[f"{front_end} apf {side}"]
        off = counts.get(f"{front_end} apf {side} nopf")
        if off is not None:
            net = ""
            if timed:
                saved = served - timed[f"{front_end} apf {side}"] - (
                    off - timed[f"{front_end} apf {side} nopf"])
                net = f"; without the time-based work {saved:+,.0f}"
            lines.append(f"  {front_end}: the PF headers cost {served - off:+,.0f} instructions "
                         f"per response (APF_PF_HEADERS=on vs off, {side}{net})")
        rejected = counts.get(f"{front_end} apf 429")
        if rejected is not None:
            ratio = rejected / served
            net = ""
            if timed:
                own = (rejected - timed[f"{front_end} apf 429"]) / (
                    served - timed[f"{front_end} apf {side}"])
                net = f"; without the time-based work {own:.3f}"
            lines.append(f"  {front_end}: a 429 costs {ratio:.3f} of a served request ({side}; "
                         f"target <= {REJECT_TARGET:.3f}: "
                         f"{'ok' if ratio <= REJECT_TARGET else 'MISSED'}{net})")
    return lines


def _keep_dump(dump: str, name: str, keep_dir: str) -> None:
    os.makedirs(keep_dir, exist_ok=True)
    kept = os.path.join(keep_dir, re.sub(r"[^\w.-]+", "_", name) + ".callgrind")
    shutil.copyfile(dump, kept)
    print(f"{name}: worker dump kept as {kept}", flush=True)


def run_asgi(fairness_names: list[str], requests: int, keep_dumps: str | None,
             idle_s: float = 0.0, *, fastapi: bool = False, pf_off: bool = False,
             rejecting: bool = False) -> int:
    """``--asgi`` / ``--fastapi``: measure ``plan_asgi_runs``' servers, print ``asgi_report``."""
    try:
        import uvicorn_worker  # noqa: F401
        if fastapi:
            import fastapi as _fastapi  # noqa: F401
    except ImportError as e:
        print(f"{e.name} is missing: pip install 'apf_gunicorn[asgi]' fastapi", file=sys.stderr)
        return 2
    classes = FASTAPI_CLASSES if fastapi else ASGI_CLASSES
    counts: dict[str, float] = {}
    elapsed: dict[str, float] = {}
    idle: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        Path(config_path).write_text(BENCH_CONFIG)
        reject_path = os.path.join(tmp, "reject.yaml")
        Path(reject_path).write_text(REJECT_CONFIG)
        for name, front_end, apf, env, rejects in plan_asgi_runs(
                fairness_names, tuple(classes), pf_off=pf_off, rejecting=rejecting):
            counts[name], dump = instructions_per_request(
                ROOT, apf, reject_path if rejects else config_path, requests, tmp,
                rejecting=rejects, extra_env=env, front_end=front_end, idle_s=idle_s)
            elapsed[name] = list(ELAPSED.values())[-1]
            if idle_s > 0:
                idle[name] = list(IDLE.values())[-1]
            print(f"{name}: {counts[name]:,.0f}", flush=True)
            if keep_dumps:
                _keep_dump(dump, name, keep_dumps)
    for line in asgi_report(counts, elapsed, fairness_names, requests, idle or None, classes):
        print(line)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--baseline", metavar="DIR", help="also APF in the checkout in DIR")
    ap.add_argument("--fairness", choices=CHOICES,
                    help="the fairnesses to measure (APF_FAIRNESS; default: both when "
                         "this build has maxmin, else kubernetes)")
    ap.add_argument("--rejecting", action="store_true",
                    help="also APF answering every request 429 (one held seat, Reject)")
    ap.add_argument("--orca", action="store_true",
                    help="also APF with APF_LOAD_REPORT=orca (ORCA header on every response)")
    ap.add_argument("--asgi", action="store_true",
                    help="the ASGI workers instead: uvicorn-worker's and gunicorn's asgi, "
                         "bare and ours, serving benchmarks/asgi_hello_app.py")
    ap.add_argument("--fastapi", action="store_true",
                    help="the FastAPI endpoint instead (GET /items/42 returning a pydantic "
                         "model, benchmarks/fastapi_items_app.py) on uvicorn-worker's class, "
                         "bare and ours")
    ap.add_argument("--pf-headers-off", action="store_true",
                    help="also APF with APF_PF_HEADERS=off: what the X-Kubernetes-PF-* "
                         "headers cost per response")
    ap.add_argument("--idle", type=float, default=5.0, metavar="SECONDS",
                    help="--asgi: then count each idle worker this long, to show the "
                         "time-based share of the counts (0: skip; default 5)")
    ap.add_argument("--keep-dumps", metavar="DIR", help="keep the workers' callgrind dumps")
    args = ap.parse_args(argv)
    if args.asgi and args.fastapi:
        ap.error("--asgi and --fastapi are separate runs")
    if (args.asgi or args.fastapi) and (args.baseline or args.orca):
        ap.error("--asgi and --fastapi do not combine with --baseline or --orca")
    fairness_names, note = choose_fairness(args.fairness)
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("valgrind is not installed (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    print(note, flush=True)
    if args.asgi or args.fastapi:
        return run_asgi(fairness_names, args.requests, args.keep_dumps, args.idle,
                        fastapi=args.fastapi, pf_off=args.pf_headers_off,
                        rejecting=args.rejecting)
    # the fairness --rejecting and --orca run, and the served request they are compared with
    side = side_fairness(fairness_names)
    checkout = None
    if args.baseline:
        base = Path(args.baseline).resolve()
        build_extension(base)
        checkout = inspect_checkout(base)
        print(checkout.describe(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "bench.yaml")
        Path(config_path).write_text(BENCH_CONFIG)
        reject_path = os.path.join(tmp, "reject.yaml")
        Path(reject_path).write_text(REJECT_CONFIG)
        runs, against, notes = plan_runs(fairness_names, side, checkout, rejecting=args.rejecting,
                                         orca=args.orca, pf_off=args.pf_headers_off)
        for line in notes:
            print(f"note: {line}", flush=True)
        counts = {}
        elapsed = {}
        for name, root, apf, rejecting, env in runs:
            counts[name], dump = instructions_per_request(
                root, apf, reject_path if rejecting else config_path, args.requests, tmp,
                rejecting=rejecting, extra_env=env)
            elapsed[name] = list(ELAPSED.values())[-1]
            if args.keep_dumps:
                _keep_dump(dump, name, args.keep_dumps)
    bare = counts["bare"]
    served = counts[f"apf {side}"]
    width = max(len(name) for name in counts)
    print(f"user-space instructions per request in the worker ({args.requests} requests, "
          f"1 worker x 8 threads, callgrind):")
    for name, n in counts.items():
        extra = "" if name == "bare" else (f"  added {n - bare:+,.0f} ({n / bare - 1:+.1%}); "
                                           f"bare/apf {bare / n:.3f}")
        if name == "apf 429":
            extra = f"  {n / bare:.3f} of bare, {n / served:.3f} of a served APF request ({side})"
        print(f"  {name:{width}s} {n:12,.0f}{extra}")
    if args.baseline:
        print("this commit vs baseline, per fairness (target within +1%):")
        for p in fairness_names:
            now, old = counts[f"apf {p}"], counts[against[p]]
            print(f"  {p}: {now - old:+,.0f} instructions per request ({now / old - 1:+.2%}) "
                  f"against {against[p]}")
    if args.orca:
        per_response = counts["apf+orca60"] - served
        refreshes = max(1.0, elapsed["apf+orca"] / 0.1)
        per_refresh = (counts["apf+orca"] - counts["apf+orca60"]) * args.requests / refreshes
        print(f"ORCA header (APF_LOAD_REPORT=orca, {side}): {per_response:+,.0f} instructions "
              f"per response with the value cached; one recomputation (every 100 ms) about "
              f"{per_refresh:,.0f} ({refreshes:.0f} in this run's {elapsed['apf+orca']:.1f} s "
              f"under valgrind); at 100 req/s per worker that is "
              f"{per_response + per_refresh / 10:+,.0f} per response, at 1000 req/s "
              f"{per_response + per_refresh / 100:+,.0f}")
    if args.pf_headers_off:
        print(f"the PF headers cost {served - counts['apf nopf']:+,.0f} instructions per "
              f"response (APF_PF_HEADERS=on vs off, {side})")
    if args.rejecting:
        ratio = counts["apf 429"] / served
        print(f"a 429 costs {ratio:.3f} of a served /hello (target <= {REJECT_TARGET:.3f}: "
              f"{'ok' if ratio <= REJECT_TARGET else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
