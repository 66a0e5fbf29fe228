"""The server-test app (``tests/apps/app.py``) plus views with declared costs, for the seat
tests on real gunicorn (tests/test_server_seats.py). Serve ``tests.apps.seats_app:app``.

``/wide`` gets its 4 seats from the route file (``seats_routes.yaml``); the others declare
theirs with ``@cost``. ``/wide`` and ``/clamped`` count executing requests in the "heavy"
counter of the cross-process counter file.
"""

import time

from flask import Response, request

from apf_gunicorn.flask import cost
from tests.apps.app import _update, app

__all__ = ["app"]


def _held(counter: str) -> str:
    ms = float(request.args.get("ms", "300"))
    _update(counter, 1)
    try:
        time.sleep(ms / 1000)
    finally:
        _update(counter, -1)
    return "done\n"


@app.route("/wide")
def wide():  # 4 seats: APF_ROUTES
    return _held("heavy")


@app.route("/clamped")
@cost(seats=4)  # on a queuing level whose max seats is 2
def clamped():
    return _held("light")


@app.route("/linger")
@cost(seats=1, final_seats=2, additional_latency="6s")  # long enough to see on a loaded machine
def linger():
    return "lingering\n"


@app.route("/feed")
@cost(seats=2, long_running=True)
def feed():
    gap = float(request.args.get("gap", "2"))

    def gen():
        yield "first\n"
        time.sleep(gap)
        yield "second\n"
    return Response(gen(), mimetype="text/plain")


@app.route("/download")
@cost(seats=2)  # the same stream, not long-running: seats held until the body is sent
def download():
    gap = float(request.args.get("gap", "2"))

    def gen():
        yield "first\n"
        time.sleep(gap)
        yield "second\n"
    return Response(gen(), mimetype="text/plain")
