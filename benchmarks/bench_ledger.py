"""Benchmark the seat ledger: µs per admit+finish cycle under each fairness, and how it
grows with the queue count.

    .venv/bin/python benchmarks/bench_ledger.py [--fairness kubernetes|maxmin|both]
                                                [--cycles N] [--queues 8,128,1024]
                                                [--baseline DIR [--reps N]] [--instructions]

Per fairness (``--fairness``; the default is both when this build's ledger has
``maxmin``, else ``kubernetes``, and the first line says which), for a bytearray with
``NullLock`` and for real POSIX shared memory with ``ProcessLock``, at 8, 128 and 1024 queues
per level, three scenarios, each a steady state measured over ``--cycles`` admit+finish cycles
(10 times as many for ``at once``):

* ``at once``: 1000 seats, nothing waiting; every request is admitted at once and finished (the
  fast path: in C when the extension is built, since ``admit`` is called with all ten
  arguments as the server's middleware calls it; ``APF_NO_ACCELERATOR=1`` measures the Python
  fast path instead, on both sides of ``--baseline``);
* ``1000 waiting``: 4 seats and 1000 requests of random flows waiting; every cycle queues one
  request of a (mostly new) flow and finishes one, which dispatches the fairness's next request;
* ``flows x2``: 4 seats and as many flows as queues (8 to 1024), each keeping 2 requests
  waiting: every cycle finishes one request, which dispatches the fairness's next one, and queues
  one more for the dispatched request's flow, so every flow stays backlogged (the case where
  ``maxmin`` orders flows, not just queues; its cost may grow with the flow count, which this
  row grows with the queue count).

Prints µs per cycle (best of 7), the flatness ratio (cost at the most queues / at the fewest:
1024/8) per row and the worst per fairness and scenario, the ledger size at default capacities,
and the cost of the two buffer access styles considered (memoryview casts, used, vs ctypes
structures).

``--baseline DIR`` measures every configuration with the ``apf_gunicorn`` found in DIR as well
(e.g. a ``git worktree add /tmp/ledger-base <commit>`` checkout; its C extension is compiled in
place when gcc is present), this checkout and that one each in a child process of its own, one
repetition each in turn, and prints the best of ``--reps`` for each and their ratio: both see
the same machine load, which on a shared machine matters more than anything else. A baseline without a fairness (one that predates
``LevelSpec.fairness``) runs ``kubernetes`` in that fairness's rows, and the output says so. The
summary gives, per fairness, the range and geometric mean of the ratios and the flatness on both
sides.

``--instructions`` counts instead of timing (needs valgrind): each configuration on a bytearray
runs in a child under callgrind, ``PYTHONHASHSEED=0``, and the instructions of its measured
cycles (2000 by default, between two dump points) are divided by their number; with
``--baseline`` the baseline's too. The counts do not move with the machine's load, so they
settle what the wall-clock ratios (±10% here) cannot; about 8 s per configuration and side
(~2.5 min per fairness against a baseline).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import math
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import posix_ipc

from apf_gunicorn.ledger import QUEUED, Capacity, Ledger, LevelSpec, NullLock, ProcessLock

ROOT = Path(__file__).resolve().parent.parent
CAP = Capacity()
BUFFERS = ("bytearray+NullLock", "posix shm+ProcessLock")
AT_ONCE, WAITING, FLOWS = "at once", "1000 waiting", "flows x2"
SCENARIOS = (AT_ONCE, WAITING, FLOWS)
QUEUES = (8, 128, 1024)
#: ``at once`` runs this many times ``--cycles``: in C a cycle is ~50x cheaper than a queued
#: one, and a repetition of a few milliseconds is at the mercy of one burst of machine load
AT_ONCE_FACTOR = 10
KUBERNETES = "kubernetes"


def _hashes(n: int) -> list[int]:
    x = 0x9E3779B97F4A7C15
    out = []
    for i in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407 + i) & ((1 << 64) - 1)
        out.append(x)
    return out


HASHES = _hashes(4096)


def _spec(queues: int, seats: int, fairness: str) -> LevelSpec:
    """The benchmark's one level, running ``fairness`` (a ledger whose ``LevelSpec`` predates the
    ``fairness`` field runs kubernetes only)."""
    args = ("bench", queues, min(6, queues), 100_000, seats)
    if "fairness" in LevelSpec._fields:
        return LevelSpec(*args, fairness=fairness)
    if fairness != KUBERNETES:
        raise ValueError(f"this ledger's LevelSpec has no fairness field: cannot run {fairness}")
    return LevelSpec(*args)


def _cycles(scenario: str, cycles: int) -> int:
    """Cycles per repetition of ``scenario`` for ``--cycles``."""
    return cycles * AT_ONCE_FACTOR if scenario == AT_ONCE else cycles


def _setup(led: Ledger, queues: int, scenario: str, fairness: str = KUBERNETES):
    """Configure one level running ``fairness`` and bring ``scenario`` to its steady state.

    Returns:
        ``run(cycles) -> µs per admit+finish cycle``; ``run.state()`` gives
        ``(executing, {flow hash: requests waiting})`` as the benchmark tracks them.
    """
    # every admit passes all ten arguments positionally, as the server's middleware does: the
    # C fast path takes exactly that call and hands any other to the Python paths
    seats = 1000 if scenario == AT_ONCE else 4
    levels, _ = led.configure([_spec(queues, seats, fairness)], ["fs"], 0)
    lv = levels["bench"]
    clock = [1]
    running: collections.deque = collections.deque()  # (slot, gen) executing, oldest first
    waiting: dict = {}  # (slot, gen) -> flow hash, for the requests queued by flows x2

    def admit(flow: int) -> None:
        clock[0] += 1000
        res = led.admit(lv, flow, 1, 0, 0, 0, clock[0], 0, b"", False)
        if res.outcome == QUEUED:
            waiting[(res.slot, res.gen)] = flow
        else:
            running.append((res.slot, res.gen))

    if scenario == WAITING:
        for i in range(1000 + seats):
            admit(HASHES[i % 4096])
    elif scenario == FLOWS:
        for k, flow in enumerate(HASHES[:queues]):  # 2 waiting each (the first flow also
            while len(waiting) < 2 * (k + 1):          # takes the seats)
                admit(flow)

    def run(cycles: int) -> float:
        now = clock[0]
        t0 = time.perf_counter_ns()
        if scenario == AT_ONCE:
            for i in range(cycles):
                now += 1000
                res = led.admit(lv, HASHES[i & 4095], 1, 0, 0, 0, now, 0, b"", False)
                led.finish(res.slot, res.gen, now + 500)
        elif scenario == WAITING:
            for i in range(cycles):
                now += 1000
                led.admit(lv, HASHES[i & 4095], 1, 0, 0, 0, now, 0, b"", False)
                s, g = running.popleft()
                granted, _ = led.finish(s, g, now + 500)
                running.extend((gs, gg) for gs, gg, _o in granted)
        else:
            for _ in range(cycles):
                now += 1000
                s, g = running.popleft()
                granted, _ = led.finish(s, g, now)
                for gs, gg, _o in granted:
                    running.append((gs, gg))
                    flow = waiting.pop((gs, gg))
                    res = led.admit(lv, flow, 1, 0, 0, 0, now + 500, 0, b"",
                                    False)
                    if res.outcome == QUEUED:
                        waiting[(res.slot, res.gen)] = flow
                    else:
                        running.append((res.slot, res.gen))
        clock[0] = now
        return (time.perf_counter_ns() - t0) / cycles / 1000

    def state() -> tuple[int, dict[int, int]]:
        return len(running), dict(collections.Counter(waiting.values()))

    run.state = state
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


FACTORIES = {BUFFERS[0]: _bytearray_ledger, BUFFERS[1]: _shm_ledger}


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


def measure(buffer: str, scenario: str, queues: int, cycles: int, fairness: str = KUBERNETES,
            reps: int = 7) -> tuple[float, bool]:
    """µs per admit+finish cycle, best of ``reps`` runs of ``cycles``, and whether the ledger
    ran its C fast path (``Ledger.accelerated``).

    Args:
        buffer: one of :data:`BUFFERS`.
        scenario: one of :data:`SCENARIOS`.
        queues: queues of the level.
        cycles: cycles per repetition (``at once``: :data:`AT_ONCE_FACTOR` times as many).
        fairness: the level's fairness.
        reps: repetitions.
    Returns:
        ``(µs per cycle, accelerated)``.
    """
    led, cleanup = FACTORIES[buffer]()
    try:
        run = _setup(led, queues, scenario, fairness)
        return min(run(_cycles(scenario, cycles)) for _rep in range(reps)), led.accelerated
    finally:
        cleanup()


def _serve() -> int:
    """Child side of --baseline, one per checkout, with that checkout's apf_gunicorn: "hello" (answered with what
    it offers, one JSON line), then per configuration "setup buffer|scenario|queues|fairness"
    (answered "ok 1" when the C fast path is bound, "ok 0" when not), "rep cycles" lines (µs
    per cycle) and "done"."""
    import apf_gunicorn

    run = cleanup = None
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "hello":
            print(json.dumps({"package": apf_gunicorn.__file__,
                              "levelspec_field": "fairness" in LevelSpec._fields}), flush=True)
        elif cmd == "setup":
            buffer, scenario, queues, fairness = arg.split("|")
            led, cleanup = FACTORIES[buffer]()
            run = _setup(led, int(queues), scenario, fairness)
            print(f"ok {int(led.accelerated)}", flush=True)
        elif cmd == "rep":
            print(run(int(arg)), flush=True)
        elif cmd == "done":
            run = None
            cleanup()
            print("ok", flush=True)
    return 0


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _flatness(costs: dict, fairness: str, scenario: str, queues: tuple[int, ...]) -> float:
    """The worst over both buffers of cost at the most queues / cost at the fewest."""
    return max(costs[(fairness, b, scenario, queues[-1])]
               / costs[(fairness, b, scenario, queues[0])] for b in BUFFERS)


class _Child:
    """A ``--serve`` child measuring with the apf_gunicorn found in ``root``."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"],
                                     text=True, env=dict(os.environ, PYTHONPATH=str(root)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _compare(baseline: str, fairness_names: list[str], queues: tuple[int, ...], cycles: int,
             reps: int) -> dict:
    """Current vs baseline, each in a child process of its own (alike: neither carries the
    parent's state), one repetition each in turn (so both see the same machine load), best of
    ``reps`` for each. Returns ``{(fairness, buffer, scenario, queues): (now, base)}``."""
    sys.path.append(str(ROOT))
    from benchmarks.checkouts import build_extension, inspect_checkout

    root = Path(baseline).resolve()
    build_extension(root)
    base = inspect_checkout(root)
    here = inspect_checkout(ROOT)
    results = {}
    children = []
    try:
        for checkout in (here, base):
            children.append(_Child(checkout.root))
            hello = json.loads(children[-1].ask("hello"))
            if (hello["package"] != checkout.package
                    or hello["levelspec_field"] != checkout.levelspec_field):
                raise RuntimeError(f"the benchmark's child imported {hello}, not {checkout}")
        now_child, base_child = children
        print(base.describe())
        notes = [n for n in (base.runs(p)[1] for p in fairness_names) if n]
        for note in notes:
            print(f"note: {note}")
        print(f"{'fairness':<11}{'buffer':<22}{'scenario':<13}{'queues':>6}{'now µs':>9}"
              f"{'base µs':>9}{'ratio':>7}")
        for fairness in fairness_names:
            base_fairness, _ = base.runs(fairness)
            for buffer in BUFFERS:
                for scenario in SCENARIOS:
                    for q in queues:
                        acc = now_child.ask(f"setup {buffer}|{scenario}|{q}|{fairness}")
                        base_acc = base_child.ask(f"setup {buffer}|{scenario}|{q}|{base_fairness}")
                        if acc != base_acc:
                            print(f"WARNING: C fast path bound here: {acc}, in the baseline: "
                                  f"{base_acc}")
                        now = old = float("inf")
                        n = _cycles(scenario, cycles)
                        for _ in range(reps):
                            now = min(now, float(now_child.ask(f"rep {n}")))
                            old = min(old, float(base_child.ask(f"rep {n}")))
                        now_child.ask("done")
                        base_child.ask("done")
                        results[(fairness, buffer, scenario, q)] = (now, old)
                        print(f"{fairness:<11}{buffer:<22}{scenario:<13}{q:>6}{now:>9.2f}"
                              f"{old:>9.2f}{now / old:>7.2f}", flush=True)
    finally:
        for child in children:
            child.close()
    print(f"summary (this commit / baseline, µs per admit+finish, target within 10% (issue 12); "
          f"flatness {queues[-1]}/{queues[0]} queues, worst of both buffers):")
    for fairness in fairness_names:
        ratios = [now / old for (p, *_), (now, old) in results.items() if p == fairness]
        print(f"  {fairness}: ratio {min(ratios):.2f}-{max(ratios):.2f}, geometric mean "
              f"{_geomean(ratios):.2f}  (baseline ran {base.runs(fairness)[0]})")
        now_c = {k: v[0] for k, v in results.items()}
        old_c = {k: v[1] for k, v in results.items()}
        for scenario in SCENARIOS:
            print(f"    {scenario:<13} flatness now "
                  f"{_flatness(now_c, fairness, scenario, queues):.2f}"
                  f", baseline {_flatness(old_c, fairness, scenario, queues):.2f}")
    return results


def _count(spec: str) -> int:
    """Child side of --instructions: one configuration ("scenario|queues|fairness|cycles") on a
    bytearray, warmed up, its measured cycles between two ``os.getppid()`` calls, at which
    callgrind (``--dump-before=getppid``) writes a dump."""
    scenario, queues, fairness, cycles = spec.split("|")
    led, cleanup = _bytearray_ledger()
    run = _setup(led, int(queues), scenario, fairness)
    run(200)
    os.getppid()
    run(int(cycles))
    os.getppid()
    cleanup()
    return 0


def instructions_per_cycle(scenario: str, queues: int, fairness: str, cycles: int,
                           root: Path | None = None) -> float:
    """Instructions per admit+finish cycle on a bytearray with ``NullLock``, counted by
    callgrind in a child process: the same count whatever the machine's load.

    Args:
        scenario: one of :data:`SCENARIOS`.
        queues: queues of the level.
        fairness: the level's fairness.
        cycles: the cycles counted (after 200 to warm up).
        root: the checkout whose apf_gunicorn to measure (``PYTHONPATH``; None: this one).
    Returns:
        User-space instructions per cycle (the benchmark's loop included, the same on both
        sides of a comparison).
    Raises:
        RuntimeError: the child failed (the message ends with its last line of stderr).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg")
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(root or ROOT))
        res = subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=getppid",
                              f"--callgrind-out-file={out}", sys.executable,
                              str(Path(__file__).resolve()), "--count",
                              f"{scenario}|{queues}|{fairness}|{cycles}"],
                             env=env, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{scenario}, {queues} queues, {fairness} under callgrind failed: "
                               + res.stderr.strip().splitlines()[-1])
        text = Path(out + ".2").read_text()
    return int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1)) / cycles


def _instructions(fairness_names: list[str], queues: tuple[int, ...], cycles: int,
                  baseline: str | None) -> dict:
    """--instructions: per fairness, scenario and queue count, instructions per cycle here (and
    in the baseline, which runs kubernetes for a fairness it lacks). Returns
    ``{(fairness, scenario, queues): (now, base or None)}``."""
    from benchmarks.checkouts import build_extension, inspect_checkout

    base = None
    if baseline:
        root = Path(baseline).resolve()
        build_extension(root)
        base = inspect_checkout(root)
        print(base.describe())
        for note in [n for n in (base.runs(p)[1] for p in fairness_names) if n]:
            print(f"note: {note}")
    print(f"instructions per admit+finish (callgrind, bytearray+NullLock, {cycles} cycles, "
          f"at once {_cycles(AT_ONCE, cycles)}):")
    print(f"{'fairness':<11}{'scenario':<13}{'queues':>6}{'now':>10}"
          + (f"{'base':>10}{'ratio':>7}" if base else ""))
    results = {}
    for fairness in fairness_names:
        for scenario in SCENARIOS:
            for q in queues:
                n = _cycles(scenario, cycles)
                now = instructions_per_cycle(scenario, q, fairness, n)
                old = None
                if base:
                    old = instructions_per_cycle(scenario, q, base.runs(fairness)[0], n, base.root)
                results[(fairness, scenario, q)] = (now, old)
                print(f"{fairness:<11}{scenario:<13}{q:>6}{now:>10,.0f}"
                      + (f"{old:>10,.0f}{now / old:>7.3f}" if base else ""), flush=True)
    print(f"flatness ({queues[-1]} q / {queues[0]} q)" + (" and ratio to the baseline" if base
                                                          else "") + ":")
    for fairness in fairness_names:
        parts = []
        for scenario in SCENARIOS:
            now_f = results[(fairness, scenario, queues[-1])][0] / results[(fairness, scenario,
                                                                            queues[0])][0]
            part = f"{scenario} {now_f:.3f}"
            if base:
                old_f = (results[(fairness, scenario, queues[-1])][1]
                         / results[(fairness, scenario, queues[0])][1])
                ratios = [results[(fairness, scenario, q)][0] / results[(fairness, scenario, q)][1]
                          for q in queues]
                part += f" (baseline {old_f:.3f}; ratio {min(ratios):.3f}-{max(ratios):.3f})"
            parts.append(part)
        print(f"  {fairness:<11}" + ", ".join(parts))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fairness", choices=("kubernetes", "maxmin", "both"),
                    help="the fairnesses to measure (default: both when this build "
                         "has maxmin, else kubernetes)")
    ap.add_argument("--cycles", type=int,
                    help="cycles per repetition (default 4000; --instructions: 2000)")
    ap.add_argument("--queues", default=",".join(map(str, QUEUES)),
                    help="queue counts per level, comma-separated (flatness: last / first)")
    ap.add_argument("--baseline", help="directory holding the apf_gunicorn to compare with")
    ap.add_argument("--reps", type=int, default=15, help="--baseline: repetitions, best of")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per cycle under callgrind instead of timing "
                         "(bytearray only; needs valgrind; --cycles default 2000)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return _serve()
    if args.count:
        return _count(args.count)
    sys.path.append(str(ROOT))
    from benchmarks.checkouts import choose_fairness

    fairness_names, note = choose_fairness(args.fairness)
    queues = tuple(int(q) for q in args.queues.split(","))
    print(note)
    if args.instructions:
        if not shutil.which("valgrind"):
            print("valgrind is not installed (apt-get install -y valgrind)", file=sys.stderr)
            return 2
        _instructions(fairness_names, queues, args.cycles or 2000, args.baseline)
        return 0
    args.cycles = args.cycles or 4000
    if args.baseline:
        _compare(args.baseline, fairness_names, queues, args.cycles, args.reps)
        return 0
    print(f"ledger size at default capacities {CAP}: {Ledger.size(CAP)} bytes "
          f"({Ledger.size(CAP) / 2**20:.2f} MiB)")
    mv_ns, ct_ns = _access_styles()
    print(f"field read+write: memoryview.cast {mv_ns:.0f} ns, ctypes Structure {ct_ns:.0f} ns "
          "(a machine-speed yardstick too: gunicorn-ipc.md measured ~75 ns for the former)")
    print(f"{'fairness':<11}{'buffer':<22}{'scenario':<13}" + "".join(f"{q:>7} q" for q in queues)
          + f"{f'{queues[-1]}/{queues[0]}':>9}  (µs per admit+finish)")
    costs = {}
    accelerated = set()
    for fairness in fairness_names:
        for buffer in BUFFERS:
            for scenario in SCENARIOS:
                row = []
                for q in queues:
                    cost, acc = measure(buffer, scenario, q, args.cycles, fairness)
                    costs[(fairness, buffer, scenario, q)] = cost
                    accelerated.add(acc)
                    row.append(cost)
                print(f"{fairness:<11}{buffer:<22}{scenario:<13}"
                      + "".join(f"{c:>9.2f}" for c in row) + f"{row[-1] / row[0]:>9.2f}",
                      flush=True)
    print("C fast path: " + {frozenset({True}): "bound", frozenset({False}): "not bound "
                             "(pure-Python paths)"}.get(frozenset(accelerated), "mixed"))
    print(f"flatness ({queues[-1]} q / {queues[0]} q, worst of both buffers):")
    for fairness in fairness_names:
        print(f"  {fairness:<11}" + ", ".join(
            f"{s} {_flatness(costs, fairness, s, queues):.2f}" for s in SCENARIOS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
