"""Work estimates: validation of declared costs, hook results, the clamp to a level's max
seats (Kubernetes' vectors), the estimator hook's fallback and once-per-error logging."""

from __future__ import annotations

import datetime
import logging
import sys
import types
from pathlib import Path

import pytest

from apf_gunicorn.flowcontrol.limits import LevelLimits, compute_limits
from apf_gunicorn.flowcontrol.objects import PriorityLevel, QueuingConfig
from apf_gunicorn.flowcontrol.workestimate import (
    ONE_SEAT,
    EstimateError,
    EstimatorHook,
    HookLoadError,
    WorkEstimate,
    clamp,
    estimate_from_result,
    level_max_seats,
    load_estimator_hook,
    make_estimate,
)


def test_make_estimate_defaults_and_durations() -> None:
    assert make_estimate() == ONE_SEAT == WorkEstimate()
    assert make_estimate(4, 2, "50ms") == WorkEstimate(4, 2, 50_000_000, False)
    assert make_estimate(1, 1, "1.5s", True) == WorkEstimate(1, 1, 1_500_000_000, True)
    assert make_estimate(1, 1, datetime.timedelta(milliseconds=7)).additional_latency_ns == 7 * 10**6
    assert make_estimate(1, 1, additional_latency_ns=123).additional_latency_ns == 123
    # a tail without final seats is no tail
    assert make_estimate(2, 0, "5s") == WorkEstimate(2, 0, 0, False)
    assert WorkEstimate(2, 5).max_seats == 5


@pytest.mark.parametrize("kwargs, field, text", [
    ({"seats": 0}, "seats", "from 1 to"),
    ({"seats": 2.5}, "seats", "must be an integer"),
    ({"seats": True}, "seats", "must be an integer"),
    ({"seats": "4"}, "seats", "must be an integer"),
    ({"final_seats": -1}, "final_seats", "from 0 to"),
    ({"final_seats": 1, "additional_latency": "fast"}, "additional_latency", "Go duration"),
    ({"final_seats": 1, "additional_latency": "-5ms"}, "additional_latency", "from 0 to 1h"),
    ({"final_seats": 1, "additional_latency": "2h"}, "additional_latency", "from 0 to 1h"),
    ({"final_seats": 1, "additional_latency": 5}, "additional_latency", "Go duration string"),
    ({"additional_latency_ns": -1}, "additional_latency_ns", "nanoseconds"),
    ({"long_running": "yes"}, "long_running", "true or false"),
])
def test_make_estimate_names_the_bad_field(kwargs, field, text) -> None:
    with pytest.raises(EstimateError) as err:
        make_estimate(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(field + ": ")
    assert text in str(err.value)


def test_field_names_can_be_renamed_for_messages() -> None:
    with pytest.raises(EstimateError, match="^finalSeats: "):
        make_estimate(final_seats=-2, names={"final_seats": "finalSeats"})


def test_estimate_from_result() -> None:
    assert estimate_from_result(None) is None
    assert estimate_from_result(WorkEstimate(3, 1, 9)) == WorkEstimate(3, 1, 9, False)
    assert estimate_from_result({"seats": 5}) == WorkEstimate(5)
    assert estimate_from_result({"initial_seats": 2, "final_seats": 1,
                                 "additional_latency": "1ms", "long_running": True}) == \
        WorkEstimate(2, 1, 1_000_000, True)
    assert estimate_from_result({"final_seats": 1, "additional_latency_ns": 10}) == \
        WorkEstimate(1, 1, 10)
    with pytest.raises(ValueError, match="unknown work estimate key"):
        estimate_from_result({"width": 3})
    with pytest.raises(ValueError, match="not both"):
        estimate_from_result({"additional_latency": "1ms", "additional_latency_ns": 1})
    with pytest.raises(TypeError, match="got int"):
        estimate_from_result(4)
    with pytest.raises(EstimateError):
        estimate_from_result(WorkEstimate(0))


@pytest.mark.parametrize("est, max_seats, expected", [
    (WorkEstimate(4, 0, 0), 10, WorkEstimate(4, 0, 0)),
    (WorkEstimate(40, 0, 0), 10, WorkEstimate(10, 0, 0)),
    (WorkEstimate(0, 0, 0), 10, WorkEstimate(1, 0, 0)),
    (WorkEstimate(5, 0, 0), 0, WorkEstimate(1, 0, 0)),  # at least one seat, always
    # Kubernetes' mutating estimator vectors: final seats capped, the tail's area kept
    (WorkEstimate(1, 20, 5_000_000), 10, WorkEstimate(1, 10, 10_000_000)),
    (WorkEstimate(1, 10, 5_000_000), 5, WorkEstimate(1, 5, 10_000_000)),
    (WorkEstimate(1, 3, 5_000_000), 10, WorkEstimate(1, 3, 5_000_000)),
    (WorkEstimate(1, 0, 5_000_000), 10, WorkEstimate(1, 0, 0)),
    (WorkEstimate(9, 4, 7, True), 2, WorkEstimate(2, 2, 14, True)),  # long_running kept
])
def test_clamp(est, max_seats, expected) -> None:
    assert clamp(est, max_seats) == expected


def _queuing(nominal_shares: int, hand: int) -> PriorityLevel:
    return PriorityLevel(name="q", type="Limited", nominal_concurrency_shares=nominal_shares,
                         limit_response="Queue",
                         queuing=QueuingConfig(queues=64, hand_size=hand, queue_length_limit=50))


@pytest.mark.parametrize("server_limit, hand, expected", [
    # Kubernetes' Test_GetMaxSeats (one level holding the whole server limit)
    (5, 6, 1), (10, 6, 1), (15, 6, 2), (20, 6, 3), (35, 6, 5), (100, 6, 15), (200, 6, 30),
    (10, 1, 2), (100, 20, 5),
])
def test_level_max_seats_of_queuing_levels(server_limit, hand, expected) -> None:
    level = _queuing(100, hand)
    (lim,) = compute_limits([level], server_limit).values()
    assert level_max_seats(lim, False, server_limit) == expected


def test_level_max_seats_of_other_levels() -> None:
    reject = LevelLimits(nominal=8, lendable=0, borrowing=0, lower=8, upper=8, max_seats=None)
    assert level_max_seats(reject, False, 100) == 8  # its nominal limit
    empty = LevelLimits(nominal=0, lendable=0, borrowing=0, lower=0, upper=0, max_seats=None)
    assert level_max_seats(empty, False, 100) == 1
    exempt = LevelLimits(nominal=0, lendable=0, borrowing=100, lower=0, upper=100, max_seats=None)
    assert level_max_seats(exempt, True, 100) == 100  # the server limit


def test_hook_results_and_fallback_logging(caplog) -> None:
    calls = []

    def fn(environ, attrs, c):
        calls.append(environ["n"])
        n = environ["n"]
        if n == "dict":
            return {"seats": 3}
        if n == "none":
            return None
        if n == "bad":
            return "three"
        if n == "zero":
            return {"seats": 0}
        raise RuntimeError(f"boom {n}")

    hook = EstimatorHook(fn, "mod:fn")
    caplog.set_level(logging.ERROR, "apf_gunicorn.workestimate")
    assert hook({"n": "dict"}, None, None) == WorkEstimate(3)
    assert hook({"n": "none"}, None, None) is None
    for _ in range(3):
        assert hook({"n": "bad"}, None, None) is None
        assert hook({"n": "zero"}, None, None) is None
        assert hook({"n": "1"}, None, None) is None
    assert hook({"n": "2"}, None, None) is None
    assert hook.failures == 10
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4  # once per distinct error: bad type, bad seats, boom 1, boom 2
    assert all(m.startswith("APF_WORK_ESTIMATOR mod:fn failed") for m in messages)
    assert any("boom 2" in m for m in messages) and any("seats:" in m for m in messages)


def test_load_estimator_hook(monkeypatch) -> None:
    module = types.ModuleType("apf_test_estimators")
    module.ns = types.SimpleNamespace(est=lambda e, a, c: {"seats": 2})
    module.not_callable = 3
    monkeypatch.setitem(sys.modules, "apf_test_estimators", module)
    hook = load_estimator_hook("apf_test_estimators:ns.est")
    assert hook({}, None, None) == WorkEstimate(2)
    assert hook.name == "apf_test_estimators:ns.est"
    for spec, text in [("nocolon", "expected 'module:callable'"),
                       ("apf_no_such_module_x:f", "cannot import"),
                       ("apf_test_estimators:missing", "has no 'missing'"),
                       ("apf_test_estimators:not_callable", "is not callable")]:
        with pytest.raises(HookLoadError, match=text) as err:
            load_estimator_hook(spec)
        assert str(err.value).startswith(f"APF_WORK_ESTIMATOR={spec!r}")


def test_settings_and_server_wiring(tmp_path) -> None:
    from apf_gunicorn.flowcontrol.loader import load_configuration
    from apf_gunicorn.flowcontrol.request_info_hook import HookedResolver
    from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
    from apf_gunicorn.flowcontrol.routes import parse_routes
    from apf_gunicorn.server import generation
    from apf_gunicorn.server.settings import SettingsError, load_settings

    assert load_settings({}).work_estimator is None
    assert load_settings({"APF_WORK_ESTIMATOR": "my.mod:est"}).work_estimator == "my.mod:est"
    with pytest.raises(SettingsError, match="APF_WORK_ESTIMATOR"):
        load_settings({"APF_WORK_ESTIMATOR": "my.mod.est"})

    settings = load_settings({"APF_CONCURRENCY_LIMIT": "16"})
    seats_yaml = str(Path(__file__).parent / "apps" / "seats.yaml")
    gen = generation.load_generation(dataclass_replace(settings, seats_yaml))
    assert generation.level_max_seats(gen, settings) == {
        "wide": 8, "narrow": 2, "exempt": 16, "catch-all": 1}
    assert load_configuration(seats_yaml)  # the file the server test uses

    table = parse_routes([{"path": "/a", "seats": 2}])
    builtin = RequestInfoResolver(routes=table)
    assert generation.route_table(builtin) is table
    assert generation.route_table(HookedResolver(lambda e: {}, builtin)) is table
    assert generation.route_table(RequestInfoResolver()) is None


def dataclass_replace(settings, config_path):
    import dataclasses

    return dataclasses.replace(settings, config_path=config_path)
