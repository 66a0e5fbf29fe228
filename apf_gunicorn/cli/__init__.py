"""The ``apf-gunicorn`` command line: ``check``, ``explain``, ``simulate`` and ``dump``.

Each subcommand lives in its own module (``cli/check.py`` …) exposing
``add_arguments(parser)`` and ``run(args) -> int``; this module only wires them together.

    $ apf-gunicorn check builtin:kubernetes --concurrency-limit 600 --json
    $ apf-gunicorn --version
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "check": "validate a configuration and print each priority level's limits",
    "explain": "show which FlowSchema, priority level, flow and queues a request gets",
    "simulate": "run the fair-queuing code against a synthetic workload in virtual time",
    "dump": "print the live debug dumps of a running server",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apf-gunicorn",
        description="Kubernetes API Priority and Fairness for gunicorn.",
    )
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the versions of apf_gunicorn, gunicorn and Python, and "
                        "whether the ledger's C fast path is in use")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, help_text in SUBCOMMANDS.items():
        module = importlib.import_module(f"apf_gunicorn.cli.{name}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def version_line() -> str:
    """``apf-gunicorn 0.1.0 (gunicorn 23.0.0, Python 3.11.2, C fast path)``: what a bug report
    needs."""
    import platform

    import gunicorn

    from apf_gunicorn import __version__
    from apf_gunicorn.ledger import ledger

    fast = "C fast path" if ledger._ACCEL is not None else "pure-Python fast path"
    return (f"apf-gunicorn {__version__} (gunicorn {gunicorn.__version__}, "
            f"Python {platform.python_version()}, {fast})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `apf-gunicorn dump queues | head`
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
