"""The ledger's ``maxmin`` fairness against its reference model, decision by decision.

``tests/maxmin_model.py`` states it; ``apf_gunicorn/ledger/maxmin.py`` implements it over
the shared buffer. Both are driven with the same operations (through the simulator's harness,
and by random streams with cancels, lingering, final-seat caps and too-wide requests over two
levels), and after every operation they must agree on the outcome, the slot, the requests
dispatched, the linger time, and on every flow's words (tag, counts, learnt estimate) and each
level's virtual time. ``repair.verify`` checks the ledger's own invariants along the way.
"""

from __future__ import annotations

import os
import random

import pytest
from maxmin_model import EXECUTING, LINGERING, WAITING, MaxMinModel, verify

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, repair
from apf_gunicorn.ledger.layout import (
    F_EST,
    F_EXEC,
    F_N,
    F_PACE,
    F_SEATS,
    F_TAG,
    F_WAITING,
    M_V,
    NIL,
)
from apf_gunicorn.ledger.lock import NullLock
from apf_gunicorn.simulate import load_scenario, simulate
from apf_gunicorn.simulate.backends import concurrent_requests_bound
from apf_gunicorn.simulate.harness import Admission

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = [os.path.join(HERE, "scenarios", "fairness", n) for n in sorted(
    os.listdir(os.path.join(HERE, "scenarios", "fairness"))) if n.endswith(".yaml")] + [
    os.path.join(HERE, "scenarios", "kubernetes", n) for n in (
        "k8s-11-different-widths.yaml", "k8s-12-too-wide.yaml",
        "k8s-13-windup-upper-bound.yaml",
        "k8s-05-separation-24-think500ms-pad1s-final2-conc2-clients2.yaml",
        "k8s-05-separation-12-think0s-pad1s-final2-conc2-clients2.yaml")]


class Pair:
    """A ledger and a model with the same levels, driven together and compared."""

    def __init__(self, specs: list[tuple[int, int, int, int]], slots: int,
                 learn: bool = False) -> None:
        cap = Capacity(slots=slots, levels=max(4, len(specs)), queues=max(
            64, sum(s[1] for s in specs)))
        self.led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock(),
                                 learn_service=learn)
        names, _ = self.led.configure(
            [LevelSpec(f"l{i}", q, h, qll, c, "maxmin") for i, (c, q, h, qll) in enumerate(specs)],
            ["fs"], 0)
        self.levels = [names[f"l{i}"] for i in range(len(specs))]
        self.model = MaxMinModel(slots, learn_level=learn, check=True)
        for c, q, h, qll in specs:
            self.model.add_level(c, q, h, qll)
        self.ops = 0

    def admit(self, level, h, initial, final, al, now):
        res = self.led.admit(self.levels[level], h, initial, final, al, 0, now)
        out, s, gen, granted = self.model.admit(level, h, initial, final, al, now)
        got = [(g[0], g[1]) for g in res.granted]
        want_outcome = {"execute": EXECUTE, "queued": QUEUED}.get(out, "rejected")
        assert (res.outcome, res.reason or "") == (
            want_outcome, "" if out in ("execute", "queued") else out), (res, out)
        if out in ("execute", "queued"):
            assert (res.slot, res.gen) == (s, gen)
        assert got == granted, (got, granted)
        self.compare()
        return res, granted

    def finish(self, s, gen, now):
        g1, l1 = self.led.finish(s, gen, now)
        g2, l2 = self.model.finish(s, gen, now)
        assert ([(g[0], g[1]) for g in g1], l1) == (g2, l2)
        self.compare()
        return g2, l2

    def release(self, s, gen, now):
        g1 = self.led.release(s, gen, now)
        g2 = self.model.release(s, gen, now)
        assert [(g[0], g[1]) for g in g1] == g2
        self.compare()
        return g2

    def cancel(self, s, gen, now):
        assert self.led.cancel(s, gen, now) == self.model.cancel(s, gen, now)
        self.compare()

    def compare(self):
        """Every flow's words and every level's V agree; the ledger verifies."""
        self.ops += 1
        led, m = self.led, self.model
        mm = led._maxmin
        w, u = led._w, led._u
        for i, lv in enumerate(m.levels):
            lb = led._lvb + self.levels[i] * 40
            assert u[mm._mm(lb) + M_V] == lv.v
            assert w[lb + 13] == lv.waiting  # L_WAITING
            for f in range(m.slots):
                if m.f_level[f] != i or m.f_where[f] == 3:  # active flows of the level
                    continue
                lf = mm._find(self.levels[i], m.f_hash[f])
                assert lf != NIL
                fa = mm._fa(lf)
                assert (u[fa + F_TAG], w[fa + F_WAITING], w[fa + F_EXEC], w[fa + F_SEATS],
                        w[fa + F_EST], w[fa + F_N], w[fa + F_PACE]) == (
                    m.f_tag[f], m.f_waiting[f], m.f_exec[f], m.f_seats[f], m.f_est[f],
                    m.f_n[f], m.f_pace[f]), f
        if self.ops % 25 == 0:
            assert repair.verify(led) == []
            assert verify(m) == []


class PairBackend:
    """The pair behind the simulator's backend protocol."""

    name = "ledger+model"

    def __init__(self, qs, clients):
        slots = concurrent_requests_bound(clients) + 8
        self.pair = Pair([(qs.concurrency_limit, qs.queues, qs.hand_size,
                           qs.queue_length_limit)], slots)

    def admit(self, level, flow_hash, initial, final, al, now):
        res, granted = self.pair.admit(level, flow_hash, initial, final, al, now)
        if res.outcome == "rejected":
            return Admission(None, res.reason, granted)
        if res.outcome == EXECUTE:
            granted = [*granted, (res.slot, res.gen)]
        return Admission((res.slot, res.gen), "", granted)

    def finish(self, handle, now):
        return self.pair.finish(handle[0], handle[1], now)

    def release(self, handle, now):
        return self.pair.release(handle[0], handle[1], now)

    def demand_stats(self, level, now):
        from apf_gunicorn.simulate.harness import DemandResults

        st = self.pair.led.take_demand_stats(self.pair.levels[level], now)
        return DemandResults(st.duration_s, st.average, st.deviation, st.min, st.max)

    def epoch_advances(self):
        return 0


@pytest.mark.parametrize("path", SCENARIOS, ids=os.path.basename)
def test_ledger_matches_model_on_scenarios(path):
    sc = load_scenario(path)
    holder = {}

    def factory(qs, clients):
        holder["b"] = PairBackend(qs, clients)
        return holder["b"]

    result = simulate(sc, factory)
    assert holder["b"].pair.ops > 100
    for totals in result.clients.values():
        assert totals.dispatched == totals.completed


@pytest.mark.parametrize("learn", [False, True])
def test_ledger_matches_model_on_random_operations(learn):
    seen = {"reservations": 0, "backfills": 0, "evictions": 0}
    for seed in range(5):
        m = _random_run(seed, learn)
        seen["reservations"] += m.reservations
        seen["backfills"] += m.backfills
        seen["evictions"] += m.evictions
    assert all(seen.values()), seen  # every mechanism was compared


def test_ledger_matches_model_through_a_lockstep():
    """Issue 27's flood beside light users (``test_simulate_lockstep.py``), equal and
    jittered: the lockstep hold decides the same linger times in both, and it does hold, and
    a light user's arrival ends holds."""
    from test_simulate_lockstep import SEATS, run

    holds = ended = 0
    for jitter in (0.0, 0.2):
        be = PairBackend.__new__(PairBackend)
        be.pair = Pair([(SEATS, 64, 6, 50)], 128)
        run("maxmin", jitter=jitter, seconds=8, backend=be)
        assert be.pair.ops > 1000
        holds += be.pair.model.holds
        ended += be.pair.model.ended_holds
    assert holds > 16 and ended > 0


def test_tags_wrap_around_2_64():
    """Tags and V are uint64 seat-ns compared by signed difference: a level whose V starts just
    below 2**64 crosses the wrap with every flow, and the ledger still matches the model."""
    m = _random_run(7, False, v0=(1 << 64) - 3_000_000_000)
    assert m.levels[0].v < 1 << 40  # it wrapped


def _random_run(seed: int, learn: bool, v0: int = 0) -> MaxMinModel:
    rnd = random.Random(seed)
    pair = Pair([(rnd.randint(1, 6), 8, 3, rnd.randint(1, 6)), (rnd.randint(2, 6), 4, 2, 4)],
                slots=24, learn=learn)
    m = pair.model
    if v0:
        for i, lv in enumerate(m.levels):
            lv.v = v0
            lb = pair.led._lvb + pair.levels[i] * 40
            pair.led._u[pair.led._maxmin._mm(lb) + M_V] = v0
    now = 0
    live: list[tuple[int, int]] = []
    for _ in range(1200):
        now += rnd.choice((0, 1, 1000, 5_000_000, 100_000_000))
        op = rnd.random()
        if op < 0.45:
            level = rnd.randrange(2)
            c = m.levels[level].c
            res, _g = pair.admit(level, rnd.randrange(6 if seed % 2 else 40),
                                 rnd.randint(1, c + 1), rnd.choice((0, 0, 1, c + 2)),
                                 rnd.choice((0, 0, 50_000_000)), now)
            if res.outcome != "rejected":
                live.append((res.slot, res.gen))
        elif live:
            s, gen = rnd.choice(live)
            if m.s_gen[s] != gen or m.s_state[s] == 0:
                live.remove((s, gen))
                continue
            st = m.s_state[s]
            if st == EXECUTING:
                pair.finish(s, gen, now)
            elif st == LINGERING:
                pair.release(s, gen, now)
                live.remove((s, gen))
            elif st == WAITING and op > 0.9:
                pair.cancel(s, gen, now)
                live.remove((s, gen))
    assert repair.verify(pair.led) == []
    return m


def test_reaped_worker_and_repair_keep_the_flow_state_consistent():
    """A dead worker's waiting and executing requests leave their flows (nothing learnt from
    the executing ones); a repair rebuilds the flows from the slot table."""
    cap = Capacity(slots=32, levels=4, queues=64)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    names, _ = led.configure([LevelSpec("l", 8, 2, 8, 2, "maxmin")], ["fs"], 0)
    lv = names["l"]
    got = [led.admit(lv, h % 3, 1, 0, 0, h % 2, 10 + h) for h in range(8)]
    assert [r.outcome for r in got[:2]] == [EXECUTE, EXECUTE]
    granted = led.reap_worker(0, 1000)
    assert granted and repair.verify(led) == []
    state = led._maxmin.flow_state_locked(led._lvb + lv * 40)
    assert all(f["estimate_ns"] is None for f in state["flows"].values())  # reaped: unlearnt
    repair.rebuild(led, 2000)
    assert repair.verify(led) == []


@pytest.mark.parametrize("accelerate", [True, False], ids=["c", "python"])
def test_a_parked_flow_competes_again_when_its_worker_dies(accelerate):
    """A new flow is parked at its equal share until its first completion. When the worker
    running its one request dies, nothing completes (nothing is learnt) and it holds nothing:
    it must compete again with its tag, not wait until no other flow has anything waiting."""
    cap = Capacity(slots=32, levels=4, queues=64, workers=4)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock(), accelerate=accelerate)
    if accelerate and not led.accelerated:
        pytest.skip("the C fast paths are not built (or APF_NO_ACCELERATOR is set)")
    names, _ = led.configure([LevelSpec("l", 8, 2, 8, 2, "maxmin")], ["fs"], 0)
    lv = names["l"]
    lb = led._lvb + lv * 40
    new = led.admit(lv, 1, 1, 0, 0, 1, 10)  # flow 1, on worker 1: never finishes anything
    other = led.admit(lv, 2, 1, 0, 50_000_000, 0, 20)  # flow 2 is charged 50 ms more
    assert (new.outcome, other.outcome) == (EXECUTE, EXECUTE)
    waits = led.admit(lv, 1, 1, 0, 0, 0, 30)
    more = [led.admit(lv, 2, 1, 0, 0, 0, 40 + i) for i in range(3)]
    assert [r.outcome for r in [waits, *more]] == [QUEUED] * 4
    led.finish(other.slot, other.gen, 1000)
    led.release(other.slot, other.gen, 2000)  # a seat frees: flow 1 is first, but capped
    flows = led._maxmin.flow_state_locked(lb)["flows"]
    assert flows[1]["parked"] and flows[1]["tag"] < flows[2]["tag"]

    granted = led.reap_worker(1, 3000)  # flow 1's worker dies: its seat frees

    assert [(g[0], g[1]) for g in granted] == [(waits.slot, waits.gen)], \
        "the seat went to flow 2, whose tag is 50 ms later"
    assert not led._maxmin.flow_state_locked(lb)["flows"][1]["parked"]
    assert repair.verify(led) == []


def test_switching_fairness_keeps_waiting_requests():
    cap = Capacity(slots=32, levels=4, queues=64)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    names, _ = led.configure([LevelSpec("l", 8, 2, 8, 2)], ["fs"], 0)
    lv = names["l"]
    res = [led.admit(lv, h, 1, 0, 0, 0, 10 + h) for h in range(6)]
    for fairness in ("maxmin", "kubernetes", "maxmin"):
        led.configure([LevelSpec("l", 8, 2, 8, 2, fairness)], ["fs"], 100)
        assert repair.verify(led) == [], fairness
    done = 0
    for r in res:
        if r.outcome == EXECUTE:
            led.finish(r.slot, r.gen, 200)
            done += 1
    assert done == 2 and repair.verify(led) == []
    with pytest.raises(ValueError, match="fairness"):
        led.configure([LevelSpec("l", 8, 2, 8, 2, "fifo")], ["fs"], 300)
