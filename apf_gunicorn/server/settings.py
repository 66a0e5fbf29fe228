"""Server-level settings from environment variables (SPEC section 3), validated once at start.

Usage::

    from apf_gunicorn.server.settings import load_settings, SettingsError
    try:
        settings = load_settings(os.environ, workers=4, threads=16)
    except SettingsError as e:
        sys.exit(str(e))     # names the variable, the value and what is allowed

Every variable is checked; the first bad one raises :class:`SettingsError`. The resulting
:class:`Settings` is frozen and is inherited by the workers across ``fork``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.flowcontrol.gomath import parse_duration
from apf_gunicorn.flowcontrol.identity import (
    DEFAULT_USER_FROM,
    JWT_SUB,
    SYSTEM_PREFIX,
    VERIFIED_SOURCES,
    is_reserved_name,
    parse_user_from,
)
from apf_gunicorn.flowcontrol.kube_paths import PATH_MODES, PATHS_AUTO
from apf_gunicorn.flowcontrol.loader import DEFAULT_BUILTIN, PUBLIC_BUILTIN
from apf_gunicorn.flowcontrol.requestinfo import UNIX_PEER
from apf_gunicorn.ledger.ledger import DEFAULT_SERVICE_ESTIMATE_NS, MAX_SERVICE_ESTIMATE_NS

if TYPE_CHECKING:
    from apf_gunicorn.flowcontrol.jwtauth import JWTKey

DEFAULT_QUEUE_WAIT_LIMIT_S = 15.0
DEFAULT_ADMIN_BIND = "127.0.0.1:9180"
DEFAULT_USER_HEADER = "X-Remote-User"
DEFAULT_GROUP_HEADER = "X-Remote-Group"
DEFAULT_METRICS_PREFIX = "apf"
DEFAULT_BORROWING_PERIOD_S = 10.0  # Kubernetes' concurrency limit adjustment period
DEFAULT_ADAPTIVE_TICK_S = 1.0  # APF_CONCURRENCY_LIMIT=auto: seconds between controller ticks
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_EXEMPT_THREADS = 2
# per worker: connections reading their head in the poller, and the bytes their heads buffer
DEFAULT_HEAD_CONNECTIONS = 512
# per worker: how long a just-accepted connection still sending its head counts as wanting a
# thread (a burst of connects is spread over the workers)
DEFAULT_ACCEPT_GRACE_S = 0.25
DEFAULT_HEAD_BUFFER_LIMIT = 16 * 1024 * 1024
# per worker: 429s held before they are written (a flow retrying before its Retry-After)
DEFAULT_HELD_REJECTIONS = 256
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2,
               "mb": 1000 ** 2, "mib": 1024 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
               "gib": 1024 ** 3}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$")
# Workers' oom_score_adj above the master's: the OOM killer takes a worker (whose seats the
# master reclaims), not the master (which owns the ledger)
DEFAULT_WORKER_OOM_SCORE_ADJ_STEP = 500
#: How the ledger picks the next request to dispatch (APF_FAIRNESS; flowcontrol/fairness.py):
#: "kubernetes" (Kubernetes' queueset) or "maxmin"; a level's annotation overrides it.
FAIRNESS_NAMES = fairness.NAMES
DEFAULT_FAIRNESS = fairness.SERVER_DEFAULT
DEFAULT_AGENT_DRAIN_DELAY_S = 3.0  # above HAProxy's default agent-inter of 2 s
DEFAULT_JWT_LEEWAY_S = 60.0  # as flowcontrol/jwtauth.py's DEFAULT_LEEWAY_S (not imported: PyJWT)
MAX_JWT_PREFIX = 64

_HEADER_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_METRIC_PREFIX = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_IMPORT_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_INSTANCE = re.compile(r"^[A-Za-z0-9_.-]{0,40}$")


class SettingsError(ValueError):
    """A bad setting; ``str()`` names the variable, the value and what is allowed."""

    def __init__(self, var: str, value: str, allowed: str):
        self.var, self.value, self.allowed = var, value, allowed
        super().__init__(f"invalid {var}={value!r}: {allowed}")


@dataclass(frozen=True, slots=True)
class Settings:
    config_path: str | None  # APF_CONFIG; None: the built-in configuration named by ``builtin``
    concurrency_limit: int
    queue_wait_limit_ns: int
    # CIDRs, and "unix" for peers on a Unix socket
    trusted_proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network | str, ...]
    user_header: str
    group_header: str
    request_info: str | None  # "module:callable" or None for the built-in resolver
    routes: str | None  # path of a YAML route map (APF_ROUTES) or None
    admin_bind: tuple[str, int] | None  # None: off
    metrics_prefix: str
    instance: str  # user-chosen instance id, part of the shm and socket names
    # seconds between borrowing rounds; Kubernetes' 10 s unless changed for tests/experiments
    borrowing_period_s: float = DEFAULT_BORROWING_PERIOD_S
    # "module:callable" (environ, attributes, classification) -> WorkEstimate | dict | None
    work_estimator: str | None = None
    # G, the service time charged at dispatch: where each level starts, and whether it then
    # learns its own from finished requests (APF_SERVICE_ESTIMATE=learn, the default) or keeps
    # it fixed as Kubernetes does (APF_SERVICE_ESTIMATE=<duration>)
    service_estimate_ns: int = DEFAULT_SERVICE_ESTIMATE_NS
    learn_service: bool = True
    # APF_POOL_SIGNALS: find the app's connection pools in the workers (signals/), for the
    # metrics, dump_pools and the default limit; "off" leaves the libraries untouched
    pool_signals: bool = True
    # APF_PF_HEADERS: the X-Kubernetes-PF-FlowSchema-UID / -PriorityLevel-UID response headers
    # on every response APF answers or lets through (Kubernetes sends them); False: none
    pf_headers: bool = True
    # connection handling by the accept-gated worker (gthread/worker.py, gthread/head.py)
    header_timeout_ns: int = int(DEFAULT_HEADER_TIMEOUT_S * 1e9)  # whole head, from accept
    exempt_threads: int = DEFAULT_EXEMPT_THREADS  # per worker, only for exempt requests
    # False: concurrency_limit is default_concurrency_limit(workers, threads), not set
    concurrency_limit_set: bool = False
    # APF_CONCURRENCY_LIMIT=auto[:MIN-MAX]: the bounds of the adaptive limit (master/autolimit.py;
    # concurrency_limit is then where it starts, and the master moves it); None: a fixed limit
    concurrency_auto: tuple[int, int] | None = None
    # APF_ADAPTIVE_TICK: seconds between the adaptive controller's ticks (1 s; shorter for tests)
    adaptive_tick_s: float = DEFAULT_ADAPTIVE_TICK_S
    accept_slack: int = 0  # connections accepted beyond the worker's threads
    # APF_ACCEPT_GRACE: seconds a just-accepted connection sending its head counts for the gate
    accept_grace_s: float = DEFAULT_ACCEPT_GRACE_S
    # APF_HEAD_CONNECTIONS: reading connections a worker holds (then the oldest idle dropped)
    head_connections: int = DEFAULT_HEAD_CONNECTIONS
    # APF_HEAD_BUFFER_LIMIT: bytes of incomplete heads a worker buffers (then the largest 431)
    head_buffer_limit: int = DEFAULT_HEAD_BUFFER_LIMIT
    # APF_HELD_REJECTIONS: 429s a worker holds before writing them (0: never held)
    held_rejections: int = DEFAULT_HELD_REJECTIONS
    # added to the master's oom_score_adj in each worker (capped at 1000); None: left alone
    worker_oom_score_adj_step: int | None = DEFAULT_WORKER_OOM_SCORE_ADJ_STEP
    # APF_USER_FROM: identity sources in order (flowcontrol/identity.py)
    user_from: tuple[str, ...] = DEFAULT_USER_FROM
    # APF_JWT_*: the key that verifies jwt-sub tokens (flowcontrol/jwtauth.py); None: unverified
    jwt_key: JWTKey | None = None
    jwt_audience: str | None = None  # APF_JWT_AUDIENCE: a token's aud must contain it
    jwt_issuer: str | None = None  # APF_JWT_ISSUER: a token's iss must be it
    jwt_groups_claim: str = "groups"  # APF_JWT_GROUPS_CLAIM: the claim listing the groups
    # APF_JWT_USER_PREFIX, APF_JWT_GROUPS_PREFIX: put before a token's sub and each of its groups
    jwt_user_prefix: str = ""
    jwt_groups_prefix: str = ""
    # APF_JWT_LEEWAY: seconds a token's nbf may be ahead of the server's clock
    jwt_leeway_s: float = DEFAULT_JWT_LEEWAY_S
    # APF_FAIRNESS: the fairness of levels without an apf-gunicorn.io/fairness annotation
    fairness: str = DEFAULT_FAIRNESS
    # APF_PATHS: whether /api/ and /apis/ are Kubernetes API paths (kubernetes), never (plain)
    # or when the configuration's FlowSchemas have resource rules (auto)
    paths: str = PATHS_AUTO
    # -- load balancer exports (docs/load-balancers.md) --
    agent_bind: tuple[str, int] | None = None  # APF_AGENT_BIND; None: off
    agent_drain_delay_s: float = DEFAULT_AGENT_DRAIN_DELAY_S  # APF_AGENT_DRAIN_DELAY
    load_report: str = "off"  # APF_LOAD_REPORT: "off" or "orca"
    load_report_interval_s: float = 0.1  # APF_LOAD_REPORT_INTERVAL: ORCA value reused this long
    # the built-in configuration used when APF_CONFIG is unset (see builtin_configuration)
    builtin: str = DEFAULT_BUILTIN
    # APF_CONFIG_WATCH: the master applies APF_CONFIG's file (or directory) when it changes
    # (master/reload.py); False: only a HUP does
    config_watch: bool = True

    @property
    def config_source(self) -> str:
        """What the loader is given: ``APF_CONFIG``, else ``builtin:<builtin>``."""
        return self.config_path if self.config_path is not None else f"builtin:{self.builtin}"

    @property
    def builtin_reason(self) -> str:
        """Why the built-in configuration is not webapp (for the start line and ``explain``),
        or "" when it is."""
        if self.builtin == DEFAULT_BUILTIN:
            return ""
        return f"APF_USER_FROM={','.join(self.user_from)} names no verified identity"


def builtin_configuration(user_from: tuple[str, ...], jwt_verified: bool,
                          request_info: str | None) -> str:
    """The built-in configuration a server without ``APF_CONFIG`` runs.

    ``webapp`` (signed-in users 80 % of the limit, anonymous clients 16 %) whenever a request
    can carry a verified identity: ``proxy``, ``remote_user`` or ``jwt-sub`` with a key among
    the sources, or an ``APF_REQUEST_INFO`` hook (it may name anybody). Otherwise only
    unverified identities exist (``address``, ``header:NAME``, ``jwt-sub`` without a key), all
    in ``system:unauthenticated``: webapp's users level could never be reached and its seats
    would idle, so ``public`` gives the clients' level those seats.

    Args:
        user_from: the ``APF_USER_FROM`` sources.
        jwt_verified: ``APF_JWT_KEY`` is set (``jwt-sub`` tokens are verified).
        request_info: the ``APF_REQUEST_INFO`` hook, or None.

    Returns:
        ``"webapp"`` or ``"public"``.
    """
    verified = set(user_from) & VERIFIED_SOURCES or (jwt_verified and JWT_SUB in user_from)
    return DEFAULT_BUILTIN if verified or request_info is not None else PUBLIC_BUILTIN


def default_concurrency_limit(workers: int, threads: int) -> int:
    """Half of all worker threads: the other half holds queued and exempt requests."""
    return max(1, (workers * threads) // 2)


def auto_start(workers: int, threads: int, bounds: tuple[int, int]) -> int:
    """Where ``auto`` starts: the default, within the bounds. The controller's first binding
    tick halves it to see below (the knee of the app's bottleneck, a pool or the CPU, may be
    on either side), and goes back when the seats above the half paid (docs/adaptive.md).

    Args:
        workers: gunicorn's workers; threads: threads per worker.
        bounds: ``(MIN, MAX)`` of ``auto:MIN-MAX``.
    Returns:
        The starting limit in seats.
    """
    return min(max(default_concurrency_limit(workers, threads), bounds[0]), bounds[1])


def parse_auto_limit(raw: str, workers: int, threads: int) -> tuple[int, int]:
    """The bounds of ``APF_CONCURRENCY_LIMIT=auto`` or ``auto:MIN-MAX``. Plain ``auto`` is
    bounded by 1 and the default (half of all worker threads): a request waits in a fair
    queue holding its thread, so seats beyond half the threads leave too few to queue on (the
    thread reserve then turns requests away), and plain ``auto`` never sets more seats than
    the default would; ``auto:MIN-MAX`` sets other bounds.

    Args:
        raw: the variable's value (starting with ``auto``).
        workers: gunicorn's workers; threads: threads per worker.
    Returns:
        ``(MIN, MAX)``.
    Raises:
        SettingsError: not ``auto`` nor ``auto:MIN-MAX`` with ``1 <= MIN <= MAX <= 1000000``.
    """
    from apf_gunicorn.control.adaptive import parse_auto

    allowed = ("must be auto or auto:MIN-MAX with 1 <= MIN <= MAX <= 1000000 (e.g. auto:2-64): "
               "the master adapts the limit within the bounds (experimental)")
    try:
        bounds = parse_auto(raw.lower())
    except ValueError:
        raise SettingsError("APF_CONCURRENCY_LIMIT", raw, allowed) from None
    if bounds is None or bounds[1] > 1_000_000:
        raise SettingsError("APF_CONCURRENCY_LIMIT", raw, allowed)
    if raw.strip().lower() == "auto":
        return 1, default_concurrency_limit(workers, threads)
    return bounds


def load_settings(env: Mapping[str, str] | None = None, *, workers: int = 1,
                  threads: int = 1) -> Settings:
    """Read and validate every APF_* variable of ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env

    def get(var: str) -> str | None:
        v = env.get(var)
        return None if v is None or v.strip() == "" else v.strip()

    config_path = get("APF_CONFIG")
    if (config_path is not None and not config_path.startswith("builtin:")
            and not os.path.exists(config_path)):
        raise SettingsError("APF_CONFIG", config_path,
                            "must be an existing YAML file, a directory of *.yaml/*.yml files, "
                            "or builtin:<name> (webapp, public, kubernetes, mandatory)")

    raw = raw_limit = get("APF_CONCURRENCY_LIMIT")
    auto = None
    if raw is None:
        limit = default_concurrency_limit(workers, threads)
    elif raw.lower().startswith("auto"):
        auto = parse_auto_limit(raw, workers, threads)
        limit = auto_start(workers, threads, auto)
    else:
        limit = _int(raw)
        if limit is None or limit < 1 or limit > 1_000_000:
            raise SettingsError("APF_CONCURRENCY_LIMIT", raw,
                                "must be an integer number of seats from 1 to 1000000, or "
                                "auto / auto:MIN-MAX (experimental: the master adapts it)")
    tick_s = _number(get, "APF_ADAPTIVE_TICK", DEFAULT_ADAPTIVE_TICK_S,
                     lambda x: 0.05 <= x <= 60,
                     "must be a number of seconds from 0.05 to 60 (default 1: how often the "
                     "adaptive limit's controller runs; other values are for tests)")

    wait_s = _number(get, "APF_QUEUE_WAIT_LIMIT", DEFAULT_QUEUE_WAIT_LIMIT_S,
                     lambda x: 0 < x <= 3600,
                     "must be a number of seconds greater than 0 and at most 3600")

    raw = get("APF_TRUSTED_PROXIES")
    proxies = []
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() == UNIX_PEER:  # peers on a Unix socket (a proxy on this host)
            proxies.append(UNIX_PEER)
            continue
        try:
            proxies.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise SettingsError("APF_TRUSTED_PROXIES", raw or "",
                                f"{item!r} is not an IP address, a CIDR or 'unix'; expected a "
                                "comma-separated list such as 10.0.0.0/8,127.0.0.1") from None

    headers = {}
    for var, default in (("APF_USER_HEADER", DEFAULT_USER_HEADER),
                         ("APF_GROUP_HEADER", DEFAULT_GROUP_HEADER)):
        raw = get(var)
        if raw is not None and not _HEADER_TOKEN.match(raw):
            raise SettingsError(var, raw, "must be an HTTP header name (letters, digits, '-')")
        headers[var] = raw or default

    request_info = get("APF_REQUEST_INFO")
    if request_info is not None and not _IMPORT_SPEC.match(request_info):
        raise SettingsError("APF_REQUEST_INFO", request_info,
                            "must be 'module:callable', e.g. myapp.apf:request_attributes")

    work_estimator = get("APF_WORK_ESTIMATOR")
    if work_estimator is not None and not _IMPORT_SPEC.match(work_estimator):
        raise SettingsError("APF_WORK_ESTIMATOR", work_estimator,
                            "must be 'module:callable', e.g. myapp.apf:estimate")

    routes = get("APF_ROUTES")
    if routes is not None and not os.path.isfile(routes):
        raise SettingsError("APF_ROUTES", routes, "must be an existing YAML file of route rules")

    raw = get("APF_ADMIN_BIND")
    admin_bind = _bind(raw) if raw is not None else _bind(DEFAULT_ADMIN_BIND)

    prefix = get("APF_METRICS_PREFIX") or DEFAULT_METRICS_PREFIX
    if not _METRIC_PREFIX.match(prefix):
        raise SettingsError("APF_METRICS_PREFIX", prefix,
                            "must match [a-zA-Z_:][a-zA-Z0-9_:]* (a Prometheus name prefix)")

    instance = get("APF_INSTANCE") or ""
    if not _INSTANCE.match(instance):
        raise SettingsError("APF_INSTANCE", instance,
                            "must be at most 40 characters from A-Z a-z 0-9 _ . -")

    period = _number(get, "APF_BORROWING_PERIOD", DEFAULT_BORROWING_PERIOD_S,
                     lambda x: 0.1 <= x <= 3600,
                     "must be a number of seconds from 0.1 to 3600 (default 10, Kubernetes' "
                     "period; other values are for tests and experiments)")

    raw = get("APF_SERVICE_ESTIMATE")
    learn, service_ns = True, DEFAULT_SERVICE_ESTIMATE_NS
    if raw is not None and raw.lower() != "learn":
        learn = False
        try:
            seconds = _float(raw)
            service_ns = parse_duration(raw if seconds is None else seconds)
        except ValueError:
            service_ns = -1
        if not 0 <= service_ns <= MAX_SERVICE_ESTIMATE_NS:
            raise SettingsError("APF_SERVICE_ESTIMATE", raw,
                                "must be 'learn' (each level learns its service time from "
                                "finished requests) or a fixed duration from 0 to 60s such as "
                                "3ms (Kubernetes' value) or 0.25")

    header_s = _number(get, "APF_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT_S,
                       lambda x: 0 < x <= 3600,
                       "must be a number of seconds greater than 0 and at most 3600: how long "
                       "a connection may take to send its whole request head")

    raw = get("APF_EXEMPT_THREADS")
    # unset: 2, but always leave one thread for everything else
    reserve = min(DEFAULT_EXEMPT_THREADS, threads - 1) if raw is None else _int(raw)
    if reserve is None or reserve < 0 or reserve >= max(threads, 1):
        raise SettingsError("APF_EXEMPT_THREADS", raw or str(DEFAULT_EXEMPT_THREADS),
                            f"must be an integer from 0 to threads - 1 = {threads - 1}: the "
                            f"threads of each worker kept for exempt requests (health checks, "
                            f"admins); with --threads {threads} raise --threads or lower it")

    slack = _int_setting(get, "APF_ACCEPT_SLACK", 0, 0, 100_000,
                         "must be an integer from 0 to 100000 (connections a worker may "
                         "accept beyond its threads)")
    grace_s = _number(get, "APF_ACCEPT_GRACE", DEFAULT_ACCEPT_GRACE_S, lambda x: 0 <= x <= 10,
                      "must be a number of seconds from 0 to 10: how long a connection a "
                      "worker just accepted counts as wanting a thread while its request head "
                      "is on the way (0: never)")
    head_conns = _int_setting(get, "APF_HEAD_CONNECTIONS", DEFAULT_HEAD_CONNECTIONS, 1,
                              1_000_000, "must be an integer from 1 to 1000000: connections "
                              "per worker that may be sending their request head (then the "
                              "oldest idle is closed)")
    held = _int_setting(get, "APF_HELD_REJECTIONS", DEFAULT_HELD_REJECTIONS, 0, 1_000_000,
                        "must be an integer from 0 to 1000000: connections per worker whose "
                        "429 is held because their flow keeps retrying before its Retry-After "
                        "(0: never hold)")

    raw = get("APF_HEAD_BUFFER_LIMIT")
    head_bytes = DEFAULT_HEAD_BUFFER_LIMIT if raw is None else _size(raw)
    if head_bytes is None or not (64 * 1024 <= head_bytes <= 1 << 40):
        raise SettingsError("APF_HEAD_BUFFER_LIMIT", raw or "",
                            "must be a size from 64KiB to 1TiB, in bytes or with a unit (16MiB, "
                            "500k): the request-head bytes a worker buffers for connections "
                            "still sending their head (then the largest is answered 431)")

    raw = get("APF_WORKER_OOM_SCORE_ADJ")
    oom_step: int | None = DEFAULT_WORKER_OOM_SCORE_ADJ_STEP
    if raw is not None:
        oom_step = None if raw.lower() == "off" else _int(raw)
        if raw.lower() != "off" and (oom_step is None or not (1 <= oom_step <= 2000)):
            raise SettingsError("APF_WORKER_OOM_SCORE_ADJ", raw,
                                "must be 'off' or an integer from 1 to 2000 that each worker "
                                "adds to the master's oom_score_adj (capped at 1000)")
    raw = get("APF_USER_FROM")
    user_from = DEFAULT_USER_FROM
    if raw is not None:
        try:
            user_from = parse_user_from(raw)
        except ValueError as e:
            raise SettingsError("APF_USER_FROM", raw, f"{e} (comma-separated, tried in order; "
                                "default proxy,remote_user)") from None

    fairness_name = _choice(get, "APF_FAIRNESS", DEFAULT_FAIRNESS, FAIRNESS_NAMES,
                            "must be 'kubernetes' (Kubernetes' fair queuing) or 'maxmin' (max-min "
                            "fair between flows): the fairness of every priority level "
                            "without an apf-gunicorn.io/fairness annotation")
    paths = _choice(get, "APF_PATHS", PATHS_AUTO, PATH_MODES,
                    "must be 'auto' (parse /api/ and /apis/ paths as Kubernetes API requests "
                    "only when a FlowSchema has resource rules), 'kubernetes' (always) or "
                    "'plain' (never: they are paths like any other)")

    return Settings(
        config_path=config_path,
        concurrency_limit=limit,
        queue_wait_limit_ns=int(wait_s * 1e9),
        trusted_proxies=tuple(proxies),
        user_header=headers["APF_USER_HEADER"],
        group_header=headers["APF_GROUP_HEADER"],
        request_info=request_info,
        routes=routes,
        admin_bind=admin_bind,
        metrics_prefix=prefix,
        instance=instance,
        borrowing_period_s=period,
        work_estimator=work_estimator,
        service_estimate_ns=service_ns,
        learn_service=learn,
        pool_signals=_choice(get, "APF_POOL_SIGNALS", "on", ("on", "off"),
                             "must be 'on' (find the app's connection pools: docs/signals.md) "
                             "or 'off'") == "on",
        pf_headers=_choice(get, "APF_PF_HEADERS", "on", ("on", "off"),
                           "must be 'on' (the X-Kubernetes-PF-FlowSchema-UID and "
                           "X-Kubernetes-PF-PriorityLevel-UID headers on every response, as "
                           "Kubernetes sends them) or 'off' (left out: docs/server.md)") == "on",
        header_timeout_ns=int(header_s * 1e9),
        exempt_threads=reserve,
        concurrency_limit_set=raw_limit is not None,
        concurrency_auto=auto,
        adaptive_tick_s=tick_s,
        accept_slack=slack,
        accept_grace_s=grace_s,
        head_connections=head_conns,
        head_buffer_limit=head_bytes,
        held_rejections=held,
        worker_oom_score_adj_step=oom_step,
        user_from=user_from,
        fairness=fairness_name,
        paths=paths,
        builtin=builtin_configuration(user_from, get("APF_JWT_KEY") is not None, request_info),
        config_watch=_on_off(get, "APF_CONFIG_WATCH", True,
                             "must be 'on' (1, true: the master applies APF_CONFIG when its "
                             "file or directory changes) or 'off' (0, false: only a HUP "
                             "reloads it)"),
        **_load_balancer_settings(get),
        **_jwt_settings(get, user_from),
    )


def _jwt_settings(get, user_from: tuple[str, ...]) -> dict:
    """APF_JWT_KEY, APF_JWT_AUDIENCE, APF_JWT_ISSUER and APF_JWT_GROUPS_CLAIM, as Settings
    fields; the key file is read and checked here, so a bad one stops the server at start."""
    raw = get("APF_JWT_KEY")
    names = [var for var in ("APF_JWT_AUDIENCE", "APF_JWT_ISSUER", "APF_JWT_GROUPS_CLAIM",
                             "APF_JWT_USER_PREFIX", "APF_JWT_GROUPS_PREFIX", "APF_JWT_LEEWAY")
             if get(var) is not None]
    if raw is None:
        if names:
            raise SettingsError(names[0], get(names[0]) or "",
                                "only applies to verified tokens: set APF_JWT_KEY too")
        return {}
    if JWT_SUB not in user_from:
        raise SettingsError("APF_JWT_KEY", raw,
                            "verifies the tokens of the jwt-sub identity source, which "
                            f"APF_USER_FROM={','.join(user_from)} does not list; add it, e.g. "
                            "APF_USER_FROM=proxy,jwt-sub,address")
    from apf_gunicorn.flowcontrol.jwtauth import JWTKeyError, load_jwt_key

    try:
        key = load_jwt_key(raw)
    except JWTKeyError as e:
        raise SettingsError("APF_JWT_KEY", raw,
                            f"{e}; must be a file holding an HMAC secret (32 bytes or more), a "
                            "PEM public key or certificate, or a JWKS") from None
    claim = get("APF_JWT_GROUPS_CLAIM") or "groups"
    leeway = _number(get, "APF_JWT_LEEWAY", DEFAULT_JWT_LEEWAY_S, lambda x: 0 <= x <= 600,
                     "must be a number of seconds from 0 to 600: how far a token's nbf may be "
                     "ahead of this server's clock (an identity provider whose clock runs "
                     f"ahead); default {DEFAULT_JWT_LEEWAY_S:g}")
    return {"jwt_key": key, "jwt_audience": get("APF_JWT_AUDIENCE"),
            "jwt_issuer": get("APF_JWT_ISSUER"), "jwt_groups_claim": claim,
            "jwt_user_prefix": _jwt_prefix(get, "APF_JWT_USER_PREFIX", "user"),
            "jwt_groups_prefix": _jwt_prefix(get, "APF_JWT_GROUPS_PREFIX", "group"),
            "jwt_leeway_s": leeway}


def _jwt_prefix(get: Callable[[str], str | None], var: str, what: str) -> str:
    """APF_JWT_USER_PREFIX or APF_JWT_GROUPS_PREFIX ("" when unset).

    Raises:
        SettingsError: blanks or control characters, longer than 64 characters, or a prefix
            in the reserved ``system:`` namespace.
    """
    raw = get(var)
    if raw is None:
        return ""
    if len(raw) > MAX_JWT_PREFIX or not raw.isprintable() or any(c.isspace() for c in raw):
        raise SettingsError(var, raw, f"must be at most {MAX_JWT_PREFIX} printable characters "
                            f"without blanks, put before every {what} name a verified token "
                            "names, e.g. oidc:")
    if is_reserved_name(raw) or SYSTEM_PREFIX.startswith(raw):
        raise SettingsError(var, raw, f"must not be in the reserved system: namespace: a token "
                            f"could then name a system: {what} (no claim may), e.g. oidc:")
    return raw


def _load_balancer_settings(get) -> dict:
    """APF_AGENT_BIND, APF_AGENT_DRAIN_DELAY and APF_LOAD_REPORT, as Settings fields."""
    raw = get("APF_AGENT_BIND")
    agent_bind = None if raw is None else _bind(raw, "APF_AGENT_BIND", "127.0.0.1:9200")

    delay = _number(get, "APF_AGENT_DRAIN_DELAY", DEFAULT_AGENT_DRAIN_DELAY_S,
                    lambda x: 0 <= x <= 300,
                    "must be a number of seconds from 0 to 300 (how long a gracefully "
                    "stopping server answers drain and keeps serving)")

    report = _choice(get, "APF_LOAD_REPORT", "off", ("off", "orca"),
                     "must be 'orca' (an endpoint-load-metrics header on every response APF "
                     "handled) or 'off'")

    interval = _number(get, "APF_LOAD_REPORT_INTERVAL", 0.1, lambda x: 0.001 <= x <= 60,
                       "must be a number of seconds from 0.001 to 60 (how long a worker reuses "
                       "its ORCA load report)")
    return {"agent_bind": agent_bind, "agent_drain_delay_s": delay, "load_report": report,
            "load_report_interval_s": interval}


def _choice(get: Callable[[str], str | None], var: str, default: str,
            names: Collection[str], allowed: str) -> str:
    """One of ``names`` (any case; ``default`` when unset).

    Raises:
        SettingsError: it is set to anything else (``allowed`` says what may be).
    """
    raw = get(var)
    value = default if raw is None else raw.lower()
    if value not in names:
        raise SettingsError(var, raw or "", allowed)
    return value


def _on_off(get: Callable[[str], str | None], var: str, default: bool, allowed: str) -> bool:
    """A switch: ``on``/``1``/``true`` or ``off``/``0``/``false`` (any case; ``default`` when
    unset).

    Raises:
        SettingsError: it is set to anything else (``allowed`` says what may be).
    """
    raw = get(var)
    if raw is None:
        return default
    value = raw.lower()
    if value in ("on", "1", "true"):
        return True
    if value in ("off", "0", "false"):
        return False
    raise SettingsError(var, raw, allowed)


def _int_setting(get: Callable[[str], str | None], var: str, default: int, lo: int, hi: int,
                 allowed: str) -> int:
    """An integer setting from ``lo`` to ``hi``, ``default`` when unset.

    Raises:
        SettingsError: it is set to anything else (``allowed`` says what may be).
    """
    raw = get(var)
    value = default if raw is None else _int(raw)
    if value is None or not (lo <= value <= hi):
        raise SettingsError(var, raw or "", allowed)
    return value


def _size(raw: str) -> int | None:
    """A byte count such as ``16777216``, ``16MiB``, ``16M`` or ``500k``; None if it is not."""
    m = _SIZE.match(raw.lower())
    if m is None or m.group(2) not in _SIZE_UNITS:
        return None
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def _number(get: Callable[[str], str | None], var: str, default: float,
            ok: Callable[[float], bool], allowed: str) -> float:
    """The number ``var`` holds (``default`` when unset).

    Raises:
        SettingsError: not a number, or not ``ok``.
    """
    raw = get(var)
    if raw is None:
        return default
    value = _float(raw)
    if value is None or not ok(value):
        raise SettingsError(var, raw, allowed)
    return value


def _float(raw: str) -> float | None:
    try:
        return float(raw)
    except ValueError:
        return None


def _int(raw: str) -> int | None:
    try:
        return int(raw, 10)
    except ValueError:
        return None


def _bind(raw: str, var: str = "APF_ADMIN_BIND",
          example: str = "127.0.0.1:9180") -> tuple[str, int] | None:
    if raw.lower() == "off":
        return None
    host, sep, port = raw.rpartition(":")
    host = host.strip("[]")
    p = _int(port) if sep else None
    if not host or p is None or not (0 <= p <= 65535):
        ipv6 = example.replace("127.0.0.1", "[::1]")
        raise SettingsError(var, raw,
                            f"must be host:port (e.g. {example}, {ipv6}) or 'off'")
    return host, p
