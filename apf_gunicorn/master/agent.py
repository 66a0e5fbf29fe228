"""The HAProxy agent-check endpoint the master serves (``APF_AGENT_BIND``, off by default).

HAProxy's ``agent-check`` connects to ``agent-port``, reads one line and closes. Each
connection here gets one line, then is closed:

* ``up ready 73%`` -- the weight of :func:`~apf_gunicorn.admission.loadreport.weight_percent`
  (100% idle, down to 1% when full or queuing), relative to the server's ``weight`` in
  haproxy.cfg; ``ready`` ends a previous ``drain``, ``up`` a previous ``down``;
* ``drain`` -- during a graceful stop (the master got SIGTERM: it keeps serving for
  ``APF_AGENT_DRAIN_DELAY`` seconds while the balancer moves new traffic away, then stops as
  gunicorn does), and while workers restart (fewer workers registered in the ledger than
  gunicorn's ``num_workers``, or more processes than that: a HUP or a worker being replaced);
* ``down`` -- the ledger is unusable (unmapped, or not a valid ledger any more).

The reply is computed from :meth:`Ledger.load` (plain word reads, no lock): it never waits
for a request, a worker or the ledger lock. One thread accepts and answers in turn; it never
reads from the client (anything HAProxy sends with ``agent-send`` is discarded), so a client
cannot hold it. The listener is close-on-exec, and forked workers close it
(:meth:`AgentServer.close_in_child`).

Usage (``hooks.when_ready`` through ``MasterServices.start_agent``)::

    agent = AgentServer(("127.0.0.1", 9200), AgentState(state.MASTER, arbiter).reply)
    agent.start()
    install_drain_on_term(arbiter, agent_state, delay_s=3.0)
    agent.stop()
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from apf_gunicorn.admission.loadreport import summarize, weight_percent
from apf_gunicorn.ledger.records import LedgerPort

log = logging.getLogger("apf_gunicorn.agent")

DRAIN = b"drain\n"
DOWN = b"down\n"


def ready_line(weight: int) -> bytes:
    """The reply of a serving server: ``up ready <weight>%``."""
    return b"up ready %d%%\n" % weight


class AgentState:
    """What the agent answers, from the master's state and gunicorn's arbiter.

    Args:
        master: ``server.state.MasterState`` (its ``ledger``), or any object with one.
        arbiter: gunicorn's Arbiter (``num_workers``, ``WORKERS``), or None to skip the
            worker check.
    """

    def __init__(self, master: Any, arbiter: Any = None) -> None:
        self.master = master
        self.arbiter = arbiter
        self.stopping = False  # set on SIGTERM: "drain" until the master exits
        self.last = b""  # the previous reply (a change to down is logged once)

    def workers_restarting(self, ledger: LedgerPort) -> bool:
        """Whether gunicorn is starting or replacing workers right now."""
        arb = self.arbiter
        if arb is None:
            return False
        from apf_gunicorn.ledger.layout import WORKER_ALIVE

        expected = arb.num_workers or 0
        running = len(arb.WORKERS)
        registered = sum(1 for _o, _pid, st, _hb in ledger.workers() if st == WORKER_ALIVE)
        return running != expected or registered < expected

    def reply(self) -> bytes:
        """The line for one agent connection (never raises)."""
        ledger: LedgerPort | None = self.master.ledger
        try:
            if ledger is None:
                raise ValueError("no ledger")
            load = summarize(ledger.load())
            restarting = self.workers_restarting(ledger)
        except Exception as e:
            if self.last != DOWN:
                log.error("apf agent: the ledger is unusable, answering down: %s", e)
            self.last = DOWN
            return DOWN
        self.last = DRAIN if self.stopping or restarting else ready_line(weight_percent(load))
        return self.last


class AgentServer:
    """A TCP listener answering each connection with ``reply()`` and closing it.

    Args:
        bind: ``(host, port)``.
        reply: returns the bytes to send (called once per connection, in the agent thread).
    """

    def __init__(self, bind: tuple[str, int], reply: Callable[[], bytes]) -> None:
        self.address = bind
        self.reply = reply
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.served = 0

    @property
    def port(self) -> int | None:
        return self._sock.getsockname()[1] if self._sock is not None else None

    def start(self, quiet: bool = False) -> bool:
        """Bind and serve in a daemon thread. False (logged unless ``quiet``) when the address
        is in use, e.g. by the old master during a USR2 upgrade.

        Raises:
            OSError: binding failed for another reason than the address being in use.
        """
        host, port = self.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                if not quiet:
                    log.error("apf agent-check endpoint: %s:%d is already in use (another "
                              "gunicorn master, e.g. during a USR2 upgrade?); running without "
                              "it until it is free. Set APF_AGENT_BIND to another host:port.",
                              host, port)
                return False
            raise
        os.set_inheritable(sock.fileno(), False)
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="apf-agent", daemon=True)
        self._thread.start()
        log.info("apf agent-check endpoint on %s:%d", host, self.port)
        return True

    def _serve(self) -> None:
        sock = self._sock
        sock.settimeout(0.5)  # wake up to notice stop()
        while not self._stop.is_set():
            try:
                conn, _addr = sock.accept()
            except TimeoutError:
                continue
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                continue
            try:
                self._answer(conn)
            except Exception:
                log.debug("apf agent: answering failed", exc_info=True)
            finally:
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            data = self.reply()
        except Exception:
            log.exception("apf agent: computing the reply failed")
            data = DOWN
        try:
            conn.send(data)  # a few bytes into a fresh socket's buffer: never blocks
            self.served += 1
            try:  # read what the client sent (agent-send), so close() does not reset
                conn.recv(4096)
            except (BlockingIOError, InterruptedError):
                pass
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited listening socket (the master keeps its own)."""
        sock, self._sock = self._sock, None
        self._thread = None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        sock, self._sock = self._sock, None
        if self._thread is not None:
            self._thread.join(timeout=2)
        if sock is not None:
            sock.close()


def install_drain_on_term(arbiter: Any, agent: AgentState, delay_s: float,
                          timer: Callable[..., Any] = threading.Timer) -> None:
    """Make gunicorn's SIGTERM (graceful stop) drain first: the agent answers ``drain`` at once,
    the server keeps serving for ``delay_s`` seconds so the balancer moves new traffic away,
    then the master stops as usual (a second SIGTERM stops at once). SIGINT and SIGQUIT (quick
    stops) are not delayed.

    Args:
        arbiter: gunicorn's Arbiter (its ``handle_term`` is wrapped on this instance).
        agent: the :class:`AgentState` to switch to ``drain``.
        delay_s: seconds to keep serving; 0: only answer ``drain`` while stopping.
        timer: ``threading.Timer`` (tests pass their own): re-sends SIGTERM to the master.
    """
    original = arbiter.handle_term
    if getattr(original, "apf_drain", False):
        return

    def handle_term() -> None:
        if agent.stopping or delay_s <= 0:
            agent.stopping = True
            original()
            return
        agent.stopping = True
        arbiter.log.info("apf: graceful stop: agent-check answers drain; serving for %.1f s "
                         "more so the load balancer moves traffic away (APF_AGENT_DRAIN_DELAY)",
                         delay_s)
        resend = timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
        resend.daemon = True
        resend.start()

    handle_term.apf_drain = True  # type: ignore[attr-defined]
    arbiter.handle_term = handle_term
