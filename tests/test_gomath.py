"""Go conventions that Kubernetes' numbers depend on."""

import pytest

from apf_gunicorn.flowcontrol.gomath import (
    duration_seconds,
    format_duration,
    format_rfc3339nano,
    go_round,
    parse_duration,
)


@pytest.mark.parametrize(
    ("x", "want"),
    [(220.5, 221), (24.5, 25), (0.5, 1), (1.4999, 1), (-2.5, -3), (-0.4, 0), (2.0, 2),
     (0.49999999999999994, 0), (-0.49999999999999994, 0), (4503599627370497.0, 4503599627370497)],
)
def test_go_round_is_half_away_from_zero(x, want):
    assert go_round(x) == want


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("1s", 1_000_000_000),
        ("250ms", 250_000_000),
        ("-1ns", -1),
        ("2184h", 2184 * 3600 * 10**9),
        ("1h2m3.5s", (3600 + 120 + 3) * 10**9 + 500_000_000),
        ("1.5us", 1500),
        ("0", 0),
        (2, 2 * 10**9),
        (0.25, 250_000_000),
    ],
)
def test_parse_duration(text, ns):
    assert parse_duration(text) == ns


@pytest.mark.parametrize("bad", ["", "1", "s", "1x", "1s2", "--1s", True, None, float("nan")])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (5_000_000, "5ms"),
        (1_500_000_000, "1.5s"),
        (60 * 10**9, "1m0s"),
        (3_723_000_000_000, "1h2m3s"),
        (-1, "-1ns"),
        (1500, "1.5µs"),
    ],
)
def test_format_duration_matches_go(ns, text):
    assert format_duration(ns) == text


def test_rfc3339nano():
    assert format_rfc3339nano(1714557600123456789) == "2024-05-01T10:00:00.123456789Z"
    assert format_rfc3339nano(1714557600100000000) == "2024-05-01T10:00:00.1Z"
    assert format_rfc3339nano(1714557600000000000) == "2024-05-01T10:00:00Z"
    assert format_rfc3339nano(0) == "0001-01-01T00:00:00Z"


def test_duration_seconds_like_go():
    assert duration_seconds(1_500_000_000) == 1.5
    assert duration_seconds(-1) == -1e-9
    assert duration_seconds(20 * 10**9 + 1) == 20.0 + 1e-9
