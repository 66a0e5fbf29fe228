"""SeatSeconds vectors from Kubernetes' seat_seconds_test.go (k8s-queueset.md 1.1)."""

from __future__ import annotations

from apf_gunicorn.ledger.seatseconds import (
    HIGH_R,
    MAX_SEAT_SECONDS,
    R_DECREMENT,
    duration_per_seat,
    seats_times_duration,
    ss_string,
    ss_to_float,
)

MS = 1_000_000
S = 1_000_000_000


def test_string_vectors() -> None:
    assert ss_string(1) == "0.00000001ss"
    assert ss_string(100_000_000 - 1) == "0.99999999ss"
    assert ss_string(0) == "0.00000000ss"


def test_seats_times_duration_vectors() -> None:
    for seats, d, text, f in ((1, S, "1.00000000ss", 1.0), (123, 100 * MS, "12.30000000ss", 12.3),
                              (1203, 10 * MS, "12.03000000ss", 12.03)):
        ss = seats_times_duration(seats, d)
        assert ss_string(ss) == text
        assert ss_to_float(ss) == f


def test_duration_per_seat_vectors() -> None:
    assert duration_per_seat(seats_times_duration(10, S), 1) == 10 * S
    assert duration_per_seat(seats_times_duration(1, S), 10) == 100 * MS
    assert duration_per_seat(seats_times_duration(13, 5 * MS), 5) == 13 * MS
    assert duration_per_seat(seats_times_duration(12, 0), 10) == 0


def test_negative_products_wrap_like_int64_to_uint64() -> None:
    # finish correction with S > G: subtracting the wrapped value adds initial*(S-G)
    corr = seats_times_duration(2.0, 3 * MS - 1 * S)
    assert corr == (1 << 64) - 2 * (S - 3 * MS) // 10
    assert (1000 - corr) & MAX_SEAT_SECONDS == 1000 + 2 * (S - 3 * MS) // 10


def test_go_rounding_is_half_away_from_zero() -> None:
    assert seats_times_duration(1, 5) == 1  # 0.5 -> 1 (Python's round would give 0)
    assert seats_times_duration(1, 15) == 2  # 1.5 -> 2
    assert seats_times_duration(1, 25) == 3  # 2.5 -> 3 (banker's rounding gives 2)
    assert seats_times_duration(-1, 25) == (1 << 64) - 3


def test_epoch_thresholds() -> None:
    assert R_DECREMENT == 9223372036854775807
    assert HIGH_R == 13835058055282163710


def test_integer_path_equals_the_float_path_on_random_values_and_at_the_bound() -> None:
    import random

    from apf_gunicorn.ledger.seatseconds import EXACT_BOUND, seats_ns_times

    rng = random.Random(20261121)
    cases = []
    for _ in range(200_000):
        seats = rng.choice((rng.randrange(0, 8), rng.randrange(0, 1000), rng.randrange(1, 1 << 20)))
        span = rng.choice((1000, 10**7, 10**10, 10**13, EXACT_BOUND // max(seats, 1) + 2))
        cases.append((seats, rng.randrange(-span, span)))
    for seats in (1, 3, 7, 10, 999):  # products on both sides of the bound, and ties
        for k in range(-30, 30):
            d = EXACT_BOUND // seats + k
            cases += [(seats, d), (seats, -d), (seats, d - d % 10 + 5), (seats, -(d - d % 10 + 5))]
    cases += [(1, 5), (1, -5), (1, 15), (1, -15), (1, 25), (3, 5), (0, 10**18), (7, 0)]
    for seats, d in cases:
        assert seats_ns_times(seats, d) == seats_times_duration(float(seats), d), (seats, d)
