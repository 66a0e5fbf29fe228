"""Shared-memory segments: exclusive creation, header, stale cleanup of dead owners."""

import os
import subprocess
import sys

import posix_ipc
import pytest

from apf_gunicorn.server import shm


@pytest.fixture
def instance():
    name = f"t{os.getpid()}x{id(object())}"
    yield name
    for entry in os.listdir(shm.SHM_DIR):
        if entry.startswith(f"{shm.NAME_PREFIX}{name}_"):
            posix_ipc.unlink_shared_memory("/" + entry)


def test_create_exclusive_and_header(instance):
    seg = shm.Segment.create(instance, 4096)
    try:
        assert os.path.exists(f"/dev/shm/{seg.name}")
        assert shm.read_header(seg.name) == (os.getpid(), shm.process_start_time(os.getpid()))
        buf = seg.ledger_buffer
        assert len(buf) == 4096 and not buf.readonly
        buf[0:3] = b"abc"
        assert seg.mmap[shm.HEADER_SIZE:shm.HEADER_SIZE + 3] == b"abc"
        buf.release()
        with pytest.raises(posix_ipc.ExistentialError):
            shm.Segment.create(instance, 4096)
        assert not shm.is_stale(seg.name)
        assert seg.name not in shm.clean_stale_segments()
    finally:
        seg.unlink()
    assert not os.path.exists(f"/dev/shm/{seg.name}")


def test_stale_segment_of_dead_master_is_removed(instance):
    # A child creates a segment under its own pid and exits without unlinking (as a SIGKILLed
    # master would).
    code = ("import sys; from apf_gunicorn.server import shm; "
            f"print(shm.Segment.create({instance!r}, 128).name)")
    name = subprocess.check_output([sys.executable, "-c", code], text=True, timeout=30).strip()
    assert os.path.exists(f"/dev/shm/{name}")
    assert shm.is_stale(name)
    assert name in shm.clean_stale_segments()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_pid_reuse_is_stale(instance):
    # Header claims our pid but a different start time: a dead master whose pid was reused.
    seg = shm.Segment.create(instance, 128)
    try:
        seg.mmap[16:24] = (12345).to_bytes(8, "little")
        assert shm.is_stale(seg.name)
    finally:
        seg.unlink()


def test_foreign_files_are_left_alone(instance):
    name = f"{shm.NAME_PREFIX}{instance}_foreign"
    mem = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=128)
    mem.close_fd()
    assert shm.read_header(name) is None
    assert name not in shm.clean_stale_segments()
    assert os.path.exists(f"/dev/shm/{name}")
