"""Master services: the thread that runs borrowing every 10 s and hosts the admin endpoint.

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
import threading
import time

log = logging.getLogger("apf_gunicorn.master")

BORROWING_PERIOD_S = 10.0

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


class MasterServices(threading.Thread):
    def __init__(self, master_state, glog=None):
        super().__init__(name="apf-master", daemon=True)
        self.state = master_state
        self.glog = glog or log
        self._stop_event = threading.Event()
        self.admin = None
        self.rounds = 0

    def run(self) -> None:
        self._start_admin()
        while not self._stop_event.wait(BORROWING_PERIOD_S):
            self.borrow_once()

    def borrow_once(self) -> None:
        m = self.state
        try:
            from apf_gunicorn.flowcontrol.borrowing import BorrowingStates, run_borrowing
        except ImportError:
            return
        if m.borrowing_states is None:
            m.borrowing_states = BorrowingStates()
        gen = m.generation
        try:
            with SERVICE_LOCK:
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

    def _start_admin(self) -> None:
        bind = self.state.settings.admin_bind
        if bind is None:
            return
        try:
            from apf_gunicorn.server.admin import AdminServer
        except ImportError:
            return
        try:
            self.admin = AdminServer(self.state, bind)
            self.admin.start()
        except OSError as e:
            self.glog.warning("apf: admin endpoint not started on %s:%s: %s", *bind, e)
        except Exception:
            self.glog.exception("apf: admin endpoint failed to start")

    def close_in_child(self) -> None:
        """In a freshly forked worker: close the admin listener the child inherited."""
        admin = self.admin
        for attr in ("socket", "sock"):
            sock = getattr(admin, attr, None)
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        close = getattr(admin, "close_in_child", None)
        if close is not None:
            close()

    def stop(self) -> None:
        self._stop_event.set()
        stop = getattr(self.admin, "stop", None)
        if stop is not None:
            try:
                stop()
            except Exception:
                pass
