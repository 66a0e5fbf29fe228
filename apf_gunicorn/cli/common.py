"""Helpers the subcommands share: the server-limit arguments, loading a configuration and
reporting why it failed.

    add_limit_arguments(parser)               # --concurrency-limit, --workers, --threads
    limit, source, auto = server_limit(args)  # (64, "the server's default for 2 workers ...", None)
    cfg = load_or_report(path, "check")
    if isinstance(cfg, int):
        return cfg          # 1: invalid (every error printed), 2: unreadable
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

from apf_gunicorn import conf
from apf_gunicorn.flowcontrol.configuration import Configuration
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.validation import ConfigErrors
from apf_gunicorn.server.settings import (
    SettingsError,
    auto_start,
    default_concurrency_limit,
    parse_auto_limit,
)


def plural(count: int, noun: str) -> str:
    """``"1 error"``, ``"2 errors"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def positive_int(text: str) -> int:
    """An argparse type: a positive integer.

    Raises:
        argparse.ArgumentTypeError: not an integer, or not positive.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def limit_argument(text: str) -> int | str:
    """An argparse type: a positive integer, or ``auto`` / ``auto:MIN-MAX`` (kept as text:
    plain ``auto``'s bounds depend on ``--workers`` and ``--threads``).

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text.strip().lower().startswith("auto"):
        try:
            parse_auto_limit(text, 1, 1)
        except SettingsError as e:
            raise argparse.ArgumentTypeError(e.allowed) from None
        return text.strip().lower()
    return positive_int(text)


class ServerLimit(NamedTuple):
    """The server concurrency limit a command assumes: ``seats`` (with ``auto``, where it
    starts), where it comes from, and ``auto``'s ``(MIN, MAX)`` bounds or None."""

    seats: int
    source: str
    auto: tuple[int, int] | None = None

    def describe(self) -> str:
        """``"20 seats"``, or ``"auto (starts at 20 seats, bounds 2-64; experimental)"``."""
        if self.auto is None:
            return f"{self.seats} seats"
        return (f"auto (starts at {self.seats} seats, bounds {self.auto[0]}-{self.auto[1]}; "
                "experimental: the server moves it)")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--concurrency-limit``, ``--workers`` and ``--threads``: what :func:`server_limit`
    reads."""
    parser.add_argument(
        "--concurrency-limit",
        type=limit_argument,
        metavar="N",
        help="server concurrency limit in seats, or auto / auto:MIN-MAX, as "
        "APF_CONCURRENCY_LIMIT (default: the server's default for --workers x --threads)",
    )
    parser.add_argument(
        "--workers", type=positive_int, default=conf.workers, metavar="W",
        help=f"gunicorn workers, for the default limit (default {conf.workers}, as "
        "apf_gunicorn.conf)",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=conf.threads, metavar="T",
        help=f"threads per worker, for the default limit (default {conf.threads}, as "
        "apf_gunicorn.conf)",
    )


def server_limit(args: argparse.Namespace, environment_limit: int | str | None = None
                 ) -> ServerLimit:
    """The server concurrency limit a command assumes, and a phrase saying where it comes from.

    Args:
        args: parsed arguments of :func:`add_limit_arguments` (``concurrency_limit``,
            ``workers``, ``threads``).
        environment_limit: ``APF_CONCURRENCY_LIMIT`` (seats, or its ``auto`` text) when the
            command reads the environment and it is set, else None.

    Returns:
        :class:`ServerLimit`, e.g. ``(600, "from --concurrency-limit", None)``:
        ``--concurrency-limit``, else ``APF_CONCURRENCY_LIMIT``, else the server's default for
        ``--workers`` x ``--threads``. With ``auto``, ``seats`` is where the server starts: the
        default, within the bounds.
    """
    default = default_concurrency_limit(args.workers, args.threads)
    for value, source in ((args.concurrency_limit, "from --concurrency-limit"),
                          (environment_limit, "from APF_CONCURRENCY_LIMIT")):
        if isinstance(value, str):
            low, high = parse_auto_limit(value, args.workers, args.threads)
            return ServerLimit(auto_start(args.workers, args.threads, (low, high)), source,
                               (low, high))
        if value is not None:
            return ServerLimit(value, source)
    return ServerLimit(default, (
        f"the server's default for {args.workers} workers x {args.threads} threads: "
        "workers x threads / 2 unless APF_CONCURRENCY_LIMIT is set "
        "(check it with --concurrency-limit)"))


def load_or_report(path: str | None, command: str) -> Configuration | int:
    """The configuration at ``path`` (None: the built-in one), or the exit status after printing
    every error to stderr: 1 for an invalid configuration, 2 for one that cannot be read."""
    where = path or "the built-in configuration"
    try:
        return load_configuration(path)
    except ConfigErrors as exc:
        print(f"{where}: invalid configuration ({plural(len(exc.errors), 'error')}):",
              file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"apf-gunicorn {command}: cannot read {where}: {exc}", file=sys.stderr)
        return 2
