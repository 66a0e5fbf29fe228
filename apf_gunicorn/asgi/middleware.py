"""The ASGI front end: API Priority and Fairness in front of any ASGI app, as pure ASGI middleware.

The admission rules live in :mod:`apf_gunicorn.admission.core` (this class subclasses its
:class:`~apf_gunicorn.admission.core.Admission`); what is ASGI's here:

* **Waiting costs no thread, and the loop never blocks.** A queued request awaits a future of
  the worker's event loop (``admission/asyncparking.py``); the grant wakes it through the loop.
  Ledger calls on the loop are the same microsecond critical sections as on a thread, but the
  loop never waits for the ledger lock: when another process holds it past a short spin, the
  call raises ``LockBusy`` having done nothing (``Ledger.never_wait_on``, set for the loop's
  thread by the worker), and runs again on a small thread pool (admit, cancel: awaited; if
  the awaiting task is cancelled meanwhile, the pool undoes what the call did) or the
  dispatcher thread (finish). Every request is counted, exempt ones too: a lock held for
  microseconds (the usual case, a scrape's snapshot included) delays nobody noticeably. Admission happens before the app runs, so a FastAPI sync
  endpoint never waits in AnyIO's thread pool behind ours.
* **A client that leaves while queued frees its place at once.** ASGI tells an app of a
  disconnect only through ``receive()``: while a request waits, a task reads ``receive()``
  and keeps what it read (the request body, up to 64 KiB) to replay to the app; an
  ``http.disconnect`` cancels the wait (``cancelled``). Past 64 KiB of body it stops reading
  (a disconnect is then noticed by the app, or the wait limit ends the wait). When the wait
  ends, its read in flight is handed to the app, never cancelled (:class:`_Watcher`).
* **Seats are held until the response has been sent**: the app's coroutine returns after its
  last ``send``, so a streamed response holds them to its end. A watch or a request declared
  long-running (``@cost(long_running=True)``, ``?watch=``) holds them only until its response
  starts, as Kubernetes does; a WebSocket connection is classified at its handshake and holds
  one seat only until it is accepted or refused (not the cost of an HTTP route on its path).
  An exception in the app gives them back.
* **Answers** are ASGI messages: 429 (with the level's server-wide Retry-After and the PF
  UID headers), 503 while the worker stops; a refused WebSocket handshake gets the 429 through
  the ``websocket.http.response`` extension when the server has it, else ``websocket.close``
  with code 1013 (try again later), which servers answer 403.
* ``lifespan`` (and any other scope type) passes through untouched.

Usage (the ASGI workers' ``apf_attach`` does this)::

    worker.asgi = ASGIMiddleware(worker.asgi, WorkerContext(..., parking=AsyncParking()))
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from apf_gunicorn.admission.core import (
    RUN,
    STOPPED,
    STOPPING_BODY,
    TOO_MANY,
    Admission,
    Route,
    WorkerContext,
    raw_headers,
    rejection_headers,
)
from apf_gunicorn.admission.dispatcher import CANCELLED
from apf_gunicorn.asgi.scope import ScopeEnviron
from apf_gunicorn.ledger.lock import LockBusy
from apf_gunicorn.ledger.records import EXECUTE, QUEUED

log = logging.getLogger("apf_gunicorn.middleware")

WATCH_BODY_LIMIT = 64 * 1024  # request body a queued request's watcher reads and keeps
_DISCONNECTS = ("http.disconnect", "websocket.disconnect")
# the messages after which a WebSocket connection's seats go back
_WS_SETTLED = ("websocket.accept", "websocket.close", "websocket.http.response.start")


class ASGIMiddleware(Admission):
    """APF in front of an ASGI app (:class:`Admission` decides; see the module docstring).

    Args:
        app: the ASGI application.
        ctx: the worker's context; ``ctx.parking`` is an
            :class:`~apf_gunicorn.admission.asyncparking.AsyncParking`.
    """

    def __init__(self, app: Any, ctx: WorkerContext):
        super().__init__(app, ctx)
        resolver = ctx.resolver
        from apf_gunicorn.starlette import app_root_path

        # the bound method: calling it skips the instance's __call__ lookup, once a request
        to_environ = ScopeEnviron(getattr(resolver, "environ_keys", None)
                                  if self._cache is not None else None, app_root_path(app))
        self._to_environ = to_environ.__call__
        # the C gate's one call from an http scope to admitted (None: the Python path)
        gate = None
        if self._cache is not None:
            where = to_environ.key_sources(resolver.environ_keys)
            if where is not None:
                gate = self._gate(sources=where[0], headers=where[1], busy_declines=True)
        self._admit_scope = gate.admit_scope if gate is not None else None
        self._parking = ctx.parking
        self._dispatched = ctx.ledger.dispatched
        # a 429's headers as ASGI bytes, per (route, Retry-After): the same few, built once
        # (not with APF_LOAD_REPORT=orca, whose header changes)
        self._rejections: dict[tuple[Route, int], list[tuple[bytes, bytes]]] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        typ = scope["type"]
        if typ != "http" and typ != "websocket":
            return await self.app(scope, receive, send)
        try:
            gate = self._admit_scope
            # the C gate: a cached shape, no hook, not a watch, the lock free (else None)
            fast = gate(scope) if gate is not None and typ == "http" else None
            if fast is not None:
                outcome, slot, gen, granted, now, route, _flow_hash, kind = fast
                early = False
            else:
                environ = self._to_environ(scope)
                (level, flow_hash, initial, final, al, fs_index, detail, early, route, attrs, c,
                 kind) = self.shape_of(environ)
                if self._hook is not None:
                    dynamic = self.hook_estimate(environ, attrs, c, route)
                    if dynamic is not None:
                        initial, final, al, early = dynamic
                if typ == "websocket":  # one seat for the handshake, whatever the HTTP cost
                    initial, final, al = 1, 0, 0
                now = self._clock()
                try:
                    outcome, slot, gen, _reason, granted = self._admit(
                        level, flow_hash, initial, final, al, self._owner, now, fs_index,
                        detail, early)
                except LockBusy:  # another process holds the ledger lock: wait on a thread
                    outcome, slot, gen, _reason, granted = await _off_loop(
                        self._admit, level, flow_hash, initial, final, al, self._owner, now,
                        fs_index, detail, early, undo=self._undo_admit)
        except Exception:
            log.exception("apf: admission failed; serving the request without APF")
            self.stats["bypassed"] += 1
            return await self.app(scope, receive, send)

        if granted:
            self._deliver(granted)
        watcher = None  # a queued request's receive() watcher, handed to the app
        if outcome != EXECUTE:
            if outcome != QUEUED:
                return await self._answer(scope, send, route, 429)
            verdict, watcher = await self._wait(scope, receive, slot, gen, now)
            if verdict != RUN:
                return await self._answer(scope, send, route, 503 if verdict == STOPPED else 429)
            if watcher is not None:
                receive = watcher.receive
            if kind >= 0:
                now = self._clock()  # dispatched: the route's service time starts here
        self.stats["served"] += 1
        extra = route.raw_headers
        if self._orca is not None:  # APF_LOAD_REPORT=orca: the cached ORCA header
            extra = [*extra, *raw_headers(self._orca.extend([], now))]
        if not early and typ == "http":
            # The common case: the seats go back when the app returns. The wrapper is a plain
            # function returning the server's own awaitable (no coroutine of ours per message:
            # the PF headers are added to the start message, nothing runs after a send).
            if extra:
                def send_plain(message: dict) -> Any:
                    if message["type"] == "http.response.start":
                        message = {**message, "headers": [*message.get("headers", ()), *extra]}
                    return send(message)
            else:  # nothing to add (APF_PF_HEADERS=off): the server's own send
                send_plain = send

            try:
                await self.app(scope, receive, send_plain)
            finally:
                self.finish_timed(slot, gen, kind, now)
                if watcher is not None:
                    watcher.close()
            return

        # A watch, a long-running request or a WebSocket connection: its seats go back once
        # its response has started (or its handshake is settled), else when the app returns.
        held = [slot, gen]  # emptied once the seats are given back

        async def send_(message: dict) -> None:
            mtype = message["type"]
            if mtype == "http.response.start" and extra:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)
            if held and (mtype == "http.response.start" or mtype in _WS_SETTLED):
                held.clear()
                self.finish(slot, gen)

        try:
            await self.app(scope, receive, send_)
        finally:
            if held:
                held.clear()
                self.finish(slot, gen)
            if watcher is not None:
                watcher.close()

    async def _wait(self, scope: dict, receive: Any, slot: int, gen: int, arrival: int):
        """Await the grant, watching ``receive()`` for the client leaving.

        Returns:
            ``(verdict, watcher)``: :meth:`Admission.after_wait`'s verdict, and the
            :class:`_Watcher` whose ``receive`` the app must use (it replays what was read and
            hands over the read in flight; its ``close`` ends it once the app has
            returned), or None when nothing was read and nothing is in flight.
        """
        self.stats["queued"] += 1
        deadline = self.wait_deadline(scope.get("query_string", b"").decode("latin-1"), arrival)
        parking = self._parking
        w = parking.park(slot, gen)
        if not self.ctx.alive():
            parking.stop(w)
        watcher = _Watcher(receive, parking, w)
        try:
            try:
                outcome = await parking.wait(w, deadline, self._clock, self._dispatched)
            except asyncio.CancelledError:
                # The request's task was cancelled (the server is closing the connection): it
                # leaves the ledger, or gives back the seats a grant gave it meanwhile.
                try:
                    self.after_wait(CANCELLED, slot, gen)
                except LockBusy:
                    _in_pool(self.after_wait, CANCELLED, slot, gen)
                raise
            watcher.waiting = False  # a read in flight is the app's now: it is never cancelled
            try:
                verdict = self.after_wait(outcome, slot, gen)
            except LockBusy:
                verdict = await _off_loop(self.after_wait, outcome, slot, gen,
                                          undo=self._undo_after_wait)
        except BaseException:
            watcher.close()
            raise
        if verdict != RUN:
            watcher.close()  # no app will read: the read in flight is nobody's
            return verdict, None
        return verdict, watcher.handed_over()

    def _undo_after_wait(self, verdict: int, _outcome: int, slot: int, gen: int) -> None:
        """``after_wait`` ran on the pool for a task cancelled meanwhile: nobody will run the
        request, so seats it was left holding (RUN) go back."""
        if verdict == RUN:
            self.finish(slot, gen)

    def _undo_admit(self, result: Any, *_args: Any) -> None:
        """``admit`` ran on the pool for a task cancelled meanwhile: the request it admitted
        or queued leaves the ledger (and the requests it dispatched are woken)."""
        outcome, slot, gen, _reason, granted = result
        if granted:
            self._deliver(granted)
        if outcome == EXECUTE:
            self.finish(slot, gen)
        elif outcome == QUEUED:
            self.after_wait(CANCELLED, slot, gen)

    async def _answer(self, scope: dict, send: Any, route: Route, status: int) -> None:
        """Answer 429 (counted, with Retry-After) or 503 (the worker is stopping)."""
        if status == 429:
            body = TOO_MANY
            if self._orca is None:
                retry = self.count_rejection(route)
                raw = self._rejections.get((route, retry))
                if raw is None:
                    if len(self._rejections) >= 1024:
                        self._rejections.clear()
                    raw = self._rejections[route, retry] = raw_headers(
                        rejection_headers(route, retry))
            else:
                raw = raw_headers(self.reject_headers(route))
        else:
            body = STOPPING_BODY
            raw = raw_headers(self.stopping_headers(route))
        if scope["type"] == "websocket":
            if "websocket.http.response" in (scope.get("extensions") or {}):
                await send({"type": "websocket.http.response.start", "status": status,
                            "headers": raw})
                await send({"type": "websocket.http.response.body", "body": body})
            else:
                await send({"type": "websocket.close", "code": 1013})
            return
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """The worker's threads for ledger calls the loop must not wait for (made on first use,
    after the fork)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="apf-ledger")
    return _POOL


async def _off_loop(fn: Any, *args: Any, undo: Any) -> Any:
    """``fn(*args)`` on a thread of :func:`_pool`, awaited: a ledger call whose lock another
    process holds (``LockBusy``: nothing was done), run again where waiting is harmless.

    If the awaiting task is cancelled meanwhile (gunicorn cancels a request's task a while
    after its client left, as long as the lock is held) the thread still does it:
    ``undo(result, *args)`` then runs on the pool once it has, so nothing it took is left
    held by nobody (a call the pool had not started yet is dropped instead).
    """
    future = _pool().submit(fn, *args)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda f: _undo_done(f, undo, args))
        raise


def _undo_done(future: Any, undo: Any, args: tuple) -> None:
    # runs where the future completed (the pool thread), or on the loop when it already had:
    # either way the undo goes to the pool, which may wait for the lock
    if not future.cancelled() and future.exception() is None:
        _in_pool(undo, future.result(), *args)


def _in_pool(fn: Any, *args: Any) -> None:
    """``fn(*args)`` on the pool, nobody awaiting it (a ledger call the loop gave up on)."""
    def call() -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - nobody awaits it: say so here
            log.exception("apf: ledger call on the pool failed")

    try:
        _pool().submit(call)
    except RuntimeError:  # the pool is shut down: the worker is exiting (its reap frees)
        pass


class _Watcher:
    """A queued request's ``receive()`` while it waits, then the app's.

    While ``waiting``, a task reads ``receive()`` and keeps what it read (the request body,
    up to :data:`WATCH_BODY_LIMIT`); an ``http.disconnect`` cancels the wait. Once the wait
    ends it starts no new read, and the read in flight is never cancelled while the app may
    still read: a cancelled read is not harmless (gunicorn's body receiver then says the
    client left; its ``asyncio.wait_for`` may swallow the cancel and keep a body chunk).
    :meth:`receive` replays what was read, then awaits the watcher's read in flight, then
    asks the server.
    """

    __slots__ = ("_receive", "_read", "_task", "waiting")

    def __init__(self, receive: Any, parking: Any, w: Any):
        self._receive = receive
        self._read: deque = deque()
        self.waiting = True
        self._task = asyncio.ensure_future(self._read_while_waiting(parking, w))

    async def _read_while_waiting(self, parking: Any, w: Any) -> None:
        read, receive = self._read, self._receive
        size = 0
        while self.waiting:
            try:
                message = await receive()
            except Exception:  # noqa: BLE001 - the app's own receive() will meet it again
                return
            read.append(message)
            if message.get("type") in _DISCONNECTS:
                if self.waiting:
                    parking.cancel(w)
                return
            size += len(message.get("body") or b"")
            if size > WATCH_BODY_LIMIT:
                return

    def handed_over(self) -> _Watcher | None:
        """This watcher for the app, or None when it has nothing to hand over."""
        if self._read or not self._task.done():
            return self
        return None

    async def receive(self) -> dict:
        """The app's ``receive``."""
        if self._read:
            return self._read.popleft()
        task = self._task
        if not task.done():
            # a cancelled receive() (the app's, e.g. Starlette's is_disconnected) must not
            # cancel the read in flight: the next call awaits it again
            await asyncio.shield(task)
            if self._read:
                return self._read.popleft()
        return await self._receive()

    def close(self) -> None:
        """Stop watching: the wait ended without the app, or the app has returned."""
        self.waiting = False
        if not self._task.done():
            self._task.cancel()
