"""``apf-gunicorn check PATH [--concurrency-limit N] [--json]``: validate a configuration.

Prints every priority level with the seats it gets for a server concurrency limit of N (default
600, Kubernetes' 400 + 200 in-flight default), the FlowSchemas in matching order, and dangling
schemas or broken levels as warnings (on stderr). ``PATH`` is a YAML file, a directory of them,
or ``builtin:<name>`` (``webapp``, ``kubernetes``, ``mandatory``).

Exit status: 0 valid (warnings allowed), 1 invalid (every error listed on stderr), 2 the path
cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from apf_gunicorn.cli.common import load_or_report
from apf_gunicorn.flowcontrol.configuration import Configuration
from apf_gunicorn.flowcontrol.limits import LevelLimits, compute_limits, nominal_sum

DEFAULT_CONCURRENCY_LIMIT = 600


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH", help="YAML file, directory of *.yaml/*.yml, or builtin:NAME"
    )
    parser.add_argument(
        "--concurrency-limit",
        type=_positive_int,
        default=DEFAULT_CONCURRENCY_LIMIT,
        metavar="N",
        help=f"server concurrency limit in seats (default {DEFAULT_CONCURRENCY_LIMIT})",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args.path, "check")
    if isinstance(cfg, int):
        return cfg
    limits = compute_limits(cfg.priority_levels.values(), args.concurrency_limit)
    for warning in cfg.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        json.dump(report(cfg, limits, args.concurrency_limit), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(cfg, limits, args.concurrency_limit))
    return 0


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
        {"name": fs.name, "priorityLevel": fs.priority_level, "source": fs.source, "message": msg}
        for fs, msg in cfg.dangling
    ]
    return {
        "concurrencyLimit": server_limit,
        "nominalSum": nominal_sum(limits),
        "priorityLevels": levels,
        "flowSchemas": schemas,
        "dangling": dangling,
        "brokenPriorityLevels": [{"name": n, "reason": r} for n, r in cfg.broken],
        "sources": list(cfg.sources),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines) + "\n"


def render_text(cfg: Configuration, limits: dict[str, LevelLimits], server_limit: int) -> str:
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
    out = [f"Server concurrency limit {server_limit} seats; nominal sum {nominal_sum(limits)}.\n\n"]
    out.append(_table(rows))
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
