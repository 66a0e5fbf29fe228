"""Telling when ``APF_CONFIG``'s file or directory has changed, from ``stat`` alone.

The master polls it twice a second (``master/reload.py``); a change is reported once the
files have stayed the same for one poll, so a file an editor is still writing in place is not
read half-way (a half that happens to parse would otherwise be applied). What counts: the
files the loader reads (``config_files``: the file, or a directory's ``*.yaml``/``*.yml``),
each by the ``stat`` of what it resolves to: a Kubernetes ConfigMap mount swaps its ``..data``
symlink to a new directory, and its visible files, symlinks through ``..data``, then resolve
to new inodes. A file that appears, disappears or cannot be read is a change too.

This only says "look again": the caller hashes the contents and compares them with the
running configuration's digest, so a ``touch`` or a swap to the same bytes applies nothing.

    watch = ChangeDetector("/etc/apf")
    if watch.poll():                     # every 0.5 s
        ...read, hash, compare, apply or refuse...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from pathlib import Path

from apf_gunicorn.flowcontrol.loader import config_files

#: seconds between two polls
POLL_S = 0.5


def watchable(source: str | None) -> bool:
    """Whether a configuration source can change: a path, not a built-in set."""
    return source is not None and not source.startswith("builtin:")


def fingerprint(source: str) -> Hashable:
    """What ``stat`` says of the files ``source`` stands for (never raises: a failure is a
    fingerprint of its own, so that it changes when the failure does)."""
    try:
        out = []
        for path in config_files(source):
            st = os.stat(path)  # follows symlinks: a ConfigMap's swap shows as a new inode
            out.append((path.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                        st.st_ctime_ns))
        return tuple(out)
    except (OSError, ValueError) as exc:
        return ("error", type(exc).__name__, str(exc))


_NOTHING = object()  # before the first poll: equal to no fingerprint


class ChangeDetector:
    """Reports, once, each change of a source's files that has stayed for one poll.

    Args:
        source: ``APF_CONFIG`` (a file or a directory).
        stat: the fingerprint function (tests pass their own).

    The first stable poll counts as a change: the caller then compares the files with the
    configuration loaded at start, which they may have left since.
    """

    def __init__(self, source: str | Path,
                 stat: Callable[[str], Hashable] = fingerprint) -> None:
        self.source = str(source)
        self._stat = stat
        self._seen: object = _NOTHING  # the previous poll's fingerprint
        self._reported: object = _NOTHING  # the fingerprint last reported as a change

    def poll(self) -> bool:
        """Look once; True when the files differ from the last report and have not moved
        since the previous poll."""
        now = self._stat(self.source)
        stable = now == self._seen
        self._seen = now
        if stable and now != self._reported:
            self._reported = now
            return True
        return False
