"""Flask app for the server tests: endpoints that sleep, stream, fail, and count how many
requests execute at once across all worker processes.

The cross-process counter lives in a small file (``APP_COUNTER``) mapped by every worker and
updated under ``flock``: per counter name, the number executing now and the most ever seen.
"""

import fcntl
import mmap
import os
import struct
import time

from flask import Flask, Response, jsonify, request

app = Flask(__name__)
# A slow worker boot, as on a loaded machine (seconds; tests of the fixture's readiness probe).
time.sleep(float(os.environ.get("APP_IMPORT_DELAY", "0")))

_COUNTERS = ("work", "other", "light", "heavy")
_REC = struct.Struct("<qq")  # executing now, max seen
_PATH = os.environ.get("APP_COUNTER", "")
_mm = None


def _map():
    global _mm
    if _mm is None and _PATH:
        fd = os.open(_PATH, os.O_RDWR)
        try:
            _mm = mmap.mmap(fd, _REC.size * len(_COUNTERS))
        finally:
            os.close(fd)
    return _mm


def _update(name: str, delta: int) -> None:
    mm = _map()
    if mm is None or name not in _COUNTERS:
        return
    off = _REC.size * _COUNTERS.index(name)
    fd = os.open(_PATH, os.O_RDWR)  # own open file description: flock excludes threads too
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cur, top = _REC.unpack_from(mm, off)
        cur += delta
        mm[off:off + _REC.size] = _REC.pack(cur, max(top, cur))
    finally:
        os.close(fd)


def read_counters(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    return {n: _REC.unpack_from(data, _REC.size * i) for i, n in enumerate(_COUNTERS)}


def _busy(name: str):
    ms = float(request.args.get("ms", "100"))
    _update(name, 1)
    try:
        time.sleep(ms / 1000)
    finally:
        _update(name, -1)
    return f"{name} done pid={os.getpid()}\n"


@app.route("/hello")
def hello():
    return "hello\n"


@app.route("/spin")
def spin():
    """``ms`` of this thread's CPU time in Python (holding the GIL)."""
    end = time.thread_time() + float(request.args.get("ms", "5")) / 1000
    n = 0
    while time.thread_time() < end:
        n += 1
    return f"spun {n}\n"


@app.route("/healthz")
def healthz():
    return "ok\n"


@app.route("/work")
def work():
    return _busy(request.args.get("c", "work"))


_TRACK = os.environ.get("APP_TRACK", "")


def track(tag: str, rid: str) -> None:
    """Append one record ``tag pid rid monotonic_ns`` to ``APP_TRACK`` (``S`` when a tracked
    request starts, ``E`` when it ends): the chaos tests compute the app's concurrency from
    them, counting a request of a killed worker as ended when it was killed. One ``write`` on
    an ``O_APPEND`` file, so records of concurrent workers never interleave."""
    fd = os.open(_TRACK, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{tag} {os.getpid()} {rid} {time.monotonic_ns()}\n".encode())
    finally:
        os.close(fd)


@app.route("/work/tracked")
def tracked():
    """Sleep ``ms`` between a start and an end record (:func:`track`)."""
    ms = float(request.args.get("ms", "100"))
    rid = os.urandom(6).hex()
    track("S", rid)
    try:
        time.sleep(ms / 1000)
    finally:
        track("E", rid)
    return f"tracked pid={os.getpid()}\n"


_POOL = None


@app.route("/work/pool")
def pool():
    """Hold one of a backend's "connections" ``ms`` ms: a POSIX semaphore shared by every
    worker, named by ``APP_POOL_SEMAPHORE`` (the test creates it with the pool's size).
    Requests beyond the pool wait for a connection inside the app, as on a database pool."""
    global _POOL
    import posix_ipc

    if _POOL is None:
        _POOL = posix_ipc.Semaphore(os.environ["APP_POOL_SEMAPHORE"])
    ms = float(request.args.get("ms", "50"))
    _POOL.acquire()
    try:
        time.sleep(ms / 1000)
    finally:
        _POOL.release()
    return f"pool done pid={os.getpid()}\n"


@app.route("/other")
def other():
    return _busy("other")


@app.route("/boom")
def boom():
    raise RuntimeError("boom")


@app.route("/stream")
def stream():
    def gen():
        for i in range(3):
            time.sleep(0.05)
            yield f"chunk {i}\n"
    return Response(gen(), mimetype="text/plain")


@app.route("/pid")
def pid():
    return jsonify(pid=os.getpid())


@app.route("/ledger-path")
def ledger_path():
    """Which fast paths this worker's ledger runs: C (``accelerated``) or pure Python
    (``APF_NO_ACCELERATOR=1``, inherited from the test run; scripts/test.sh's second pass)."""
    from apf_gunicorn.server import state

    return jsonify(pid=os.getpid(), accelerated=state.WORKER.ledger.accelerated)


@app.route("/fork")
def fork():
    """Fork a child that outlives the request (as a lazily created multiprocessing pool does)."""
    seconds = float(request.args.get("s", "30"))
    child = os.fork()
    if child == 0:
        time.sleep(seconds)
        os._exit(0)
    return jsonify(child=child, pid=os.getpid())
