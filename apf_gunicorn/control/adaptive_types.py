"""What the adaptive limit's controller (:mod:`apf_gunicorn.control.adaptive`) is fed and
configured with, and what it answers: the ``auto`` setting's bounds, a tick's observations,
the controller's constants, its decision. Kept apart so that settings, the simulator's scenario
and the metrics read them without the control law.

    lo, hi = parse_auto("auto:2-64")                     # (2, 64)
    tick = Tick(now, {"users": KindSample(120, 6_100_000_000)}, concurrency=9.6, waiting=True,
                cpu=CpuSample(workers=2, busy=1.9, cpu_per_request_ns=5e6))
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

#: what ``auto`` means without bounds
DEFAULT_MINIMUM = 1
DEFAULT_MAXIMUM = 1024


def parse_auto(text: str) -> tuple[int, int] | None:
    """Parse ``auto`` or ``auto:MIN-MAX``.

    Args:
        text: the setting's value.
    Returns:
        ``(minimum, maximum)``, or None when ``text`` is not an ``auto`` form at all (a number,
        say).
    Raises:
        ValueError: an ``auto:`` form whose bounds are not two integers ``1 <= MIN <= MAX``.
    """
    text = text.strip()
    if text == "auto":
        return DEFAULT_MINIMUM, DEFAULT_MAXIMUM
    if not text.startswith("auto:"):
        return None
    low, sep, high = text[5:].partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"{text!r}: write auto or auto:MIN-MAX, e.g. auto:2-64")
    lo, hi = int(low), int(high)
    if lo < 1 or hi < lo:
        raise ValueError(f"{text!r}: the bounds must satisfy 1 <= MIN <= MAX")
    return lo, hi


@dataclass(frozen=True, slots=True)
class KindSample:
    """The requests of one kind that finished in a tick: how many, and their summed service
    time (dispatch to finish: execution, not queue wait), in ns."""

    count: int
    service_ns: int


@dataclass(frozen=True, slots=True)
class CpuSample:
    """The server's CPU over a tick (``signals/cpu.py`` measures it once a window).

    ``workers``: the workers counted; ``busy``: their CPU summed, in cores (a worker's GIL
    lets it use about one); ``cpu_per_request_ns``: their CPU over the requests they served
    (None: none); ``host_share``: the busy share of all the host's cores (None: not known);
    ``cores``: the host's cores (0: not known); ``wanted``: the workers' time running or
    waiting for a core (the host's run queue), in workers (each at most 1; None: not known):
    near ``workers``, they always had Python to run, and only the cores held them back.
    """

    workers: int
    busy: float
    cpu_per_request_ns: float | None = None
    host_share: float | None = None
    cores: int = 0
    wanted: float | None = None

    @property
    def gil_share(self) -> float:
        """The workers' mean share of their GILs (1.0: all at capacity)."""
        return self.busy / self.workers if self.workers > 0 else 0.0

    @property
    def others_share(self) -> float | None:
        """The share of all cores busy with other processes than our workers."""
        if self.host_share is None or self.cores <= 0:
            return None
        return max(0.0, self.host_share - self.busy / self.cores)


@dataclass(frozen=True, slots=True)
class Tick:
    """What one tick observed.

    ``kinds`` maps a kind of request (any hashable: a level name, or ``(level, route)``) to its
    :class:`KindSample`; ``concurrency`` is the average seats executing over the tick;
    ``waiting`` says whether any request waited in a queue (the limit was binding); ``cpu``
    the server's CPU (None: not measured: the latency law alone decides).
    """

    now: int
    kinds: Mapping[Hashable, KindSample]
    concurrency: float
    waiting: bool
    cpu: CpuSample | None = None


@dataclass(frozen=True, slots=True)
class AdaptiveSettings:
    """The controller's bounds and constants (the defaults are what the simulator's tests
    and docs/adaptive.md use)."""

    minimum: int = DEFAULT_MINIMUM
    maximum: int = DEFAULT_MAXIMUM
    tolerance: float = 0.25  # inflation up to 1 + tolerance counts as none
    gain_low: float = 0.08  # throughput elasticity below which added seats only wait
    gain_high: float = 0.5  # elasticity at which added seats clearly pay
    step_up: float = 0.25  # a confirmed move up: a quarter (at least one seat)
    step_explore: float = 0.1  # an exploratory move: a tenth (at least one seat)
    step_down: float = 0.25  # the largest move down per tick
    memory_above_ticks: int = 4  # how long what a higher concurrency said is believed ...
    # ... while recovering (the limit below where it was before the last cut); at the high, a
    # probe past the knee costs the light user a wait inside the app, so it is rare
    memory_above_steady_ticks: int = 60
    memory_below_ticks: int = 20  # ... and a lower one
    separation: float = 1.08  # two concurrencies compared differ by at least this ratio
    smoothing: float = 0.5  # weight of a new tick in a concurrency's smoothed sample
    regime_change: float = 0.2  # a jump of the inflation at one concurrency wiping the rest
    binding_fraction: float = 0.9  # executing seats / limit from which the limit binds
    reset_ticks: int = 30  # binding ticks at the floor, inflated, before baselines reset
    noise_prior: float = 0.03  # a tick's inflation noise (log) assumed for a point seen once
    confidence: float = 0.25  # moving up needs the elasticity this many noise spreads above gain_low
    slow_start: float = 0.25  # the growth per tick while latency stays at its baseline
    fall_back: float = 0.1  # inflation falling by this much, to calm, means capacity came back
    jump_down: float = 0.5  # the largest move down when latency at one concurrency jumps
    look_below: bool = True  # the first binding tick halves the limit to see below the start
    fall_sigmas: float = 3.0  # a fall short of calm counts beyond this many noise spreads
    # the CPU (issue 33): the workers at this share of their GILs, or the host at this share
    # of its cores with our workers using at least cpu_ours of its busy time, are CPU-bound
    gil_full: float = 0.9
    host_full: float = 0.9
    cpu_ours: float = 0.5
    # ... or running or waiting for a core (a busy host) this share of the time, their
    # requests' CPU at least cpu_part of their no-load service time
    cpu_part: float = 0.1
    # CPU-bound, the seats that keep every worker's GIL busy: workers x (no-load service
    # time / CPU per request, at least 1) x (1 + cpu_margin): a request ready in each worker
    # while one runs, so that its GIL does not wait for a seat's hand-off
    cpu_margin: float = 1.0
    # a host busy with other processes: from this share of its cores not ours
    host_others: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"bounds must satisfy 1 <= minimum <= maximum, got "
                             f"{self.minimum}-{self.maximum}")


@dataclass(slots=True)
class Decision:
    """The last tick's outcome, for metrics, logs and tests."""

    limit: int
    reason: str
    inflation: float | None = None
    concurrency: float = 0.0
    below: float | None = None  # elasticity towards the lower concurrency compared
    above: float | None = None  # ... towards the higher one
