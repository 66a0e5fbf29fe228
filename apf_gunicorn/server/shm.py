"""The shared-memory segment that holds the seat ledger: naming, exclusive creation, stale cleanup.

Usage (master, at start)::

    from apf_gunicorn.server import shm
    shm.clean_stale_segments()                      # segments of masters that died
    seg = shm.Segment.create("myinstance", Ledger.size(capacity))
    ledger = Ledger.create(seg.ledger_buffer, capacity, lock=...)
    ...                                             # workers inherit ``seg.mmap`` across fork
    seg.unlink()                                    # on exit

Names are ``apf_<instance>_<master pid>`` (``/dev/shm/apf_...``), created with ``O_CREX``, so two
servers on one host, or the two masters of a USR2 upgrade, never share a segment. The first 64
bytes are a header (magic, owner pid, owner start time, ledger offset and size): a segment
whose owner pid is gone, or belongs to a newer process that reused the pid, is stale.
"""

from __future__ import annotations

import mmap
import os
import struct

import posix_ipc

NAME_PREFIX = "apf_"
SHM_DIR = "/dev/shm"
MAGIC = b"APFGUNI1"
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sQQQQ")  # magic, pid, start time (clock ticks), offset, size


def process_start_time(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22);
    0 when it cannot be read. Distinguishes a live owner from a process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def segment_name(instance: str, pid: int) -> str:
    return f"{NAME_PREFIX}{instance or 'gunicorn'}_{pid}"


class Segment:
    """One POSIX shared-memory segment with our header, mapped in this process."""

    def __init__(self, name: str, mm: mmap.mmap, size: int):
        self.name = name
        self.mmap = mm
        self.size = size

    @classmethod
    def create(cls, instance: str, ledger_size: int, pid: int | None = None) -> Segment:
        """Create ``apf_<instance>_<pid>`` exclusively and write the header.

        Raises ``posix_ipc.ExistentialError`` if the name exists (a live server owns it)."""
        pid = os.getpid() if pid is None else pid
        name = segment_name(instance, pid)
        total = HEADER_SIZE + ledger_size
        shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=total)
        try:
            mm = mmap.mmap(shm.fd, total)
        finally:
            shm.close_fd()
        mm[0:_HEADER.size] = _HEADER.pack(MAGIC, pid, process_start_time(pid), HEADER_SIZE,
                                          ledger_size)
        return cls(name, mm, ledger_size)

    @property
    def ledger_buffer(self) -> memoryview:
        """A writable view of the ledger region (after the header)."""
        return memoryview(self.mmap)[HEADER_SIZE:HEADER_SIZE + self.size]

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until the processes exit."""
        try:
            posix_ipc.unlink_shared_memory("/" + self.name)
        except posix_ipc.ExistentialError:
            pass


def read_header(name: str) -> tuple[int, int] | None:
    """(owner pid, owner start time) of ``/dev/shm/<name>``, or None if it is not ours."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            data = f.read(_HEADER.size)
    except OSError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, pid, start, _offset, _size = _HEADER.unpack(data)
    if magic != MAGIC:
        return None
    return pid, start


def is_stale(name: str) -> bool:
    header = read_header(name)
    if header is None:
        return False  # not our format: leave it alone
    pid, start = header
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, owned by someone else
    current = process_start_time(pid)
    return bool(start) and bool(current) and current != start


def clean_stale_segments() -> list[str]:
    """Unlink every ``apf_*`` segment whose owner master is dead; return the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(NAME_PREFIX) and is_stale(name):
            try:
                posix_ipc.unlink_shared_memory("/" + name)
                removed.append(name)
            except posix_ipc.ExistentialError:
                pass
    return removed
