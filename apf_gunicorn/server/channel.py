"""Grant channel between worker processes: msgpack datagrams on abstract Unix sockets.

When a ledger operation in one process dispatches a slot owned by another worker, that worker
must wake the parked request thread. Each worker binds one ``SOCK_DGRAM`` socket named
``\\0apf-<token>-w<index>`` in the Linux abstract namespace (nothing to unlink; the name
disappears with the process). A message is a msgpack list of ``[slot, gen]`` pairs.

Usage::

    inbox = GrantInbox(token, index)            # in the worker (dispatcher thread reads it)
    for slot, gen in inbox.receive():  ...
    sender = GrantSender(token)                 # any process, any thread
    sender.send_grants(granted, my_index)       # granted: [(slot, gen, owner), ...]

Sending never blocks: a full or missing receiver drops the datagram, and the receiver's
100 ms ledger scan (the backstop) picks the grant up. Generations make stale grants harmless.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

import msgpack

MAX_DATAGRAM = 60_000
_PAIRS_PER_DATAGRAM = 4000  # 2 ints of at most 9 bytes each, plus framing: well under 60 KB


def grant_token(instance: str, master_pid: int) -> str:
    """The per-server part of the socket names: one per master (USR2 runs two at once). The
    pid is all digits and comes after the last ``_``, so two (instance, pid) pairs never give
    the same token (``a`` + 1234 and ``a1`` + 234 did when they were simply concatenated)."""
    return f"{instance}_{master_pid}"


def address(token: str, index: int) -> bytes:
    return f"\0apf-{token}-w{index}".encode()


class GrantInbox:
    """The receiving end of one worker; non-blocking, close-on-exec."""

    def __init__(self, token: str, index: int):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address(token, index))
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[tuple[int, int]]:
        """Every pair waiting in the socket now (possibly none). Malformed datagrams are skipped."""
        out: list[tuple[int, int]] = []
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return out
            try:
                pairs = msgpack.unpackb(data, use_list=True)
                for slot, gen in pairs:
                    out.append((int(slot), int(gen)))
            except Exception:  # noqa: BLE001 - a bad datagram must not stop the dispatcher
                continue

    def close(self) -> None:
        self.sock.close()


class GrantSender:
    """Sends grants to their owners. Thread-safe (one datagram per ``sendto``)."""

    def __init__(self, token: str):
        self.token = token
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self._addresses: dict[int, bytes] = {}
        self.dropped = 0

    def send(self, owner: int, pairs: list[list[int]]) -> bool:
        """Send ``[[slot, gen], ...]`` to worker ``owner``; False if it could not be delivered."""
        addr = self._addresses.get(owner)
        if addr is None:
            addr = self._addresses[owner] = address(self.token, owner)
        ok = True
        for i in range(0, len(pairs), _PAIRS_PER_DATAGRAM):
            try:
                self.sock.sendto(msgpack.packb(pairs[i:i + _PAIRS_PER_DATAGRAM]), addr)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.ECONNREFUSED, errno.ENOENT,
                                   errno.ENOBUFS):
                    raise
                self.dropped += 1
                ok = False
        return ok

    def send_grants(self, granted: Iterable[tuple[int, int, int]],
                    skip_owner: int = -1) -> None:
        """Group ``(slot, gen, owner)`` triples by owner and send them, except ``skip_owner``'s."""
        by_owner: dict[int, list[list[int]]] = {}
        for slot, gen, owner in granted:
            if owner != skip_owner and owner >= 0:
                by_owner.setdefault(owner, []).append([slot, gen])
        for owner, pairs in by_owner.items():
            self.send(owner, pairs)

    def close(self) -> None:
        self.sock.close()
