"""Layout, attach, the fast path's promise not to touch the min-structure, and the C header
generated from layout.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


# -- the C header (apf_gunicorn/ledger/_layout.h) ---------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
C_SOURCE = ROOT / "apf_gunicorn" / "ledger" / "_fastpath.c"
HEADER = ROOT / "apf_gunicorn" / "ledger" / "_layout.h"


def test_the_committed_c_header_is_generated_from_layout_py() -> None:
    """Regenerate and compare: fails until ``scripts/layout_header.py`` is rerun after a
    change to layout.py."""
    assert HEADER.read_text() == L.c_header(), (
        "apf_gunicorn/ledger/_layout.h is stale: run .venv/bin/python scripts/layout_header.py")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "layout_header.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_header_names_every_layout_constant_with_its_value() -> None:
    text = HEADER.read_text()
    values = dict(re.findall(r"^    ([A-Z][A-Z0-9_]*) = (-?\d+),$", text, re.M))
    values.update(re.findall(r"^#define ([A-Z][A-Z0-9_]*) U?INT64_C\((-?0x[0-9a-f]+)\)$",
                             text, re.M))
    assert {k: int(v, 0) for k, v in values.items()} == dict(L.c_constants())
    names = dict(L.c_constants())
    assert names["ST_FREE"] == L.FREE and names["ST_EXECUTING"] == L.EXECUTING
    assert names["S_SERVICE_NS"] == L.S_SERVICE_NS and names["MAGIC"] == L.MAGIC
    assert "ENTRY_WORDS" not in names  # imported from stats.py, not a layout.py constant
    assert f'#define LAYOUT_DIGEST "{L.digest()}"' in text


def test_the_c_file_copies_no_layout_constant_by_hand() -> None:
    """Every layout constant reaches ``_fastpath.c`` through the generated header."""
    src = C_SOURCE.read_text()
    assert '#include "_layout.h"' in src
    for name, _ in L.c_constants():
        assert not re.search(rf"\b{name}\s*=\s*-?\d", src), f"{name} is assigned in _fastpath.c"
        assert not re.search(rf"#define\s+{name}\b", src), f"{name} is defined in _fastpath.c"


def test_the_c_files_arithmetic_constants_come_from_the_header_and_its_digest(
        monkeypatch) -> None:
    """The constants ``_fastpath.c`` needs from seatseconds.py and service.py are generated
    with the layout, so the digest covers them: changing one in Python makes the committed
    header stale and an extension built before the change unused."""
    from apf_gunicorn.ledger import seatseconds, service

    names = dict(L.c_constants())
    python = {"EXACT_BOUND": seatseconds.EXACT_BOUND, "HIGH_R": seatseconds.HIGH_R,
              "SERVICE_WINDOW": service.SERVICE_WINDOW,
              "MAX_SERVICE_ESTIMATE_NS": service.MAX_SERVICE_ESTIMATE_NS}
    assert {k: names.get(k) for k in python} == python
    src = C_SOURCE.read_text()
    for name in python:
        assert re.search(rf"\b{name}\b", src.split('#include "_layout.h"', 1)[1]), name
    before = L.digest()
    monkeypatch.setattr(service, "SERVICE_WINDOW", service.SERVICE_WINDOW + 1)
    assert L.digest() != before
    assert HEADER.read_text() != L.c_header()  # the stale-header test would fail


def test_an_extension_built_for_another_layout_is_not_used(monkeypatch) -> None:
    from apf_gunicorn.ledger import fastpath as ledger_module

    real = ledger_module.fastpath_module()
    if real is None:
        pytest.skip("the C fast path is not built or APF_NO_ACCELERATOR is set")
    assert real.LAYOUT_DIGEST == L.digest()
    assert ledger_module._load_accelerator() is real

    class Stale:  # the same LAYOUT tuple, built from an older header
        LAYOUT = real.LAYOUT
        LAYOUT_DIGEST = "0" * 16

    monkeypatch.setattr(ledger_module, "fastpath_module", lambda: Stale)
    assert ledger_module._load_accelerator() is None
    del Stale.LAYOUT_DIGEST  # built before the header existed
    assert ledger_module._load_accelerator() is None
