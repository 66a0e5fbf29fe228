"""Kubernetes' ``SeatSeconds``: uint64 fixed point, 1 unit = 1e-8 seat-second.

Python ints never overflow, so every function here wraps to 64 bits explicitly; the queue set
depends on that (a finish correction with a negative argument must *add* through uint64
wraparound, and the epoch advance is triggered at exact uint64 thresholds).

    >>> ss_string(seats_times_duration(123, 100_000_000))
    '12.30000000ss'
    >>> duration_per_seat(seats_times_duration(13, 5_000_000), 5)
    13000000
    >>> seats_ns_times(3, -15) == seats_times_duration(3.0, -15)
    True
"""

from __future__ import annotations

SS_SCALE = 100_000_000
MAX_SEAT_SECONDS = (1 << 64) - 1
MIN_SEAT_SECONDS = 0
U64 = MAX_SEAT_SECONDS
# advanceEpoch: subtract rDecrement once currentR reaches highR (queueset.go).
R_DECREMENT = MAX_SEAT_SECONDS // 2
HIGH_R = R_DECREMENT + R_DECREMENT // 2

_I64_MIN = -(1 << 63)
_TWO63 = float(1 << 63)


def _go_int64(x: float) -> int:
    """Go's float64 -> int64 conversion on amd64 (truncation; out of range gives MinInt64)."""
    if -_TWO63 <= x < _TWO63:
        return int(x)
    return _I64_MIN


def seats_times_duration(seats: float, duration_ns: int) -> int:
    """``SeatsTimesDuration``: ``math.Round(seats * ns / 10)`` as int64, then as uint64 (wraps).

    Rounds exactly as Go's ``math.Round`` (half away from zero, no ``x + 0.5`` double
    rounding: 0.49999999999999994 rounds to 0)."""
    x = seats * float(duration_ns) / 10
    if -_TWO63 <= x < _TWO63:  # False for NaN and infinities
        t = int(x)  # truncates toward zero; x - t is exact
        d = x - t
        if d >= 0.5:
            t += 1
        elif d <= -0.5:
            t -= 1
        if t < _TWO63:
            return t & U64
    return _I64_MIN & U64  # Go's out-of-range float -> int64 on amd64


# Below this bound on |seats * ns| the float path equals integer rounding (see seats_ns_times).
EXACT_BOUND = 1 << 50


def seats_ns_times(seats: int, duration_ns: int) -> int:
    """``seats_times_duration`` for integer seats, in integer arithmetic where that is exact.

    Why it is exact for |x| < 2^50, x = seats * ns (both ints): x is an integer below 2^53, so
    ``float(seats) * float(ns)`` is exactly x, and ``x / 10`` in float is the correctly rounded
    q = x/10 (1 + e), |e| <= 2^-53. |x/10| < 2^47 so |q - x/10| <= ulp/2 <= 2^-6. The exact
    x/10 is a multiple of 0.1: either a half-integer (k + 0.5, exactly representable below
    2^52, so q = x/10) or at least 0.1 away from every half-integer, further than q can drift.
    Rounding q half away from zero (Go's math.Round) therefore rounds x/10 itself, which is
    ``(x + 5) // 10`` for x >= 0 and ``-((5 - x) // 10)`` below 0. The int64 -> uint64 wrap is
    the same. Outside the bound, the float path."""
    x = seats * duration_ns
    if 0 <= x < EXACT_BOUND:
        return (x + 5) // 10
    if -EXACT_BOUND < x < 0:
        return -((5 - x) // 10) & U64
    return seats_times_duration(float(seats), duration_ns)


def duration_per_seat(ss: int, seats: float) -> int:
    """``SeatSeconds.DurationPerSeat``: ``ss / seats`` as a duration in ns, truncated."""
    if seats == 0:
        return _I64_MIN  # Go: ss/0 is +Inf or NaN; converting either gives MinInt64 on amd64
    return _go_int64(float(ss) / seats * 10.0)


def ss_to_float(ss: int) -> float:
    """``SeatSeconds.ToFloat``: seat-seconds as a float."""
    return float(ss) / SS_SCALE


def ss_string(ss: int) -> str:
    """``SeatSeconds.String``: ``<int>.<8 digits>ss``."""
    quo, rem = divmod(ss & U64, SS_SCALE)
    return f"{quo}.{rem:08d}ss"
