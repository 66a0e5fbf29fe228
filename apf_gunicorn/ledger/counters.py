"""Per-request counting: every metric event, counted under the lock into the stats table.

``stats.py`` defines the table (one entry per (level serial, FlowSchema) pair: the work
histogram, dispatched, rejections by reason, wait and execution histograms); this mixin of
``Ledger`` finds or creates an entry (``_stats_entry_locked``, cached per process) and counts
into it, logging each word in the undo log first where an event must stay whole. Also the
public counting calls that are not requests through ``admit``: :meth:`turn_away` (a 429 from a
worker's thread reserve), :meth:`count_rejection_delayed` (a 429 a poller held),
:meth:`count_head_timeout`, and the readers
:meth:`request_stats` (under the lock) and :meth:`rejected_total` (one lock-free word)::

    for st in led.request_stats(): st.level, st.flow_schema, st.work, st.rejected
"""

from __future__ import annotations

from bisect import bisect_left

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    L_CANCELLED,
    L_DESIRED,
    L_REJECTED,
    LEVEL_WORDS,
    S_ARRIVAL_NS,
    S_STATS,
)
from apf_gunicorn.ledger.stats import DURATION_BOUNDS_NS as _DUR
from apf_gunicorn.ledger.stats import (
    E_DELAYED,
    E_FS,
    E_LEVEL,
    E_NAME_LEN,
    E_REJECTED,
    E_SERIAL,
    E_WAIT_R,
    E_WAIT_X,
    E_WORK,
    E_WORK_SUM,
    ENTRY_WORDS,
    ND,
    OVERFLOW,
    R_CANCELLED,
    REASON_INDEX,
    WORK_BOUNDS,
    RequestStats,
    read_entry,
)

# apf_connections_dropped_total's reasons and their counter words
_DROP_WORDS = {"head-connections": L.C_DROPPED_HEAD_CONNECTIONS,
               "head-buffer": L.C_DROPPED_HEAD_BUFFER}


def _reason_index(reason: str) -> int:
    """The word index of rejection ``reason`` in a stats entry's counters.

    Raises:
        ValueError: not one of ``stats.REASONS``.
    """
    r = REASON_INDEX.get(reason)
    if r is None:
        raise ValueError(f"unknown rejection reason {reason!r}")
    return r


class RequestCounters:
    """Counting per-request events into the stats table (lock held)."""

    def _stats_entry_locked(self, lb: int, level: int, fs: int) -> int:
        """Word address of the stats entry of (level, fs), created on first use (lock held)."""
        serial = self._w[lb + L.L_SERIAL]
        key = (serial << 32) | (fs & 0xFFFFFFFF)
        eb = self._stats_at.get(key)
        if eb is None:
            eb = self._stats_at[key] = self._find_or_create_entry_locked(lb, level, serial, fs)
        return eb

    def _find_or_create_entry_locked(self, lb: int, level: int, serial: int, fs: int) -> int:
        w = self._w
        lay = self._lay
        cap = lay.cap.stats_entries
        n = w[L.H_STATS_COUNT]
        base = lay.stats_base
        end = base + n * ENTRY_WORDS
        serials = w[base + E_SERIAL: end: ENTRY_WORDS].tolist()
        fss = w[base + E_FS: end: ENTRY_WORDS].tolist()
        for i in range(n):
            if serials[i] == serial and fss[i] == fs:
                return base + i * ENTRY_WORDS
        # regular entries leave room for the levels' overflow entries
        limit = cap - min(lay.cap.levels, cap // 2) if fs >= 0 else cap
        if n >= limit:
            if fs >= 0:
                return self._find_or_create_entry_locked(lb, level, serial, -1)
            return base + cap * ENTRY_WORDS  # the catch-all
        name = self._read_name(lay.level_names, level, w[lb + L.L_NAME_LEN])
        self._name_stats_entry_locked(n, name, level, fs, serial)
        w[L.H_STATS_COUNT] = n + 1
        return base + n * ENTRY_WORDS

    def _name_stats_entry_locked(self, i: int, name: str, level: int, fs: int, serial: int = 0) -> None:
        w = self._w
        eb = self._lay.stats_entry(i)
        w[eb + E_SERIAL] = serial
        w[eb + E_LEVEL] = level
        w[eb + E_FS] = fs
        raw = name.encode("utf-8")
        off = self._lay.stats_names + i * L.NAME_BYTES
        self._mv[off: off + len(raw)] = raw
        w[eb + E_NAME_LEN] = len(raw)

    def _observe_wait_locked(self, eb: int, ns: int) -> None:
        """The wait histogram with execute="true" (at dispatch, time-out or cancel)."""
        b = eb + E_WAIT_X + bisect_left(_DUR, ns)
        self._log_locked(b, eb + E_WAIT_X + ND)
        self._w[b] += 1
        if ns:
            self._f[eb + E_WAIT_X + ND] += ns / 1e9

    def _note_rejection_locked(self, eb: int, reason: int, exempt: bool) -> None:
        w = self._w
        self._log_locked(eb + E_REJECTED + reason, eb + E_WAIT_R)
        w[eb + E_REJECTED + reason] += 1
        if not exempt:
            w[eb + E_WAIT_R] += 1  # a 0 s wait: bucket 0, the sum does not move

    def _count_lost_wait_locked(self, lb: int, sa: int, now: int) -> None:
        """A waiting request whose worker is gone: counted as a cancel (reap, repair)."""
        w = self._w
        self._count_rejection_locked(lb)
        self._log_locked(lb + L_CANCELLED)
        w[lb + L_CANCELLED] += 1
        eb = w[sa + S_STATS] >> 1
        lay = self._lay
        # (after a holder died mid-admit the slot may be half written: check the address)
        if (lay.stats_base <= eb < lay.stats_entry(lay.cap.stats_entries + 1)
                and (eb - lay.stats_base) % ENTRY_WORDS == 0):
            self._log_locked(eb + E_REJECTED + R_CANCELLED)
            w[eb + E_REJECTED + R_CANCELLED] += 1
            self._observe_wait_locked(eb, max(0, now - w[sa + S_ARRIVAL_NS]))

    def _count_rejection_locked(self, lb: int) -> None:
        w = self._w
        self._log_locked(lb + L_REJECTED, lb + L.L_REJECTED_SHADOW)
        total = w[lb + L_REJECTED] + 1
        w[lb + L_REJECTED] = total
        w[lb + L.L_REJECTED_SHADOW] = total

    def turn_away(self, level: int, fs_index: int, seats: int, reason: str, now: int) -> None:
        """Count a request that a worker answered 429 before :meth:`admit` (its thread
        reserve: ``thread-reserve``) as an admit that rejected it: arrival work, rejection
        reason, 0 s wait, and the level's rejected total that Retry-After follows.

        Args:
            level: the request's level index.
            fs_index: its FlowSchema index (the stats entry).
            seats: max(initial, final) seats it asked for.
            reason: one of ``stats.REASONS``.
            now: monotonic ns (for a repair on entry).
        Raises:
            ValueError: an unknown level index or reason.
        """
        self._locked(now, self._turn_away_locked, level, fs_index, seats, _reason_index(reason))

    def _turn_away_locked(self, level: int, fs_index: int, seats: int, r: int) -> None:
        lb = self._lb(level)
        self._reject_arrival_locked(lb, self._stats_entry_locked(lb, level, fs_index), seats, r)

    def _reject_arrival_locked(self, lb: int, eb: int, seats: int, r: int) -> None:
        """Count an arrival rejected without a slot (a worker's turn-away, the poller's
        ``reject_if_full``) as one event, as ``admit`` counts its rejections: its work, the
        level's rejected total (what Retry-After follows), reason ``r`` and, on a non-exempt
        level, a 0 s wait. One undo-log entry for the whole event (this runs per 429)."""
        w = self._w
        bw = eb + E_WORK + bisect_left(WORK_BOUNDS, seats)
        total = lb + L_REJECTED
        shadow = lb + L.L_REJECTED_SHADOW
        reason = eb + E_REJECTED + r
        if w[lb + L_DESIRED] < 0:
            self._log_locked(bw, eb + E_WORK_SUM, total, shadow, reason)
        else:
            self._log_locked(bw, eb + E_WORK_SUM, total, shadow, reason, eb + E_WAIT_R)
            w[eb + E_WAIT_R] += 1  # a 0 s wait: bucket 0, the sum does not move
        w[bw] += 1
        w[eb + E_WORK_SUM] += seats
        n = w[total] + 1
        w[total] = n
        w[shadow] = n
        w[reason] += 1
        self._commit_locked()

    def count_head_timeout(self) -> None:
        """Count one connection answered 408 because its request head was late (server-wide,
        under the lock).
        """
        self._locked(None, self._count_word_locked, L.C_HEAD_TIMEOUTS)

    def count_connection_dropped(self, reason: str) -> None:
        """Count one connection a worker's poller closed before its head was complete
        (server-wide, under the lock).

        Args:
            reason: ``"head-connections"`` (past ``APF_HEAD_CONNECTIONS``, the oldest idle) or
                ``"head-buffer"`` (past ``APF_HEAD_BUFFER_LIMIT``, the largest head).
        Raises:
            ValueError: another reason.
        """
        word = _DROP_WORDS.get(reason)
        if word is None:
            raise ValueError(f"unknown reason {reason!r} for a dropped connection")
        self._locked(None, self._count_word_locked, word)

    def count_rejection_delayed(self, level: int, fs_index: int, reason: str) -> None:
        """Count one 429 a worker's poller held before writing it (its flow came back before
        its Retry-After again and again: ``gthread/pollreject.py``) in the stats entry of its
        level and FlowSchema, by its rejection reason (the one its rejection was counted
        with), under the lock.

        Args:
            level: the request's level index (as its rejection was counted with).
            fs_index: its FlowSchema index.
            reason: its rejection reason, one of ``stats.REASONS``.
        Raises:
            ValueError: an unknown level index or reason.
        """
        self._locked(None, self._count_delayed_locked, level, fs_index, _reason_index(reason))

    def _count_delayed_locked(self, level: int, fs_index: int, r: int) -> None:
        lb = self._lb(level)
        self._w[self._stats_entry_locked(lb, level, fs_index) + E_DELAYED + r] += 1

    def _count_word_locked(self, word: int) -> None:
        self._w[self._lay.counters_base + word] += 1

    @property
    def connections_dropped(self) -> dict[str, int]:
        """Connections the workers' pollers dropped, by reason, server-wide (no lock)."""
        base = self._lay.counters_base
        return {reason: self._w[base + word] for reason, word in _DROP_WORDS.items()}

    @property
    def head_timeouts(self) -> int:
        """Connections answered 408 for a late request head, server-wide (one word, no lock)."""
        return self._w[self._lay.counters_base + L.C_HEAD_TIMEOUTS]

    def rejected_total(self, level: int) -> int:
        """The cumulative rejections (every reason) of the level now at index ``level``: one word
        read without the lock, from a shadow copy no fast path rewrites.

        Args:
            level: a level index within ``Capacity.levels`` (not checked: one word read).
        Returns:
            The count; it restarts at 0 if the index is reused by a new level.
        """
        return self._w[self._lvb + level * LEVEL_WORDS + L.L_REJECTED_SHADOW]

    def request_stats(self) -> list[RequestStats]:
        """Every per-request stats entry as plain objects (under the lock), in creation order.

        Returns:
            One :class:`RequestStats` per (level, FlowSchema) pair seen, then the per-level
            overflow entries, and the catch-all entry only once something was counted in it.
        """
        return self._locked(None, self._request_stats_locked)

    def _request_stats_locked(self) -> list[RequestStats]:
        w, f, lay = self._w, self._f, self._lay
        cap = lay.cap.stats_entries
        fs_names = self._fs_names_locked()
        out = []
        for i in [*range(w[L.H_STATS_COUNT]), cap]:
            eb = lay.stats_entry(i)
            words = w[eb: eb + ENTRY_WORDS].tolist()
            if i == cap and not any(words[E_WORK:]):
                continue
            floats = f[eb: eb + ENTRY_WORDS].tolist()
            off = lay.stats_names + i * L.NAME_BYTES
            level = bytes(self._mv[off: off + words[E_NAME_LEN]]).decode("utf-8")
            fs = words[E_FS]
            flow_schema = fs_names[fs] if 0 <= fs < len(fs_names) else OVERFLOW if fs == -1 else ""
            out.append(read_entry(words, floats, level, flow_schema))
        return out
