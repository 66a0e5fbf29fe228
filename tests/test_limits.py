"""Static per-level limits against Kubernetes' published numbers (k8s-apf-config.md 3.3, 5.1, 5.5)."""

from __future__ import annotations

import pytest

from apf_gunicorn.flowcontrol.bootstrap import MANDATORY_PRIORITY_LEVELS
from apf_gunicorn.flowcontrol.limits import (
    LevelLimits,
    compute_limits,
    max_waiting_requests,
    nominal_sum,
)
from apf_gunicorn.flowcontrol.loader import builtin_path, load_configuration
from apf_gunicorn.flowcontrol.objects import PriorityLevel, QueuingConfig

EXEMPT = MANDATORY_PRIORITY_LEVELS["exempt"]
CATCH_ALL = MANDATORY_PRIORITY_LEVELS["catch-all"]


def queuing(name, shares, lendable=0, borrowing=None, queues=64, hand=6, qll=50):
    return PriorityLevel(
        name=name,
        type="Limited",
        nominal_concurrency_shares=shares,
        lendable_percent=lendable,
        borrowing_limit_percent=borrowing,
        limit_response="Queue",
        queuing=QueuingConfig(queues, hand, qll),
    )


# (nominal, lendable, lower, upper, max_seats) for ServerCL 600, from the 3.3 table.
KUBERNETES_600 = {
    "exempt": (0, 0, 0, 600, None),
    "catch-all": (13, 0, 13, 613, None),
    "system": (74, 24, 50, 674, 12),
    "node-high": (98, 25, 73, 698, 15),
    "leader-election": (25, 0, 25, 625, 4),
    "workload-high": (98, 49, 49, 698, 15),
    "workload-low": (245, 221, 24, 845, 37),
    "global-default": (49, 25, 24, 649, 8),
}


def test_kubernetes_defaults_at_600():
    cfg = load_configuration(builtin_path("kubernetes"))
    limits = compute_limits(cfg.priority_levels.values(), 600)
    got = {n: (x.nominal, x.lendable, x.lower, x.upper, x.max_seats) for n, x in limits.items()}
    assert got == KUBERNETES_600
    assert all(x.borrowing == 600 for x in limits.values())
    assert nominal_sum(limits) == 602  # exceeds 600 because of ceil
    assert max_waiting_requests(cfg.priority_levels.values()) == 26400


@pytest.mark.parametrize(
    "server_limit, hand, expected",
    [(5, 6, 1), (10, 6, 1), (15, 6, 2), (20, 6, 3), (35, 6, 5), (100, 6, 15), (200, 6, 30),
     (10, 1, 2), (100, 20, 5)],
)  # fmt: skip
def test_max_seats_vectors(server_limit, hand, expected):
    # max_seats_test: one level with 10000 shares next to the imagined mandatory levels.
    pl = queuing("test-pl", 10000, queues=64 if hand <= 6 else 128, hand=hand)
    limits = compute_limits([pl, EXEMPT, CATCH_ALL], server_limit)
    assert limits["test-pl"].max_seats == expected
    assert limits["exempt"].max_seats is None and limits["catch-all"].max_seats is None


def test_borrowing_test_nominals():
    pl0 = queuing("test-pl0", 100, queues=10, hand=2, qll=10)
    pl1 = queuing("test-pl1", 100, queues=10, hand=2, qll=10)
    limits = compute_limits([pl0, pl1, EXEMPT, CATCH_ALL], 24)
    assert [limits[n].nominal for n in ("test-pl0", "test-pl1", "catch-all", "exempt")] == [
        12, 12, 1, 0,
    ]  # fmt: skip
    assert nominal_sum(limits) == 25


@pytest.mark.parametrize(
    "p0, p1, expected",
    [
        # lendable-limited: pl0 lendable 50 / borrowing 67, pl1 lendable 33 / borrowing 50
        ((50, 67), (33, 50), ((6, 20), (8, 18))),
        # borrowing-limited: pl0 lendable 50 / borrowing 33, pl1 lendable 67 / borrowing 50
        ((50, 33), (67, 50), ((6, 16), (4, 18))),
    ],
)
def test_borrowing_test_bounds(p0, p1, expected):
    pl0 = queuing("pl0", 100, lendable=p0[0], borrowing=p0[1], queues=10, hand=2)
    pl1 = queuing("pl1", 100, lendable=p1[0], borrowing=p1[1], queues=10, hand=2)
    limits = compute_limits([pl0, pl1, EXEMPT, CATCH_ALL], 24)
    assert (
        (limits["pl0"].lower, limits["pl0"].upper),
        (limits["pl1"].lower, limits["pl1"].upper),
    ) == expected


def test_exempt_borrowing_numbers():
    high = queuing("workload-high", 40, lendable=50, queues=128)
    low = queuing("workload-low", 100, lendable=90, queues=128)
    limits = compute_limits([high, EXEMPT, low, CATCH_ALL], 870)
    assert limits == {
        "workload-high": LevelLimits(240, 120, 870, 120, 1110, 36),
        "exempt": LevelLimits(0, 0, 870, 0, 870, None),
        "workload-low": LevelLimits(600, 540, 870, 60, 1470, 90),
        "catch-all": LevelLimits(30, 0, 870, 30, 900, None),
    }
    assert nominal_sum(limits) == 870


def test_exempt_shares_count_and_exempt_borrowing_is_server_limit():
    exempt = PriorityLevel("exempt", "Exempt", nominal_concurrency_shares=5, lendable_percent=50,
                           borrowing_limit_percent=None)  # fmt: skip
    limits = compute_limits([exempt, CATCH_ALL], 100)
    assert limits["exempt"] == LevelLimits(50, 25, 100, 25, 150, None)
    assert limits["catch-all"].nominal == 50


def test_go_rounding_half_away_from_zero():
    # 98 * 25% = 24.5 must round to 25 (Python's round() would give 24).
    pl = queuing("x", 98, lendable=25, borrowing=25)
    limits = compute_limits([pl], 98)
    assert (limits["x"].lendable, limits["x"].borrowing) == (25, 25)


def test_reject_level_has_no_max_seats_and_zero_shares_gets_zero():
    jail = PriorityLevel("jail", "Limited", nominal_concurrency_shares=0, limit_response="Reject")
    limits = compute_limits([jail, CATCH_ALL], 10)
    assert limits["jail"] == LevelLimits(0, 0, 10, 0, 10, None)
    assert compute_limits([jail], 10)["jail"].nominal == 0  # shareSum 0 does not divide by zero


def test_max_seats_annotation_replaces_kubernetes_rule():
    """apf-gunicorn.io/max-seats (PriorityLevel.max_seats) sets the widest request of a
    queuing or Reject level, above or below Kubernetes' 15%; exempt levels keep None."""
    import dataclasses

    from apf_gunicorn.flowcontrol.limits import max_seats_origin

    small = queuing("small", 1, hand=1)
    wide = dataclasses.replace(small, name="wide", max_seats=4)
    reject = PriorityLevel(name="reject", type="Limited", nominal_concurrency_shares=1,
                           limit_response="Reject", max_seats=3)
    limits = compute_limits([small, wide, reject], 8)  # 8 / 3 shares: nominal 3 each
    assert limits["small"].max_seats == 1  # ceil(0.15 x 3)
    assert limits["wide"].max_seats == 4
    assert limits["reject"].max_seats == 3
    assert "apf-gunicorn.io/max-seats annotation" in max_seats_origin(wide)
    assert max_seats_origin(small).startswith("Kubernetes' rule")
    assert "set it with the apf-gunicorn.io/max-seats" in max_seats_origin(small)
