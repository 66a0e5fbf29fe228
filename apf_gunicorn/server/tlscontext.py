"""The TLS context the gthread workers serve with, made in the master and kept while it is good.

A worker that made its own context when it started (``init_process``) and failed to (a key
file that does not match its certificate, in the middle of a certificate rotation that
replaces them one at a time) exited with gunicorn's boot error, and gunicorn then halts the
whole server, for a worker that was only being replaced (``max_requests``, a timeout, an OOM
kill, a ``HUP``). So the master makes the context: at start, where a failure stops the start
with a clear error, and again on each reload (``HUP``: gunicorn's reload makes a new config
object, which the master sees at its next fork, ``pre_fork``), where a failure is logged and
the context in use stays in force. A forked worker inherits the master's context; it makes
none of its own and never fails its boot over the files. A renewed certificate is used from
the next ``HUP``; killed or restarted workers keep the context of the start or of the last
good reload. Usage (master: ``master/hooks.py``; worker: ``gthread/worker.py``)::

    tlscontext.make_at_start(server.cfg)        # raises TlsContextError with the message
    tlscontext.refresh(server.cfg, server.log)  # each fork: made again after a reload
    tlscontext.current()                        # the SSLContext, or None (never made)
"""

from __future__ import annotations

import ssl
import time
from typing import Any

from gunicorn import sock as gsock


class TlsContextError(Exception):
    """The TLS context cannot be made from the configured files (the message names them)."""


class _Made:
    """The master's TLS context and the config it was last tried with (module state: it
    survives the config's re-execution on ``HUP``, and forks with the master)."""

    context: ssl.SSLContext | None = None
    tried: Any = None  # the gunicorn config last made from (or failed with)
    made_at: str = ""  # when the context in use was made (UTC, for the log)


def make(cfg: Any) -> ssl.SSLContext:
    """A TLS context from ``cfg`` by gunicorn's own ``ssl_context`` (its ``ssl_context`` hook,
    ``certfile``, ``keyfile``, ``ca_certs``, ``cert_reqs``, ``ciphers``, ALPN).

    Raises:
        TlsContextError: it cannot be made; the message names the files and the cause.
    """
    try:
        return gsock.ssl_context(cfg)
    except Exception as e:
        raise TlsContextError(f"cannot make the TLS context from certfile {cfg.certfile}, "
                              f"keyfile {cfg.keyfile} (gunicorn's ssl_context): {e}") from e


def make_at_start(cfg: Any) -> None:
    """Make the context the workers will serve with (the master, at start; nothing without
    ``certfile``).

    Raises:
        TlsContextError: it cannot be made (the server must not start).
    """
    _Made.tried = cfg
    if not cfg.is_ssl:
        _Made.context = None
        return
    _Made.context = make(cfg)
    _Made.made_at = _utc_now()


def refresh(cfg: Any, log: Any) -> None:
    """Make the context again if ``cfg`` is not the config it was made from (the master
    reloaded); when that fails, log the error and keep the context in use. Cheap otherwise
    (one identity test): called before each fork."""
    if cfg is _Made.tried:
        return
    _Made.tried = cfg
    if not cfg.is_ssl:
        _Made.context = None
        return
    try:
        context = make(cfg)
    except TlsContextError as e:
        if _Made.context is None:
            log.error("apf: %s; workers started now cannot serve TLS until the files are "
                      "fixed and the server reloaded (HUP)", e)
            return
        log.error("apf: %s; the workers keep serving with the TLS context made at %s: fix "
                  "the files and reload (HUP) again", e, _Made.made_at)
        return
    _Made.context = context
    _Made.made_at = _utc_now()


def current() -> ssl.SSLContext | None:
    """The master's context (in a worker: the one it inherited), or None when none was made
    (no ``certfile``, or the master's hooks were not installed)."""
    return _Made.context


def _utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
