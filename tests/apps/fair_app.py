"""The server-test app (``tests/apps/app.py``) plus three views of different widths, for the
fairness test on real gunicorn (tests/test_server_fairness.py). Serve
``tests.apps.fair_app:app`` with ``APF_CONFIG=tests/apps/fair.yaml``.

``/w1``, ``/w2`` and ``/w4`` declare 1, 2 and 4 seats with ``@cost``, sleep ``ms``
milliseconds (default 100), and append one record per request to the file ``APP_FAIR_LOG``::

    <seats> <user> <start monotonic_ns> <end monotonic_ns> <pid>

(one ``write`` on an ``O_APPEND`` descriptor, so records of concurrent requests never
interleave). The user is the ``X-Remote-User`` header, the flow the test gave the request.
:func:`read_records` parses the file.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

from flask import request

from apf_gunicorn.flask import cost
from tests.apps.app import app

__all__ = ["app", "WIDTHS", "Record", "read_records"]

WIDTHS = (1, 2, 4)
_LOG = os.environ.get("APP_FAIR_LOG", "")


class Record(NamedTuple):
    seats: int
    user: str
    start_ns: int
    end_ns: int
    pid: int


def read_records(path: str) -> list[Record]:
    """Every record in ``path``, in file order."""
    out = []
    with open(path) as f:
        for line in f:
            seats, user, start, end, pid = line.split()
            out.append(Record(int(seats), user, int(start), int(end), int(pid)))
    return out


def _view(seats: int):
    @cost(seats=seats)
    def view():
        ms = float(request.args.get("ms", "100"))
        user = request.headers.get("X-Remote-User", "-") or "-"
        start = time.monotonic_ns()
        time.sleep(ms / 1000)
        end = time.monotonic_ns()
        fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{seats} {user} {start} {end} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return f"w{seats} done\n"

    view.__name__ = f"w{seats}"
    return view


for _seats in WIDTHS:
    app.add_url_rule(f"/w{_seats}", view_func=_view(_seats))
