"""The adaptive server concurrency limit (``auto``): a pure controller, fed once a tick.

The server's concurrency limit should sit at the knee of the real bottleneck (a connection
pool, the CPU): below it seats stay idle while the backend could serve more; above it requests
pile up *inside* the app, where nothing is fair. :class:`AdaptiveLimit` finds the knee from
what finished requests say, once a tick (about a second), with no probing window that rejects
or pins traffic: while it moves, requests wait fairly in the queues.

    ctl = AdaptiveLimit(AdaptiveSettings(minimum=2, maximum=64), start=20)
    limit = ctl.update(Tick(now, {("workload-low", "/items"): KindSample(120, 6_100_000_000)},
                            concurrency=19.6, waiting=True))

The control law (docs/adaptive.md has the reasoning and the simulator's numbers):

* **Inflation against each kind's own baseline.** A kind of request (a priority level, and a
  route shape when known) has a baseline: its service time with no contention. A tick's
  inflation ``r`` is the work-weighted ratio ``sum(service) / sum(count x baseline)`` over the
  kinds that finished, so a shift of the mix towards a slower kind is not inflation.
* **A curve, not a point.** Each tick's per-kind service times are filed under the concurrency
  they were observed at (the average seats executing), smoothed, and kept for a few ticks. The
  *throughput elasticity* between two concurrencies ``a < b`` is ``1 - ln(r_b/r_a) / ln(b/a)``:
  by Little's law, the fraction of the added seats that became throughput (1 below the knee of
  a pool; 0 beyond it, where added seats only wait for a connection; in between for CPU and
  the GIL, where latency grows with concurrency while throughput still grows too).
* **Moves** (at most one per two ticks: the tick after a move mixes requests served before
  it, so it only teaches baselines). With ``below`` the elasticity from the nearest lower
  concurrency to this one and ``above`` from this one to the nearest higher: down towards the
  lower one when ``below < gain_low`` (the seats above it only queued); up when
  ``above >= gain_low`` (by a quarter when ``>= gain_high``); a probe one step up when nothing
  is known above (by a quarter while rising and the last seats paid in full); moving up needs
  the elasticity to clear ``gain_low`` by ``confidence`` times its noise (each point's
  tick-to-tick spread over the distance between the points), so noise does not ratchet the
  limit up, while moving down needs no such proof (fewer seats only make requests wait in our
  fair queues); a step down
  when nothing is known below and the seats above did not pay (a quarter when they clearly
  did not), or when nothing is known at all and latency is inflated beyond ``1 + tolerance``
  (towards the tolerance, at most a quarter; with no-load baselines and latency within the
  tolerance, hold: a busy host's noise is no reason to go down); past the knee from a far
  lower point (the seats above here did not pay, latency not calm), a step towards calm;
  else hold: the knee. What a higher concurrency said is believed for ``memory_above_ticks``
  while recovering from a cut (a return of capacity is found within a few ticks) and for
  ``memory_above_steady_ticks`` at the high (a probe past the knee makes the light user wait
  inside the app: rare there), a lower one for ``memory_below_ticks``. An elasticity impossible
  for one backend, or a concurrency's inflation jumping by more than ``regime_change``, means
  the backend changed: the rest of the curve is forgotten.
* **Fast moves, before the curve** (they need baselines that are no-load latencies: the
  limit should start below the knee). *Slow start*: from the start, while latency stays at
  its baseline (within half the tolerance) and the last seats paid in full, the limit grows by
  ``slow_start`` a tick, with no settle tick; the first step that inflates latency ends it
  (back to where the inflation is within the tolerance). *A jump*: latency at one
  concurrency (or from a lower one, faster than concurrency) rising by more than
  ``regime_change`` means lost capacity: the limit is cut in proportion at once (at most by
  ``jump_down``), and restored on the next tick when fewer seats brought no relief (a uniform
  slowdown, not lost capacity). *Falling back*: latency falling to calm by ``fall_back`` or
  more means capacity came back: the limit returns to where it was before the last cut (at
  most twice) and slow start resumes. *The margin*, only while recovering (the limit below
  where it was before the last cut): once the baselines are known to be no-load (an
  elasticity >= ``gain_high`` seen while calm, or a tick that ran at most one request at a
  time), the limit holds up to the tolerance past the knee, or one seat past calm, instead of
  going down to the knee itself, so a returning capacity shows as latency falling back
  rather than waiting for a probe. At the high it sits at the knee itself: the light user's
  latency wins over finding new capacity quickly (docs/adaptive.md).
* **When the limit does not bind** (nothing waited, executing seats below
  ``binding_fraction`` of the limit): far below (demand under half the limit) it holds, so an
  idle server's limit does not drift; near it, the app's own bottleneck may still be
  overloaded while our limit is not reached, so unless fewer seats are known to cost
  throughput the limit steps below the demand and the curve learns.

Guards against the known failures of Envoy's adaptive concurrency filter and Netflix's
concurrency-limits: the baseline comes down at once (half the gap per tick, so one noisy tick
does not pull it to the bottom of the noise) and never creeps up under sustained load: it rises
only by a reset after ``reset_ticks`` binding ticks at the floor still inflated (the floor is
the least concurrency we can offer, so what is seen there is the best no-load estimate left);
smoothing and a tolerance against noise; moves bounded per tick; a floor (``minimum``) that
holds however inflated latency is.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from .adaptive_types import (
    DEFAULT_MAXIMUM,
    DEFAULT_MINIMUM,
    AdaptiveSettings,
    CpuSample,
    Decision,
    KindSample,
    Tick,
    parse_auto,
)

# the controller's inputs and settings, importable from here too
__all__ = ["DEFAULT_MAXIMUM", "DEFAULT_MINIMUM", "AdaptiveLimit", "AdaptiveSettings",
           "CpuSample", "Decision", "KindSample", "Tick", "parse_auto"]

# the latency law's cuts on inflated latency (a busy host may explain it: _host_explains);
# the look below and probes are not
_LATENCY_CUTS = ("down: latency jumped", "down: inflated", "down: finishing a partial cut",
                 "down: seats above only queued", "down: past the knee", "down: slow start")

# light traffic: at most this many requests at a time on average (five light users of the
# benchmark, one 50 ms query per 250 ms each, run 1.2)
LIGHT_SEATS = 2.0


@dataclass(slots=True)
class _Point:
    """The smoothed per-kind ``[count, service ns]`` observed at one concurrency (rounded),
    and the smoothed exact concurrency."""

    kinds: dict[Hashable, list[float]]
    tick: int
    concurrency: float
    samples: int = 1
    spread: float = 0.0  # smoothed squared log-deviation of a tick's inflation from the point


@dataclass(slots=True)
class AdaptiveLimit:
    """The controller: :meth:`update` once a tick returns the new server limit.

    Args:
        settings: bounds and constants.
        start: the limit before the first tick (clamped to the bounds).
    """

    settings: AdaptiveSettings
    start: int
    limit: int = field(init=False)
    baselines: dict[Hashable, float] = field(init=False, default_factory=dict)
    last: Decision = field(init=False)
    _curve: dict[int, _Point] = field(init=False, default_factory=dict)
    _tick: int = field(init=False, default=0)
    _floor_ticks: int = field(init=False, default=0)
    _settling: bool = field(init=False, default=False)
    _rising: bool = field(init=False, default=False)  # the last move was up
    _growing: bool = field(init=False, default=True)  # slow start: multiplicative growth
    _anchored: bool = field(init=False, default=False)  # baselines seen below the knee
    _jump: float = field(init=False, default=1.0)  # this tick's inflation over the point's
    _fall: float = field(init=False, default=1.0)  # the point's inflation over this tick's
    _fall_sure: bool = field(init=False, default=False)  # ... lower beyond the point's noise
    _r_now: float = field(init=False, default=1.0)  # this tick's inflation, unsmoothed
    _cut_from: int = field(init=False, default=0)  # the limit before the last cut
    # the last move: (the limit before it, the inflation it was decided on, whether it was a
    # cut on a jump)
    _moved: tuple[int, float, bool] | None = field(init=False, default=None)
    _look: int = field(init=False, default=0)  # looking below the start: the start; -1 done
    _floor_means: dict[Hashable, list[float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.limit = self._clamp(self.start)
        self.last = Decision(self.limit, "start")

    def _clamp(self, value: float) -> int:
        return max(self.settings.minimum, min(self.settings.maximum, int(value)))

    # -- the tick ---------------------------------------------------------------------------
    def update(self, tick: Tick) -> int:
        """Fold one tick's observations and return the limit to apply.

        Args:
            tick: what the tick observed (:class:`Tick`).
        Returns:
            The new server concurrency limit, within the settings' bounds.
        """
        self._tick += 1
        kinds = {k: s for k, s in tick.kinds.items() if s.count > 0}
        if not kinds:
            self.last = Decision(self.limit, "no finished requests", None, tick.concurrency)
            return self.limit
        self._learn_baselines(kinds)
        binding = tick.waiting or tick.concurrency >= self.settings.binding_fraction * self.limit
        cpu = self._cpu_rule(kinds, tick.cpu, tick.concurrency)
        if cpu is not None:
            return cpu
        if self._settling:
            # the first tick after a move mixes requests served before it: learn only baselines
            self._settling = False
            moved, self._moved = self._moved, None
            if moved is not None and binding:
                held = self.limit
                settled = self._settle(kinds, tick.concurrency, *moved)
                if settled is not None:
                    return self._busy_host(settled, held, kinds, tick.cpu)
            self.last = Decision(self.limit, "settling after a move", None, tick.concurrency)
            return self.limit
        key = max(1, round(tick.concurrency))
        r_now = self._inflation({k: [s.count, s.service_ns] for k, s in kinds.items()})
        self._file(key, kinds, r_now, tick.concurrency)
        r = self._inflation(self._curve[key].kinds)
        if not binding:
            self._floor_ticks = 0
            if tick.concurrency <= LIGHT_SEATS and r <= 1 + self.settings.tolerance / 2:
                # a request or two at a time, nothing waiting: (almost) nothing to contend
                # with, so the baselines (each kind's lowest mean yet) are no-load latencies
                self._anchored = True
            new, reason, below = self._unbound(key, tick.concurrency)
            self._settling = self._clamp(new) != self.limit
            self._moved = (self.limit, r, False)
            self.limit = self._clamp(new)
            self.last = Decision(self.limit, reason, r, tick.concurrency, below)
            return self.limit
        self._watch_floor(kinds, r)
        new, reason, below, above = self._decide(key, r, tick.concurrency)
        new, reason = self._host_explains(new, reason, r, kinds, tick.cpu)
        if self._anchored and new < self.limit and r > 1:
            # with no-load baselines, never below the margin: where latency would be calm if
            # it fell in proportion to the seats (as past a pool's knee)
            calm = 1 + self.settings.tolerance / 2
            new = max(new, min(self.limit - 1, round(self.limit * calm / r)))
        # a growth step needs no settle tick: it only asks whether latency stays calm
        self._settling = self._clamp(new) != self.limit and not (
            self._growing and reason in ("up: slow start", "up: latency fell back"))
        self._rising = self._clamp(new) > self.limit
        self._moved = (self.limit, r, reason == "down: latency jumped")
        self.limit = self._clamp(new)
        self.last = Decision(self.limit, reason, r, tick.concurrency, below, above)
        return self.limit

    # -- another signal in charge (auto with the app's pools) --------------------------------
    def cpu_bound(self, tick: Tick) -> str | None:
        """Why more seats add nothing now (the workers or the host at their CPU capacity, as
        the CPU rule judges it), or None; learns the tick's baselines (the CPU rule weighs
        the requests' CPU against them). For a limit another signal sets: a rise it wants is
        refused while this says why."""
        kinds = {k: s for k, s in tick.kinds.items() if s.count > 0}
        if kinds:
            self._learn_baselines(kinds)
        return self._cpu_bound(tick.cpu, kinds)

    def follow(self, limit: int, reason: str, concurrency: float = 0.0) -> None:
        """Another signal (the app's pools) set the limit: stand at ``limit`` (clamped), so
        that when it stops saying anything the latency law goes on from there, with no jump.
        What the curve held was seen at other limits, possibly before the other signal came:
        forgotten. No look below and no slow start: the other signal said where the knee was.
        """
        self.limit = self._clamp(limit)
        self.last = Decision(self.limit, reason, None, concurrency)
        self._curve.clear()
        self._look = -1
        self._growing = self._rising = self._settling = False
        self._moved = None
        self._cut_from = 0
        self._floor_ticks = 0

    # -- the CPU (issue 33) ------------------------------------------------------------------
    def _cpu_bound(self, cpu: CpuSample | None,
                   kinds: Mapping[Hashable, KindSample]) -> str | None:
        """Why more seats add nothing (for the log), or None: the workers at their GILs'
        capacity; or running or waiting for a core nearly all the time (a host whose other
        processes take the cores); or the host at its cores' with our workers using most."""
        s = self.settings
        if cpu is None or cpu.workers <= 0:
            return None
        if cpu.gil_share >= s.gil_full:
            return f"workers at {cpu.gil_share:.2f} of their GIL"
        if cpu.wanted is not None and cpu.wanted >= s.gil_full * cpu.workers and \
                self._cpu_part(kinds, cpu) >= s.cpu_part:
            # always Python to run, the host's cores the only limit: more seats add nothing
            # (threads that only wake for I/O also wait for a core on a busy host: the
            # requests must be CPU for a part of their time)
            return (f"workers want their GIL {cpu.wanted / cpu.workers:.2f} of the time "
                    f"({cpu.gil_share:.2f} running, the rest waiting for a core)")
        if (cpu.host_share is not None and cpu.cores > 0 and cpu.host_share >= s.host_full
                and cpu.busy >= s.cpu_ours * cpu.host_share * cpu.cores):
            return (f"host at {cpu.host_share:.2f} of its {cpu.cores} cores, "
                    f"{cpu.busy:.1f} of them ours")
        return None

    def _no_load_ns(self, kinds: Mapping[Hashable, KindSample]) -> float | None:
        """This tick's requests' mean service time at their baselines (no contention)."""
        n = sum(v.count for k, v in kinds.items() if self.baselines.get(k))
        if not n:
            return None
        return sum(v.count * self.baselines[k] for k, v in kinds.items()
                   if self.baselines.get(k)) / n

    def _cpu_part(self, kinds: Mapping[Hashable, KindSample], cpu: CpuSample) -> float:
        """The requests' CPU over their no-load service time, at most 1 (0: not known)."""
        base, per = self._no_load_ns(kinds), cpu.cpu_per_request_ns
        return min(1.0, per / base) if base and per else 0.0

    def cpu_seats(self, kinds: Mapping[Hashable, KindSample], cpu: CpuSample) -> int:
        """The seats that keep every worker's GIL busy: a worker runs one request's Python at a
        time, so it needs (no-load service time / CPU per request) requests, at least one,
        and ``cpu_margin`` more for the hand-offs between them (a seat freed in one worker
        may go to a request in another)."""
        s = self.settings
        base, per = self._no_load_ns(kinds), cpu.cpu_per_request_ns
        per_worker = max(1.0, base / per) if base and per else 1.0
        return max(1, math.ceil(cpu.workers * per_worker * (1 + s.cpu_margin) - 1e-9))

    def _cpu_rule(self, kinds: Mapping[Hashable, KindSample], cpu: CpuSample | None,
                  concurrency: float) -> int | None:
        """CPU-bound: more seats add nothing, and latency there is the GIL's queue, not the
        backend's: never up; down towards :meth:`cpu_seats` (at most ``step_down`` a tick),
        else hold, instead of the latency law's noisy look below. None: not CPU-bound."""
        why = self._cpu_bound(cpu, kinds)
        if why is None:
            return None
        assert cpu is not None
        s = self.settings
        target = self.cpu_seats(kinds, cpu)
        if 0 < self._look and self.limit < min(self._look, target):
            # the look below halved the limit before the CPU was known: the CPU says where
            # the knee is, so undo the look (up to the start, or the CPU's seats below it)
            new = self._clamp(min(self._look, target))
            reason = f"cpu: {why}, back to {new} seats (the look below is the CPU's to settle)"
        elif self.limit > target:
            new = self._clamp(max(target, math.floor(self.limit * (1 - s.step_down))))
            reason = f"cpu: {why}, {new} seats"
        else:
            new = self.limit
            reason = f"cpu: {why}, holding {new} seats (more add nothing)"
        # the CPU says where the knee is: no look below, no slow start, no settle tick
        self._look = -1
        self._growing = self._rising = self._settling = False
        self._moved = None
        self.limit = new
        self.last = Decision(new, reason, None, concurrency)
        return new

    def host_inflation(self, kinds: Mapping[Hashable, KindSample],
                       cpu: CpuSample | None) -> float | None:
        """The latency inflation a host busy with other processes explains, or None when it
        is not busy with them: the requests' CPU part (CPU per request over the no-load
        service time) stretched by the cores the others take (``cores / cores left``)."""
        s = self.settings
        others = cpu.others_share if cpu is not None else None
        if (others is None or cpu is None or cpu.host_share is None
                or cpu.host_share < s.host_full or others < s.host_others):
            return None
        part = self._cpu_part(kinds, cpu)
        left = max(0.5, cpu.cores * (1 - others))
        return 1 + part * (cpu.cores / left - 1)

    def _host_explains(self, new: float, reason: str, r: float,
                       kinds: Mapping[Hashable, KindSample], cpu: CpuSample | None
                       ) -> tuple[float, str]:
        """A cut on inflated latency while other processes keep the host busy: held when the
        busy host explains the inflation (more than the calm band, and this tick's within the
        calm band of it: fewer seats would not help), else made and said to be the
        backend's."""
        if new >= self.limit or not reason.startswith(_LATENCY_CUTS):
            return new, reason
        explained = self.host_inflation(kinds, cpu)
        if explained is None:
            return new, reason
        assert cpu is not None and cpu.others_share is not None
        host = f"{cpu.others_share:.2f} of {cpu.cores} cores not ours"
        calm = 1 + self.settings.tolerance / 2
        bound = explained * calm
        # a host that explains less than the calm band changes nothing: the law as on a quiet
        # host (holding there kept a pool app a seat or two past its knee)
        if explained > calm and r <= bound:
            return self.limit, (f"hold: host busy with other processes ({host}), latency "
                                f"x{r:.2f} within what it explains (x{explained:.2f}, "
                                f"x{bound:.2f} with the tolerance)")
        return new, (f"{reason} (a slow backend: latency x{r:.2f} beyond the busy host's "
                     f"x{explained:.2f}, {host})")

    def _busy_host(self, new: int, before: int, kinds: Mapping[Hashable, KindSample],
                   cpu: CpuSample | None) -> int:
        """:meth:`_host_explains` for the settle tick's cut (from ``before``), already
        applied: undone when the busy host explains the inflation."""
        if new >= before:
            return new
        last = self.last
        self.limit = before
        kept, reason = self._host_explains(new, last.reason, last.inflation or 1.0, kinds, cpu)
        self.limit = int(kept)
        if self.limit == before:
            self._settling = False
        self.last = Decision(self.limit, reason, last.inflation, last.concurrency)
        return self.limit

    def _settle(self, kinds: Mapping[Hashable, KindSample], concurrency: float,
                before: int, r_then: float, jumped: bool) -> int | None:
        """The settle tick after a move: finish a cut that fell short, or fall back.

        A capacity drop inside a tick shows only in part of its requests: the cut in
        proportion to the jump falls short, or no jump shows at all and the curve moves a
        step. The next tick's requests straddle our move, not the drop, and by Little's law
        ``concurrency / inflation`` is their throughput times the baselines: the seats the
        backend now serves at no-load speed, whatever the seats offered to it. After a cut on
        a jump, or when this tick's own inflation jumped past the one the move was decided on
        (by more than ``regime_change``: lost capacity, not the move), the limit goes to that
        plus the tolerance, at most half below the limit before the cut, as a cut on a jump.

        Args:
            kinds: this tick's samples; concurrency: its average seats executing.
            before: the limit before the move; r_then: the inflation it was decided on;
            jumped: it was a cut on a jump.
        The same tick can show the opposite: latency calm and lower than the move explains
        (fewer seats lower it at most in proportion, more seats do not lower it) means
        capacity came back, and the limit falls back as on a fall (:meth:`_react`).

        Returns:
            The new limit, or None when there is nothing to finish.
        """
        s = self.settings
        r_now = self._inflation({k: [v.count, v.service_ns] for k, v in kinds.items()})
        if self._anchored and r_now <= 1 + s.tolerance / 2 and (
                r_now * (1 + s.fall_back) <= r_then * min(1.0, self.limit / before)):
            # calm, and lower than the move explains: capacity came back while we moved
            self._growing = True
            self._rising = True
            grow = self.limit + max(1, round(s.slow_start * self.limit))
            new = self._clamp(max(grow, min(2 * self.limit, self._cut_from)))
            self.last = Decision(new, "up: latency fell back", r_now, concurrency)
            self.limit = new
            return new
        if not jumped:
            if r_now <= (1 + s.regime_change) * r_then * max(1.0, self.limit / before):
                return None
            # the drop came with (or just after) the curve's move: a jump seen a tick late
            self._growing = False
            self._curve.clear()
            self._cut_from = before
        # past the knee latency grows with the seats: where it would be calm
        target = max(math.floor(before * (1 - s.jump_down)),
                     math.ceil(self.limit * (1 + s.tolerance / 2) / max(r_now, 1e-9)))
        new = self._clamp(target)
        if new >= self.limit:
            return None
        self._settling = True  # the next tick straddles this cut
        self._rising = False
        self.last = Decision(new, "down: finishing a partial cut", r_now, concurrency)
        self.limit = new
        return new

    def _learn_baselines(self, kinds: Mapping[Hashable, KindSample]) -> None:
        """A kind's baseline starts at its first mean and only comes down: by half the gap per
        tick (less for a tick of one or two requests), so noise does not drag it to its
        bottom; it rises only by the floor reset (:meth:`_watch_floor`)."""
        for kind, s in kinds.items():
            mean = s.service_ns / s.count
            base = self.baselines.get(kind)
            if base is None or base <= 0:
                self.baselines[kind] = mean
            elif mean < base:
                self.baselines[kind] = base + 0.5 * min(1.0, s.count / 3) * (mean - base)

    def _inflation(self, kinds: Mapping[Hashable, list[float]]) -> float:
        """``sum(service) / sum(count x baseline)`` over kinds with a baseline."""
        num = den = 0.0
        for kind, (count, service) in kinds.items():
            base = self.baselines.get(kind)
            if base:
                num += service
                den += count * base
        return num / den if den > 0 else 1.0

    def _file(self, key: int, kinds: Mapping[Hashable, KindSample], r_now: float,
              concurrency: float) -> None:
        """Smooth this tick into the point at ``key``; a jump means the backend changed, and
        what other concurrencies said no longer holds."""
        s = self.settings
        point = self._curve.get(key)
        self._jump = self._fall = 1.0
        self._fall_sure = False
        self._r_now = r_now
        fresh = {k: [float(v.count), float(v.service_ns)] for k, v in kinds.items()}
        if point is not None and self._tick - point.tick <= s.memory_below_ticks:
            r_old = self._inflation(point.kinds)
            if r_old > 1 + s.tolerance / 2:
                self._fall = r_old / r_now
                # a tick straddling a return of capacity falls short of calm: enough when the
                # fall is beyond the point's own noise (and half of fall_back)
                noise = math.sqrt(point.spread) if point.samples > 1 else s.noise_prior
                self._fall_sure = math.log(self._fall) > max(math.log1p(s.fall_back / 2),
                                                             s.fall_sigmas * noise)
            if abs(math.log(r_now / r_old)) > math.log1p(s.regime_change):
                self._jump = r_now / r_old
                self._curve = {key: _Point(fresh, self._tick, concurrency)}
                return
            a = s.smoothing
            deviation = math.log(r_now / r_old) ** 2
            spread = deviation if point.samples == 1 else (1 - a) * point.spread + a * deviation
            merged = {k: [(1 - a) * c, (1 - a) * t] for k, (c, t) in point.kinds.items()}
            for k, (c, t) in fresh.items():
                old = merged.setdefault(k, [0.0, 0.0])
                old[0] += a * c
                old[1] += a * t
            conc = (1 - a) * point.concurrency + a * concurrency
            self._curve[key] = _Point(merged, self._tick, conc, point.samples + 1, spread)
        else:
            self._curve[key] = _Point(fresh, self._tick, concurrency)
        horizon = max(s.memory_above_ticks, s.memory_above_steady_ticks, s.memory_below_ticks)
        self._curve = {c: p for c, p in self._curve.items() if self._tick - p.tick <= horizon}

    def _recovering(self) -> bool:
        """Whether the limit is below where it was before the last cut on lost capacity: the
        capacity may come back, so a seat past the knee (the margin) and frequent probes pay
        for a quick return there. At the high they would only make requests wait inside the
        app."""
        return self.limit < self._cut_from

    def _neighbour(self, key: int, lower: bool) -> int | None:
        s = self.settings
        memory = s.memory_below_ticks if lower else (
            s.memory_above_ticks if self._recovering() else s.memory_above_steady_ticks)
        best = None
        for c, p in self._curve.items():
            if self._tick - p.tick > memory:
                continue
            if lower and c * s.separation <= key and (best is None or c > best):
                best = c
            elif not lower and c >= key * s.separation and (best is None or c < best):
                best = c
        return best

    def _compare(self, key: int, lower: bool) -> tuple[int | None, float | None]:
        """The neighbour below or above ``key`` and the elasticity between them. An
        elasticity impossible for one backend (latency falling as concurrency rises, or
        growing much faster than it) means the backend changed since the neighbour was seen:
        the rest of the curve is forgotten, only what ``key`` just said is kept."""
        other = self._neighbour(key, lower)
        if other is None:
            return None, None
        e = self._elasticity(other, key) if lower else self._elasticity(key, other)
        if not -1.0 <= e <= 1.5:
            here, there = self._curve[key], self._curve[other]
            rise = self._inflation(here.kinds) / self._inflation(there.kinds)
            if lower:  # latency here grew faster than concurrency: scale by the concurrency
                rise *= there.concurrency / max(here.concurrency, 1e-9)
            if rise > 1 + self.settings.regime_change:
                self._jump = rise
            self._curve = {key: self._curve[key]}
            return None, None
        return other, e

    def _uncertainty(self, a: int, b: int) -> float:
        """How far noise can move :meth:`_elasticity` between ``a`` and ``b``: the points'
        tick-to-tick spread (``noise_prior`` for a point seen once) over their distance."""
        s = self.settings
        pa, pb = self._curve[a], self._curve[b]
        var = sum(p.spread if p.samples > 1 else s.noise_prior ** 2 for p in (pa, pb))
        spread = math.log(max(pb.concurrency, 1e-9) / max(pa.concurrency, 1e-9))
        return math.sqrt(var) / spread if spread > 0.01 else math.inf

    def _elasticity(self, a: int, b: int) -> float:
        """Throughput elasticity between concurrencies ``a < b`` (Little's law on the
        inflation): 1 when latency stays flat, 0 when it grows as fast as concurrency."""
        pa, pb = self._curve[a], self._curve[b]
        ra, rb = self._inflation(pa.kinds), self._inflation(pb.kinds)
        spread = math.log(max(pb.concurrency, 1e-9) / max(pa.concurrency, 1e-9))
        if spread <= 0.01:
            return 1.0  # rounding put two alike concurrencies apart: nothing to learn
        return 1.0 - math.log(rb / ra) / spread

    def _unbound(self, key: int, concurrency: float) -> tuple[int, str, float | None]:
        """The limit did not bind: demand is below it. Far below (less than half), it holds,
        so an idle server's limit does not drift. Near it, the knee may still be under the
        demand (the app's own pool overloaded while our limit is not reached): unless a lower
        concurrency is known to cost throughput, the limit goes a step below the demand, so
        requests wait in our queues and the curve learns what fewer seats give."""
        s = self.settings
        if concurrency < 0.5 * self.limit:
            return self.limit, "not binding: hold", None
        lo, below = self._compare(key, lower=True)
        demand = math.ceil(concurrency)
        if below is None:
            step = max(1, math.ceil(s.step_explore * demand))
            return min(self.limit, demand - step), "not binding: probe below the demand", None
        if below < s.gain_low:
            ratio = max(1 - s.step_down, lo / max(concurrency, 1e-9))
            return min(self.limit, math.floor(demand * ratio)), \
                "not binding: seats above only queued", below
        return self.limit, "not binding: hold", below

    def _decide(self, key: int, r: float, concurrency: float
                ) -> tuple[float, str, float | None, float | None]:
        s = self.settings
        limit = self.limit
        lo, below = self._compare(key, lower=True)
        hi, above = self._compare(key, lower=False)
        if lo is not None and lo not in self._curve:  # the comparison above wiped the curve
            lo, below = None, None
        inflated = r > 1 + s.tolerance
        calm = r <= 1 + s.tolerance / 2
        # the margin: with no-load baselines, hold a little past the knee (latency calm, or
        # one seat past what the backend serves at no-load speed, concurrency / r by Little's
        # law), where a capacity increase shows as latency falling back
        # only while recovering: at the high, the light user's latency wins over finding more
        # capacity (a seat past a pool's knee makes one of her requests in a few wait a query)
        margin = self._anchored and self._recovering() and (
            calm or round(concurrency - concurrency / r) <= 1)
        if calm and gain_high_seen(below, above, s.gain_high):
            # a point below the knee (the seats above it paid in full): its latency is no-load
            self._anchored = True
        look = self._look_below(key, hi, above)
        if look is not None:
            return look
        react = self._react(r, lo, below, above)
        if react is not None:
            return react
        explore_up = limit + max(1, math.ceil(s.step_explore * limit))
        explore_down = limit - max(1, math.ceil(s.step_explore * limit))
        if below is not None and below < s.gain_low and not margin:
            # the seats above `lo` only waited inside the app: go back towards it
            ratio = max(1 - s.step_down, lo / max(concurrency, 1e-9))
            return min(limit - 1, math.floor(limit * ratio)), "down: seats above only queued", \
                below, above
        sure_above = above is not None and above - s.confidence * self._uncertainty(key, hi) >= s.gain_low
        sure_below = below is not None and below - s.confidence * self._uncertainty(lo, key) >= s.gain_low
        if sure_above:
            # the seats above paid: go back up (by a quarter when they clearly paid)
            step = s.step_up if above >= s.gain_high else s.step_explore
            return limit + max(1, round(step * limit)), "up: more seats paid", below, above
        # a blind probe (nothing known below) needs latency not inflated, and calm once the
        # baselines are no-load: past the knee, within the margin, it would only queue
        blind = below is None and (calm if self._anchored else not inflated)
        if above is None and (sure_below or blind):
            if self._rising and below is not None and below >= s.gain_high:
                # rising, and the last seats paid in full: a capacity increase, climb faster
                return limit + max(1, round(s.step_up * limit)), "up: probe, seats paid", \
                    below, above
            return explore_up, "up: probe", below, above
        if below is None and margin:
            return limit, "hold: the margin past the knee", below, above
        if below is None:
            if above is None and not inflated and self._anchored:
                # nothing known, latency within the tolerance of no-load baselines: a step
                # down would buy nothing sure (on a busy host this is the host's noise)
                return limit, "hold: nothing known, latency within the tolerance", below, above
            if above is None:  # inflated, nothing known: head for the tolerance at once
                target = round(limit * max(1 - s.step_down, (1 + s.tolerance) / r))
                return min(explore_down, target), "down: inflated", below, above
            if above < s.gain_low / 2:  # latency grows with concurrency: far past the knee
                return min(explore_down, math.floor(limit * (1 - s.step_down))), \
                    "down: seats above only queued", below, above
            return explore_down, "down: probe", below, above
        if self._anchored and not calm and lo is not None and lo < explore_down and \
                above is not None and above < s.gain_low:
            # the seats above a far lower point paid on the whole, those above here did not,
            # and latency here is past the calm band: the knee lies between the lower point
            # and here (not CPU's slope, where the seats above still pay); step towards calm
            target = math.floor(limit * (1 + s.tolerance / 2) / r)
            return max(lo, min(explore_down, target)), "down: past the knee, towards calm", \
                below, above
        return limit, "hold: at the knee", below, above

    def _look_below(self, key: int, hi: int | None, above: float | None
                    ) -> tuple[float, str, float | None, float | None] | None:
        """Where the limit starts, nothing is known: the knee may be above or below. The
        first binding tick halves the limit; the next one compares. When the seats above the
        half paid (surely, as for any move up), the limit goes back to the start at once,
        and keeps growing (slow start) if they paid in full; otherwise the curve's law goes
        on from the half, down towards the knee. None: the look is over."""
        s = self.settings
        if self._look == 0 and s.look_below and self.limit > s.minimum:
            self._look = self.limit
            self._growing = False
            return max(s.minimum, self.limit // 2), "down: looking below the start", None, None
        if self._look <= 0:
            return None
        start, self._look = self._look, -1
        if above is not None and hi is not None and \
                above - s.confidence * self._uncertainty(key, hi) >= s.gain_low:
            self._growing = above >= s.gain_high
            return start, "up: back to the start, the seats paid", None, above
        return None

    def _react(self, r: float, lo: int | None, below: float | None, above: float | None
               ) -> tuple[float, str, float | None, float | None] | None:
        """The fast moves, before the curve's law: a cut when latency jumps (lost capacity),
        undone when fewer seats bring no relief (a slowdown); back up when latency falls to
        its baseline (capacity came back); slow start while latency stays at it. None: the
        curve's law decides."""
        s = self.settings
        limit = self.limit
        calm = r <= 1 + s.tolerance / 2
        grow = limit + max(1, round(s.slow_start * limit))
        if self._jump > 1 + s.regime_change:
            # latency jumped (at this concurrency, or faster than concurrency from a lower
            # one): the backend lost capacity in proportion; cut at once, at most by half
            self._growing = False
            self._curve.clear()  # the tick that saw the jump straddled it: learn afresh
            self._cut_from = limit
            target = round(limit / self._jump)
            return max(math.floor(limit * (1 - s.jump_down)), min(limit - 1, target)), \
                "down: latency jumped", below, above
        # this tick alone, not the smoothed point: a tick straddling the change already shows it
        if (self._r_now <= 1 + s.tolerance / 2 and (
                self._jump < 1 / (1 + s.regime_change)
                or (self._anchored and self._fall >= 1 + s.fall_back))) or (
                self._anchored and self._fall_sure and self._r_now <= 1 + s.tolerance):
            # latency fell back to its baseline: capacity came back; back to where it was
            # before the last cut (at most twice the limit), then grow until it inflates
            self._growing = True
            back = max(grow, min(2 * limit, self._cut_from))
            return back, "up: latency fell back", below, above
        if self._growing:
            if calm and above is None and below is not None and below >= s.gain_high:
                # the seats just added paid in full at the baseline's latency: the baselines
                # are no-load latencies, and there is room to grow
                self._anchored = True
                return grow, "up: slow start", below, above
            if calm and above is None and below is None:
                return limit + max(1, math.ceil(s.step_explore * limit)), \
                    "up: slow start, probe", below, above
            self._growing = False
            if not calm and lo is not None:
                # the last step overshot the knee: back to where latency is calm
                return max(lo, math.floor(limit * (1 + s.tolerance / 2) / r)), \
                    "down: slow start overshot", below, above
        return None

    def _watch_floor(self, kinds: Mapping[Hashable, KindSample], r: float) -> None:
        """Reset the baselines after ``reset_ticks`` binding ticks at the floor, still
        inflated: at the least concurrency we can offer, what is seen is the no-load latency
        now (a slower backend, a slower release), and the curve restarts from it."""
        s = self.settings
        if self.limit > s.minimum or r <= 1 + s.tolerance:
            self._floor_ticks = 0
            self._floor_means.clear()
            return
        self._floor_ticks += 1
        for kind, sample in kinds.items():
            acc = self._floor_means.setdefault(kind, [0.0, 0.0])
            acc[0] += sample.count
            acc[1] += sample.service_ns
        if self._floor_ticks >= s.reset_ticks:
            for kind, (count, service) in self._floor_means.items():
                self.baselines[kind] = service / count
            self._floor_ticks = 0
            self._floor_means.clear()
            self._curve.clear()


def gain_high_seen(below: float | None, above: float | None, gain_high: float) -> bool:
    """Whether seats next to this point paid in full (an elasticity at least ``gain_high`` on
    either side): the lower of the two points is below the knee."""
    return any(e is not None and e >= gain_high for e in (below, above))
