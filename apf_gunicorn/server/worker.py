"""A gthread worker that does not accept connections it has no thread for.

Stock gthread keeps accepting while every thread is busy (up to ``worker_connections``, 1000)
and queues the connections in its executor, where APF cannot see them and where they wait
behind whatever holds the threads (gunicorn issues #908, #3433; ``reference/gunicorn-ipc.md``
1.4). This subclass counts the connections handed to the executor and stops accepting while
that count reaches ``threads + APF_ACCEPT_SLACK`` (default 0). Extra connections then wait in
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
import time

from gunicorn.workers.gthread import ThreadWorker

from apf_gunicorn.server.middleware import hidden


def accept_slack() -> int:
    try:
        return max(0, int(os.environ.get("APF_ACCEPT_SLACK", "0")))
    except ValueError:
        return 0


class ApfThreadWorker(ThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.apf_busy = 0
        self.apf_accept_limit = self.cfg.threads + accept_slack()
        self.apf_hidden_wait_max_ns = 0
        self.apf_hidden_wait_sum_ns = 0
        self.apf_handled = 0

    def set_accept_enabled(self, enabled):
        if enabled and self.apf_busy >= self.apf_accept_limit:
            return  # stays off; run() asks again on its next pass
        super().set_accept_enabled(enabled)

    def enqueue_req(self, conn):
        conn.apf_enqueued_ns = time.monotonic_ns()
        self.apf_busy += 1
        super().enqueue_req(conn)
        if self._accepting and self.apf_busy >= self.apf_accept_limit:
            self.set_accept_enabled(False)

    def finish_request(self, conn, fs):
        self.apf_busy -= 1
        super().finish_request(conn, fs)

    def handle(self, conn):
        t = getattr(conn, "apf_enqueued_ns", 0)
        hidden.enqueued_ns = t
        if t:
            waited = time.monotonic_ns() - t
            self.apf_handled += 1
            self.apf_hidden_wait_sum_ns += waited
            if waited > self.apf_hidden_wait_max_ns:
                self.apf_hidden_wait_max_ns = waited
        return super().handle(conn)
