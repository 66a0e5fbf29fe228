"""A configuration generation: what the master derives from ``APF_CONFIG`` and applies to the
ledger, at start and on every HUP.

    gen = load_generation(settings)            # raises the loader's errors; gen.digest set
    contents = read_config_files(settings.config_source)   # or read first, hash, then load:
    gen = load_generation(settings, 2, contents)            # config_digest(source, contents)
    derive_limits(gen, server_limit)           # again for another server limit
    level_specs(gen)
    configure_ledger(ledger, gen, now)         # gen.level_index / fs_index filled in
    warning = thread_budget(gen, settings, workers, threads)
    before = level_seats(ledger, old_gen)      # on a reload, around configure_ledger:
    config_change_lines(old_gen.configuration, gen.configuration)  # objects added/removed/changed
    seat_change_lines(before, level_seats(ledger, gen))   # each level's seats before/after
    worker_change_lines(old_gen.configuration, gen.configuration)  # what workers must re-read

Workers take the per-level request widths (``level_max_seats``) and the route cost table
(``route_table``) from the generation they inherit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.flowcontrol.limits import compute_limits
from apf_gunicorn.flowcontrol.loader import load_configuration, read_config_files
from apf_gunicorn.flowcontrol.matching import Classifier, queues_flows
from apf_gunicorn.flowcontrol.workestimate import level_max_seats as widest
from apf_gunicorn.ledger.ledger import LevelSpec
from apf_gunicorn.server.settings import default_concurrency_limit
from apf_gunicorn.server.state import Generation

if TYPE_CHECKING:
    from apf_gunicorn.flowcontrol.configuration import Configuration
    from apf_gunicorn.ledger.ledger import Ledger
    from apf_gunicorn.server.settings import Settings


def load_generation(settings: Settings, number: int = 1,
                    contents: list[tuple[str, bytes]] | None = None) -> Generation:
    """Load ``APF_CONFIG`` and derive the levels' limits and the classifier.

    Args:
        settings: whose ``config_source`` is loaded; number: the generation's number;
        contents: the source's files as ``read_config_files`` read them (read here when None).
    Returns:
        The generation, its ``digest`` that of exactly the bytes it was loaded from.
    Raises:
        ConfigErrors: the configuration is invalid (every error listed).
        OSError: it cannot be read.
    """
    source = settings.config_source
    if contents is None:
        contents = read_config_files(source)
    cfg = load_configuration(source, contents)
    gen = Generation(cfg, {}, Classifier(cfg), {}, {}, number, fairness=settings.fairness,
                     digest=config_digest(source, contents))
    derive_limits(gen, settings.concurrency_limit)
    return gen


def config_digest(source: str | Path, contents: list[tuple[str, bytes]]) -> str:
    """``sha256:<hex>`` of a configuration's files, to tell which version runs.

    A file: the SHA-256 of its bytes (what ``sha256sum FILE`` prints). A directory (and a
    built-in set): the SHA-256 of ``sha256sum``'s lines for its files in name order,
    ``<hex>  <file name>\n`` each (``cd DIR && sha256sum $(ls *.yaml *.yml) | sha256sum``
    when the names sort the same).
    """
    if len(contents) == 1 and Path(contents[0][0]) == Path(str(source)):
        return "sha256:" + hashlib.sha256(contents[0][1]).hexdigest()
    lines = "".join(f"{hashlib.sha256(data).hexdigest()}  {Path(name).name}\n"
                    for name, data in contents)
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def short_digest(digest: str) -> str:
    """``sha256:`` and the first 16 hex digits, as the metrics, dumps and log show it."""
    return digest[:len("sha256:") + 16]


def derive_limits(gen: Generation, server_limit: int) -> None:
    """Set ``gen.limits``: each level's share of ``server_limit`` seats.

    A reload loads its generation outside the master's service lock and derives the limits
    again under it: with ``APF_CONCURRENCY_LIMIT=auto`` the adaptive tick may have moved the
    server limit in between.
    """
    gen.limits = compute_limits(gen.configuration.priority_levels.values(), server_limit)


def fairness_by_level(gen: Generation) -> dict[str, tuple[str | None, str]]:
    """Per priority level, the fairness it runs and where that came from.

    Returns:
        ``{level name: (fairness, source)}``: ``(None, "exempt")`` for the exempt level, else the
        annotation's fairness or ``gen.fairness`` (``APF_FAIRNESS``), see
        :func:`apf_gunicorn.flowcontrol.fairness.level_fairness`.
    """
    return {name: fairness.level_fairness(pl, gen.fairness, "APF_FAIRNESS")
            for name, pl in gen.configuration.priority_levels.items()}


def level_specs(gen: Generation) -> list[LevelSpec]:
    """The ledger's view of each priority level (queues, hand, queue length, nominal seats,
    and the fairness).
    """
    by_level = fairness_by_level(gen)
    specs = []
    for name, pl in sorted(gen.configuration.priority_levels.items()):
        q = pl.queuing
        fairness_name, source = by_level[name]
        specs.append(LevelSpec(name, pl.desired_queues, q.hand_size if q else 0,
                               q.queue_length_limit if q else 0, int(gen.limits[name].nominal),
                               fairness=fairness_name))
    return specs


def configure_ledger(ledger: Ledger, gen: Generation, now: int) -> None:
    """Apply ``gen`` to the ledger and record the level and FlowSchema indices it gave."""
    fs_names = [fs.name for fs in gen.configuration.flow_schemas]
    levels, schemas = ledger.configure(level_specs(gen), fs_names, now)
    gen.level_index = dict(levels)
    gen.fs_index = dict(schemas)


def level_seats(ledger: Ledger, gen: Generation) -> dict[str, tuple[int, int]]:
    """Each level's seats as ``gen`` and the ledger have them (read without the ledger lock).

    Args:
        ledger: the master's ledger; gen: the generation applied to it last.
    Returns:
        ``{level name: (nominal seats, current seats)}``: nominal from ``gen``'s limits,
        current the ledger's C (after borrowing); levels the ledger does not hold are left out.
    """
    current = {load.index: load.concurrency_limit for load in ledger.load()}
    return {name: (int(gen.limits[name].nominal), current[index])
            for name, index in gen.level_index.items()
            if index in current and name in gen.limits}


def seat_change_lines(before: dict[str, tuple[int, int]],
                      after: dict[str, tuple[int, int]]) -> list[str]:
    """One log line per level for a reload: its nominal and current seats before and after.

    Args:
        before, after: :func:`level_seats` before and after the new generation was applied.
    Returns:
        Lines such as ``level 'work': nominal 8 -> 4 seats, current 8 -> 4``, by name; a level
        only in ``before`` is said to drain, one only in ``after`` to be new.
    """
    lines = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            nominal, current = before[name]
            lines.append(f"level {name!r}: removed (drains its requests); it had nominal "
                         f"{nominal} seats, current {current}")
        elif name not in before:
            nominal, current = after[name]
            lines.append(f"level {name!r}: new, nominal {nominal} seats, current {current}")
        else:
            (n0, c0), (n1, c1) = before[name], after[name]
            lines.append(f"level {name!r}: nominal {n0} -> {n1} seats, current {c0} -> {c1}")
    return lines


#: The YAML name of an object attribute that is not its camelCase (config_change_lines).
_FIELD_NAMES = {"priority_level": "priorityLevelConfiguration",
                "distinguisher": "distinguisherMethod", "limit_response": "limitResponse.type",
                "uid": "metadata.uid", "fairness": "annotation apf-gunicorn.io/fairness",
                "max_seats": "annotation apf-gunicorn.io/max-seats"}
#: Attributes that say where an object was read, not what it is: not a change.
_NOT_COMPARED = ("name", "source")


def _changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The YAML names of the fields in which two versions of a FlowSchema or level differ
    (``queuing.handSize`` inside a level's queuing)."""
    out = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name in _NOT_COMPARED or a == b:
            continue
        head, *rest = f.name.split("_")
        name = prefix + _FIELD_NAMES.get(f.name, head + "".join(w.title() for w in rest))
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            out += _changed_fields(a, b, name + ".")
        else:
            out.append(name)
    return out


def _diff(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """The names added and removed, and the changed ones with their fields: ``'x' (a, b)``."""
    added = sorted(new.keys() - old.keys())
    removed = sorted(old.keys() - new.keys())
    changed = [f"{name!r} ({', '.join(fields)})" for name in sorted(old.keys() & new.keys())
               if (fields := _changed_fields(old[name], new[name]))]
    return added, removed, changed


def _object_changes(kind: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    """One line naming the objects of ``kind`` added, removed and changed (with the fields)."""
    parts = []
    added, removed, changed = _diff(old, new)
    if added:
        parts.append("added " + ", ".join(repr(n) for n in added))
    if removed:
        parts.append("removed " + ", ".join(repr(n) for n in removed))
    if changed:
        parts.append("changed " + ", ".join(changed))
    return f"{kind}: " + ("; ".join(parts) if parts else "unchanged")


def config_change_lines(old: Configuration, new: Configuration) -> list[str]:
    """What a reload changes: the FlowSchemas and the priority levels added, removed and
    changed (the fields that differ), compared by name.

    Args:
        old, new: the configuration in force and the one replacing it.
    Returns:
        Two lines, such as ``FlowSchemas: added 'extra'; changed 'work' (matchingPrecedence)``
        and ``priority levels: removed 'batch'`` (``unchanged`` when nothing is); the file an
        object was read from does not count.
    """
    return [_object_changes("FlowSchemas", {fs.name: fs for fs in old.flow_schemas},
                            {fs.name: fs for fs in new.flow_schemas}),
            _object_changes("priority levels", old.priority_levels, new.priority_levels)]


def config_change_summary(old: Configuration, new: Configuration) -> str:
    """A reload's changes counted, for its one log line: ``5 priority levels (1 added,
    0 removed, 1 changed), 4 FlowSchemas (0 added, 0 removed, 0 changed)``."""
    parts = []
    for kind, a, b in (("priority levels", old.priority_levels, new.priority_levels),
                       ("FlowSchemas", {fs.name: fs for fs in old.flow_schemas},
                        {fs.name: fs for fs in new.flow_schemas})):
        added, removed, changed = _diff(a, b)
        parts.append(f"{len(b)} {kind} ({len(added)} added, {len(removed)} removed, "
                     f"{len(changed)} changed)")
    return ", ".join(parts)


def _worker_schemas(cfg: Configuration) -> dict[str, Any]:
    """The FlowSchemas a worker's classifier matches by (the dangling ones are left out)."""
    return {fs.name: fs for fs in cfg.flow_schemas if fs.priority_level in cfg.priority_levels}


def _worker_level_view(level: Any) -> tuple:
    """What a worker takes from a level it classifies into, besides its name: the uid (a
    response header), whether it is exempt, its limit response and whether its requests get
    a flow (more than one queue), and its max-seats annotation. Its shares, queue sizes and
    fairness live in the ledger, which the master changes in place."""
    return (level.uid, level.type, level.limit_response, queues_flows(level), level.max_seats)


def worker_change_lines(old: Configuration, new: Configuration) -> list[str]:
    """What of a new configuration the running workers cannot take without being replaced.

    A worker classifies with the FlowSchemas and the levels they name as it was forked with
    them (``admission/boot.py``); everything else (new or unused levels, shares, queues,
    fairness: the ledger's) reaches it through the ledger the master reconfigures. The width
    clamp a worker computed from the limits (``level_max_seats``) stays as it was, as it does
    while ``APF_CONCURRENCY_LIMIT=auto`` moves the limit.

    Args:
        old, new: the configuration the workers run and the one applied.
    Returns:
        Lines naming the FlowSchemas and the levels that changed for the workers, such as
        ``FlowSchemas: added 'extra'`` or ``priority level 'web': type``; empty when the
        workers may go on as they are.
    """
    before, after = _worker_schemas(old), _worker_schemas(new)
    if before.keys() != after.keys() or any(_changed_fields(before[n], after[n])
                                              for n in before):
        return [_object_changes("FlowSchemas", before, after)]
    names = ("metadata.uid", "type", "limitResponse.type", "queuing.queues (one or several)",
             "annotation apf-gunicorn.io/max-seats")
    lines = []
    for name in sorted({fs.priority_level for fs in after.values()}):
        a, b = (_worker_level_view(old.priority_levels[name]),
                _worker_level_view(new.priority_levels[name]))
        if a != b:
            fields = ", ".join(n for n, x, y in zip(names, a, b, strict=True) if x != y)
            lines.append(f"priority level {name!r}: {fields}")
    return lines


def config_error_lines(exc: BaseException) -> list[str]:
    """One line per configuration error in ``exc`` (a ConfigErrors, a list, or any error)."""
    errors = exc if isinstance(exc, list) else getattr(exc, "errors", None)
    if errors:
        return [str(e) for e in errors]
    return [str(exc) or type(exc).__name__]


def thread_budget(gen: Generation, settings: Settings, workers: int,
                  threads: int) -> str | None:
    """A warning when the threads non-exempt requests may use (each worker's threads less
    ``APF_EXEMPT_THREADS``) cannot hold the executing + queued requests the configuration
    allows (parked requests hold a thread each).

    Args:
        gen: the configuration generation (its levels' queues and queue length limits).
        settings: the settings (the limit, whether ``APF_CONCURRENCY_LIMIT`` set it, the
            exempt threads, the configuration's source).
        workers, threads: gunicorn's ``--workers`` and ``--threads``.
    Returns:
        None when they fit; else the warning: the numbers, where each came from, and the
        ``--threads`` (and, where one fits, the ``APF_CONCURRENCY_LIMIT``) that would fit.
    """
    reserve = settings.exempt_threads
    total = workers * (threads - reserve)
    queued = 0
    for pl in gen.configuration.priority_levels.values():
        if pl.queuing is not None and not pl.is_exempt:
            queued += pl.queuing.queues * pl.queuing.queue_length_limit
    limit = settings.concurrency_limit
    if total >= limit + queued:
        return None
    usable = (f"workers x (threads - APF_EXEMPT_THREADS) = {workers} x ({threads} - {reserve}) "
              f"= {total} threads")
    if settings.concurrency_limit_set:
        seats = f"{limit} seats (APF_CONCURRENCY_LIMIT)"
    else:
        seats = (f"{limit} seats (the default, workers x threads / 2 = {workers} x {threads} / 2; "
                 f"APF_CONCURRENCY_LIMIT is not set)")
    source = settings.config_source
    fix = _budget_fix(settings, workers, threads, total, queued)
    if total <= limit:
        return (f"{usable} cannot even run the concurrency limit of {seats}: the seats can "
                f"never all be in use, and once the threads are taken, requests are answered "
                f"429 (thread-reserve) instead of queueing. {fix}")
    return (f"{usable} hold the concurrency limit of {seats} plus only {total - limit} waiting "
            f"requests, while the configuration ({source}) allows {queued} queued (sum of "
            f"queues x queueLengthLimit); beyond that, a worker whose non-exempt threads are "
            f"all taken answers 429 at once: the newcomer (reason thread-reserve), or a parked "
            f"request of a flow holding more parked threads (thread-share). {fix}")


def _budget_fix(settings: Settings, workers: int, threads: int, total: int, queued: int) -> str:
    """What would make :func:`thread_budget` fit: the smallest ``--threads`` (with the same
    limit, or with the default limit, which grows with the threads), and the largest
    ``APF_CONCURRENCY_LIMIT`` the present threads hold, if any."""
    reserve = settings.exempt_threads
    if settings.concurrency_limit_set:
        # workers x (t - reserve) >= limit + queued
        need = reserve + -(-(settings.concurrency_limit + queued) // workers)
        fix = f"--threads {need} fits (with --workers {workers})"
    else:
        # workers x (t - reserve) >= floor(workers x t / 2) + queued needs
        # t >= 2 reserve + (2 queued - 1) / workers: start there, step up past the flooring
        need = max(threads + 1, 2 * reserve + (2 * queued - 1) // workers)
        while workers * (need - reserve) < default_concurrency_limit(workers, need) + queued:
            need += 1
        fix = (f"--threads {need} fits (with --workers {workers}; the default limit grows with "
               f"it, to {default_concurrency_limit(workers, need)} seats)")
    if total - queued >= 1:
        fix += f", or APF_CONCURRENCY_LIMIT={total - queued} with these threads"
    else:
        fix += (f", or fewer queued requests in the configuration (these threads cannot hold "
                f"its {queued} at any limit)")
    return fix + "."


def level_max_seats(gen: Generation, settings: Settings) -> dict[str, int]:
    """Per level, the widest request the work estimate is clamped to (docs/work-estimation.md)."""
    levels = gen.configuration.priority_levels
    return {name: widest(lim, levels[name].is_exempt if name in levels else False,
                         settings.concurrency_limit)
            for name, lim in gen.limits.items()}


def route_table(resolver):
    """The APF_ROUTES table behind a resolver (the built-in one, or an APF_REQUEST_INFO hook's
    fallback), for its cost entries; None without one."""
    for candidate in (resolver, getattr(resolver, "fallback", None)):
        table = getattr(candidate, "routes", None)
        if table is not None:
            return table
    return None
