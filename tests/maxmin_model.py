"""Reference model of the ``maxmin`` fairness (test-only), in the ledger's data layout.

This is the readable statement of the fairness that the shared-memory ledger implements and is
checked against (same scenario -> same dispatch decisions). It is written the way the ledger
stores things, so that the Python and C ledgers can follow it word for word:

* integers only: nanoseconds, seats, and *seat-ns* tags, wrapping modulo 2**64 and compared by
  signed difference (serial-number arithmetic), so a tag never overflows in a long-lived server;
* struct-of-arrays tables (one list per field) standing for buffer words: the slot table, the
  queue records and a bounded **flow table** with as many entries as slots (an active flow, one
  with a request waiting or executing, holds at least one slot), found through an
  open-addressing index with linear probing and backward-shift deletion (no tombstones), entries
  handed out from a free list so their index is stable;
* per level, an intrusive **pairing heap** of the backlogged flows keyed by (start tag, later
  backlog first), O(log n) amortised per operation, with links (child, next sibling, previous
  sibling or parent) in the flow entries; a list of *parked* flows (new flows at their equal
  share); a per-flow FIFO of its waiting requests across its queues (links in the slots).

Admission is Kubernetes' (shuffle sharding over the level's queues with the rotating offset and
the least waiting work, the queue-length limit, ``queue-full`` only when every seat is busy);
only the dispatch order differs. The fairness (``docs/fairness.md`` explains it and its bound):

* **Start tags per flow.** ``tag`` is the flow's virtual start in seat-ns. When a flow goes from
  nothing waiting to something waiting, ``tag = max(tag, V)`` and it takes the next backlog
  sequence number (ties go to the flow that started waiting last). ``V`` is the level's virtual
  time: at every dispatch ``V = max(V, min(tag of the dispatched flow, smallest tag waiting))``.
* **Charging.** At dispatch the flow's tag grows by ``held seats x (estimate + additional
  latency)``; the estimate is the flow's learnt service time (mean of its first 16 requests, then
  an exponentially weighted average, the ledger's ``learn_service``), or the level's G for a flow
  that has not finished a request yet. At the end of the main phase the tag is corrected by
  ``held x (ran - estimate)``: the net charge is the seat-time the request held.
* **Dispatch.** The backlogged flow with the smallest key sends its oldest waiting request.
  A flow that has finished nothing yet (its cost is unknown) holds at most its equal share of
  the seats (``C / active flows``) while others wait: it is parked until its first completion.
* **Reservation and backfill.** When the chosen head does not fit, the level reserves for it
  (``reserve``) until it runs. Another head may run meanwhile only if it fits now and, by the
  estimates, either ends before the reserved head could start (``T``), or uses only seats the
  reserved head will not need at ``T``. Only this case scans (the executing requests and the
  backlogged flows of the level).
"""

from __future__ import annotations

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.ledger.ledger import SERVICE_WINDOW, learn_service
from apf_gunicorn.ledger.seatseconds import duration_per_seat, seats_ns_times
from apf_gunicorn.simulate.harness import Admission, DemandResults, ExactIntegrator

U64 = (1 << 64) - 1
HALF = 1 << 63
NIL = -1
G_NS = 3_000_000

# slot states
FREE, WAITING, EXECUTING, LINGERING = 0, 1, 2, 3
# where a flow is
NOWHERE, IN_HEAP, PARKED, IDLE = 0, 1, 2, 3


def tag_lt(a: int, b: int) -> bool:
    """``a < b`` for tags modulo 2**64 (valid while live tags lie within 2**63 of each other)."""
    return ((a - b) & U64) >= HALF and a != b


def mix(level: int, flow_hash: int) -> int:
    """The flow index's probe start: a 64-bit mix of (level, hash) (splitmix64 finaliser)."""
    x = (flow_hash ^ (level * 0x9E3779B97F4A7C15)) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


class Level:
    """One level's words (as in the level record)."""

    __slots__ = ("c", "desired", "hand", "qll", "qbase", "enqueues", "waiting", "seats_waiting",
                 "in_use", "executing", "v", "seq", "root", "park_head", "park_tail",
                 "reserve", "nflows", "g", "g_n", "demand", "dispatched")

    def __init__(self, c: int, desired: int, hand: int, qll: int, qbase: int, g: int,
                 now: int) -> None:
        self.c, self.desired, self.hand, self.qll, self.qbase = c, desired, hand, qll, qbase
        self.enqueues = self.waiting = self.seats_waiting = self.in_use = self.executing = 0
        self.v = 0
        self.seq = 0
        self.root = self.park_head = self.park_tail = self.reserve = NIL
        self.nflows = 0
        self.g = g
        self.g_n = 0
        self.demand = ExactIntegrator(now)
        self.dispatched = 0


class MaxMinModel:
    """Levels, queues, slots and flows of one ledger under the ``maxmin`` fairness.

    Args:
        slots: the slot table's size (also the flow table's).
        learn_level: whether a level's G learns from finished requests (the ledger's
            ``learn_service``); per-flow estimates always learn.
        check: after every operation, verify that no waiting request fits unless a head is
            reserved (the "no idle seats" rule), by a scan; for tests.
    """

    def __init__(self, slots: int, learn_level: bool = False, check: bool = True,
                 newer_wins_ties: bool = False) -> None:
        self.slots = slots
        self.newer_wins_ties = newer_wins_ties
        self.learn_level = learn_level
        self.check = check
        self.levels: list[Level] = []
        # queue records
        self.q_head: list[int] = []
        self.q_tail: list[int] = []
        self.q_waiting: list[int] = []
        self.q_work: list[int] = []
        # slot table
        n = slots
        self.s_state = [FREE] * n
        self.s_gen = [0] * n
        self.s_level = [NIL] * n
        self.s_queue = [NIL] * n
        self.s_flow = [NIL] * n
        self.s_qprev = [NIL] * n
        self.s_qnext = [NIL] * n
        self.s_fprev = [NIL] * n
        self.s_fnext = [NIL] * n
        self.s_initial = [0] * n
        self.s_final = [0] * n
        self.s_al = [0] * n
        self.s_max = [0] * n
        self.s_held = [0] * n
        self.s_work = [0] * n
        self.s_final_work = [0] * n
        self.s_end = [0] * n  # a lingering slot: when its seats free
        self.s_arrival = [0] * n
        self.s_start = [0] * n
        self.s_est = [0] * n
        self.s_hash = [0] * n
        self.free_head = 0
        self.s_free_next = list(range(1, n)) + [NIL]
        # flow table: entries (stable index) + open-addressing index of entry+1 (0 empty)
        self.f_level = [NIL] * n
        self.f_hash = [0] * n
        self.f_tag = [0] * n
        self.f_seq = [0] * n
        self.f_waiting = [0] * n
        self.f_exec = [0] * n  # requests in their main phase
        self.f_seats = [0] * n  # seats they hold
        self.f_head = [NIL] * n
        self.f_tail = [NIL] * n
        self.f_est = [0] * n
        self.f_n = [0] * n
        self.f_where = [NOWHERE] * n
        self.f_child = [NIL] * n
        self.f_next = [NIL] * n  # heap sibling, or the parked list's next
        self.f_prev = [NIL] * n  # heap previous sibling or parent, or the parked list's prev
        self.f_pace = [0] * n  # the lockstep hold's pace (0 for a new flow)
        self.f_free_head = 0
        self.f_free_next = list(range(1, n)) + [NIL]
        self.idle_head = self.idle_tail = NIL
        self.evictions = 0
        size = 1
        while size < 2 * n:
            size *= 2
        self.index = [0] * size
        self.index_mask = size - 1
        # measurements (not ledger words)
        self.max_wait: dict[int, int] = {}
        self.idle_reserved_seat_ns = 0
        self.busy_seat_ns = 0
        self._last_t = 0
        self.reservations = 0
        self.backfills = 0
        self.max_reserved_ns = 0  # longest time a reserved head waited for its seats
        self._reserved_at: dict[int, int] = {}
        self.waiting_ns = 0  # seat-ns of capacity while something waited
        self.busy_waiting_seat_ns = 0  # of which busy
        self.held_seat_ns = 0  # seat-ns held idle by the lockstep hold
        self.holds = 0
        self.ended_holds = 0  # holds ended early by another flow's arrival

    # -- configuration ---------------------------------------------------------------------
    def add_level(self, c: int, desired: int, hand: int, qll: int, now: int = 0,
                  g: int = G_NS) -> int:
        qbase = len(self.q_head)
        for _ in range(max(desired, 0)):
            self.q_head.append(NIL)
            self.q_tail.append(NIL)
            self.q_waiting.append(0)
            self.q_work.append(0)
        self.levels.append(Level(c, desired, hand, qll, qbase, g, now))
        return len(self.levels) - 1

    # -- measurements -----------------------------------------------------------------------
    def _advance(self, now: int) -> None:
        dt = now - self._last_t
        if dt > 0:
            for lv in self.levels:
                self.busy_seat_ns += min(lv.in_use, lv.c) * dt
                if lv.reserve != NIL:
                    self.idle_reserved_seat_ns += max(lv.c - lv.in_use, 0) * dt
                if lv.waiting:
                    self.waiting_ns += lv.c * dt
                    self.busy_waiting_seat_ns += min(lv.in_use, lv.c) * dt
            self._last_t = now

    def _note_demand(self, lv: Level, now: int) -> None:
        d = lv.demand
        d.add(lv.in_use + lv.seats_waiting - d.x, now)

    # -- flow table ---------------------------------------------------------------------------
    def _flow_find(self, level: int, h: int) -> int:
        mask = self.index_mask
        i = mix(level, h) & mask
        while True:
            e = self.index[i]
            if e == 0:
                return NIL
            f = e - 1
            if self.f_hash[f] == h and self.f_level[f] == level:
                return f
            i = (i + 1) & mask

    def _flow_get(self, lv: Level, level: int, h: int) -> int:
        """The flow's entry, made active: found (an idle entry leaves the idle list), or a
        free entry, or else the least recently idle entry, evicted (there is one: active
        flows hold slots, and a slot was just taken for this request)."""
        f = self._flow_find(level, h)
        if f != NIL:
            if self.f_where[f] == IDLE:
                self._idle_remove(f)
                lv.nflows += 1
            return f
        f = self.f_free_head
        if f != NIL:
            self.f_free_head = self.f_free_next[f]
        else:
            f = self.idle_head
            assert f != NIL, "no idle flow entry to reuse (cannot happen)"
            self._idle_remove(f)
            self._index_delete(f)
            self.evictions += 1
        self.f_level[f], self.f_hash[f] = level, h
        self.f_tag[f] = lv.v
        self.f_seq[f] = 0
        self.f_waiting[f] = self.f_exec[f] = self.f_seats[f] = 0
        self.f_head[f] = self.f_tail[f] = NIL
        self.f_est[f] = 0
        self.f_n[f] = 0
        self.f_pace[f] = 0
        self.f_where[f] = NOWHERE
        self.f_child[f] = self.f_next[f] = self.f_prev[f] = NIL
        mask = self.index_mask
        i = mix(level, h) & mask
        while self.index[i]:
            i = (i + 1) & mask
        self.index[i] = f + 1
        lv.nflows += 1
        return f

    def _flow_idle(self, lv: Level, f: int) -> None:
        """Nothing waiting or executing any more: the entry keeps its tag and estimate on the
        idle list (a flow that returns before V passes its tag is still charged for what it
        used) until the table needs it."""
        self.f_where[f] = IDLE
        self.f_next[f] = NIL
        self.f_prev[f] = self.idle_tail
        if self.idle_tail == NIL:
            self.idle_head = f
        else:
            self.f_next[self.idle_tail] = f
        self.idle_tail = f
        lv.nflows -= 1

    def _idle_remove(self, f: int) -> None:
        p, n = self.f_prev[f], self.f_next[f]
        if p == NIL:
            self.idle_head = n
        else:
            self.f_next[p] = n
        if n == NIL:
            self.idle_tail = p
        else:
            self.f_prev[n] = p
        self.f_next[f] = self.f_prev[f] = NIL
        self.f_where[f] = NOWHERE

    def _index_delete(self, f: int) -> None:
        """Take entry ``f`` out of the open-addressing index (backward-shift deletion)."""
        mask = self.index_mask
        i = mix(self.f_level[f], self.f_hash[f]) & mask
        while self.index[i] != f + 1:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            e = self.index[j]
            if e == 0:
                break
            home = mix(self.f_level[e - 1], self.f_hash[e - 1]) & mask
            # move e back to i unless its home lies cyclically in (i, j]
            if (j - home) & mask >= (j - i) & mask:
                self.index[i] = e
                i = j
        self.index[i] = 0

    # -- the pairing heap -------------------------------------------------------------------
    def _less(self, a: int, b: int) -> bool:
        ta, tb = self.f_tag[a], self.f_tag[b]
        if ta == tb:
            if self.newer_wins_ties:
                return self.f_seq[a] > self.f_seq[b]
            sa, sb = self.f_seats[a], self.f_seats[b]
            if sa != sb:
                return sa < sb
            return self.f_seq[a] < self.f_seq[b]
        return ((ta - tb) & U64) >= HALF

    def _meld(self, a: int, b: int) -> int:
        if a == NIL:
            return b
        if b == NIL:
            return a
        if self._less(b, a):
            a, b = b, a
        c = self.f_child[a]
        self.f_next[b] = c
        if c != NIL:
            self.f_prev[c] = b
        self.f_prev[b] = a
        self.f_child[a] = b
        return a

    def _merge_pairs(self, first: int) -> int:
        acc = NIL
        x = first
        while x != NIL:
            a = x
            b = self.f_next[a]
            nxt = self.f_next[b] if b != NIL else NIL
            self.f_next[a] = self.f_prev[a] = NIL
            if b != NIL:
                self.f_next[b] = self.f_prev[b] = NIL
                a = self._meld(a, b)
            self.f_next[a] = acc
            acc = a
            x = nxt
        res = NIL
        while acc != NIL:
            nxt = self.f_next[acc]
            self.f_next[acc] = NIL
            res = self._meld(res, acc)
            acc = nxt
        return res

    def _heap_insert(self, lv: Level, f: int) -> None:
        self.f_child[f] = self.f_next[f] = self.f_prev[f] = NIL
        self.f_where[f] = IN_HEAP
        lv.root = self._meld(lv.root, f)

    def _heap_remove(self, lv: Level, f: int) -> None:
        if f == lv.root:
            lv.root = self._merge_pairs(self.f_child[f])
            if lv.root != NIL:
                self.f_prev[lv.root] = NIL
        else:
            p, n = self.f_prev[f], self.f_next[f]
            if self.f_child[p] == f:
                self.f_child[p] = n
            else:
                self.f_next[p] = n
            if n != NIL:
                self.f_prev[n] = p
            sub = self._merge_pairs(self.f_child[f])
            if sub != NIL:
                self.f_prev[sub] = NIL
            lv.root = self._meld(lv.root, sub)
        self.f_child[f] = self.f_next[f] = self.f_prev[f] = NIL
        self.f_where[f] = NOWHERE

    def _heap_all(self, lv: Level) -> list[int]:
        out, stack = [], [lv.root] if lv.root != NIL else []
        while stack:
            x = stack.pop()
            out.append(x)
            c = self.f_child[x]
            while c != NIL:
                stack.append(c)
                c = self.f_next[c]
        return out

    # -- parked flows -----------------------------------------------------------------------
    def _park(self, lv: Level, f: int) -> None:
        self.f_where[f] = PARKED
        self.f_next[f] = NIL
        self.f_prev[f] = lv.park_tail
        if lv.park_tail == NIL:
            lv.park_head = f
        else:
            self.f_next[lv.park_tail] = f
        lv.park_tail = f

    def _unpark(self, lv: Level, f: int) -> None:
        p, n = self.f_prev[f], self.f_next[f]
        if p == NIL:
            lv.park_head = n
        else:
            self.f_next[p] = n
        if n == NIL:
            lv.park_tail = p
        else:
            self.f_prev[n] = p
        self.f_next[f] = self.f_prev[f] = NIL
        self.f_where[f] = NOWHERE

    def _unlist(self, lv: Level, f: int) -> None:
        if self.f_where[f] == IN_HEAP:
            self._heap_remove(lv, f)
        elif self.f_where[f] == PARKED:
            self._unpark(lv, f)
        if lv.reserve == f:
            lv.reserve = NIL

    # -- requests -----------------------------------------------------------------------------
    def _fits(self, lv: Level, ms: int) -> bool:
        if ms > lv.c:
            return lv.executing == 0  # Kubernetes' too-wide rule
        return lv.in_use + ms <= lv.c

    def _estimate(self, lv: Level, f: int) -> int:
        return self.f_est[f] if self.f_n[f] else lv.g

    def _charge(self, s: int, f: int, lv: Level) -> int:
        est = self._estimate(lv, f)
        self.s_est[s] = est
        return (self.s_held[s] * (est + self.s_al[s])) & U64

    def admit(self, level: int, flow_hash: int, initial: int, final: int, al: int,
              now: int) -> tuple[str, int, int, list[tuple[int, int]]]:
        """Kubernetes' StartRequest: (outcome, slot, gen, granted) with outcome ``execute``,
        ``queued`` or a rejection reason."""
        self._advance(now)
        lv = self.levels[level]
        granted: list[tuple[int, int]] = []
        ms = initial if initial >= final else final
        if self.free_head == NIL:
            return "no-slot", NIL, 0, granted
        h = flow_hash & U64
        hs = lv.hand
        hand = deal(h, lv.desired, hs)
        enq = lv.enqueues
        lv.enqueues = enq + 1
        off = enq % hs
        best_q = hand[off]
        best = self.q_work[lv.qbase + best_q]
        for i in range(1, hs):
            q = hand[(off + i) % hs]
            ws = self.q_work[lv.qbase + q]
            if ws < best:
                best, best_q = ws, q
        qi = lv.qbase + best_q
        if lv.in_use >= lv.c and self.q_waiting[qi] >= lv.qll:
            return "queue-full", NIL, 0, granted
        s = self._alloc(lv, level, best_q, h, initial, final, al, now)
        f = self._flow_get(lv, level, h)
        self.s_flow[s] = f
        self.s_state[s] = WAITING
        # queue FIFO
        t = self.q_tail[qi]
        self.s_qprev[s], self.s_qnext[s] = t, NIL
        if t == NIL:
            self.q_head[qi] = s
        else:
            self.s_qnext[t] = s
        self.q_tail[qi] = s
        self.q_waiting[qi] += 1
        self.q_work[qi] = (self.q_work[qi] + self.s_work[s]) & U64
        # flow FIFO
        t = self.f_tail[f]
        self.s_fprev[s], self.s_fnext[s] = t, NIL
        if t == NIL:
            self.f_head[f] = s
        else:
            self.s_fnext[t] = s
        self.f_tail[f] = s
        self.f_waiting[f] += 1
        lv.waiting += 1
        lv.seats_waiting += ms
        if self.f_waiting[f] == 1:
            self._backlog(lv, f)
            self._heap_insert(lv, f)
        self._note_demand(lv, now)
        self._dispatch_all(lv, now, granted)
        if self.f_waiting[f] == 1 and self.s_state[s] == WAITING and lv.executing < lv.in_use:
            self._end_holds(lv, level, s, now, granted)
        if self.s_state[s] == EXECUTING:
            me = (s, self.s_gen[s])
            granted = [g for g in granted if g != me]
            return "execute", s, self.s_gen[s], granted
        return "queued", s, self.s_gen[s], granted

    def _backlog(self, lv: Level, f: int) -> None:
        """The flow goes from nothing waiting to something waiting."""
        if tag_lt(self.f_tag[f], lv.v):
            self.f_tag[f] = lv.v
        lv.seq += 1
        self.f_seq[f] = lv.seq

    def _alloc(self, lv: Level, level: int, q: int, h: int, initial: int, final: int, al: int,
               now: int) -> int:
        s = self.free_head
        self.free_head = self.s_free_next[s]
        self.s_gen[s] += 1
        self.s_level[s] = level
        self.s_queue[s] = q
        self.s_initial[s], self.s_final[s], self.s_al[s] = initial, final, al
        ms = initial if initial >= final else final
        self.s_max[s] = self.s_held[s] = ms
        iw = seats_ns_times(initial, lv.g)
        fw = seats_ns_times(final, al) if final and al else 0
        self.s_work[s] = (iw + fw) & U64
        self.s_final_work[s] = fw
        self.s_arrival[s] = now
        self.s_start[s] = 0
        self.s_hash[s] = h
        self.s_qprev[s] = self.s_qnext[s] = self.s_fprev[s] = self.s_fnext[s] = NIL
        return s

    def _start(self, lv: Level, s: int, f: int, now: int) -> None:
        """Execution starts: seats, the final-seat cap, V and the flow's charge."""
        c = lv.c
        initial = self.s_initial[s]
        held = self.s_max[s]
        if self.s_final[s] > c:  # final-seat cap, preserving the tail's area (Kubernetes')
            self.s_al[s] = duration_per_seat(self.s_final_work[s], float(c))
            self.s_final[s] = c
            held = initial if initial >= c else c
        self.s_held[s] = held
        self.s_state[s] = EXECUTING
        self.s_start[s] = now
        lv.executing += 1
        lv.in_use += held
        lv.dispatched += 1
        tag = self.f_tag[f]
        low = tag
        if lv.root != NIL and tag_lt(self.f_tag[lv.root], low):
            low = self.f_tag[lv.root]
        if tag_lt(lv.v, low):
            lv.v = low
        self.f_tag[f] = (tag + self._charge(s, f, lv)) & U64
        self.f_exec[f] += 1
        self.f_seats[f] += held
        wait = now - self.s_arrival[s]
        h = self.s_hash[s]
        if wait > self.max_wait.get(h, -1):
            self.max_wait[h] = wait

    def _dispatch(self, lv: Level, f: int, now: int, granted: list) -> None:
        """Dispatch flow ``f``'s oldest waiting request."""
        s = self.f_head[f]
        # out of its queue
        qi = lv.qbase + self.s_queue[s]
        p, n = self.s_qprev[s], self.s_qnext[s]
        if p == NIL:
            self.q_head[qi] = n
        else:
            self.s_qnext[p] = n
        if n == NIL:
            self.q_tail[qi] = p
        else:
            self.s_qprev[n] = p
        self.q_waiting[qi] -= 1
        self.q_work[qi] = (self.q_work[qi] - self.s_work[s]) & U64
        # out of its flow
        n = self.s_fnext[s]
        self.f_head[f] = n
        if n == NIL:
            self.f_tail[f] = NIL
        else:
            self.s_fprev[n] = NIL
        self.s_qprev[s] = self.s_qnext[s] = self.s_fprev[s] = self.s_fnext[s] = NIL
        self.f_waiting[f] -= 1
        lv.waiting -= 1
        lv.seats_waiting -= self.s_max[s]
        where = self.f_where[f]
        if where == IN_HEAP:
            self._heap_remove(lv, f)  # its key changes (or it leaves)
        self._start(lv, s, f, now)
        if self.f_waiting[f] == 0:
            self._unlist(lv, f)
        elif where == IN_HEAP:
            self._heap_insert(lv, f)
        granted.append((s, self.s_gen[s]))

    def _capped(self, lv: Level, f: int) -> bool:
        """A flow that has finished nothing yet holds at most its equal share."""
        if self.f_n[f] or self.f_seats[f] == 0:
            return False
        return (self.f_seats[f] + self.s_max[self.f_head[f]]) * lv.nflows > lv.c

    def _dispatch_all(self, lv: Level, now: int, granted: list) -> None:
        while lv.waiting and lv.in_use < lv.c and self._dispatch_one(lv, now, granted):
            pass
        if self.check:
            self._check_no_idle(lv)

    def _dispatch_one(self, lv: Level, now: int, granted: list) -> bool:
        f = lv.reserve
        if f != NIL:
            if self._fits(lv, self.s_max[self.f_head[f]]):
                lv.reserve = NIL
                held = now - self._reserved_at.pop(id(lv), now)
                self.max_reserved_ns = max(self.max_reserved_ns, held)
                self._dispatch(lv, f, now, granted)
                return True
            return self._backfill(lv, f, now, granted)
        f = lv.root
        while f != NIL and self._capped(lv, f):
            self._heap_remove(lv, f)
            self._park(lv, f)
            f = lv.root
        if f == NIL:  # only parked flows wait: no one else to protect
            p = lv.park_head
            while p != NIL:
                if self._fits(lv, self.s_max[self.f_head[p]]):
                    self._dispatch(lv, p, now, granted)
                    return True
                p = self.f_next[p]
            return False
        if self._fits(lv, self.s_max[self.f_head[f]]):
            self._dispatch(lv, f, now, granted)
            return True
        lv.reserve = f
        self.reservations += 1
        self._reserved_at[id(lv)] = now
        return self._backfill(lv, f, now, granted)

    def _end_estimate(self, lv: Level, s: int, now: int) -> int:
        """When slot ``s``'s seats should be free, by the estimate it was charged."""
        if self.s_state[s] == LINGERING:
            return self.s_end[s]
        end = self.s_start[s] + self.s_est[s]
        if end < now:
            end = now  # overdue: assume it is about to end (the reserved head's side)
        return end + self.s_al[s]

    def _backfill(self, lv: Level, r: int, now: int, granted: list) -> bool:
        """The reserved flow ``r``'s head does not fit: dispatch one other head that fits now
        and leaves the reserved head's start (by the estimates) where it is."""
        need = self.s_max[self.f_head[r]]
        free = lv.c - lv.in_use
        if free <= 0:
            return False
        level = self.levels.index(lv)
        ends = []
        for s in range(self.slots):  # the scan of the blocked case (the ledger keeps a list)
            st = self.s_state[s]
            if (st == EXECUTING or st == LINGERING) and self.s_level[s] == level:
                ends.append((self._end_estimate(lv, s, now), self.s_held[s], st == EXECUTING))
        ends.sort()
        if need > lv.c:  # too wide: waits for every executing request to end
            t = now
            for end, _held, executing in ends:
                if executing and end > t:
                    t = end
            spare = 0
        else:
            acc, t = free, now
            for end, held, _x in ends:
                if acc >= need:
                    break
                acc += held
                t = end
            spare = acc - need
        best = NIL
        for f in self._heap_all(lv) + self._parked(lv):
            if f == r:
                continue
            s = self.f_head[f]
            ms = self.s_max[s]
            if ms > free:
                continue
            if self.f_where[f] == PARKED and self._capped(lv, f):
                continue
            end = now + self._estimate(lv, f) + self.s_al[s]
            if end > t and ms > spare:
                continue
            if best == NIL or self._less(f, best):
                best = f
        if best == NIL:
            return False
        self.backfills += 1
        self._dispatch(lv, best, now, granted)
        return True

    def _parked(self, lv: Level) -> list[int]:
        out, p = [], lv.park_head
        while p != NIL:
            out.append(p)
            p = self.f_next[p]
        return out

    def _check_no_idle(self, lv: Level) -> None:
        if lv.reserve != NIL or lv.waiting == 0 or lv.in_use >= lv.c:
            return
        for s in range(self.slots):
            if self.s_state[s] == WAITING and self.levels[self.s_level[s]] is lv:
                assert not self._fits(lv, self.s_max[s]), "a fitting request waits at idle seats"

    # -- completion ---------------------------------------------------------------------------
    def finish(self, s: int, gen: int, now: int) -> tuple[list, int]:
        """The main phase is over: correct the flow's tag, learn, dispatch.
        Returns (granted, linger-until ns or 0)."""
        self._advance(now)
        assert self.s_gen[s] == gen and self.s_state[s] == EXECUTING
        lv = self.levels[self.s_level[s]]
        granted: list = []
        f = self.s_flow[s]
        hold = self._hold(lv, s, f, now) if self.s_al[s] <= 0 and lv.waiting else 0
        lv.executing -= 1
        ran = now - self.s_start[s]
        held = self.s_held[s]
        corr = (held * (ran - self.s_est[s])) & U64
        where = self.f_where[f]
        if where == IN_HEAP:
            self._heap_remove(lv, f)
        self.f_tag[f] = (self.f_tag[f] + corr) & U64
        n = self.f_n[f]
        if n < SERVICE_WINDOW:
            n += 1
            self.f_n[f] = n
        self.f_est[f] = learn_service(self.f_est[f] if n > 1 else 0, n, ran)
        if self.learn_level:
            ln = lv.g_n
            if ln < SERVICE_WINDOW:
                ln += 1
                lv.g_n = ln
            lv.g = learn_service(lv.g, ln, ran)
        self.f_exec[f] -= 1
        self.f_seats[f] -= held
        if where == IN_HEAP:
            self._heap_insert(lv, f)
        elif where == PARKED:  # learnt now: compete normally
            self._unpark(lv, f)
            self._heap_insert(lv, f)
        if self.f_waiting[f] == 0 and self.f_exec[f] == 0:
            self._flow_idle(lv, f)
        self.s_flow[s] = NIL
        linger = 0
        if self.s_al[s] > 0:
            linger = now + self.s_al[s]
            self.s_state[s] = LINGERING
            self.s_end[s] = linger
        elif hold:
            linger = hold
            self.s_state[s] = LINGERING
            self.s_end[s] = linger
        else:
            self._release_seats(lv, s, now)
        self._dispatch_all(lv, now, granted)
        return granted, linger

    def _end_holds(self, lv: Level, level: int, s: int, now: int, granted: list) -> None:
        """A flow started waiting (slot ``s``) with no seat free: held seats free, the soonest
        to end first, until it runs or nothing is held."""
        while self.s_state[s] == WAITING:
            held = [(self.s_end[t], t) for t in range(self.slots)
                    if self.s_state[t] == LINGERING and self.s_level[t] == level
                    and self.s_al[t] <= 0]
            if not held:
                return
            self._release_seats(lv, min(held)[1], now)
            self.ended_holds += 1
            self._dispatch_all(lv, now, granted)

    def _hold(self, lv: Level, s: int, f: int, now: int) -> int:
        """The lockstep hold: seats handed straight back to the only waiting flow free at
        least 0.9 x est x held / C apart (one spacing of tolerance), each held at most est / 2,
        and only those of a request that ran within half a spacing of est.
        Returns the time until which they are held, or 0."""
        if f == NIL or self.f_waiting[f] == 0 or self.f_waiting[f] != lv.waiting:
            return 0
        if not self.f_n[f] or lv.c <= 0:
            return 0
        est = self.f_est[f]
        gap = est * self.s_held[s] * 9 // (10 * lv.c)
        pace = self.f_pace[f]
        if pace - now <= gap or 2 * abs(now - self.s_start[s] - est) > gap:
            self.f_pace[f] = max(pace, now) + gap
            return 0
        until = min(pace, now + est // 2)
        self.f_pace[f] = until + gap
        self.held_seat_ns += (until - now) * self.s_held[s]
        self.holds += 1
        return until

    def release(self, s: int, gen: int, now: int) -> list:
        self._advance(now)
        if self.s_gen[s] != gen or self.s_state[s] != LINGERING:
            return []  # stale: a hold that another flow's arrival ended (as the ledger: no-op)
        lv = self.levels[self.s_level[s]]
        granted: list = []
        self._release_seats(lv, s, now)
        self._dispatch_all(lv, now, granted)
        return granted

    def _release_seats(self, lv: Level, s: int, now: int) -> None:
        lv.in_use -= self.s_held[s]
        self.s_state[s] = FREE
        self.s_free_next[s] = self.free_head
        self.free_head = s
        self._note_demand(lv, now)

    def cancel(self, s: int, gen: int, now: int) -> bool:
        """A waiting request leaves (time-out): False if it is no longer waiting."""
        self._advance(now)
        if self.s_gen[s] != gen or self.s_state[s] != WAITING:
            return False
        lv = self.levels[self.s_level[s]]
        f = self.s_flow[s]
        qi = lv.qbase + self.s_queue[s]
        p, n = self.s_qprev[s], self.s_qnext[s]
        if p == NIL:
            self.q_head[qi] = n
        else:
            self.s_qnext[p] = n
        if n == NIL:
            self.q_tail[qi] = p
        else:
            self.s_qprev[n] = p
        self.q_waiting[qi] -= 1
        self.q_work[qi] = (self.q_work[qi] - self.s_work[s]) & U64
        p, n = self.s_fprev[s], self.s_fnext[s]
        if p == NIL:
            self.f_head[f] = n
        else:
            self.s_fnext[p] = n
        if n == NIL:
            self.f_tail[f] = p
        else:
            self.s_fprev[n] = p
        self.f_waiting[f] -= 1
        lv.waiting -= 1
        lv.seats_waiting -= self.s_max[s]
        if self.f_waiting[f] == 0:
            self._unlist(lv, f)
            if self.f_exec[f] == 0:
                self._flow_idle(lv, f)
        self.s_flow[s] = NIL
        self.s_state[s] = FREE
        self.s_free_next[s] = self.free_head
        self.free_head = s
        self._note_demand(lv, now)
        return True


class MaxMinBackend:
    """The model behind the simulator's :class:`~apf_gunicorn.simulate.harness.Backend`."""

    name = "maxmin-model"

    def __init__(self, queues: int, hand_size: int, queue_length_limit: int,
                 concurrency_limit: int, slots: int, check: bool = True) -> None:
        self.model = MaxMinModel(slots, check=check)
        self.model.add_level(concurrency_limit, queues, hand_size, queue_length_limit)

    def admit(self, level, flow_hash, initial, final, additional_latency_ns, now) -> Admission:
        outcome, s, gen, granted = self.model.admit(level, flow_hash, initial, final,
                                                    additional_latency_ns, now)
        if outcome in ("execute", "queued"):
            if outcome == "execute":
                granted.append((s, gen))
            return Admission((s, gen), "", granted)
        return Admission(None, outcome, granted)

    def finish(self, handle, now):
        return self.model.finish(handle[0], handle[1], now)

    def release(self, handle, now):
        return self.model.release(handle[0], handle[1], now)

    def demand_stats(self, level, now) -> DemandResults:
        return self.model.levels[level].demand.reset(now)

    def epoch_advances(self) -> int:
        return 0

    def handles_of(self, grants: list) -> list:
        return list(grants)


def model_factory(qs, clients):
    """A ``backend_factory`` for :func:`apf_gunicorn.simulate.simulate`."""
    from apf_gunicorn.simulate.backends import concurrent_requests_bound

    return MaxMinBackend(qs.queues, qs.hand_size, qs.queue_length_limit, qs.concurrency_limit,
                         slots=concurrent_requests_bound(clients) + 8)


def verify(m: MaxMinModel) -> list[str]:
    """Every violated invariant of the model's words (empty when consistent)."""
    bad: list[str] = []
    for li, lv in enumerate(m.levels):
        in_heap = set(m._heap_all(lv))
        parked = set(m._parked(lv))
        for f in in_heap:
            c = m.f_child[f]
            while c != NIL:
                if m._less(c, f):
                    bad.append(f"level {li}: heap order broken at flow {f}")
                c = m.f_next[c]
        waiting = seats_waiting = in_use = executing = 0
        flows_active = set()
        for s in range(m.slots):
            if m.s_level[s] != li or m.s_state[s] == FREE:
                continue
            st = m.s_state[s]
            if st == WAITING:
                waiting += 1
                seats_waiting += m.s_max[s]
                flows_active.add(m.s_flow[s])
            if st in (EXECUTING, LINGERING):
                in_use += m.s_held[s]
            if st == EXECUTING:
                executing += 1
                flows_active.add(m.s_flow[s])
        if (waiting, seats_waiting, in_use, executing) != (
                lv.waiting, lv.seats_waiting, lv.in_use, lv.executing):
            bad.append(f"level {li}: totals {(lv.waiting, lv.seats_waiting, lv.in_use, lv.executing)}"
                       f" != recount {(waiting, seats_waiting, in_use, executing)}")
        if len(flows_active) != lv.nflows:
            bad.append(f"level {li}: {lv.nflows} active flows counted, {len(flows_active)} found")
        for f in flows_active:
            fifo, s = [], m.f_head[f]
            while s != NIL:
                fifo.append(s)
                s = m.s_fnext[s]
            if len(fifo) != m.f_waiting[f]:
                bad.append(f"flow {f}: FIFO of {len(fifo)}, waiting {m.f_waiting[f]}")
            if m.f_waiting[f] and f not in in_heap and f not in parked:
                bad.append(f"flow {f}: waits but is neither in the heap nor parked")
            if m._flow_find(li, m.f_hash[f]) != f:
                bad.append(f"flow {f}: not found by its key")
        for f in in_heap | parked:
            if not m.f_waiting[f]:
                bad.append(f"flow {f}: listed with nothing waiting")
        if lv.reserve != NIL and not m.f_waiting[lv.reserve]:
            bad.append(f"level {li}: reserved flow {lv.reserve} has nothing waiting")
    return bad
