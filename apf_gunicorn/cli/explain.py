"""`apf-gunicorn explain`: not written yet (see the open issues)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    print("apf-gunicorn explain: not implemented yet", file=sys.stderr)
    return 2
