"""Go's numeric and time conventions that Kubernetes' numbers depend on.

Python differs from Go in ways that change real results: ``round()`` rounds half to even where
Go's ``math.Round`` rounds half away from zero (workload-low lendable 220.5 -> 221), durations
are ``time.Duration`` nanoseconds with their own text form, and times print as RFC3339Nano.

    >>> go_round(220.5), go_round(-2.5)
    (221, -3)
    >>> parse_duration("1m30s"), format_duration(90_000_000_000)
    (90000000000, '1m30s')
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from fractions import Fraction

NS_PER_SECOND = 1_000_000_000

_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "μs": 1_000,
    "ms": 1_000_000,
    "s": NS_PER_SECOND,
    "m": 60 * NS_PER_SECOND,
    "h": 3600 * NS_PER_SECOND,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def go_round(x: float) -> int:
    """Go ``math.Round``: half away from zero, returned as an int.

    Not ``floor(x + 0.5)``: that addition itself rounds, so 0.49999999999999994 would become 1.
    """
    a = abs(x)
    whole = math.floor(a)
    r = int(whole) + (1 if a - whole >= 0.5 else 0)
    return -r if x < 0 else r


def parse_duration(value: str | int | float) -> int:
    """A Go duration string (``"1s"``, ``"250ms"``, ``"-1ns"``, ``"1h2m"``) or a number of
    seconds, as integer nanoseconds. Raises ``ValueError`` with the offending text."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, int):
        return value * NS_PER_SECOND
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"invalid duration {value!r}")
        return go_round(value * NS_PER_SECOND)
    if not isinstance(value, str):
        raise ValueError(f"invalid duration {value!r}")
    text = value.strip()
    if text in ("0", "+0", "-0"):
        return 0
    sign = 1
    body = text
    if body and body[0] in "+-":
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    if not body:
        raise ValueError(f"invalid duration {value!r}")
    pos = 0
    total = Fraction(0)

    while pos < len(body):
        m = _DURATION_PART.match(body, pos)
        if not m:
            raise ValueError(f"invalid duration {value!r}")
        total += Fraction(m.group(1)) * _UNITS_NS[m.group(2)]
        pos = m.end()
    return sign * int(total)  # Go truncates fractional nanoseconds


def format_duration(ns: int) -> str:
    """Go ``time.Duration.String()``: ``0s``, ``5ms``, ``1.5s``, ``1m0s``, ``-1ns``."""
    if ns == 0:
        return "0s"
    neg = ns < 0
    u = -ns if neg else ns
    if u < NS_PER_SECOND:
        for unit, scale in (("ns", 1), ("µs", 1_000), ("ms", 1_000_000)):
            if u < scale * 1000:
                text = _frac(u, scale) + unit
                break
    else:
        hours, rem = divmod(u, 3600 * NS_PER_SECOND)
        minutes, rem = divmod(rem, 60 * NS_PER_SECOND)
        text = _frac(rem, NS_PER_SECOND) + "s"
        if hours:
            text = f"{hours}h{minutes}m{text}"
        elif minutes:
            text = f"{minutes}m{text}"
    return "-" + text if neg else text


def _frac(value: int, scale: int) -> str:
    whole, frac = divmod(value, scale)
    if not frac:
        return str(whole)
    digits = len(str(scale)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def format_rfc3339nano(unix_ns: int | None) -> str:
    """Go ``time.RFC3339Nano`` in UTC with trailing zeros trimmed. ``None`` or 0 is Go's zero
    time ``0001-01-01T00:00:00Z`` (a waiting request's start time in the dumps)."""
    if not unix_ns:
        return "0001-01-01T00:00:00Z"
    secs, frac = divmod(unix_ns, NS_PER_SECOND)
    base = _dt.datetime.fromtimestamp(secs, tz=_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        base += "." + f"{frac:09d}".rstrip("0")
    return base + "Z"


def duration_seconds(ns: int) -> float:
    """Go ``Duration.Seconds()``: whole seconds plus the nanosecond remainder / 1e9, which is
    what makes Kubernetes' exact-average scenarios reproducible bit for bit."""
    sec, nsec = divmod(abs(ns), NS_PER_SECOND)
    value = float(sec) + float(nsec) / 1e9
    return -value if ns < 0 else value
