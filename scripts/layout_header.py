"""Write apf_gunicorn/ledger/_layout.h, the C header of the ledger's layout constants.

``_fastpath.c`` includes the header instead of copying ``layout.py``'s constants (and the
arithmetic constants it shares with ``seatseconds.py`` and ``service.py``) by hand; the
header is committed, so building the extension needs no Python step. Run this after changing
one of them, then reinstall (``bash scripts/test.sh --co -q``) so the
extension is rebuilt::

    .venv/bin/python scripts/layout_header.py           # regenerate
    .venv/bin/python scripts/layout_header.py --check   # exit 1 if the committed one is stale

tests/test_ledger_layout.py runs the check.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the worktree's layout.py, installed or not

from apf_gunicorn.ledger.layout import c_header  # noqa: E402

HEADER = ROOT / "apf_gunicorn" / "ledger" / "_layout.h"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the header differs from layout.py")
    args = parser.parse_args(argv)
    text = c_header()
    if args.check:
        if not HEADER.exists() or HEADER.read_text() != text:
            print(f"{HEADER.relative_to(ROOT)} is stale: run python scripts/layout_header.py",
                  file=sys.stderr)
            return 1
        return 0
    HEADER.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
