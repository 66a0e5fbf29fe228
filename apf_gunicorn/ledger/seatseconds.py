"""Kubernetes' ``SeatSeconds``: uint64 fixed point, 1 unit = 1e-8 seat-second.

Python ints never overflow, so every function here wraps to 64 bits explicitly; the queue set
depends on that (a finish correction with a negative argument must *add* through uint64
wraparound, and the epoch advance is triggered at exact uint64 thresholds).

    >>> ss_string(seats_times_duration(123, 100_000_000))
    '12.30000000ss'
    >>> duration_per_seat(seats_times_duration(13, 5_000_000), 5)
    13000000
"""

from __future__ import annotations

from apf_gunicorn.flowcontrol.gomath import go_round

SS_SCALE = 100_000_000
MAX_SEAT_SECONDS = (1 << 64) - 1
MIN_SEAT_SECONDS = 0
U64 = MAX_SEAT_SECONDS
# advanceEpoch: subtract rDecrement once currentR reaches highR (queueset.go).
R_DECREMENT = MAX_SEAT_SECONDS // 2
HIGH_R = R_DECREMENT + R_DECREMENT // 2

_I64_MIN = -(1 << 63)
_INF = float("inf")


def _go_int64(x: float) -> int:
    """Go's float64 -> int64 conversion on amd64 (truncation; out of range gives MinInt64)."""
    if x != x or x >= 9.223372036854775807e18 or x < -9.223372036854775808e18:
        return _I64_MIN
    return int(x)


def seats_times_duration(seats: float, duration_ns: int) -> int:
    """``SeatsTimesDuration``: ``round(seats * ns / 10)`` as int64, then as uint64 (wraps)."""
    x = seats * float(duration_ns) / 10
    if x != x or x in (_INF, -_INF):
        return _I64_MIN & U64
    return _go_int64(go_round(x)) & U64


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
