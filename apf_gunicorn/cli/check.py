"""``apf-gunicorn check PATH [--concurrency-limit N | --workers W --threads T] [--json]``.

Validates a configuration and prints every priority level with the seats it gets (and the
fairness of levels that choose one by annotation) and the FlowSchemas in matching order;
broken or repaired levels are warnings and dangling FlowSchemas errors (on stderr).
``PATH`` is a YAML file, a directory of them, or ``builtin:<name>`` (``webapp``, ``public``,
``kubernetes``, ``mandatory``).

Like a cluster, a configuration need not define the mandatory objects (``exempt`` and
``catch-all``, levels and schemas): they exist as the bootstrap ensurer makes them, and a
FlowSchema may name either level. A FlowSchema naming any other level that the configuration
does not define is *dangling*: Kubernetes accepts it and marks it ``Dangling``, and the server
starts without it (logging a warning), but since a configuration is read whole this is a
mistake (usually a typo), so ``check`` lists each one, with file, schema and field, and exits 1.

The server concurrency limit is ``--concurrency-limit N`` (what ``APF_CONCURRENCY_LIMIT`` gives
the server), else the server's own default for ``--workers`` x ``--threads`` (workers x threads
/ 2, with ``apf_gunicorn.conf``'s 2 workers x 64 threads when not given); the output says which.

Exit status: 0 valid (warnings allowed); 1 invalid (every error listed on stderr, or as a JSON
object ``{"valid": false, "errors": [{"file", "kind", "name", "field", "message"}]}`` on stdout
under ``--json``), or valid for the server but with a dangling FlowSchema (the full report is
printed, ``"valid": true`` with a non-empty ``"dangling"`` list under ``--json``); 2 the path
cannot be read (JSON: one error with only ``file`` and ``message``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from apf_gunicorn.cli.common import add_limit_arguments, load_or_report, plural, server_limit
from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.flowcontrol.configuration import Configuration
from apf_gunicorn.flowcontrol.limits import (
    MAX_SEATS_ANNOTATION,
    LevelLimits,
    compute_limits,
    nominal_sum,
)
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.validation import ConfigErrors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH", help="YAML file, directory of *.yaml/*.yml, or builtin:NAME"
    )
    add_limit_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object (errors too)")


def error_report(path: str, exc: BaseException) -> dict:
    """The ``--json`` object of a configuration that fails.

    Args:
        path: what was checked.
        exc: the loader's :class:`ConfigErrors`, or the ``OSError``/``ValueError`` of a path
            that cannot be read.

    Returns:
        ``{"valid": False, "errors": [{"file", "kind", "name", "field", "message"}, ...]}``.
    """
    if isinstance(exc, ConfigErrors):
        errors = [{"file": e.file, "kind": e.kind, "name": e.name, "field": e.field,
                   "message": e.message} for e in exc.errors]
    else:
        errors = [{"file": path, "kind": "", "name": "", "field": "",
                   "message": f"cannot read {path}: {exc}"}]
    return {"valid": False, "errors": errors}


def _load_json(path: str) -> Configuration | int:
    try:
        return load_configuration(path)
    except (ConfigErrors, OSError, ValueError) as exc:
        json.dump(error_report(path, exc), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if isinstance(exc, ConfigErrors) else 2


def run(args: argparse.Namespace) -> int:
    cfg = _load_json(args.path) if args.json else load_or_report(args.path, "check")
    if isinstance(cfg, int):
        return cfg
    chosen = server_limit(args)
    limit, source = chosen.seats, chosen.source
    limits = compute_limits(cfg.priority_levels.values(), limit)
    dangling = cfg.dangling_errors()
    dangling_texts = {str(err) for err in dangling}
    for warning in cfg.warnings():
        if warning not in dangling_texts:
            print(f"warning: {warning}", file=sys.stderr)
    if dangling:
        # Kubernetes stores such a schema and marks it Dangling; in one file it is a mistake.
        skipped = "it" if len(dangling) == 1 else "them"
        print(f"{args.path}: {plural(len(dangling), 'dangling FlowSchema')} (the server would "
              f"start without {skipped}, as Kubernetes does):", file=sys.stderr)
        for err in dangling:
            print(f"  {err}", file=sys.stderr)
    if args.json:
        doc = report(cfg, limits, limit)
        doc["concurrencyLimitSource"] = source
        if chosen.auto is not None:
            doc["concurrencyLimitAuto"] = {"start": limit, "min": chosen.auto[0],
                                           "max": chosen.auto[1]}
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(cfg, limits, limit, source, chosen.describe()))
    return 1 if dangling else 0


def report(cfg: Configuration, limits: dict[str, LevelLimits], server_limit: int) -> dict:
    """The ``--json`` object."""
    levels = []
    for name, pl in cfg.priority_levels.items():
        lim = limits[name]
        q = pl.queuing
        levels.append(
            {
                "name": name,
                "type": pl.type,
                "limitResponse": pl.limit_response,
                "nominalConcurrencyShares": pl.nominal_concurrency_shares,
                "lendablePercent": pl.lendable_percent,
                "borrowingLimitPercent": pl.borrowing_limit_percent,
                "nominal": lim.nominal,
                "lendable": lim.lendable,
                "borrowing": lim.borrowing,
                "lower": lim.lower,
                "upper": lim.upper,
                "maxSeats": lim.max_seats,
                "queues": q.queues if q else None,
                "handSize": q.hand_size if q else None,
                "queueLengthLimit": q.queue_length_limit if q else None,
                "fairness": pl.fairness,
                "maxSeatsAnnotation": pl.max_seats,
                "uid": pl.uid,
                "source": pl.source,
            }
        )
    schemas = [
        {
            "name": fs.name,
            "matchingPrecedence": fs.matching_precedence,
            "priorityLevel": fs.priority_level,
            "distinguisher": fs.distinguisher,
            "uid": fs.uid,
            "source": fs.source,
        }
        for fs in cfg.flow_schemas
    ]
    dangling = [
        {"name": fs.name, "priorityLevel": fs.priority_level, "source": fs.source, "message": msg,
         "field": err.field, "error": str(err)}
        for (fs, msg), err in zip(cfg.dangling, cfg.dangling_errors(), strict=True)
    ]
    return {
        "valid": True,
        "concurrencyLimit": server_limit,
        "nominalSum": nominal_sum(limits),
        "priorityLevels": levels,
        "flowSchemas": schemas,
        "dangling": dangling,
        "brokenPriorityLevels": [{"name": n, "reason": r} for n, r in cfg.broken],
        "repairedPriorityLevels": [{"name": pl.name, "source": pl.source, "reason": r}
                                   for pl, r in cfg.repaired],
        "sources": list(cfg.sources),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines) + "\n"


def render_text(cfg: Configuration, limits: dict[str, LevelLimits], server_limit: int,
                source: str = "", shown: str | None = None) -> str:
    """The human report; ``shown`` describes the limit (default ``"<server_limit> seats"``;
    ``auto (starts at N seats, bounds ...)`` with an adaptive limit)."""
    def opt(value: Any) -> str:
        return "-" if value is None else str(value)

    rows = [["PRIORITY LEVEL", "TYPE", "SHARES", "NOMINAL", "LENDABLE", "LOWER", "UPPER",
             "MAX SEATS", "QUEUES", "HAND", "QLL"]]  # fmt: skip
    for name, pl in cfg.priority_levels.items():
        lim = limits[name]
        q = pl.queuing
        kind = pl.type if pl.is_exempt else f"{pl.type}/{pl.limit_response}"
        rows.append([
            name, kind, str(pl.nominal_concurrency_shares), str(lim.nominal), str(lim.lendable),
            str(lim.lower), str(lim.upper), opt(lim.max_seats),
            opt(q and q.queues), opt(q and q.hand_size), opt(q and q.queue_length_limit),
        ])  # fmt: skip
    used = f", {source}" if source else ""
    out = [f"Server concurrency limit {shown or f'{server_limit} seats'}{used}; "
           f"nominal sum {nominal_sum(limits)}.\n\n"]
    out.append(_table(rows))
    chosen = [f"{name} {pl.fairness}" for name, pl in cfg.priority_levels.items()
              if pl.fairness is not None]
    if chosen:
        out.append(f"Fairness by annotation ({fairness.ANNOTATION}): "
                   f"{', '.join(chosen)}; "
                   f"other levels: APF_FAIRNESS (default {fairness.SERVER_DEFAULT}).\n")
    widest = [f"{name} {pl.max_seats}" for name, pl in cfg.priority_levels.items()
              if pl.max_seats is not None]
    if widest:
        out.append(f"Max seats by annotation ({MAX_SEATS_ANNOTATION}): {', '.join(widest)}; "
                   "other queuing levels: Kubernetes' 15% of nominal.\n")
    fs_rows = [["FLOW SCHEMA", "PRECEDENCE", "PRIORITY LEVEL", "DISTINGUISHER", "SOURCE"]]
    for fs in cfg.flow_schemas:
        fs_rows.append([fs.name, str(fs.matching_precedence), fs.priority_level,
                        opt(fs.distinguisher), fs.source])  # fmt: skip
    out.append("\n")
    out.append(_table(fs_rows))
    if cfg.dangling:
        out.append("\nDangling FlowSchemas (not used for matching):\n")
        for fs, msg in cfg.dangling:
            out.append(f"  {fs.name} ({fs.source}): {msg}\n")
    return "".join(out)
