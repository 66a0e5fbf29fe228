"""Layout, attach and the fast path's promise not to touch the min-structure."""

from __future__ import annotations

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger import layout as L


def test_default_size_is_under_16_mib_and_word_aligned() -> None:
    size = Ledger.size(Capacity())
    assert size < 16 * 1024 * 1024
    assert size % 8 == 0


def test_capacity_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="slots"):
        Capacity(slots=0)


def test_attach_sees_the_same_ledger_and_refuses_garbage() -> None:
    cap = Capacity(levels=2, queues=8, slots=8, workers=2, flow_schemas=2, detail_bytes=16)
    buf = bytearray(Ledger.size(cap))
    led = Ledger.create(buf, cap)
    levels, _ = led.configure([LevelSpec("a", 2, 1, 5, 1)], ["fs"], 0)
    res = led.admit(levels["a"], 3, 1, 0, 0, 1, 0, fs_index=0, detail=b"x" * 40)
    other = Ledger.attach(buf)
    assert other.capacity == cap
    assert other.level_indices() == {"a": levels["a"]}
    (req,) = other.snapshot(0).levels[0].requests
    assert (req.slot, req.gen, req.owner, req.detail) == (res.slot, res.gen, 1, b"x" * 16)
    with pytest.raises(ValueError, match="ledger"):
        Ledger.attach(bytearray(Ledger.size(cap)))


def test_fast_path_never_touches_the_segment_tree(monkeypatch) -> None:
    cap = Capacity(levels=2, queues=64, slots=16, workers=2, flow_schemas=2, detail_bytes=0)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, _ = led.configure([LevelSpec("a", 64, 6, 5, 2)], [], 0)

    def forbidden(*_args):
        raise AssertionError("the fast path touched the tree")

    monkeypatch.setattr(Ledger, "_set_leaf_locked", forbidden)
    monkeypatch.setattr(Ledger, "_first_le_locked", forbidden)
    a = led.admit(levels["a"], 11, 1, 0, 0, 0, 0)
    b = led.admit(levels["a"], 12, 1, 0, 0, 0, 5)
    assert (a.outcome, b.outcome) == (EXECUTE, EXECUTE)
    led.finish(a.slot, a.gen, 10)
    led.finish(b.slot, b.gen, 20)
    monkeypatch.undo()
    assert verify(led) == []
    c = led.admit(levels["a"], 13, 1, 0, 0, 0, 30)
    d = led.admit(levels["a"], 14, 1, 0, 0, 0, 30)
    e = led.admit(levels["a"], 15, 1, 0, 0, 0, 30)
    assert [r.outcome for r in (c, d, e)] == [EXECUTE, EXECUTE, QUEUED]
    assert led._w[led._lb(levels["a"]) + L.L_WAITING] == 1
    assert verify(led) == []
