"""The worker table."""

from __future__ import annotations

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    FREE,
    L_USED,
    L_WAITING,
    LEVEL_WORDS,
    S_GEN,
    S_LEVEL,
    S_OWNER,
    S_STATE,
    SLOT_WORDS,
    WAITING,
)


class WorkerTable:
    """workers."""

    def register_worker(self, owner: int, pid: int, now: int) -> None:
        """Record that worker index ``owner`` is process ``pid`` (used to repair after a
        holder dies)."""
        wa = self._lay.worker(owner)
        w = self._w
        w[wa + L.W_PID] = pid
        w[wa + L.W_STATE] = L.WORKER_ALIVE
        w[wa + L.W_HEARTBEAT] = now

    def set_worker_room(self, owner: int, room: bool) -> None:
        """Publish whether worker ``owner`` has a thread free for a non-exempt request (one
        word store, no lock)."""
        self._w[self._lay.worker(owner) + L.W_ROOM] = 1 if room else 0

    def other_worker_has_room(self, owner: int) -> bool:
        """Whether a live worker other than ``owner`` has published room (lock-free read of
        one word per worker record; a reaped worker's word is 0)."""
        lay = self._lay
        base = lay.worker_base + L.W_ROOM
        rooms = self._w[base: base + lay.cap.workers * L.WORKER_WORDS: L.WORKER_WORDS]
        n = rooms.tolist().count(1)
        return n > (1 if self._w[lay.worker(owner) + L.W_ROOM] else 0)

    def heartbeat(self, owner: int, now: int) -> None:
        self._w[self._lay.worker(owner) + L.W_HEARTBEAT] = now

    def workers(self) -> list[tuple[int, int, int, int]]:
        """[(owner, pid, state, heartbeat)] of registered workers."""
        w = self._w
        out = []
        for i in range(self._lay.cap.workers):
            wa = self._lay.worker(i)
            if w[wa + L.W_STATE] != L.WORKER_FREE:
                out.append((i, w[wa + L.W_PID], w[wa + L.W_STATE], w[wa + L.W_HEARTBEAT]))
        return out

    def owned_slots(self, owner: int) -> list[tuple[int, int, str]]:
        """[(slot, gen, state)] held by ``owner`` (the dispatcher's 100 ms backstop scan)."""
        return self._locked(None, self._owned_slots_locked, owner)

    def _owned_slots_locked(self, owner: int) -> list[tuple[int, int, str]]:
        states, owners, gens = self._slot_columns_locked(S_STATE, S_OWNER, S_GEN)
        return [(s, gens[s], L.STATE_NAMES[st]) for s, st in enumerate(states)
                if st != FREE and owners[s] == owner]

    def reap_worker(self, owner: int, now: int) -> list:
        """Drop everything worker ``owner`` had (waits, executions, lingering seats) and
        dispatch what that frees. Idempotent."""
        return self._granting(now, self._reap_worker_locked, owner, now)[0]

    def _reap_worker_locked(self, granted: list, owner: int, now: int) -> None:
        self._reap_owner_locked(owner, now)
        self._dispatch_every_level_locked(now, granted)
        wa = self._lay.worker(owner)
        if self._w[wa + L.W_STATE] != L.WORKER_FREE:
            self._w[wa + L.W_STATE] = L.WORKER_GONE
        self._w[wa + L.W_ROOM] = 0

    def _reap_owner_locked(self, owner: int, now: int) -> None:
        w = self._w
        synced = set()
        states, owners = self._slot_columns_locked(S_STATE, S_OWNER)
        for s in range(len(states)):
            if states[s] == FREE or owners[s] != owner:
                continue
            sa = self._sb + s * SLOT_WORDS
            state = w[sa + S_STATE]
            level = w[sa + S_LEVEL]
            lb = self._lvb + level * LEVEL_WORDS
            if level not in synced:
                self._sync_locked(lb, now)
                synced.add(level)
            if state == WAITING:
                self._drop_waiting_locked(lb, s, sa, now)
                self._count_lost_wait_locked(lb, sa, now)
                self._commit_locked()
                continue
            if state == EXECUTING:
                self._end_main_phase_locked(lb, sa, now, learn=False)
            self._release_seats_locked(lb, level, s, sa, now)

    def _dispatch_every_level_locked(self, now: int, granted: list) -> None:
        w = self._w
        for level in range(self._lay.cap.levels):
            lb = self._lvb + level * LEVEL_WORDS
            if w[lb + L_USED]:
                if w[lb + L_WAITING]:
                    self._sync_locked(lb, now)
                    self._dispatch_all_locked(lb, now, granted)
                self._maybe_drop_locked(lb)
