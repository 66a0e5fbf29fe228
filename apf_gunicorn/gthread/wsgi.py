"""The WSGI front end: API Priority and Fairness in front of any WSGI app, on gthread's threads.

The admission rules live in :mod:`apf_gunicorn.admission.core` (this class subclasses its
:class:`~apf_gunicorn.admission.core.Admission`); what is WSGI's here: a queued request parks
its *thread* until the ledger grants the request, its wait limit runs out (429, ``time-out``),
its client leaves (``cancelled``: the dispatcher watches the socket), the worker stops (503) or
another flow's request takes its thread (429, ``thread-share``: gthread/threadshare.py); the
thread reserve for exempt requests; the answer through ``start_response``. The seats are given
back (``ledger.finish``) when the response body has been sent or closed, or when the app
raises; a watch or a long-running request holds them only until the app returns its iterable
(its initial phase). Lingering seats (final seats, additional latency) are released by the
dispatcher.

Work estimate, highest precedence first: the ``APF_WORK_ESTIMATOR`` hook (called per request,
``None`` or a failure falls through), a Flask or Django view's ``@cost`` (found through the
app's ``url_map`` or URLconf), a cost entry of ``APF_ROUTES``, ``WorkerContext.estimator`` (default: one seat);
clamped to the level's max seats. Everything but the hook is computed once per request shape
and kept in the shape cache with the classification, so a request without a cost takes the
same one-seat fast path as before.

Metrics cost nothing here: the ledger records every per-request event (dispatched, rejected,
wait, execution, estimated seats) under the lock ``admit``/``finish``/``cancel`` already hold,
and the master exports them at scrape time. 429s carry the level's server-wide Retry-After:
the worker's tracker is fed the ledger's cumulative rejected count of the level
(``RetryAfterTracker.observe_total``), so every worker answers the same back-off.

With ``APF_LOAD_REPORT=orca`` (``WorkerContext.load_report``) every response APF handled also
carries the worker's cached ORCA ``endpoint-load-metrics`` header, and a 429
``x-envoy-ratelimited`` (``admission/loadreport.py``).

Usage (``post_worker_init`` does this)::

    worker.wsgi = APFMiddleware(worker.wsgi, WorkerContext(...))

The plugin itself never answers 500: if anything in the APF path fails before the app runs,
the request is served without APF and the error is logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from gunicorn.http.wsgi import Response as _GunicornResponse

from apf_gunicorn.admission.core import (
    REJECTED_STATUS,
    RUN,
    STOPPED,
    STOPPING_BODY,
    STOPPING_STATUS,
    TOO_MANY,
    Admission,
    Route,
    WorkerContext,
    rejection_headers,
)
from apf_gunicorn.admission.dispatcher import STOPPING
from apf_gunicorn.gthread.threadshare import ThreadShare, reserve_full
from apf_gunicorn.ledger.records import EXECUTE, QUEUED

__all__ = ["APFMiddleware", "WorkerContext", "REJECTED_STATUS", "TOO_MANY", "rejection_headers",
           "hidden"]

log = logging.getLogger("apf_gunicorn.middleware")

# Set by the gthread subclass (gthread/worker.py) on the request thread: when gunicorn queued
# the connection for a thread. Lets the wait limit count the time spent in gthread's queue.
hidden = threading.local()


class APFMiddleware(Admission):
    """APF in front of a WSGI app, on gthread's request threads (:class:`Admission` decides)."""

    def __init__(self, app: Callable, ctx: WorkerContext):
        super().__init__(app, ctx)
        self._nonexempt_threads = ctx.nonexempt_threads
        # who holds the parked threads, by flow (only with a thread reserve: route.inflight)
        self._share = ThreadShare() if ctx.inflight is not None else None
        self._reject_if_full = getattr(ctx.ledger, "reject_if_full", None)
        # the C gate's one call from environ to admitted (None: the Python path every time)
        gate = self._gate(held=hidden)
        self._admit_environ = gate.admit_environ if gate is not None else None
        # ... and its response body (_Body in C: no Python frame to iterate, close or collect)
        self._body = gate.body if gate is not None else None

    # -- the request path ------------------------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        try:
            gate = self._admit_environ
            fast = gate(environ) if gate is not None else None
            if fast is not None:  # the C gate admitted it (cached shape, no hook, not a watch)
                outcome, slot, gen, granted, now, route, flow_hash, kind = fast
                early = False
            else:
                shape = self.shape_of(environ)
                # Shape's fields, unpacked at once (cheaper than eleven attribute reads)
                (level, flow_hash, initial, final, al, fs_index, detail, early, route, attrs, c,
                 kind) = shape
                if self._hook is not None:
                    dynamic = self.hook_estimate(environ, attrs, c, route)
                    if dynamic is not None:
                        initial, final, al, early = dynamic
                now = self._clock()
                inflight = route.inflight
                if inflight is not None:
                    # The thread reserve: append first, then check, so racing threads can only
                    # both turn away, never both take the last non-exempt thread.
                    inflight.append(None)
                    if (reserve_full(len(inflight) - 1, self._nonexempt_threads)
                            and not self._take_parked_thread(inflight, level, flow_hash)):
                        inflight.pop()
                        return self._turn_away(start_response, route, fs_index,
                                               initial if initial >= final else final, now)
                    hidden.held = True  # the worker pops the entry when the thread is done
                # positional: cheaper than keywords on the per-request path
                outcome, slot, gen, _reason, granted = self._admit(
                    level, flow_hash, initial, final, al, self._owner, now, fs_index, detail, early)
        except Exception:
            log.exception("apf: admission failed; serving the request without APF")
            self.stats["bypassed"] += 1
            return self.app(environ, start_response)

        if granted:
            self._deliver(granted)
        if outcome != EXECUTE:
            if outcome != QUEUED:
                return self._reject(start_response, route)
            answer = self._wait(environ, start_response, slot, gen, route, now, flow_hash)
            if answer is not None:
                return answer
            if kind >= 0:
                now = self._clock()  # dispatched: the route's service time starts here
        # Run the app (inline rather than a method: one Python frame less per request).
        headers = route.headers
        if self._orca is not None:  # APF_LOAD_REPORT=orca: the cached ORCA header
            headers = self._orca.extend(headers, now)
        self.stats["served"] += 1
        resp = getattr(start_response, "__self__", None)
        if not headers:  # APF_PF_HEADERS=off: nothing to add, no wrapper
            sr = start_response
        elif route.checked and type(resp) is _GunicornResponse:
            # gunicorn checks every header of every response with two regular expressions
            # (~3.5k instructions each for these two); ours are constant and passed those
            # checks once (Route.checked), so they join its list after the app's are checked.
            def sr(status, response_headers, exc_info=None):
                write = start_response(status, response_headers, exc_info)
                resp.headers.extend(headers)
                return write
        else:
            def sr(status, response_headers, exc_info=None):
                return start_response(status, [*response_headers, *headers], exc_info)

        try:
            result = self.app(environ, sr)
        except BaseException:
            self.finish(slot, gen)
            raise
        if early:
            # Kubernetes: a watch holds its seats only for its initialization; so does any
            # request declared long-running.
            self.finish(slot, gen)
            return result
        if type(result) is not list:  # (a list is never a file wrapper: skip the lookup)
            file_wrapper = environ.get("wsgi.file_wrapper")
            if file_wrapper is not None and isinstance(result, file_wrapper):
                hooked = self._finish_on_close(result, slot, gen)
                if hooked is not None:
                    return hooked
        wrap = self._body
        if wrap is not None:
            return wrap(result, slot, gen, kind, now)
        body = _new_body(_Body)
        body._result = result
        body._mw = self
        body._slot = slot
        body._gen = gen
        body._kind = kind
        body._t0 = now
        return body

    # -- rejecting from the worker's poller (gthread/pollreject.py) -------------------------

    @property
    def poller_classifies(self) -> bool:
        """Whether a request can be classified and rejected from its head alone: the built-in
        resolver (a custom ``APF_REQUEST_INFO`` hook may read anything in the environ), no
        ``APF_WORK_ESTIMATOR`` hook (it is called with the full environ), no ORCA load report
        (its header is per response), and a ledger that can reject without admitting."""
        return (self._cache is not None and self._hook is None and self._orca is None
                and self._reject_if_full is not None)

    def thread_share_rejects(self, route: Route, level: int, flow_hash: int) -> bool:
        """Whether the worker's thread reserve turns this request away now (reason
        ``thread-reserve``): no thread for a non-exempt request is free, and no other flow
        holds parked threads this request could take (:func:`threadshare.choose_victim`). The
        one place the poller asks; what the middleware decides on a thread (``__call__``)
        agrees, but for a victim dispatched meanwhile (then the thread path turns it away).

        Args:
            route: the request's FlowSchema route; level, flow_hash: its flow.
        Returns:
            True when the request would be answered 429 for want of a thread.
        """
        inflight = route.inflight
        if inflight is None or not reserve_full(len(inflight), self._nonexempt_threads):
            return False
        return self._share is None or not self._share.has_victim_for((level, flow_hash))

    def reject_early(self, environ: dict, now: int) -> tuple[Route, int, int, str] | None:
        """Reject the request now if the middleware would certainly reject it on a thread: the
        thread reserve applies (:meth:`thread_share_rejects`), or the ledger's ``admit`` would
        reject it (queue full, a Reject-type level full, no slot: ``reject_if_full``, exact
        under the ledger's lock). Counted exactly as the middleware counts a rejection.

        Args:
            environ: what the resolver reads of the request (``pollreject.HeadReader``).
            now: monotonic ns.
        Returns:
            ``(route, retry_after_s, flow_hash, reason)`` when rejected (answer
            :func:`rejection_headers`; ``reason`` is the one it was counted with), None when
            the request must go to a thread as usual (nothing was counted).
        Raises:
            Exception: whatever classification or the ledger raise (the caller then hands
            the request to a thread, which decides as usual).
        """
        level, flow_hash, initial, final, al, fs_index, detail, early, route, _, _, _ = (
            self.shape_of(environ))
        if route.exempt:
            return None
        if self.thread_share_rejects(route, level, flow_hash):
            self.stats["turned_away"] += 1
            reason = "thread-reserve"
            self.ctx.ledger.turn_away(level, fs_index, initial if initial >= final else final,
                                      reason, now)
        else:
            reason = self._reject_if_full(level, flow_hash, initial, final, al, self._owner,
                                          now, fs_index, detail, early)
            if not reason:
                return None
        self.stats["rejected"] += 1
        return route, self.retry_after(route), flow_hash, reason

    def _wait(self, environ, start_response, slot, gen, route, admitted_ns, flow_hash):
        """Park until granted (returns None: run the request) or answer 429/503."""
        ctx = self.ctx
        self.stats["queued"] += 1
        arrival = getattr(hidden, "enqueued_ns", 0) or admitted_ns
        if arrival > admitted_ns:
            arrival = admitted_ns
        deadline = self.wait_deadline(environ.get("QUERY_STRING", ""), arrival)
        fd = -1
        if environ.get("HTTP_VERSION") != "2":
            sock = environ.get("gunicorn.socket")
            if sock is not None:
                try:
                    fd = sock.fileno()
                except OSError:
                    fd = -1
        parking = ctx.parking
        w = parking.park(slot, gen, fd)
        # (only a request holding a thread of the reserve's count can give it up)
        parked = (self._share.park((route.level, flow_hash), slot, gen, w)
                  if route.inflight is not None else None)
        if not ctx.alive():
            parking._wake(w, STOPPING)
        # runs only once the ledger says it was dispatched, whatever woke it
        outcome = parking.wait(w, deadline, self._clock, ctx.ledger.dispatched)
        if parked is not None and self._share.leave(parked):
            # Another flow's request took this thread: the ledger removed and counted this
            # one (thread-share), and its entry in the thread reserve went to that request.
            hidden.held = False
            self.stats["thread_share"] += 1
            return self._reject(start_response, route)
        verdict = self.after_wait(outcome, slot, gen)
        if verdict == RUN:
            return None
        if verdict == STOPPED:
            start_response(STOPPING_STATUS, self.stopping_headers(route))
            return [STOPPING_BODY]
        return self._reject(start_response, route)

    def _take_parked_thread(self, inflight: list, level: int, flow_hash: int) -> bool:
        """For a request that found no non-exempt thread: take the thread of the newest
        parked request of the flow holding the most parked threads, if that flow holds more
        than the request's own (gthread/threadshare.py). That request is removed from the
        ledger (``thread-share``) and woken to answer 429; its entry in ``inflight`` is given
        up here, the arrival's stays.

        Returns:
            True when a thread was taken; False: turn the arrival away.
        """
        ledger, clock = self.ctx.ledger, self._clock
        try:
            victim = self._share.evict((level, flow_hash),
                                 lambda slot, gen: ledger.cancel(slot, gen, clock(),
                                                                 "thread-share"))
        except Exception:
            log.exception("apf: taking a parked thread failed")
            return False
        if victim is None:
            return False
        inflight.pop()  # the victim's: its thread answers 429 and no longer counts
        self.ctx.parking.evict(victim.waiter)
        return True

    def _turn_away(self, start_response, route, fs_index: int, seats: int, now: int):
        """429 (``thread-reserve``) for a non-exempt request that would take one of the threads
        kept for exempt requests; counted in the ledger like a rejection at admit."""
        self.stats["turned_away"] += 1
        try:
            self.ctx.ledger.turn_away(route.level, fs_index, seats, "thread-reserve", now)
        except Exception:
            log.exception("apf: counting a thread-reserve rejection failed")
        return self._reject(start_response, route)

    def _reject(self, start_response, route):
        """429 with the level's server-wide Retry-After."""
        start_response(REJECTED_STATUS, self.reject_headers(route))
        return [TOO_MANY]

    def _finish_on_close(self, result, slot: int, gen: int):
        """A ``wsgi.file_wrapper`` response keeps sendfile: hook its close instead of wrapping
        it. None when it cannot be hooked (then it is wrapped like any iterable)."""
        orig_close = getattr(result, "close", None)

        def close():
            try:
                if orig_close is not None:
                    orig_close()
            finally:
                self.finish(slot, gen)

        try:
            result.close = close
        except AttributeError:
            return None
        return result

class _Body:
    """Wraps the app's response iterable; gives the seats back on close (exactly once). (With
    the C request gate, its ``Body`` in ``ledger/_fastpath.c`` does the same.)

    Built without ``__init__`` (``_new_body`` plus attribute stores: one Python call less
    per request); ``_mw`` is set to None once the seats are given back."""

    __slots__ = ("_result", "_mw", "_slot", "_gen", "_kind", "_t0")

    def __iter__(self):
        return iter(self._result)

    def close(self):
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            mw = self._mw
            if mw is not None:
                self._mw = None
                mw.finish_timed(self._slot, self._gen, self._kind, self._t0)

    def __del__(self):
        # A server that never calls close() must not leak seats. A finalizer may run on any
        # thread, one inside a ledger call included (the lock is not reentrant): hand the
        # finish to the dispatcher thread, never take the ledger lock here.
        mw = self._mw
        if mw is not None:
            self._mw = None
            finish_later = mw.ctx.finish_later
            if finish_later is not None:
                finish_later(self._slot, self._gen)


_new_body = object.__new__

