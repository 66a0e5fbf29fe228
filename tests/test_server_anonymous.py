"""Per-client fairness out of the box (real gunicorn): with ``APF_USER_FROM=address`` and the
built-in configuration, a client that floods the anonymous level fills only its own hand of
queues, and another address still gets a queue, and an answer."""

from __future__ import annotations

import threading

import pytest

from apf_gunicorn.flowcontrol.loader import builtin_path, load_configuration
from apf_gunicorn.flowcontrol.matching import Classifier, hand
from apf_gunicorn.flowcontrol.objects import RequestAttributes

pytestmark = pytest.mark.server

FLOODER, CLIENT = "203.0.113.66", "203.0.113.2"
FLOOD = 20  # more than the level's seats plus every queue of the old one-queue level (12)


def hand_of(address: str) -> set[int]:
    c = Classifier(load_configuration(builtin_path("webapp"))).classify(
        RequestAttributes(f"addr:{address}", ("system:unauthenticated",), "get", "/work"))
    return set(hand(c))


def test_a_flooding_address_leaves_another_address_a_queue(server_factory):
    assert not hand_of(CLIENT) <= hand_of(FLOODER)  # the 219 cases in 220 this test is about
    env = {"APF_USER_FROM": "address", "APF_CONCURRENCY_LIMIT": "8"}  # anonymous: 2 seats
    with server_factory(workers=1, threads=32, config="builtin:webapp", env=env) as srv:
        statuses: list[int] = []

        def flood() -> None:
            statuses.append(srv.request("/work?ms=3000", headers={"X-Forwarded-For": FLOODER},
                                        timeout=60)[0])

        threads = [threading.Thread(target=flood) for _ in range(FLOOD)]
        for t in threads:
            t.start()

        def settled() -> bool:  # every flood request executing, waiting or answered
            level = srv.level("anonymous")
            return (level.requests_executing + level.requests_waiting
                    + statuses.count(429)) == FLOOD

        assert srv.wait_for(settled, timeout=30), (statuses, srv.level("anonymous"))
        assert statuses.count(429) > 0  # the flooder's queues are full
        status, _, body = srv.request("/work?ms=1", headers={"X-Forwarded-For": CLIENT},
                                      timeout=60)
        assert (status, body.startswith(b"work done")) == (200, True)
        for t in threads:
            t.join(60)
        assert srv.idle() is not None
