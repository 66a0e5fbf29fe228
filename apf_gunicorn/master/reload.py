"""Applying a new configuration to the running master: on HUP and when ``APF_CONFIG``'s files
change, by one path.

:func:`reload_configuration` reads ``APF_CONFIG``, loads it outside the master's service lock,
then under :data:`~apf_gunicorn.master.master.SERVICE_LOCK` reconfigures the ledger in place
(new levels added, removed ones drain, queue counts change by attrition) and makes it the
generation the workers forked from then on inherit. An invalid configuration is refused, every
error logged, and the running one stays. ``hooks.on_reload`` calls it on HUP (gunicorn then
replaces the workers, as it does on every HUP).

:class:`ConfigWatcher` (``APF_CONFIG_WATCH``, on by default) polls the files twice a second
(``server/configwatch.py``: a ConfigMap's ``..data`` swap included) and applies a change the
same way, keeping the workers: the ledger they share carries the levels, shares and queues.
Only a change to what a worker classifies with (its FlowSchemas, or how the levels they name
are reached: ``generation.worker_change_lines``) needs new workers: the watcher then queues a
HUP on gunicorn's arbiter (its signal queue, read by its main loop; no signal is sent), and that
HUP replaces the workers without applying the configuration a second time.

Usage::

    reload_configuration(server, state.MASTER, "hup", os.environ.get("APF_CONFIG"))
    watcher = ConfigWatcher(state.MASTER, arbiter, server.log)
    watcher.start()
    ...
    watcher.stop()
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from typing import Any

from apf_gunicorn.flowcontrol.loader import read_config_files
from apf_gunicorn.master.master import SERVICE_LOCK
from apf_gunicorn.server.configwatch import POLL_S, ChangeDetector, watchable
from apf_gunicorn.server.generation import (
    config_change_lines,
    config_change_summary,
    config_digest,
    config_error_lines,
    configure_ledger,
    derive_limits,
    level_seats,
    load_generation,
    seat_change_lines,
    short_digest,
    thread_budget,
    worker_change_lines,
)
from apf_gunicorn.server.resolver import apply_path_parsing, path_parsing_note
from apf_gunicorn.server.state import Generation, MasterState

#: what triggered a reload (the ``trigger`` label of ``config_reloads_total``)
HUP = "hup"
FILE = "file"
APPLIED = "applied"
REFUSED = "refused"

# One reload at a time: a HUP (main thread) and a file change (the watcher) may come together;
# each takes the next generation number and compares against the one the other applied.
RELOAD_LOCK = threading.Lock()


def budget_warning(server: Any, gen: Generation, settings: Any, holds_threads: bool) -> str | None:
    """The thread-budget warning for ``gen`` (gthread only: an event loop's waiting requests
    hold no thread); ``server``: gunicorn's arbiter, for ``--workers`` and ``--threads``."""
    if not holds_threads:
        return None
    return thread_budget(gen, settings, server.cfg.workers, server.cfg.threads)


def _count(m: MasterState, result: str, trigger: str) -> None:
    m.reloads[(result, trigger)] = m.reloads.get((result, trigger), 0) + 1


def reload_configuration(server: Any, m: MasterState, trigger: str, config_path: str | None,
                         contents: list[tuple[str, bytes]] | None = None) -> Generation | None:
    """Load ``config_path`` and apply it to the running master, or refuse it.

    Args:
        server: gunicorn's arbiter (its ``log``; ``cfg`` for the thread-budget warning).
        m: the master's state.
        trigger: :data:`HUP` or :data:`FILE`, for the log and the counters.
        config_path: ``APF_CONFIG`` (None: the built-in configuration).
        contents: the files as ``read_config_files`` read them; read here when None.
    Returns:
        The generation applied, or None when it was refused (every error logged at error,
        ``m.reload_errors`` counted).
    """
    with RELOAD_LOCK:
        return _reload_locked(server, m, trigger, config_path, contents)


def _reload_locked(server, m, trigger, config_path, contents):
    glog = server.log
    try:
        settings = dataclasses.replace(m.settings, config_path=config_path)
        if contents is None:
            contents = read_config_files(settings.config_source)
        # Read from disk outside the service lock; the adaptive tick (APF_CONCURRENCY_LIMIT=auto)
        # may move the server limit meanwhile, so the limit is taken again under the lock.
        gen = load_generation(settings, 0, contents)
        with SERVICE_LOCK:
            settings = dataclasses.replace(m.settings, config_path=config_path)
            derive_limits(gen, settings.concurrency_limit)
            old = m.generation
            gen.number = old.number + 1
            changes = config_change_lines(old.configuration, gen.configuration)
            summary = config_change_summary(old.configuration, gen.configuration)
            seats_before = level_seats(m.ledger, old)
            configure_ledger(m.ledger, gen, time.monotonic_ns())
            m.generation = gen
            m.settings = settings
            # the workers forked from now on inherit it (APF_PATHS=auto follows the schemas)
            apply_path_parsing(m.resolver, settings, gen.configuration)
    except Exception as e:  # the loader's ConfigErrors, an unreadable file, a full ledger
        m.reload_errors += 1
        _count(m, REFUSED, trigger)
        lines = config_error_lines(e)
        glog.error("apf: reload rejected (%s), the running configuration (generation %d, %s) "
                   "stays in force (%d error(s)):", _cause(trigger, config_path),
                   m.generation.number, short_digest(m.generation.digest), len(lines))
        for line in lines:
            glog.error("apf:   %s", line)
        return None
    _count(m, APPLIED, trigger)
    glog.info("apf: configuration generation %d applied (%s, %s): %s; /api/ and /apis/ "
              "paths are %s", gen.number, _cause(trigger, config_path),
              short_digest(gen.digest), summary, path_parsing_note(settings, gen.configuration))
    for line in changes + seat_change_lines(seats_before, level_seats(m.ledger, gen)):
        glog.info("apf:   %s", line)
    warning = budget_warning(server, gen, settings, m.holds_threads)
    if warning:
        glog.warning("apf: %s", warning)
    m.restart_digest = ""
    return gen


def _cause(trigger: str, config_path: str | None) -> str:
    return "HUP" if trigger == HUP else f"{config_path} changed"


def on_hup(server: Any, m: MasterState, config_path: str | None) -> None:
    """The HUP path (``hooks.on_reload``): apply ``APF_CONFIG`` as it is now; but a HUP the
    watcher queued to replace the workers after it applied these very files applies nothing
    again (gunicorn replaces the workers after this returns)."""
    if m.restart_digest and config_path == m.settings.config_path:
        try:
            contents = read_config_files(m.settings.config_source)
        except (OSError, ValueError):
            contents = None
        digest = contents and config_digest(m.settings.config_source, contents)
        if digest == m.restart_digest == m.generation.digest:
            m.restart_digest = ""
            server.log.info("apf: new workers take configuration generation %d (%s)",
                            m.generation.number, short_digest(digest))
            return
        reload_configuration(server, m, HUP, config_path, contents)
        return
    reload_configuration(server, m, HUP, config_path)


class ConfigWatcher(threading.Thread):
    """The master's thread applying ``APF_CONFIG`` when its files change (module docstring).

    Args:
        master: the master's state (its settings name the source; its generation the
            digest running).
        arbiter: gunicorn's arbiter: its log, its config, and its signal queue for the HUP
            that replaces the workers when they must see the change.
        poll_s: seconds between polls.
    """

    def __init__(self, master: MasterState, arbiter: Any, poll_s: float = POLL_S) -> None:
        super().__init__(name="apf-config-watch", daemon=True)
        self.master = master
        self.arbiter = arbiter
        self.poll_s = poll_s
        self.detector: ChangeDetector | None = None
        self.refused = ""  # the digest last refused: not logged again until the files change
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            try:
                self.check_once()
            except Exception:
                self.arbiter.log.exception("apf: watching APF_CONFIG failed")

    def check_once(self) -> Generation | None:
        """One poll; the generation applied, if it applied one."""
        m = self.master
        source = m.settings.config_path  # a HUP may bring another APF_CONFIG (gunicorn's env)
        if not watchable(source):
            self.detector = None
            return None
        if self.detector is None or self.detector.source != source:
            self.detector = ChangeDetector(source)
        if not self.detector.poll():
            return None
        try:
            contents = read_config_files(source)
            digest = config_digest(source, contents)
        except (OSError, ValueError) as e:
            contents, digest = None, f"unreadable: {e}"
        if digest in (m.generation.digest, self.refused):
            return None  # touched, swapped to the same bytes, or the same broken files
        old = m.generation.configuration
        gen = reload_configuration(self.arbiter, m, FILE, source, contents)
        if gen is None:
            self.refused = digest
            return None
        self.refused = ""
        reasons = worker_change_lines(old, gen.configuration)
        if reasons:
            # the workers classify with what they were forked with: new ones must take it
            m.restart_digest = gen.digest
            self.arbiter.log.info("apf: replacing the workers (a HUP) so that they classify "
                                  "by generation %d: %s", gen.number, "; ".join(reasons))
            self.arbiter.signal(signal.SIGHUP, None)
        return gen

    def stop(self) -> None:
        self._stopping.set()
