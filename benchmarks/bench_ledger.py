"""Benchmark the seat ledger: µs per admit+finish cycle, and how it grows with the queue count.

    .venv/bin/python benchmarks/bench_ledger.py [--cycles N] [--baseline DIR]
                                                [--fairness kubernetes|maxmin]

For a bytearray with ``NullLock`` and for real POSIX shared memory with ``ProcessLock``, at 8,
128 and 1024 queues per level, with 0 waiting requests (the fast path: free seats, nothing
queued) and with 1000 waiting (every cycle queues one request and finishes one, which
dispatches the head with the least virtual finish). Prints µs per cycle, the 1024/8 ratio, the
ledger size at default capacities, and the cost of the two buffer access styles considered
(memoryview casts, used, vs ctypes structures).

``--baseline DIR`` measures every configuration with the ``apf_gunicorn`` found in DIR as well
(e.g. a ``git worktree add /tmp/ledger-base <commit>`` checkout), in a child process, one
repetition each in turn, and prints the best of ``--reps`` for each and their ratio: both see the
same machine load, which on a shared machine matters more than anything else.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import subprocess
import sys
import time
import uuid

import posix_ipc

from apf_gunicorn.ledger import QUEUED, Capacity, Ledger, LevelSpec, NullLock, ProcessLock

CAP = Capacity()
FAIRNESS = ["kubernetes"]  # the benchmarked level's dispatch policy (--fairness)


def _hashes(n: int) -> list[int]:
    x = 0x9E3779B97F4A7C15
    out = []
    for i in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407 + i) & ((1 << 64) - 1)
        out.append(x)
    return out


def _cycle_cost(led: Ledger, queues: int, waiting: int, cycles: int) -> float:
    one_rep = _setup(led, queues, waiting)
    return min(one_rep(cycles) for _rep in range(7))


def _setup(led: Ledger, queues: int, waiting: int):
    """Configure one level, fill it with ``waiting`` queued requests; returns run(cycles) ->
    µs per admit+finish cycle."""
    hand = min(6, queues)
    c = 4 if waiting else 1000
    spec = LevelSpec("bench", queues, hand, 100_000, c)
    if FAIRNESS[0] != "kubernetes":  # (a baseline checkout may predate the field)
        spec = spec._replace(fairness=FAIRNESS[0])
    levels, _ = led.configure([spec], ["fs"], 0)
    lv = levels["bench"]
    hashes = _hashes(4096)
    now = 1
    running = []
    for i in range(waiting + (c if waiting else 0)):
        res = led.admit(lv, hashes[i % 4096], 1, 0, 0, 0, now)
        if res.outcome != QUEUED:
            running.append((res.slot, res.gen))
        now += 1000
    clock = [now]

    def run(cycles: int) -> float:
        now = clock[0]
        t0 = time.perf_counter_ns()
        for i in range(cycles):
            now += 1000
            res = led.admit(lv, hashes[i & 4095], 1, 0, 0, 0, now)
            if waiting:
                s, g = running.pop(0)
                granted, _ = led.finish(s, g, now + 500)
                running.extend((gs, gg) for gs, gg, _o in granted)
            else:
                led.finish(res.slot, res.gen, now + 500)
        clock[0] = now
        return (time.perf_counter_ns() - t0) / cycles / 1000

    return run


def _bytearray_ledger() -> tuple[Ledger, callable]:
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=NullLock())
    return led, lambda: None


def _shm_ledger() -> tuple[Ledger, callable]:
    name = f"/apf_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    size = Ledger.size(CAP)
    seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    mm = mmap.mmap(seg.fd, size)
    seg.close_fd()
    led = Ledger.create(mm, CAP, lock=ProcessLock())

    def cleanup() -> None:
        led.close()
        mm.close()
        posix_ipc.unlink_shared_memory(name)

    return led, cleanup


def _access_styles(n: int = 200_000) -> tuple[float, float]:
    """ns per read+write of one field: memoryview cast vs ctypes structure array."""
    buf = bytearray(8192 * 22 * 8)
    w = memoryview(buf).cast("q")
    t0 = time.perf_counter_ns()
    base = 22 * 100
    for _ in range(n):
        w[base + 7] = w[base + 7] + 1
    mv_ns = (time.perf_counter_ns() - t0) / n

    class Slot(ctypes.Structure):
        _fields_ = [(f"f{i}", ctypes.c_int64) for i in range(22)]

    slots = (Slot * 8192).from_buffer(buf)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        s = slots[100]
        s.f7 = s.f7 + 1
    ct_ns = (time.perf_counter_ns() - t0) / n
    del slots, s
    w.release()
    return mv_ns, ct_ns


FACTORIES = {"bytearray+NullLock": _bytearray_ledger, "posix shm+ProcessLock": _shm_ledger}


def _measure(label: str, waiting: int, queues: int, cycles: int) -> float:
    led, cleanup = FACTORIES[label]()
    try:
        return _cycle_cost(led, queues, waiting, cycles)
    finally:
        cleanup()


def _serve() -> int:
    """Child side of --baseline: "setup label|waiting|queues", then "rep cycles" lines, each
    answered with µs per cycle, then "done"."""
    run = cleanup = None
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "setup":
            label, waiting, queues = arg.split("|")
            led, cleanup = FACTORIES[label]()
            run = _setup(led, int(queues), int(waiting))
            print("ok", flush=True)
        elif cmd == "rep":
            print(run(int(arg)), flush=True)
        elif cmd == "done":
            run = None
            cleanup()
            print("ok", flush=True)
    return 0


def _compare(baseline: str, cycles: int, reps: int) -> None:
    """Current vs baseline, one repetition each in turn (so both see the same machine load),
    best of ``reps`` for each."""
    child = subprocess.Popen([sys.executable, __file__, "--serve"], text=True,
                             env=dict(os.environ, PYTHONPATH=baseline),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(line: str) -> str:
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    print(f"{'buffer':<22}{'waiting':>8}{'queues':>7}{'now µs':>9}{'base µs':>9}{'ratio':>7}")
    try:
        for label in FACTORIES:
            for waiting in (0, 1000):
                for queues in (8, 128, 1024):
                    led, cleanup = FACTORIES[label]()
                    try:
                        run = _setup(led, queues, waiting)
                        ask(f"setup {label}|{waiting}|{queues}")
                        now = base = float("inf")
                        for _ in range(reps):
                            now = min(now, run(cycles))
                            base = min(base, float(ask(f"rep {cycles}")))
                        ask("done")
                    finally:
                        cleanup()
                    print(f"{label:<22}{waiting:>8}{queues:>7}{now:>9.2f}{base:>9.2f}"
                          f"{now / base:>7.2f}", flush=True)
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=4000)
    ap.add_argument("--baseline", help="directory holding the apf_gunicorn to compare with")
    ap.add_argument("--reps", type=int, default=15, help="--baseline: repetitions, best of")
    ap.add_argument("--fairness", choices=("kubernetes", "maxmin"), default="kubernetes",
                    help="the benchmarked level's dispatch policy (docs/fairness.md); "
                         "not with --baseline")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fairness != "kubernetes" and args.baseline:
        ap.error("--fairness is not supported with --baseline")
    FAIRNESS[0] = args.fairness
    if args.serve:
        return _serve()
    if args.baseline:
        _compare(args.baseline, args.cycles, args.reps)
        return 0
    print(f"ledger size at default capacities {CAP}: {Ledger.size(CAP)} bytes "
          f"({Ledger.size(CAP) / 2**20:.2f} MiB)")
    mv_ns, ct_ns = _access_styles()
    print(f"field read+write: memoryview.cast {mv_ns:.0f} ns, ctypes Structure {ct_ns:.0f} ns "
          "(a machine-speed yardstick too: gunicorn-ipc.md measured ~75 ns for the former)")
    print(f"{'buffer':<22}{'waiting':>8}{'8 q':>9}{'128 q':>9}{'1024 q':>9}{'1024/8':>8}  (µs/cycle)")
    for label in FACTORIES:
        for waiting in (0, 1000):
            costs = [_measure(label, waiting, queues, args.cycles) for queues in (8, 128, 1024)]
            print(f"{label:<22}{waiting:>8}" + "".join(f"{c:>9.2f}" for c in costs)
                  + f"{costs[2] / costs[0]:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
