"""The ASGI workers' accept gate: spread a server's connections evenly over its workers.

asyncio's server accepts every pending connection at each wake-up (the selector loop's
``_accept_connection`` loops up to ``backlog`` times), so a burst of connects lands mostly in
whichever worker woke first, and with kept-alive connections its requests stay there: that
worker's own resources (its database pool) queue while another worker's idle. gthread has its
accept gate for that (gthread/worker.py); this is the same for an asyncio server.

:class:`AcceptGate` accepts on the listening sockets itself (``loop.add_reader``), one
connection at a time, and hands each to ``loop.connect_accepted_socket`` with the server's own
protocol factory, so the server's protocols, connection accounting and TLS are as before. The
measure is *open connections*: each worker publishes how many it holds (the ledger's worker
records, :meth:`~apf_gunicorn.ledger.workers.WorkerTable.set_worker_connections`), and a worker
accepts while it holds no more than the least-loaded other worker. (Not in-flight requests: a
burst of connects arrives before its requests, and an ASGI request holds no thread; what a
kept-alive connection decides is where its next requests run.)

* A worker out of room removes its reader and looks again every :data:`TICK_S`, and when one
  of its connections closes.
* Among the workers, the least-loaded one always has room, so some worker always accepts; a
  worker alone (or without a ledger) always accepts.
* A worker that does not accept while it has the fewest (its loop is blocked by the app, or
  it is stopped) must not hold connections back: once the listening socket has stayed
  readable for :data:`MAX_DEFER_S`, a worker out of room accepts one connection anyway. So no
  connection (a health probe) waits in the backlog much longer than that.

Per request it costs nothing; per connection, one shared-memory read and store.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("apf_gunicorn.acceptgate")

#: how often a worker out of room looks again whether it has room
TICK_S = 0.005
#: how long the listening socket may stay readable while this worker is out of room before it
#: accepts one connection anyway (the worker with room is not accepting)
MAX_DEFER_S = 0.05
#: connections accepted per wake-up at most while the gate is open (the others go to the
#: next wake-up, after the loop's other work)
PER_WAKEUP = 4

# errors of accept() that say nothing about the listening socket's health: the peer went
# away, or the process or system is out of a resource (retry on the next tick)
_TRANSIENT = {errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EINTR, errno.EPROTO,
              errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class AcceptGate:
    """Accepts connections on ``sockets`` for an asyncio server, one worker's share at a time.

    Quacks like the ``asyncio.Server`` it replaces for its server's shutdown (``close``,
    ``wait_closed``).

    Args:
        loop: the running event loop.
        sockets: the listening sockets (gunicorn's, shared by every worker).
        protocol_factory: the server's, called once per connection.
        ssl: the server's TLS context, or None.
        open_connections: how many connections the server holds open now (made ones: the gate
            counts the ones it accepted whose protocol is not made yet itself).
        publish: ``publish(n)`` stores this worker's open connections for the others (``None``:
            it stopped); None: no peers.
        fewest_elsewhere: the fewest open connections another worker published (None: no
            other worker takes part); None: no peers.
    """

    def __init__(self, loop: Any, sockets: list[socket.socket], protocol_factory: Callable,
                 ssl: Any, open_connections: Callable[[], int],
                 publish: Callable[[int | None], None] | None = None,
                 fewest_elsewhere: Callable[[], int | None] | None = None) -> None:
        if (publish is None) != (fewest_elsewhere is None):
            raise ValueError("AcceptGate: give both publish and fewest_elsewhere, or neither")
        self._loop = loop
        self._sockets = list(sockets)
        self._factory = protocol_factory
        self._ssl = ssl
        self._open = open_connections
        self._publish = publish
        self._fewest = fewest_elsewhere
        self._pending = 0  # accepted, protocol not made yet
        self._serving = False  # the readers are registered
        self._closed = False
        self._timer = None
        self._readable_since = 0.0  # when the backlog was first seen waiting while out of room
        self._poll = select.poll()
        for sock in self._sockets:
            sock.setblocking(False)
            self._poll.register(sock.fileno(), select.POLLIN)

    # -- asyncio.Server's part --------------------------------------------------------------

    def start(self) -> None:
        """Begin accepting (as far as the gate lets)."""
        self._reopen()

    def close(self) -> None:
        """Stop accepting for good (the connections already made stay the server's)."""
        if self._closed:
            return
        self._closed = True
        self._stop_reading()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._publish is not None:
            self._publish(None)

    def is_serving(self) -> bool:
        return not self._closed

    async def wait_closed(self) -> None:
        return None

    # -- the gate --------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether this worker may accept now: it holds no more connections than the
        least-loaded other worker (publishing its own count for them)."""
        if self._publish is None:
            return True
        mine = self._open() + self._pending
        self._publish(mine)
        fewest = self._fewest()
        return fewest is None or mine <= fewest

    def connection_closed(self) -> None:
        """Called by the server when one of its connections closes: publish, and reopen if that
        gave this worker room."""
        if self._closed or self._publish is None:
            return
        if self.has_room() and not self._serving:
            self._reopen()

    def _reopen(self) -> None:
        if self._closed:
            return
        if not self.has_room():
            self._wait()
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._readable_since = 0.0
        if not self._serving:
            self._serving = True
            for sock in self._sockets:
                self._loop.add_reader(sock.fileno(), self._on_readable, sock)

    def _stop_reading(self) -> None:
        if self._serving:
            self._serving = False
            for sock in self._sockets:
                self._loop.remove_reader(sock.fileno())

    def _wait(self) -> None:
        """Out of room: stop reading, look again in a tick."""
        self._stop_reading()
        if self._timer is None:
            self._timer = self._loop.call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._closed:
            return
        if self.has_room():
            self._reopen()
            return
        # still out of room: a worker with room should drain the backlog within a wake-up;
        # if the backlog stays, it is not accepting, and this one takes a connection
        ready = self._poll.poll(0)
        now = time.monotonic()
        if not ready:
            self._readable_since = 0.0
        elif not self._readable_since:
            self._readable_since = now
        elif now - self._readable_since >= MAX_DEFER_S:
            self._readable_since = 0.0
            ready_fds = {fd for fd, _ in ready}
            for sock in self._sockets:
                if sock.fileno() in ready_fds:
                    self._accept_one(sock)
        self._timer = self._loop.call_later(TICK_S, self._tick)

    def _on_readable(self, sock: socket.socket) -> None:
        for _ in range(PER_WAKEUP):
            if not self.has_room():
                self._wait()
                return
            if not self._accept_one(sock):
                return

    def _accept_one(self, sock: socket.socket) -> bool:
        """Accept one connection on ``sock`` and start it; whether there was one."""
        try:
            conn, _addr = sock.accept()
        except OSError as e:
            if e.errno not in _TRANSIENT:
                raise
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                log.error("apf: accept failed (%s); retrying", e)
                self._wait()  # not reading until the next tick: the loop would spin
            return False
        conn.setblocking(False)
        self._pending += 1
        if self._publish is not None:
            self._publish(self._open() + self._pending)
        task = self._loop.create_task(
            self._loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl))
        task.add_done_callback(self._made)
        return True

    def _made(self, task: Any) -> None:
        self._pending -= 1
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:  # a TLS handshake failed: the transport closed the socket
            log.debug("apf: connection not made: %r", e)
            self.connection_closed()
