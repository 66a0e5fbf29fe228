"""A gthread worker that does not accept connections it has no thread for.

Stock gthread keeps accepting while every thread is busy (up to ``worker_connections``, 1000)
and queues the connections in its executor, where APF cannot see them and where they wait
behind whatever holds the threads (gunicorn issues #908, #3433; ``reference/gunicorn-ipc.md``
1.4). This subclass stops accepting while the connections handed to the executor (gthread's
open connections less those parked in its poller: kept alive, or waiting for their first
bytes) reach ``threads + APF_ACCEPT_SLACK`` (default 0). Extra connections then wait in
the kernel's listen backlog, shared by all workers, so the next worker with a free thread takes
them: no unseen per-worker queue, no unbalanced workers. Kept-alive connections still come
back to their worker when readable; that is bounded by the keep-alive count.

It also stamps each connection when it is queued for a thread, so the middleware's wait limit
counts the time spent in gthread's queue (``middleware.hidden.enqueued_ns``) and the worker
keeps the hidden wait as numbers (``apf_hidden_wait_*``).

Use ``worker_class = "apf_gunicorn.server.worker.ApfThreadWorker"`` (conf.py does).
"""

from __future__ import annotations

import os
from time import monotonic_ns

from gunicorn.workers.gthread import ThreadWorker

from apf_gunicorn.server.middleware import hidden


def accept_slack() -> int:
    try:
        return max(0, int(os.environ.get("APF_ACCEPT_SLACK", "0")))
    except ValueError:
        return 0


class ApfThreadWorker(ThreadWorker):
    # Per request this class adds one Python frame on the main thread (enqueue_req) and one
    # on the request thread (handle); both call the base class directly, not through super().

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.apf_accept_limit = self.cfg.threads + accept_slack()
        self.apf_hidden_wait_max_ns = 0
        self.apf_hidden_wait_sum_ns = 0
        self.apf_handled = 0

    @property
    def apf_busy(self) -> int:
        """Connections handed to the executor and not yet back (running or queued there)."""
        return self.nr_conns - len(self.keepalived_conns) - len(self.pending_conns)

    def set_accept_enabled(self, enabled):
        if enabled and self.apf_busy >= self.apf_accept_limit:
            return  # stays off; run() asks again on its next pass
        ThreadWorker.set_accept_enabled(self, enabled)

    def enqueue_req(self, conn):
        conn.apf_enqueued_ns = monotonic_ns()
        ThreadWorker.enqueue_req(self, conn)
        if self._accepting and self.apf_busy >= self.apf_accept_limit:
            self.set_accept_enabled(False)

    def handle(self, conn):
        t = conn.apf_enqueued_ns
        hidden.enqueued_ns = t
        waited = monotonic_ns() - t
        self.apf_handled += 1
        self.apf_hidden_wait_sum_ns += waited
        if waited > self.apf_hidden_wait_max_ns:
            self.apf_hidden_wait_max_ns = waited
        return ThreadWorker.handle(self, conn)
