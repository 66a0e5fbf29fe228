"""Buffer words: addressing, the slot table's free list, the per-queue FIFOs, and names.

The lowest layer of ``Ledger`` (a mixin over its buffer views ``_w``/``_u``/``_mv``): word
addresses of a level (``_lb``, which checks the index), a queue (``_qa``) and a slot (``_sa``);
taking a slot off the free list and filling it (``_alloc_locked``) and putting it back
(``_free_locked``); linking a waiting request at its queue's tail and unlinking it, with the
queue's and level's sums kept in step (``_link_tail_locked``/``_unlink_locked``); and the
name areas (level and FlowSchema names). No fairness and no counting here::

    s, sa, gen = led._alloc_locked(level, owner, flow_hash, fs_index, 1, 0, 0, now, b"")
    led._link_tail_locked(lb, led._qa(lb, q), s, sa)
"""

from __future__ import annotations

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    FREE,
    H_FREE_COUNT,
    H_FREE_HEAD,
    L_ACTIVE_QUEUES,
    L_QBASE,
    L_QSEATS,
    L_SERVICE_NS,
    L_USED,
    LEVEL_WORDS,
    NIL,
    Q_EXECUTING,
    Q_HEAD,
    Q_INIT_SUM,
    Q_MAX_SUM,
    Q_TAIL,
    Q_WAITING,
    Q_WORK_SUM,
    QUEUE_WORDS,
    S_AL,
    S_ARRIVAL_NS,
    S_DETAIL_LEN,
    S_FINAL,
    S_FINAL_WORK,
    S_FS,
    S_GEN,
    S_HASH,
    S_HELD,
    S_INIT_WORK,
    S_INITIAL,
    S_LEVEL,
    S_MAX_SEATS,
    S_NEXT,
    S_OWNER,
    S_PREV,
    S_QUEUE,
    S_SERVICE_NS,
    S_START_NS,
    S_STATE,
    S_TOTAL_WORK,
    SLOT_WORDS,
)
from apf_gunicorn.ledger.seatseconds import (
    U64,
    seats_ns_times,
)


class BufferWords:
    """Addresses of levels, queues and slots; slot alloc/free; FIFO link/unlink; names."""

    def _lb(self, level: int) -> int:
        if not 0 <= level < self._lay.cap.levels:
            raise ValueError(f"level index {level} out of range")
        lb = self._lvb + level * LEVEL_WORDS
        if not self._w[lb + L_USED]:
            raise ValueError(f"level index {level} is not configured")
        return lb

    def _qa(self, lb: int, q: int) -> int:
        return self._qb + (self._w[lb + L_QBASE] + q) * QUEUE_WORDS

    def _sa(self, s: int) -> int:
        return self._sb + s * SLOT_WORDS

    def _alloc_locked(self, level: int, owner: int, flow_hash: int, fs_index: int, initial: int,
               final: int, al: int, now: int, detail: bytes) -> tuple[int, int, int]:
        w, u = self._w, self._u
        s = w[H_FREE_HEAD]
        sa = self._sb + s * SLOT_WORDS
        w[H_FREE_HEAD] = w[sa + S_NEXT]
        w[H_FREE_COUNT] -= 1
        gen = w[sa + S_GEN] + 1
        w[sa + S_GEN] = gen
        w[sa + S_OWNER] = owner
        w[sa + S_LEVEL] = level
        w[sa + S_QUEUE] = NIL
        w[sa + S_NEXT] = NIL  # was the free-list link
        w[sa + S_INITIAL] = initial
        w[sa + S_FINAL] = final
        w[sa + S_AL] = al
        ms = initial if initial >= final else final
        w[sa + S_MAX_SEATS] = ms
        w[sa + S_HELD] = ms
        g = w[self._lvb + level * LEVEL_WORDS + L_SERVICE_NS]
        w[sa + S_SERVICE_NS] = g
        iw = seats_ns_times(initial, g)
        fw = seats_ns_times(final, al) if final and al else 0
        u[sa + S_INIT_WORK] = iw
        u[sa + S_FINAL_WORK] = fw
        u[sa + S_TOTAL_WORK] = (iw + fw) & U64
        w[sa + S_ARRIVAL_NS] = now
        w[sa + S_START_NS] = 0
        u[sa + S_HASH] = flow_hash & U64
        w[sa + S_FS] = fs_index
        if detail:
            cap = self._lay.cap.detail_bytes
            d = detail[:cap]
            off = self._lay.details + s * self._lay.detail_stride
            self._mv[off:off + len(d)] = d
            w[sa + S_DETAIL_LEN] = len(d)
        else:
            w[sa + S_DETAIL_LEN] = 0
        return s, sa, gen

    def _free_locked(self, s: int, sa: int) -> None:
        w = self._w
        w[sa + S_STATE] = FREE
        w[sa + S_QUEUE] = NIL
        w[sa + S_PREV] = NIL
        w[sa + S_NEXT] = w[H_FREE_HEAD]
        w[H_FREE_HEAD] = s
        w[H_FREE_COUNT] += 1

    def _slot_if_locked(self, s: int, gen: int, state: int) -> int:
        """The slot's address if it still has this generation and state, else -1."""
        if not 0 <= s < self._lay.cap.slots:
            return -1
        sa = self._sb + s * SLOT_WORDS
        w = self._w
        if w[sa + S_GEN] != gen or w[sa + S_STATE] != state:
            return -1
        return sa

    def _slot_columns_locked(self, *fields: int) -> list[list[int]]:
        """One list per field over the whole slot table (fast strided reads)."""
        w = self._w
        sb = self._sb
        end = sb + self._lay.cap.slots * SLOT_WORDS
        return [w[sb + f: end: SLOT_WORDS].tolist() for f in fields]

    def _link_tail_locked(self, lb: int, qa: int, s: int, sa: int) -> None:
        w, u = self._w, self._u
        tail = w[qa + Q_TAIL]
        w[sa + S_PREV] = tail
        w[sa + S_NEXT] = NIL
        if tail == NIL:
            w[qa + Q_HEAD] = s
        else:
            w[self._sb + tail * SLOT_WORDS + S_NEXT] = s
        w[qa + Q_TAIL] = s
        n = w[qa + Q_WAITING]
        w[qa + Q_WAITING] = n + 1
        if n == 0 and w[qa + Q_EXECUTING] == 0:
            w[lb + L_ACTIVE_QUEUES] += 1
        ms = w[sa + S_MAX_SEATS]
        w[qa + Q_INIT_SUM] += w[sa + S_INITIAL]
        w[qa + Q_MAX_SUM] += ms
        u[qa + Q_WORK_SUM] = (u[qa + Q_WORK_SUM] + u[sa + S_TOTAL_WORK]) & U64
        w[lb + L_QSEATS] += ms

    def _unlink_locked(self, lb: int, qa: int, sa: int) -> None:
        w, u = self._w, self._u
        prev = w[sa + S_PREV]
        nxt = w[sa + S_NEXT]
        if prev == NIL:
            w[qa + Q_HEAD] = nxt
        else:
            w[self._sb + prev * SLOT_WORDS + S_NEXT] = nxt
        if nxt == NIL:
            w[qa + Q_TAIL] = prev
        else:
            w[self._sb + nxt * SLOT_WORDS + S_PREV] = prev
        w[sa + S_PREV] = NIL
        w[sa + S_NEXT] = NIL
        n = w[qa + Q_WAITING] - 1
        w[qa + Q_WAITING] = n
        if n == 0 and w[qa + Q_EXECUTING] == 0:
            w[lb + L_ACTIVE_QUEUES] -= 1
        ms = w[sa + S_MAX_SEATS]
        w[qa + Q_INIT_SUM] -= w[sa + S_INITIAL]
        w[qa + Q_MAX_SUM] -= ms
        u[qa + Q_WORK_SUM] = (u[qa + Q_WORK_SUM] - u[sa + S_TOTAL_WORK]) & U64
        w[lb + L_QSEATS] -= ms

    def _read_name(self, area: int, i: int, n: int) -> str:
        off = area + i * L.NAME_BYTES
        return bytes(self._mv[off: off + n]).decode("utf-8")

    def _fs_names_locked(self) -> list[str]:
        n = self._w[L.H_FS_COUNT]
        out = []
        for i in range(n):
            off = self._lay.fs_names + i * L.NAME_BYTES
            ln = self._mv[off]
            out.append(bytes(self._mv[off + 1: off + 1 + ln]).decode("utf-8"))
        return out

    def _level_names_locked(self) -> dict[str, int]:
        w = self._w
        out = {}
        for i in range(self._lay.cap.levels):
            lb = self._lvb + i * LEVEL_WORDS
            if w[lb + L_USED]:
                out[self._read_name(self._lay.level_names, i, w[lb + L.L_NAME_LEN])] = i
        return out
