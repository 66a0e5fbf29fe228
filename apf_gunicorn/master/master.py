"""Master services: the thread that runs borrowing every 10 s (``APF_BORROWING_PERIOD``),
with ``APF_CONCURRENCY_LIMIT=auto`` the adaptive limit's controller every second
(``APF_ADAPTIVE_TICK``, ``master/autolimit.py``), reclaims every second the seats of
workers that died unseen by our ``child_exit`` (``master/reclaim.py``), and hosts the
admin endpoint and the HAProxy agent-check endpoint (``APF_AGENT_BIND``).

Started from ``when_ready`` (after the listeners are bound, before the first fork), it lives
in the master for the life of the server and survives HUP. Every lock it takes is guarded
with ``os.register_at_fork`` (:data:`SERVICE_LOCK`): gunicorn forks workers from the main
thread while this thread may be inside the ledger, and a child must never inherit a lock held
by a thread that does not exist in it (``reference/gunicorn-ipc.md`` 1.7).

Usage::

    services = MasterServices(state.MASTER, log)
    services.start()
    ...
    services.stop()
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

from apf_gunicorn.flowcontrol.borrowing import BorrowingStates, run_borrowing
from apf_gunicorn.master.admin import AdminServer
from apf_gunicorn.master.autolimit import ServerAutoLimit
from apf_gunicorn.master.metrics import view_of_master_state
from apf_gunicorn.master.poollimit import ServerPoolLimit
from apf_gunicorn.master.reclaim import find_gone, reclaim_worker
from apf_gunicorn.master.serverlimit import large_move

log = logging.getLogger("apf_gunicorn.master")

BORROWING_PERIOD_S = 10.0
BOOT_ROOM_S = 30.0  # how long a booting worker counts as having room (expire_boots)
TICK_S = 1.0

# Held by master threads around every ledger operation they make; acquired by the forking
# thread before fork, so no child inherits it (or the ledger's own lock) held.
SERVICE_LOCK = threading.Lock()


def _before_fork() -> None:
    SERVICE_LOCK.acquire()


def _after_fork_parent() -> None:
    SERVICE_LOCK.release()


def _after_fork_child() -> None:
    global SERVICE_LOCK
    SERVICE_LOCK = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                     after_in_child=_after_fork_child)


class Cadence:
    """A task due every ``period_s`` seconds, on a fixed cadence; after a stall it starts over
    rather than running the missed rounds back to back.

        borrow = Cadence(10.0, now)
        wait = borrow.wait_s(now)    # seconds until it is due (0 when it is)
        if borrow.due(now): ...      # True once per period; moves the next time on
    """

    def __init__(self, period_s: float, now: float) -> None:
        self.period_s = period_s
        self.next = now + period_s

    def wait_s(self, now: float) -> float:
        return max(0.0, self.next - now)

    def due(self, now: float) -> bool:
        if now < self.next:
            return False
        self.next += self.period_s
        if self.next <= now:
            self.next = now + self.period_s
        return True


class MasterServices(threading.Thread):
    def __init__(self, master_state, glog=None, arbiter=None):
        super().__init__(name="apf-master", daemon=True)
        self.clock = time.monotonic  # tests drive the loop in virtual time
        self.state = master_state
        self.glog = glog or log
        # gunicorn's Arbiter: its worker table tells which workers are gone (reclaim_gone)
        self.arbiter = arbiter
        self._suspects: dict = {}  # worker index -> (Worker, missing since): reclaim.find_gone
        self.reclaimed = 0  # dead workers reclaimed here, not by child_exit
        self._stop_event = threading.Event()
        self.admin = None
        self.rounds = 0
        # The admin port was taken (the old master of a USR2 upgrade): try again every tick,
        # so the endpoint comes back once that master is gone.
        self.admin_retry = False
        self.agent = None  # server.agent.AgentServer while it serves
        self.agent_state = None  # server.agent.AgentState
        self.agent_retry = False
        settings = getattr(master_state, "settings", None)
        bounds = getattr(settings, "concurrency_auto", None)
        pool_signals = (getattr(settings, "pool_signals", True)
                        and getattr(master_state, "pool_table", None) is not None)
        # APF_CONCURRENCY_LIMIT=auto: the controller (None for a fixed limit), the app's pools
        # read first (the same rule as with nothing set, its ceiling auto's MAX)
        self.auto = (None if bounds is None else
                     ServerAutoLimit(bounds, settings.concurrency_limit,
                                     route_times=getattr(master_state, "route_times", None),
                                     pools=ServerPoolLimit(bounds[1]) if pool_signals else None))
        if self.auto is not None:
            master_state.auto_limit = self.auto
        self._told_host = ""  # the CPU's or a busy host's hold the log last told
        # nothing set about the limit: the master follows the app's pools once it has any
        self.pools = (ServerPoolLimit(settings.concurrency_limit)
                      if not getattr(settings, "concurrency_limit_set", True)
                      and pool_signals else None)

    @property
    def period_s(self) -> float:
        settings = getattr(self.state, "settings", None)
        return float(getattr(settings, "borrowing_period_s", BORROWING_PERIOD_S))

    @property
    def adapt_s(self) -> float:
        settings = getattr(self.state, "settings", None)
        return float(getattr(settings, "adaptive_tick_s", TICK_S))

    def run(self) -> None:
        now = self.clock()
        borrow = Cadence(self.period_s, now)
        adapt = (Cadence(self.adapt_s, now)
                 if self.auto is not None or self.pools is not None else None)
        timers = [c for c in (borrow, adapt) if c is not None]
        while not self._stop_event.wait(min(TICK_S, *(c.wait_s(self.clock()) for c in timers))):
            self.refresh_workers()
            self.reclaim_gone()
            if self.admin_retry:
                with SERVICE_LOCK:  # no fork between binding and recording the listener
                    self.start_admin(quiet=True)
            if self.agent_retry:
                with SERVICE_LOCK:
                    self.start_agent(quiet=True)
            now = self.clock()
            if adapt is not None and adapt.due(now):
                self.adapt_once()
            if borrow.due(now):
                self.borrow_once()

    def refresh_workers(self) -> None:
        """Record the pid of every worker that registered itself in the ledger (the master
        learns a child's pid only after fork, where no hook runs)."""
        from apf_gunicorn.ledger.layout import WORKER_ALIVE

        m = self.state
        try:
            with SERVICE_LOCK:
                # Only live entries: a GONE entry is the dead previous holder of a reused index,
                # and its pid on the booting replacement would keep child_exit from freeing it.
                registered = {owner: pid for owner, pid, st, _hb in m.ledger.workers()
                              if st == WORKER_ALIVE}
        except Exception:
            self.glog.exception("apf: reading the worker table failed")
            return
        for index, pid in list(m.workers.items()):
            # Re-read: the main thread may have reaped the worker (popped its index) since the
            # copy; writing then would bring the index back with a dead pid, never freed.
            if not pid and registered.get(index) and m.workers.get(index) == 0:
                m.workers[index] = registered[index]
        self.expire_boots(registered)

    def reclaim_gone(self) -> None:
        """Reclaim the seats of workers gunicorn has reaped but our ``child_exit`` did not see
        (a config's own ``child_exit`` replaced it): master/reclaim.py. Each one is logged."""
        if self.arbiter is None:
            return
        try:
            gone, self._suspects = find_gone(self.state, self.arbiter, self._suspects,
                                             time.monotonic())
            for worker in gone:
                with SERVICE_LOCK:  # a ledger operation of a master thread: no fork meanwhile
                    done = reclaim_worker(self.state, worker, self.glog)
                if done:
                    self.reclaimed += 1
                    # a warning the first time; then each one at info (max_requests restarts)
                    (self.glog.warning if self.reclaimed == 1 else self.glog.info)(
                        "apf: worker %s (pid %s) is gone and apf_gunicorn's child_exit did not "
                        "run for it (the config's child_exit hook replaces it without calling "
                        "it): the master reclaimed its seats now (%d so far). Call apf_gunicorn."
                        "server.hooks.child_exit(server, worker) from your child_exit to do it "
                        "at once.", worker.apf_index, worker.pid, self.reclaimed)
        except Exception:
            self.glog.exception("apf: checking for dead workers failed")

    def expire_boots(self, registered: dict[int, int]) -> None:
        """A worker counts as having room while it boots (hooks.pre_fork), so the others do not
        turn requests away for threads it is about to bring; one that has not registered after
        BOOT_ROOM_S (stuck in its imports, say: gunicorn times out no worker before its first
        heartbeat) stops counting, and the others accept on their exempt reserve again."""
        now = time.monotonic()
        for index, since in list(self.state.booting.items()):
            if index in registered or index not in self.state.workers:
                self.state.booting.pop(index, None)
            elif now - since > BOOT_ROOM_S:
                self.state.booting.pop(index, None)
                self.state.ledger.set_worker_room(index, False)
                self.glog.warning("apf: worker %d has not booted in %.0f s; it no longer "
                                  "counts as having room", index, BOOT_ROOM_S)

    def borrow_once(self) -> None:
        m = self.state
        if m.borrowing_states is None:
            m.borrowing_states = BorrowingStates()
        try:
            with SERVICE_LOCK:
                # read under the lock on_reload takes to replace it: a HUP in between would
                # have the old levels' limits applied to the reconfigured ledger
                gen = m.generation
                levels = [(name, idx, gen.configuration.priority_levels[name].is_exempt)
                          for name, idx in gen.level_index.items()
                          if name in gen.configuration.priority_levels]
                granted = run_borrowing(m.ledger, gen.limits, m.borrowing_states,
                                        time.monotonic_ns(),
                                        server_limit=m.settings.concurrency_limit,
                                        levels=levels)
            if granted and m.sender is not None:
                m.sender.send_grants(granted)
            self.rounds += 1
        except Exception:
            self.glog.exception("apf: borrowing round failed")

    def adapt_once(self) -> None:
        """One tick of the adaptive limit; a move by more than a quarter, every move of the CPU
        rule or for a slow backend on a busy host, and the first tick of a hold for the CPU or
        a busy host are logged (every tick's observation and decision at debug level); under
        the app's pools, every change, the first limit from them and their going away. With
        nothing set, the pool rule's tick instead: every change logged with its cause."""
        if self.pools is not None:
            self.follow_pools_once()
            return
        try:
            change = self.auto.tick(self.state, SERVICE_LOCK)
        except Exception:
            self.glog.exception("apf: adaptive concurrency limit tick failed")
            return
        auto, last = self.auto, self.auto.controller.last
        self.glog.debug("apf: concurrency limit auto: %s -> %s", auto.last_tick, last)
        if auto.handed_over:
            self.glog.info("apf: concurrency limit auto: no pool published now: the latency "
                           "rule goes on from %d seats", change[0] if change else last.limit)
        # a hold for the CPU or a busy host: said once per spell (the reason's first words)
        spell = re.sub(r"[\d.]+", "", last.reason.split(",", 1)[0]) if last.reason.startswith(
            ("cpu:", "hold: host busy")) else ""
        told, self._told_host = self._told_host, spell
        if change is not None and (auto.source != "latency"):
            # the pool rule's and the CPU rule's every change, with its cause
            self.glog.info("apf: concurrency limit auto: %d -> %d seats (%s)", change[0],
                           change[1], auto.reason)
        elif auto.pool_decision is not None and auto.pool_decision.found:
            self.glog.info("apf: concurrency limit auto: stays %d seats (%s)", last.limit,
                           auto.reason)
        elif change is not None and (large_move(*change) or "slow backend" in last.reason):
            self.glog.info("apf: concurrency limit auto: %d -> %d seats (%s; latency x%.2f "
                           "of the baseline at %.1f seats)", change[0], change[1], last.reason,
                           last.inflation or 1.0, last.concurrency)
        elif spell and spell != told:
            # the CPU's hold, or a busy host told apart from a slow backend: once per spell
            self.glog.info("apf: concurrency limit auto: stays %d seats (%s)", last.limit,
                           last.reason)

    def follow_pools_once(self) -> None:
        """One tick of the limit from the app's pools (master/poollimit.py): each change is
        logged at info with its cause."""
        try:
            old = self.state.settings.concurrency_limit
            decision = self.pools.tick(self.state, SERVICE_LOCK)
        except Exception:
            self.glog.exception("apf: concurrency limit from the pools: tick failed")
            return
        if decision is not None and decision.limit != old:
            self.glog.info("apf: concurrency limit %d -> %d seats (%s)", old, decision.limit,
                           decision.reason)
        elif decision is not None and decision.reason.startswith("limit from pools"):
            self.glog.info("apf: concurrency limit stays %d seats (%s)", old, decision.reason)

    def start_admin(self, quiet: bool = False) -> None:
        """Bind the admin endpoint (main thread, before the first fork; later from this
        thread while the port is taken). ``quiet``: do not log the port being in use again."""
        bind = self.state.settings.admin_bind
        self.admin_retry = False
        if bind is None or self.admin is not None:
            return
        try:
            from apf_gunicorn.server import state

            admin = AdminServer(bind, lambda: view_of_master_state(state.MASTER),
                                guard=SERVICE_LOCK,
                                prefix=self.state.settings.metrics_prefix)
            if admin.start(quiet=quiet):
                self.admin = admin
            else:
                self.admin_retry = True
        except OSError as e:
            self.glog.warning("apf: admin endpoint not started on %s:%s: %s", *bind, e)
        except Exception:
            self.glog.exception("apf: admin endpoint failed to start")

    def start_agent(self, arbiter=None, quiet: bool = False) -> None:
        """Bind the agent-check endpoint (``APF_AGENT_BIND``) and make SIGTERM drain first
        (main thread, before the first fork; later from this thread while the port is taken).
        ``arbiter``: gunicorn's, for the worker count and the SIGTERM handler."""
        bind = getattr(self.state.settings, "agent_bind", None)
        self.agent_retry = False
        if bind is None or self.agent is not None:
            return
        from apf_gunicorn.master.agent import AgentServer, AgentState, install_drain_on_term

        if self.agent_state is None:
            self.agent_state = AgentState(self.state, arbiter)
            if arbiter is not None:
                install_drain_on_term(arbiter, self.agent_state,
                                      self.state.settings.agent_drain_delay_s)
        try:
            agent = AgentServer(bind, self.agent_state.reply)
            if agent.start(quiet=quiet):
                self.agent = agent
            else:
                self.agent_retry = True
        except OSError as e:
            self.glog.warning("apf: agent-check endpoint not started on %s:%s: %s", *bind, e)

    def close_in_child(self) -> None:
        """In a freshly forked worker: close the admin and agent listeners it inherited."""
        if self.admin is not None:
            self.admin.close_in_child()
        if self.agent is not None:
            self.agent.close_in_child()

    def stop(self) -> None:
        self._stop_event.set()
        for server in (self.admin, self.agent):
            stop = getattr(server, "stop", None)
            if stop is not None:
                try:
                    stop()
                except Exception:
                    pass
