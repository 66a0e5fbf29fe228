"""The fair allocation (conc_alloc.go) against the properties of Kubernetes' TestConcAlloc."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apf_gunicorn.flowcontrol.borrowing import (
    MIN_TARGET,
    AllocationError,
    compute_concurrency_allocation,
)


def _partition(rng: random.Random, n: int, total: float) -> list[float]:
    """Kubernetes' partition64: n non-negative random parts summing to total."""
    if n == 0:
        return []
    cuts = sorted(rng.random() * total for _ in range(n - 1))
    edges = [0.0, *cuts, total]
    return [edges[i + 1] - edges[i] for i in range(n)]


def _problem(rng: random.Random) -> tuple[int, list[tuple[float, float, float]], float, float]:
    """One random problem of TestConcAlloc: (requiredSum, items (target, lower, upper),
    lowSum, highSum)."""
    n = rng.choice([0, 1, 2, 3, 4, 6, 9])
    items: list[list[float]] = []
    low_sum = high_sum = 0.0
    required = 0
    if n > 0:
        style = rng.randrange(20)
        if style == 0:  # bound from below
            required = rng.randrange(n * 3)
            for x in _partition(rng, n, float(required)):
                items.append([x + 2 * rng.random(), x, x + 3 * rng.random()])
        elif style == 1:  # bound from above
            required = rng.randrange(n * 3) + 1
            for x in _partition(rng, n, float(required)):
                lower = x * max(0.0, 1.25 * rng.random() - 1)
                items.append([lower + rng.random(), lower, x])
        else:  # not set by bounds
            for _ in range(n):
                x = max(0.0, rng.random() * 5 - 1)
                items.append([x + 2 * rng.random(), x, x + 3 * rng.random()])
            lo = sum(i[1] for i in items)
            hi = sum(i[2] for i in items)
            required = int(math.floor(lo + (hi - lo) * rng.random() + 0.5))
        low_sum = sum(i[1] for i in items)
        high_sum = sum(i[2] for i in items)
    while rng.random() < 0.25:  # zero-target items, swapped into a random position
        extra = [0.0, 0.0, rng.random() + 0.00001]
        items.append(extra)
        high_sum += extra[2]
        if len(items) > 2:
            m = rng.randrange(len(items) - 1)
            items[m], items[-1] = items[-1], items[m]
    return required, [tuple(i) for i in items], low_sum, high_sum


def _rel_diff(x: float, y: float) -> float:
    den = max(abs(x), abs(y))
    return 0.0 if den == 0 else abs(x - y) / den


def _check(rng: random.Random) -> str:
    return _verify(*_problem(rng))


def _verify(
    required: int, items: list[tuple[float, float, float]], low_sum: float, high_sum: float
) -> str:
    expect_err = low_sum - required > 1e-10 or required - high_sum > 1e-10
    try:
        allocs, fair_prop = compute_concurrency_allocation(required, items)
    except AllocationError:
        assert expect_err, (required, items)
        return "error"
    assert not expect_err, (required, items, allocs)
    assert _rel_diff(float(required), sum(allocs)) <= 1e-10, (required, items, allocs)
    for (target, lower, upper), alloc in zip(items, allocs, strict=True):
        want = fair_prop * max(target, MIN_TARGET)
        if want <= lower:
            assert alloc == lower
        elif want >= upper:
            assert alloc == upper
        else:
            assert _rel_diff(alloc, want) <= 1e-10 or abs(alloc - want) <= 1e-6
    return "ok"


def test_conc_alloc_seeded_like_kubernetes() -> None:
    rng = random.Random(1234567890)
    outcomes = [_check(rng) for _ in range(10_000)]
    # the generator does produce both solvable and unsolvable problems
    assert outcomes.count("ok") > 5000 and outcomes.count("error") > 0


_unit = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def _problems(draw: st.DrawFn) -> tuple[int, list[tuple[float, float, float]]]:
    """Items (target, lower, upper) with lower >= 0, target >= lower, upper >= lower, plus
    zero-target items, and a required sum anywhere around [lowSum, highSum]."""
    items = []
    for lo, dt, du in draw(st.lists(st.tuples(_unit, _unit, _unit), max_size=9)):
        lower = max(0.0, 5 * lo - 1)
        items.append((lower + 2 * dt, lower, lower + 3 * du))
    for u in draw(st.lists(_unit, max_size=3)):
        items.insert(draw(st.integers(0, len(items))), (0.0, 0.0, u + 0.00001))
    low = sum(i[1] for i in items)
    high = sum(i[2] for i in items)
    required = draw(st.integers(max(0, math.floor(low) - 1), math.ceil(high) + 1))
    return required, items


@settings(max_examples=400, deadline=None)
@given(_problems())
def test_conc_alloc_property(problem: tuple[int, list[tuple[float, float, float]]]) -> None:
    required, items = problem
    low_sum = sum(i[1] for i in items)
    high_sum = sum(i[2] for i in items)
    _verify(required, items, low_sum, high_sum)


def test_borrowing_vectors() -> None:
    # TestBorrowing "lendable-limited": fairProp 2/3, allocs 1, 16, 8
    allocs, fp = compute_concurrency_allocation(25, [(1, 1, 25), (24, 12, 20), (8, 8, 18)])
    assert [round(a) for a in allocs] == [1, 16, 8]
    assert sum(allocs) == pytest.approx(25)
    # "borrowing-limited": pl0 capped at 16; allocs 1.29, 16, 7.71 -> 1, 16, 8 (fairProp 9/7)
    allocs, fp = compute_concurrency_allocation(25, [(1, 1, 25), (24, 12, 16), (6, 6, 18)])
    assert fp == pytest.approx(9 / 7)
    assert allocs[1] == 16
    assert [round(a, 2) for a in allocs] == [1.29, 16, 7.71]
    assert sum(allocs) == pytest.approx(25)


def test_unbound_and_pinned_cases() -> None:
    allocs, fp = compute_concurrency_allocation(10, [(1, 0, 100), (4, 0, 100)])
    assert fp == pytest.approx(2.0) and allocs == pytest.approx([2.0, 8.0])
    allocs, fp = compute_concurrency_allocation(5, [(3, 2, 9), (4, 3, 9)])
    assert allocs == [2.0, 3.0] and fp == pytest.approx(2 / 3)
    allocs, fp = compute_concurrency_allocation(6, [(3, 2, 2), (4, 3, 4)])
    assert allocs == [2.0, 4.0] and fp == pytest.approx(1.0)
    assert compute_concurrency_allocation(0, [(1, 0, 3)]) == ([0.0], 0.0)


@pytest.mark.parametrize(
    ("required", "items", "message"),
    [
        (-1, [], "negative sums are not supported"),
        (1, [(1, -1, 3)], "negative lower bounds are not allowed"),
        (1, [(1, 2, 3)], "below its lower bound"),
        (1, [(3, 2, 1)], "should not be less than the lower bound"),
        (1, [(5, 2, 3)], "higher than the required sum"),
        (9, [(2, 2, 3)], "lower than the required sum"),
    ],
)
def test_errors(required: int, items: list, message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        compute_concurrency_allocation(required, items)
