"""What the gunicorn hooks share, in module globals that survive a HUP.

The path form of the config file (``-c apf_gunicorn/conf.py``) re-executes conf.py on every
HUP, so no state may live there. It lives here instead: ``MASTER`` in the master (and, as an
inherited copy, in each forked worker until the worker builds its own ``WORKER``).

Usage::

    from apf_gunicorn.server import state
    state.MASTER.ledger.snapshot(now)
    state.WORKER.index
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apf_gunicorn.ledger.records import LedgerPort


@dataclass
class Generation:
    """One loaded configuration and what is derived from it (replaced whole on reload)."""

    configuration: Any
    limits: dict  # level name -> LevelLimits
    classifier: Any
    level_index: dict[str, int]
    fs_index: dict[str, int]
    number: int = 1
    # APF_FAIRNESS: the fairness of levels without an apf-gunicorn.io/fairness annotation
    fairness: str = "kubernetes"
    # "sha256:<hex>" of the bytes it was read from (generation.config_digest)
    digest: str = ""


@dataclass
class MasterState:
    settings: Any
    token: str  # names the ledger segment and the workers' grant sockets
    segment: Any  # server.shm.Segment
    ledger: LedgerPort
    capacity: Any
    resolver: Any
    generation: Generation
    sender: Any = None  # channel.GrantSender
    workers: dict[int, int] = field(default_factory=dict)  # worker index -> pid (0: booting)
    booting: dict[int, float] = field(default_factory=dict)  # worker index -> forked (monotonic)
    # worker index -> gunicorn's Worker (pre_fork): master/reclaim.py finds dead ones by it
    forked: dict[int, Any] = field(default_factory=dict)
    services: Any = None  # master.MasterServices
    watcher: Any = None  # master.reload.ConfigWatcher while APF_CONFIG_WATCH follows the files
    reload_errors: int = 0
    # workers that exited holding requests (killed or crashed mid-request): master/reclaim.py
    workers_reclaimed: int = 0
    # configuration reloads so far by (result, trigger): ("applied" | "refused", "file" | "hup")
    reloads: dict[tuple[str, str], int] = field(default_factory=dict)
    # the digest a file change applied and asked gunicorn to restart the workers for (their
    # classifier); the HUP that restarts them does not apply it again (master/reload.py)
    restart_digest: str = ""
    borrowing_states: Any = None
    master_pid: int = 0
    auto_limit: Any = None  # master.autolimit.ServerAutoLimit with APF_CONCURRENCY_LIMIT=auto
    route_times: Any = None  # admission.routekinds.RouteTimes with APF_CONCURRENCY_LIMIT=auto
    pool_table: Any = None  # signals.table.PoolTable: the workers' pools, a row per index
    cpu_watch: Any = None  # signals.cpu.CpuWatch: the workers' and the host's CPU
    # threads per worker the default limit was computed with, and whether a request holds one
    # (gthread) or not (an event-loop worker: see admission/boot.py FrontEnd.apf_holds_threads)
    threads: int = 0
    holds_threads: bool = True


@dataclass
class WorkerState:
    index: int
    pid: int
    ledger: LedgerPort | None = None
    parking: Any = None
    dispatcher: Any = None
    inbox: Any = None
    sender: Any = None
    middleware: Any = None
    worker: Any = None
    publisher: Any = None  # signals.publisher.Publisher: this worker's pools, once a window


MASTER: MasterState | None = None
WORKER: WorkerState | None = None
