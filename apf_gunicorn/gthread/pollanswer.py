"""Answering 429 from the gthread worker's poller, without a thread.

A complete head whose request the middleware would certainly reject
(``pollreject.PollerRejector.answer``) is answered where it was read: written at once, or held
until its Retry-After when its flow retries sooner (``APF_HELD_REJECTIONS``), counted towards
``max_requests`` and logged in gunicorn's access log. :class:`PollerAnswers` is
``ApfThreadWorker``'s mixin (it uses the worker's kept-alive table, ``poller``, ``nr`` and
``max_requests`` as gthread's own request handling does).
"""

from __future__ import annotations

import heapq
import logging
import selectors
import time
from functools import partial

from apf_gunicorn.gthread.threadshare import reserve_full

log = logging.getLogger("apf_gunicorn.worker")


class PollerAnswers:
    """The poller's 429s; a mixin of ``ApfThreadWorker``."""

    def _apf_reserve_full(self) -> bool:
        """Every thread for non-exempt requests is taken (the thread reserve applies)."""
        return reserve_full(len(self.apf_inflight), self.apf_room_limit)

    def apf_reject_here(self, conn, data: bytes, kept: bool = False) -> bool:
        """Answer the complete head ``data`` 429 from the poller when the middleware would
        certainly reject it (``PollerRejector.answer``); True when answered (or held to be
        answered), False: it goes to a thread as usual. ``kept``: the connection is still
        registered and among the kept-alive ones (a kept-alive connection's next head)."""
        room = (self.alive and self._apf_keepalive_on
                and len(self.keepalived_conns) - kept < self.max_keepalived
                and self.nr + 1 < self.max_requests)  # (the last one closes, as in gthread)
        try:
            verdict = self.apf_rejector.answer(data, conn.client, room)
        except Exception:
            log.exception("apf: classifying a request head in the poller failed; a thread "
                          "takes it")
            return False
        if verdict is None:
            return False
        # a request answered, as gthread's handle_request counts it towards max_requests
        self.nr += 1
        if self.nr >= self.max_requests and self.alive:
            self.log.info("Autorestarting worker after current request.")
            self.alive = False
        held = self.apf_held
        if verdict.hold > 0 and len(held) < self.apf_held_max and self.alive:
            if kept:
                self.poller.unregister(conn.sock)
                self.keepalived_conns.remove(conn)
            self._apf_held_seq += 1
            heapq.heappush(held, (time.monotonic() + verdict.hold, self._apf_held_seq, conn,
                                  verdict))
            count = self.apf_on_delayed
            if count is not None:
                count(verdict.route.level, verdict.route.fs_index, verdict.reason)
            return True
        self._apf_answer(conn, verdict, kept)
        return True

    def _apf_answer(self, conn, verdict, kept: bool = False) -> None:
        """Write a 429 (``PollerRejector.answer``'s: a few hundred bytes, one send), log it in
        gunicorn's access log, and keep the connection alive as gthread does after a response,
        or close it. ``kept``: it is registered and kept alive already (then it stays
        registered: it moves to the end of the kept-alive ones)."""
        out, keep = verdict.data, verdict.keep
        try:
            sent = conn.sock.send(out)
        except OSError:
            sent = -1
        if self.apf_access_log:
            self.apf_rejector.log_access(self.log, verdict, conn.client, conn.server)
        if sent != len(out):  # a client that does not read, or is gone
            keep = False
        if keep and self.alive:
            conn.timeout = time.monotonic() + self._apf_keepalive_s  # (TConn.set_timeout)
            kept_alive = self.keepalived_conns
            if kept:
                kept_alive.remove(conn)
                kept_alive.append(conn)
                return
            kept_alive.append(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ,
                                 partial(self.on_client_socket_readable, conn))
            return
        if kept:
            self.poller.unregister(conn.sock)
            self.keepalived_conns.remove(conn)
        self.nr_conns -= 1
        # as gunicorn closes after a response (a client may have sent more since its head
        # was read: a plain close would reset the connection), without blocking: linger.py
        self.apf_close_answered(conn)

    def _apf_release_held(self) -> None:
        """Write the held 429s that are due (all of them once the worker stops)."""
        held = self.apf_held
        now = time.monotonic()
        alive = self.alive
        while held and (held[0][0] <= now or not alive):
            _, _, conn, verdict = heapq.heappop(held)
            self._apf_answer(conn, verdict)
