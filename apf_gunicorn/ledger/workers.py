"""The worker table: which process each worker index is, and dropping a dead worker's work.

Each gunicorn worker registers its index and pid (:meth:`WorkerTable.register_worker`; repair
finds a dead lock holder's slots by pid), publishes whether it has a thread free
(:meth:`WorkerTable.set_worker_room`, read lock-free by the others' accept gates; an ASGI
worker publishes its open connections instead, :meth:`WorkerTable.set_worker_connections`), and when it
dies the master reaps it (:meth:`WorkerTable.reap_worker`): its waiting requests count as
cancelled, its executing and lingering seats are freed, and what that frees is dispatched::

    led.register_worker(index, os.getpid(), now, inbox.name)
    granted = led.reap_worker(index, now)      # after the worker exited
"""

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
    """The worker table of ``Ledger`` (a mixin)."""

    def register_worker(self, owner: int, pid: int, now: int, grant_name: int = 0) -> None:
        """Record that worker index ``owner`` is process ``pid`` (repair finds a dead lock holder's
        slots by pid). One word each, no lock: each worker writes only its own record.

        Args:
            owner: the worker index, below ``Capacity.workers`` (not checked).
            pid: its process id; now: the caller's monotonic ns (the heartbeat).
            grant_name: the random part of its grant socket's name (0: none), what
                :meth:`grant_name` gives the senders.
        """
        wa = self._lay.worker(owner)
        w = self._w
        w[wa + L.W_PID] = pid
        w[wa + L.W_GRANT_NAME] = grant_name
        w[wa + L.W_STATE] = L.WORKER_ALIVE
        w[wa + L.W_HEARTBEAT] = now

    def grant_name(self, owner: int) -> int:
        """The random part of worker ``owner``'s grant socket name as it registered it (0: none;
        one word, no lock)."""
        return self._w[self._lay.worker(owner) + L.W_GRANT_NAME]

    def set_worker_room(self, owner: int, room: bool) -> None:
        """Publish whether worker ``owner`` has a thread free for a non-exempt request (one word
        store, no lock; read by the other workers' accept gates).
        """
        self._w[self._lay.worker(owner) + L.W_ROOM] = 1 if room else 0

    def other_worker_has_room(self, owner: int) -> bool:
        """Whether a live worker other than ``owner`` has published room (lock-free: one word per
        worker record; a reaped worker's word is 0).
        """
        lay = self._lay
        base = lay.worker_base + L.W_ROOM
        rooms = self._w[base: base + lay.cap.workers * L.WORKER_WORDS: L.WORKER_WORDS]
        n = rooms.tolist().count(1)
        return n > (1 if self._w[lay.worker(owner) + L.W_ROOM] else 0)

    def set_worker_connections(self, owner: int, connections: int | None) -> None:
        """Publish how many connections worker ``owner`` holds open (None: it no longer takes
        part in the ASGI accept gate; one word store, no lock)."""
        self._w[self._lay.worker(owner) + L.W_CONNS] = 0 if connections is None else connections + 1

    def fewest_connections_elsewhere(self, owner: int) -> int | None:
        """The fewest open connections a worker other than ``owner`` has published (None: no
        other worker takes part; lock-free: one word per worker record)."""
        lay = self._lay
        base = lay.worker_base + L.W_CONNS
        words = self._w[base: base + lay.cap.workers * L.WORKER_WORDS: L.WORKER_WORDS].tolist()
        words[owner] = 0
        fewest = min(filter(None, words), default=0)
        return fewest - 1 if fewest else None

    def heartbeat(self, owner: int, now: int) -> None:
        """Record that worker ``owner`` is alive at ``now`` (one word store, no lock)."""
        self._w[self._lay.worker(owner) + L.W_HEARTBEAT] = now

    def workers(self) -> list[tuple[int, int, int, int]]:
        """The registered workers, read without the lock.

        Returns:
            ``[(owner, pid, state, heartbeat_ns)]`` of every worker record in use, ``state``
            ``layout.WORKER_ALIVE`` or ``layout.WORKER_GONE``.
        """
        w = self._w
        out = []
        for i in range(self._lay.cap.workers):
            wa = self._lay.worker(i)
            if w[wa + L.W_STATE] != L.WORKER_FREE:
                out.append((i, w[wa + L.W_PID], w[wa + L.W_STATE], w[wa + L.W_HEARTBEAT]))
        return out

    def owned_slots(self, owner: int) -> list[tuple[int, int, str]]:
        """The slots ``owner`` holds (under the lock): the dispatcher's 100 ms backstop scan for
        grants whose wake-up was lost.

        Returns:
            ``[(slot, gen, state)]``, ``state`` ``"waiting"``, ``"executing"`` or ``"lingering"``.
        """
        return self._locked(None, self._owned_slots_locked, owner)

    def _owned_slots_locked(self, owner: int) -> list[tuple[int, int, str]]:
        states, owners, gens = self._slot_columns_locked(S_STATE, S_OWNER, S_GEN)
        return [(s, gens[s], L.STATE_NAMES[st]) for s, st in enumerate(states)
                if st != FREE and owners[s] == owner]

    def reap_worker(self, owner: int, now: int) -> list:
        """Drop everything worker ``owner`` had: its waiting requests (counted as cancelled), its
        executing requests (not observed: they did not finish) and its lingering seats; then
        dispatch what that frees in every level, and mark the worker gone. Idempotent.

        Args:
            owner: the dead worker's index; now: the caller's monotonic ns.
        Returns:
            The requests dispatched, as ``(slot, gen, owner)``.
        """
        return self._granting(now, self._reap_worker_locked, owner, now)[0]

    def _reap_worker_locked(self, granted: list, owner: int, now: int) -> None:
        self._reap_owner_locked(owner, now)
        self._dispatch_every_level_locked(now, granted)
        wa = self._lay.worker(owner)
        if self._w[wa + L.W_STATE] != L.WORKER_FREE:
            self._w[wa + L.W_STATE] = L.WORKER_GONE
        self._w[wa + L.W_ROOM] = 0
        self._w[wa + L.W_CONNS] = 0

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
