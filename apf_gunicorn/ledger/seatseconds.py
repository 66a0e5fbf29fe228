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
