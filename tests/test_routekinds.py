"""Service time per route for APF_CONCURRENCY_LIMIT=auto (admission/routekinds.py): the workers
count each finished request under its route (the path, digit-bearing segments as *) in their
own row of a shared table; the master sums the rows. Through the real middleware, with an
injected clock."""

from __future__ import annotations

from types import SimpleNamespace as NS

from werkzeug.test import EnvironBuilder

from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.admission.routekinds import SLOTS, RouteTimes, route_shape
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec

T0 = 1_000_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def middleware(table: RouteTimes | None, clock: Clock, row: int = 1, exempt: bool = False):
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure([LevelSpec("lvl", 0 if exempt else 8, 2, 50, 10)], ["fs"],
                                    T0)
    level = NS(name="lvl", uid="pl", is_exempt=exempt)
    schema = NS(name="fs", uid="fs")

    class Classifier:
        def classify(self, attrs):
            return NS(flow_schema=schema, priority_level=level, distinguisher="", flow_hash=7)

    def app(environ, start_response):
        clock.now += 5_000_000 if environ["PATH_INFO"] == "/" else 200_000_000
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    ctx = WorkerContext(
        ledger=led, resolver=RequestInfoResolver(), classifier=Classifier(), level_index=levels,
        fs_index=schemas, owner=row, parking=Parking(), deliver=lambda granted: None,
        add_linger=lambda *a: None, queue_wait_limit_ns=10**9, alive=lambda: True,
        clock=clock, route_times=table)
    return APFMiddleware(app, ctx)


def get(mw, path: str) -> None:
    body = mw(EnvironBuilder(path=path).get_environ(), lambda *a: None)
    b"".join(body)
    body.close()


def test_route_shape_hides_identifiers() -> None:
    assert route_shape("/") == "/"
    assert route_shape("/items/42") == "/items/*"
    assert route_shape("/v2/items/42/edit") == "/*/items/*/edit"


def test_each_route_is_counted_with_its_service_time_in_the_workers_row() -> None:
    table, clock = RouteTimes.create(rows=4), Clock()
    mw = middleware(table, clock, row=1)
    for path in ("/", "/", "/slow/1", "/slow/2"):
        get(mw, path)
    totals = table.totals()
    by_label = {table.label(slot): value for slot, value in totals.items()}
    assert by_label == {("lvl", "fs", "/"): (2, 10_000_000),
                        ("lvl", "fs", "/slow/*"): (2, 400_000_000)}
    # the worker wrote its own row only
    row1 = range(SLOTS * 2, SLOTS * 4)
    assert all(v == 0 for i, v in enumerate(table.words.tolist()) if i not in row1)
    # another worker's row adds up in the totals
    other = middleware(table, clock, row=2)
    get(other, "/")
    assert {table.label(s): v for s, v in table.totals().items()}[("lvl", "fs", "/")] == \
        (3, 15_000_000)


def test_exempt_requests_and_a_fixed_limit_count_nothing() -> None:
    table, clock = RouteTimes.create(rows=4), Clock()
    get(middleware(table, clock, exempt=True), "/")
    assert table.totals() == {}
    get(middleware(None, clock), "/")  # a fixed limit: no table, nothing to count


def test_a_row_past_the_table_is_not_counted() -> None:
    table, clock = RouteTimes.create(rows=2), Clock()
    assert table.offset(2, "lvl", "fs", "/") == -1
    get(middleware(table, clock, row=5), "/")
    assert table.totals() == {}
