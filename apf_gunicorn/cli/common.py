"""Helpers the subcommands share: loading a configuration and reporting why it failed.

    cfg = load_or_report(path, "check")
    if isinstance(cfg, int):
        return cfg          # 1: invalid (every error printed), 2: unreadable
"""

from __future__ import annotations

import sys

from apf_gunicorn.flowcontrol.configuration import Configuration
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.validation import ConfigErrors


def load_or_report(path: str | None, command: str) -> Configuration | int:
    """The configuration at ``path`` (None: the built-in one), or the exit status after printing
    every error to stderr: 1 for an invalid configuration, 2 for one that cannot be read."""
    where = path or "the built-in configuration"
    try:
        return load_configuration(path)
    except ConfigErrors as exc:
        print(f"{where}: invalid configuration ({len(exc.errors)} errors):", file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"apf-gunicorn {command}: cannot read {where}: {exc}", file=sys.stderr)
        return 2
