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
FLOOD = 20  # more than the level's seats plus the flooder's queues (webapp 2 + 3, public 8 + 6)


def hand_of(config: str, address: str) -> set[int]:
    c = Classifier(load_configuration(builtin_path(config))).classify(
        RequestAttributes(f"addr:{address}", ("system:unauthenticated",), "get", "/work"))
    return set(hand(c))


@pytest.mark.parametrize("config, seats", [
    ("webapp", 2),  # APF_CONFIG=builtin:webapp: anonymous has 16 % of the limit, 2 of 8
    (None, 8),  # the default with only unverified identities: builtin:public, all 8
])
def test_a_flooding_address_leaves_another_address_a_queue(server_factory, config, seats):
    # the cases this test is about: 219 in 220 (webapp), 4059 in 4060 (public)
    assert not hand_of(config or "public", CLIENT) <= hand_of(config or "public", FLOODER)
    env = {"APF_USER_FROM": "address", "APF_CONCURRENCY_LIMIT": "8",
           "APF_CONFIG": "" if config is None else f"builtin:{config}"}
    with server_factory(workers=1, threads=32, env=env) as srv:
        if config is None:
            assert srv.wait_for(lambda: "configuration builtin:public (default when "
                                "APF_USER_FROM=address" in srv.log(), timeout=30)
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
        assert srv.level("anonymous").requests_executing == seats  # the level's every seat
        status, _, body = srv.request("/work?ms=1", headers={"X-Forwarded-For": CLIENT},
                                      timeout=60)
        assert (status, body.startswith(b"work done")) == (200, True)
        for t in threads:
            t.join(60)
        assert srv.idle() is not None
