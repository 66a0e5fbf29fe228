"""With no ``APF_CONCURRENCY_LIMIT`` set: the master sets the server limit from the app's pools.

The workers find the app's connection pools after the app loads and publish them once a second
(``signals/``); once a tick (``APF_ADAPTIVE_TICK``, 1 s) the master's services thread reads them
server-wide and runs the pool rule (:class:`apf_gunicorn.control.poollimit.PoolLimit`). Its
limit is applied as ``auto``'s is (:func:`apf_gunicorn.master.serverlimit.apply_server_limit`).
Until a worker publishes a bounded pool nothing changes: an app without one keeps the default.
A number in ``APF_CONCURRENCY_LIMIT`` turns this off; under ``auto`` the adaptive limit
(``master/autolimit.py``) runs the same rule through :meth:`ServerPoolLimit.decide` and applies
its limit itself (the CPU and the bounds have their say first).

What the rule gets from the ledger (``ledger.load()``, no lock):

* the share of the level that floods: of the non-exempt levels whose limit was binding over
  the tick (requests queued in APF now, or turned away since the last tick), the largest
  nominal share of the server limit; when none binds, the last one (at first, the largest
  share of any non-exempt level);
* whether the limit was binding at all;
* the seats requests hold server-wide (every level, the exempt ones too): the rule tells
  connections held by something other than a request from them.

    pools = ServerPoolLimit(ceiling=20)
    decision = pools.tick(master_state, lock)   # None, or the PoolDecision of the tick
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from apf_gunicorn.control.poollimit import PoolDecision, PoolLimit, PoolLimitSettings
from apf_gunicorn.master.serverlimit import apply_server_limit

#: the first limit waits this long for every live worker to publish its pools
FIRST_SIGHT_WAIT_NS = 5_000_000_000


class ServerPoolLimit:
    """The pool rule as the master runs it.

    Args:
        ceiling: the highest limit it sets (the default limit).
        clock: monotonic ns (injected by tests).
        settings: the rule's thresholds.
    """

    def __init__(self, ceiling: int, clock: Callable[[], int] = time.monotonic_ns,
                 settings: PoolLimitSettings | None = None) -> None:
        self.rule = PoolLimit(ceiling, settings)
        self.clock = clock
        self.share: float | None = None
        self._rejected: dict[int, int] = {}
        self._first_seen: int | None = None

    def _everyone_published(self, pools: list, workers: int, now: int) -> bool:
        """Whether the first limit can be set: every worker has published the pool, or
        :data:`FIRST_SIGHT_WAIT_NS` passed since one did (a worker may make its pool only at
        its first request). Otherwise the first worker's pool alone would set the limit."""
        if self._first_seen is None:
            self._first_seen = now
        return (max(p.workers for p in pools) >= workers
                or now - self._first_seen >= FIRST_SIGHT_WAIT_NS)

    def _share_and_binding(self, master: Any) -> tuple[float, bool, int]:
        gen = master.generation
        levels = gen.configuration.priority_levels
        total = sum(pl.nominal_concurrency_shares for pl in levels.values())
        names = {idx: name for name, idx in gen.level_index.items() if name in levels}
        shares = {name: pl.nominal_concurrency_shares / total
                  for name, pl in levels.items() if not pl.is_exempt and total > 0}
        binding: list[float] = []
        rejected = {}
        executing = 0
        for lv in master.ledger.load():
            executing += lv.seats_in_use
            name = names.get(lv.index)
            if lv.exempt or name not in shares:
                continue
            rejected[lv.index] = lv.rejected
            if lv.requests_waiting > 0 or lv.rejected > self._rejected.get(lv.index, lv.rejected):
                binding.append(shares[name])
        self._rejected = rejected
        if binding:
            self.share = max(binding)
        elif self.share is None or self.share not in shares.values():
            self.share = max((s for s in shares.values() if s > 0), default=1.0)
        return self.share, bool(binding), executing

    def reset(self) -> None:
        """Forget the pools (``auto``: they are gone): the next ones found start the rule
        afresh, from their capacity, once every worker has published them."""
        self.rule = PoolLimit(self.rule.ceiling, self.rule.settings)
        self._first_seen = None

    def tick(self, master: Any, lock: AbstractContextManager | None = None
             ) -> PoolDecision | None:
        """One tick against ``master`` (``server.state.MasterState``: its ``pool_table``,
        ``workers``, ``generation`` and ``ledger`` are read; the limit applied on a change).

        Returns:
            The rule's decision (``changed``: the limit was applied), or None while no worker
            has published a bounded pool.
        """
        now = self.clock()
        decision = self.decide(master, now, lock)
        if decision is not None and decision.limit != master.settings.concurrency_limit:
            apply_server_limit(master, decision.limit, now, lock)
        return decision

    def decide(self, master: Any, now: int, lock: AbstractContextManager | None = None
               ) -> PoolDecision | None:
        """The rule's tick at ``now`` (monotonic ns) against ``master`` (as :meth:`tick`),
        applying nothing: the decision, or None while no live worker has published a bounded
        pool (or not every worker yet, :data:`FIRST_SIGHT_WAIT_NS`). ``share`` is then the
        flooding level's."""
        lock = lock if lock is not None else nullcontext()
        table = getattr(master, "pool_table", None)
        if table is None:
            return None
        # registered workers only: a booting one's row may hold its dead predecessor's window
        live = {i for i, pid in (master.workers or {}).items() if pid}
        pools = [p for p in table.totals(now, live=live).values() if p.capacity > 0]
        # (every worker index, the booting ones too: the first limit waits for them)
        if self.rule.seats is None and pools and not self._everyone_published(
                pools, len(master.workers or {}), now):
            return None
        with lock:  # on_reload replaces the generation under it
            share, binding, executing = self._share_and_binding(master)
        return self.rule.update(now, pools, share, binding, executing)
