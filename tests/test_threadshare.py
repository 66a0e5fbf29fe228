"""Threads shared fairly between flows (gthread/threadshare.py): the victim choice as a pure
function, the table's races, and the middleware in process: a request that finds no
non-exempt thread takes the thread of the heaviest flow's newest parked request, which answers
429 ``thread-share`` and leaves the ledger clean."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace as NS

from werkzeug.test import EnvironBuilder

from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.gthread import wsgi as middleware
from apf_gunicorn.gthread.threadshare import ThreadShare, choose_victim
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec
from apf_gunicorn.ledger.records import EXECUTE

A, B, C = (0, 1), (0, 2), (0, 3)


# -- choose_victim ------------------------------------------------------------------------------

def test_the_flow_holding_the_most_parked_threads_gives_one_up():
    assert choose_victim({A: 3, B: 1}, C) == A
    assert choose_victim({A: 3, B: 1}, B) == A
    assert choose_victim({A: 1, B: 4}, A) == B


def test_the_arrival_is_turned_away_when_its_flow_holds_the_most_or_ties():
    assert choose_victim({A: 3, B: 1}, A) is None
    assert choose_victim({A: 2, B: 2}, A) is None  # a tie: no churn between equals
    assert choose_victim({}, A) is None  # nothing parked: every thread runs a request


def test_a_flow_holding_one_thread_or_none_is_never_turned_away_while_another_holds_several():
    for own in (0, 1):
        for several in (2, 3, 10):
            parked = {A: several} if own == 0 else {A: several, B: own}
            assert choose_victim(parked, B) == A, (own, several)


def test_a_flows_only_parked_request_is_never_taken():
    """Only parked threads are counted: a flood running on every other thread holds none
    parked, and must not take a light user's one parked request for its newcomer."""
    assert choose_victim({A: 1}, B) is None
    assert choose_victim({A: 1, B: 1}, C) is None
    assert choose_victim({A: 2, B: 1}, C) == A
    assert choose_victim({A: 3, B: 2}, B) == A


def test_ties_go_to_the_flow_that_began_holding_parked_threads_first():
    assert choose_victim({B: 2, A: 2, C: 1}, C) == B
    assert choose_victim({A: 2, B: 2, C: 1}, C) == A


# -- ThreadShare ----------------------------------------------------------------------------------

def test_the_newest_parked_request_of_the_heaviest_flow_is_evicted():
    share = ThreadShare()
    a = [share.park(A, slot, 1, f"wa{slot}") for slot in range(3)]
    b = share.park(B, 10, 1, "wb")
    cancelled = []
    victim = share.evict(C, lambda slot, gen: cancelled.append(slot) or True)
    assert victim is a[-1] and cancelled == [2]
    assert share.leave(a[-1]) is True  # its thread answers 429
    assert share.counts() == {A: 2, B: 1}
    assert share.leave(b) is False and share.leave(a[0]) is False
    assert share.counts() == {A: 1}
    assert share.evict(A, lambda slot, gen: True) is None  # its own flow
    assert share.counts() == {A: 1}


def test_a_victim_dispatched_meanwhile_runs_and_the_next_one_is_tried():
    share = ThreadShare()
    a = [share.park(A, slot, 1, None) for slot in range(3)]
    dispatched = {2}
    victim = share.evict(B, lambda slot, gen: slot not in dispatched)
    assert victim is a[1]
    assert share.leave(a[2]) is False  # granted: it runs as if nothing happened
    assert share.counts() == {A: 1}


def test_no_victim_when_every_candidate_was_dispatched():
    share = ThreadShare()
    a = [share.park(A, slot, 1, None) for slot in range(2)]
    assert share.evict(B, lambda slot, gen: False) is None
    assert [share.leave(e) for e in a] == [False, False]
    assert share.counts() == {}


def test_a_victim_whose_wait_ended_learns_the_verdict_only_once_it_is_final():
    """The victim's thread calls leave() while the arrival's cancel is still in the ledger:
    it must wait for the verdict, not carry on as if it had not been claimed."""
    share = ThreadShare()
    entries = [share.park(A, slot, 1, None) for slot in range(2)]
    in_cancel, release = threading.Event(), threading.Event()

    def cancel(slot, gen):
        in_cancel.set()
        assert release.wait(10)
        return True

    arrival = threading.Thread(target=share.evict, args=(B, cancel))
    arrival.start()
    assert in_cancel.wait(10)
    verdict = []
    victim = threading.Thread(target=lambda: verdict.append(share.leave(entries[1])))
    victim.start()
    victim.join(0.2)
    assert victim.is_alive() and verdict == [], "the victim did not wait for the verdict"
    release.set()
    arrival.join(10)
    victim.join(10)
    assert verdict == [True]


def test_a_failing_cancel_leaves_the_victim_to_its_own_wait():
    share = ThreadShare()
    entry = share.park(A, 0, 1, None)
    share.park(A, 1, 1, None)

    def boom(slot, gen):
        raise RuntimeError("ledger down")

    assert share.evict(B, boom) is None  # logged, never raised; no victim is known to be out
    assert share.leave(entry) is False


# -- the middleware, in process -------------------------------------------------------------------

class ByUser:
    """Classifies every request into one level; the flow is the ``X-Remote-User`` header."""

    def classify(self, attrs):
        user = attrs.user or ""
        return NS(flow_schema=NS(name="fs", uid="uid-fs"),
                  priority_level=NS(name="lvl", uid="uid-pl", is_exempt=False),
                  distinguisher=user, flow_hash=hash(user) & 0xFFFFFFFF)


def _setup(seats: int, nonexempt: int):
    """A ledger of one level, a worker's parking and thread reserve, and a middleware whose app
    answers 200 once ``gate`` is set."""
    gate = threading.Event()

    def app(environ, start_response):
        assert gate.wait(10)
        start_response("200 OK", [])
        return [b"ok"]

    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure([LevelSpec("lvl", 16, 4, 10, seats)], ["fs"],
                                    time.monotonic_ns())
    parking = Parking()
    inflight: list = []
    ctx = WorkerContext(
        ledger=led, resolver=RequestInfoResolver(trusted_proxies=["127.0.0.1"]),
        classifier=ByUser(),
        level_index=levels, fs_index=schemas, owner=0, parking=parking,
        deliver=lambda granted: [parking.grant(s, g) for s, g, o in granted if o == 0],
        add_linger=lambda until, slot, gen: led.release(slot, gen, until),
        queue_wait_limit_ns=30 * 10**9, alive=lambda: True, max_seats={"lvl": 1},
        inflight=inflight, nonexempt_threads=nonexempt)
    return led, parking, inflight, APFMiddleware(app, ctx), gate


class Request(threading.Thread):
    """One request on its own thread, as a gthread worker runs it (the thread reserve's entry
    popped when the thread is done, as ``ApfThreadWorker.handle`` does)."""

    def __init__(self, mw, inflight, user):
        super().__init__(daemon=True)
        self.mw, self.inflight, self.user = mw, inflight, user
        self.status = None
        self.headers = {}

    def run(self):
        middleware.hidden.held = False
        middleware.hidden.enqueued_ns = 0

        def start_response(status, headers, exc_info=None):
            self.status = int(status.split()[0])
            self.headers = dict(headers)

        environ = EnvironBuilder(path="/x", headers={"X-Remote-User": self.user}).get_environ()
        environ["REMOTE_ADDR"] = "127.0.0.1"
        try:
            body = self.mw(environ, start_response)
            b"".join(body)
            getattr(body, "close", lambda: None)()
        finally:
            if middleware.hidden.held:
                middleware.hidden.held = False
                self.inflight.pop()


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _flood(mw, inflight, parking, n: int) -> list[Request]:
    """``n`` heavy requests, one after another: the first runs (one seat), the rest park."""
    flood = [Request(mw, inflight, "heavy") for _ in range(n)]
    for i, t in enumerate(flood):
        t.start()
        assert _wait_for(lambda i=i: len(inflight) == i + 1 and len(parking) == i)
    return flood


def _level(led):
    return led.snapshot(time.monotonic_ns()).levels[0]


def test_a_light_flow_takes_the_thread_of_the_floods_newest_parked_request():
    """1 seat, 3 non-exempt threads: the flood runs one request and parks two. The light
    user's request takes the newest parked one's thread, which answers 429 thread-share; the
    light request is served in its turn, and the ledger is clean after."""
    led, parking, inflight, mw, gate = _setup(seats=1, nonexempt=3)
    flood = _flood(mw, inflight, parking, 3)
    newest = flood[2]
    light = Request(mw, inflight, "light")
    light.start()
    newest.join(10)
    assert newest.status == 429 and "Retry-After" in newest.headers
    assert _wait_for(lambda: len(parking) == 2)  # the light request parked in its place
    assert len(inflight) == 3
    assert _level(led).requests_waiting == 2
    gate.set()
    for t in (*flood[:2], light):
        t.join(10)
    assert [t.status for t in flood] == [200, 200, 429] and light.status == 200
    assert inflight == [] and len(parking) == 0
    lv = _level(led)
    assert lv.requests_waiting == lv.requests_executing == lv.seats_in_use == 0
    (st,) = [s for s in led.request_stats() if s.flow_schema == "fs"]
    assert st.rejected["thread-share"] == 1 and st.rejected["thread-reserve"] == 0
    assert st.rejected["cancelled"] == 0
    assert st.dispatched == 3
    assert mw.stats["thread_share"] == 1


def test_the_floods_own_newcomer_is_turned_away_and_nothing_is_evicted():
    led, parking, inflight, mw, gate = _setup(seats=1, nonexempt=3)
    flood = _flood(mw, inflight, parking, 3)
    extra = Request(mw, inflight, "heavy")
    extra.start()
    extra.join(10)
    assert extra.status == 429
    gate.set()
    for t in flood:
        t.join(10)
    assert [t.status for t in flood] == [200] * 3
    (st,) = [s for s in led.request_stats() if s.flow_schema == "fs"]
    assert st.rejected["thread-reserve"] == 1 and st.rejected["thread-share"] == 0


def test_a_victim_granted_meanwhile_runs_and_the_arrival_is_turned_away():
    """The seats come free just before the arrival's cancel: the ledger says the victim was
    dispatched, so it runs; the flow's other parked request is its only one now (and granted
    too), so the arrival gets thread-reserve."""
    led, parking, inflight, mw, gate = _setup(seats=2, nonexempt=3)
    # the seats are taken by another worker, so this worker's requests park
    others = [led.admit(0, 99, 1, 0, 0, 1, time.monotonic_ns()) for _ in range(2)]
    assert [o.outcome for o in others] == [EXECUTE] * 2
    heavy = [Request(mw, inflight, "heavy") for _ in range(2)]
    for i, t in enumerate(heavy):
        t.start()
        assert _wait_for(lambda i=i: len(parking) == i + 1)
    inflight.append(None)  # the third non-exempt thread runs something else
    real_cancel = led.cancel

    def cancel_after_the_grants(slot, gen, now, reason="time-out"):
        for o in others:
            granted, _ = led.finish(o.slot, o.gen, time.monotonic_ns())
            for s, g, _ in granted:
                parking.grant(s, g)
        others.clear()
        return real_cancel(slot, gen, now, reason)

    led.cancel = cancel_after_the_grants
    light = Request(mw, inflight, "light")
    light.start()
    light.join(10)
    assert light.status == 429
    (st,) = [s for s in led.request_stats() if s.flow_schema == "fs"]
    assert st.rejected["thread-reserve"] == 1 and st.rejected["thread-share"] == 0
    gate.set()
    for t in heavy:
        t.join(10)
    assert [t.status for t in heavy] == [200, 200]
    inflight.pop()
    assert inflight == [] and len(parking) == 0
    assert _level(led).seats_in_use == 0


def test_has_victim_for_agrees_with_choose_victim():
    """The poller asks ``has_victim_for`` before it answers a thread-reserve 429 itself: it
    must say what ``evict`` would do, without claiming anything."""
    share = ThreadShare()
    heavy, light = (0, 1), (0, 2)
    assert not share.has_victim_for(light)  # nothing parked: the arrival is turned away
    entries = [share.park(heavy, slot, 1, object()) for slot in range(2)]
    assert share.has_victim_for(light)
    assert not share.has_victim_for(heavy)  # the flow holding the most is turned away itself
    assert share.counts() == {heavy: 2}  # nothing claimed
    share.leave(entries[1])
    assert not share.has_victim_for(light)  # a flow's only parked request is never taken
