"""Grant channel between worker processes: msgpack datagrams on abstract Unix sockets.

When a ledger operation in one process dispatches a slot owned by another worker, that worker
must wake the parked request thread. Each worker binds one ``SOCK_DGRAM`` socket named
``\\0apf-<token>-w<index>-<name>`` in the Linux abstract namespace (nothing to unlink; the
name disappears with the process). A message is a msgpack list of ``[slot, gen]`` pairs.

The token holds 128 random bits drawn by the master at start (:func:`grant_token`), so a
process outside the server cannot bind a worker's name before it does nor send to it without
first reading the name from ``/proc/net/unix``. ``<name>`` is 48 more random bits drawn by
each worker process (:attr:`GrantInbox.name`) and published in its ledger record
(``Ledger.register_worker``), where the senders read it (``Ledger.grant_name``): a process that
read a worker's name cannot take the name of the worker that replaces it at the same index
(it would get that worker's grants, which would then arrive only through the backstop scan).
Should a name be taken all the same, the worker boots without an inbox
(:attr:`GrantInbox.bound` False, its name 0 so nobody sends to it, a warning logged) and its
grants reach it through the backstop scan. One wake-up of the
dispatcher reads at most ``BATCH`` datagrams (:meth:`GrantInbox.receive`), so a flood cannot
keep the thread from its other duties (lingering seats, finishes, the backstop scan).

Anyone who shares the network namespace (another container of a Kubernetes pod) can send to an
abstract name, so the inbox takes the sender's credentials from the kernel (``SO_PASSCRED``:
each datagram carries ``SCM_CREDENTIALS``, which the kernel fills with the sender's real pid
and uid; a process may claim another pid only with ``CAP_SYS_ADMIN``) and drops every datagram
``trusted(pid, uid)`` refuses (:class:`PeerCheck`: a process of this server). A datagram is
still only a hint: the woken request runs only if the ledger says it was dispatched
(``Ledger.dispatched``), so even a datagram that passes can neither run a request early nor
leak a slot.

Usage::

    inbox = GrantInbox(token, index, trusted=PeerCheck(master_pid, worker_pids))  # worker
    ledger.register_worker(index, os.getpid(), now, inbox.name)
    for slot, gen in inbox.receive():  ...                      # (dispatcher thread)
    sender = GrantSender(token, ledger.grant_name)  # any process, any thread
    sender.send_grants(granted, my_index)       # granted: [(slot, gen, owner), ...]

Sending never blocks and never raises: a full or missing receiver, a receiver that has published
no name (booting), or any other send error, drops the datagram (counted in ``dropped``, each
errno logged once), and the receiver's 100 ms ledger scan (the backstop) picks the grant up.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Iterable

import msgpack

log = logging.getLogger("apf_gunicorn.channel")

MAX_DATAGRAM = 60_000
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_CRED_SPACE = socket.CMSG_SPACE(_UCRED.size)
# send errors that say only "full" or "no such worker now" (it died: its seats are reaped)
_ORDINARY = (errno.EAGAIN, errno.ECONNREFUSED, errno.ENOENT, errno.ENOBUFS)
_MAX_LOGGED = 64  # distinct refused senders (and send errnos) logged; the rest only counted
_PAIRS_PER_DATAGRAM = 4000  # 2 ints of at most 9 bytes each, plus framing: well under 60 KB
#: Datagrams one :meth:`GrantInbox.receive` reads at most. The dispatcher's epoll is
#: level-triggered: what is left wakes it again at once, after its other work of that pass.
#: A real grant datagram carries every pair a ledger call dispatched to this worker, so
#: real traffic rarely queues more than a few (the kernel queue holds
#: ``net.unix.max_dgram_qlen``, 10 by default, or 1 MiB).
BATCH = 64


def grant_token(instance: str, master_pid: int) -> str:
    """The per-server part of the socket names, drawn once per master (USR2 runs two at once):
    the instance, the master's pid and 128 random bits, so no other process can know a
    worker's name before the worker binds it (``\\0apf-_1-w0`` for a master of pid 1 in a
    container was there for anyone to take first) and two servers never share one."""
    return f"{instance}_{master_pid}_{secrets.token_hex(16)}"


def address(token: str, index: int, name: int) -> bytes:
    """The abstract socket address of worker ``index`` whose process drew ``name``."""
    return f"\0apf-{token}-w{index}-{name:x}".encode()


def draw_name() -> int:
    """A worker process's part of its grant socket name: 48 random bits (12 hex digits: the
    longest address stays within the 108 bytes of ``sun_path``), never 0 ("no name")."""
    return 1 + secrets.randbelow((1 << 48) - 1)


class PeerCheck:
    """Which senders a worker's inbox accepts: the master (``master_pid``, whatever its uid:
    with gunicorn's ``--user`` the workers drop to another uid, the master does not), and a
    process of this worker's own uid among ``worker_pids()`` (the ledger's worker table).

    ``worker_pids()`` is read again when an unknown pid sends, at most every ``refresh_s`` (a
    worker that booted since the last read is found; a flood of forged datagrams costs one read
    per ``refresh_s``, and a grant refused meanwhile is picked up by the receiver's backstop
    scan).
    """

    def __init__(self, master_pid: int, worker_pids: Callable[[], Iterable[int]],
                 uid: int | None = None, refresh_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic):
        self._master = master_pid
        self._pids_of = worker_pids
        self._uid = os.getuid() if uid is None else uid
        self._refresh_s = refresh_s
        self._clock = clock
        self._pids: frozenset[int] = frozenset()
        self._read_at = float("-inf")

    def __call__(self, pid: int, uid: int) -> bool:
        """Whether a datagram from process ``pid`` (running as ``uid``) is accepted."""
        if pid <= 0:
            return False
        if pid == self._master:
            return True
        if uid != self._uid:
            return False
        if pid in self._pids:
            return True
        now = self._clock()
        if now - self._read_at < self._refresh_s:
            return False
        self._read_at = now
        self._pids = frozenset(self._pids_of())
        return pid in self._pids


class GrantInbox:
    """The receiving end of one worker; non-blocking, close-on-exec.

    ``trusted(pid, uid)`` decides whom to accept datagrams from (None: anyone, for tests of the
    channel alone); refused ones are counted in ``refused`` and each sender pid is logged once.

    Attributes:
        name: the random part of the bound name (:func:`draw_name`), to publish in the
            ledger's worker record; 0 when not bound.
        bound: the name was bound. False when another process holds it (``EADDRINUSE``,
            logged): the socket then never receives, and this worker's grants reach it
            through the dispatcher's backstop scan (within 100 ms).
    """

    def __init__(self, token: str, index: int,
                 trusted: Callable[[int, int], bool] | None = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # before bind, so that no datagram is ever queued without its sender's credentials
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.bound = True
        self.name = draw_name()
        try:
            self.sock.bind(address(token, index, self.name))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                self.sock.close()
                raise
            self.bound = False
            self.name = 0
            log.warning("apf: the grant socket name of worker %d is taken by another process "
                        "(%s); this worker gets its grants from its ledger scan instead, "
                        "within 100 ms", index, e)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.trusted = trusted
        self.refused = 0
        self._logged: set[int] = set()

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self, batch: int = BATCH) -> list[tuple[int, int]]:
        """The pairs of at most ``batch`` datagrams waiting in the socket now (possibly none;
        the rest stay queued for the next call). Malformed datagrams and those of senders
        ``trusted`` refuses are skipped, and count towards ``batch``."""
        out: list[tuple[int, int]] = []
        trusted = self.trusted
        recvmsg = self.sock.recvmsg
        for _ in range(batch):
            try:
                data, anc, _flags, _addr = recvmsg(MAX_DATAGRAM, _CRED_SPACE)
            except (BlockingIOError, InterruptedError):
                return out
            if trusted is not None and not self._accepted(trusted, anc):
                continue
            try:
                pairs = msgpack.unpackb(data, use_list=True)
                for slot, gen in pairs:
                    out.append((int(slot), int(gen)))
            except Exception:  # noqa: BLE001 - a bad datagram must not stop the dispatcher
                continue
        return out

    def _accepted(self, trusted: Callable[[int, int], bool], anc: list) -> bool:
        pid, uid = 0, -1
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, uid, _gid = _UCRED.unpack(cdata[:_UCRED.size])
        if trusted(pid, uid):
            return True
        self.refused += 1
        if pid not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(pid)
            log.warning("apf: grant datagrams from pid %d (uid %d), not a process of this "
                        "server, are dropped (%d so far)", pid, uid, self.refused)
        return False

    def close(self) -> None:
        self.sock.close()


class GrantSender:
    """Sends grants to their owners. Thread-safe (one datagram per ``sendto``).

    ``names(owner)`` is the name worker ``owner`` published (``Ledger.grant_name``; 0: none),
    read at every send, so a worker that replaced another at its index is reached at once.
    """

    def __init__(self, token: str, names: Callable[[int], int]):
        self.token = token
        self.names = names
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self._addresses: dict[int, tuple[int, bytes]] = {}
        self.dropped = 0
        self._logged: set[int] = set()

    def send(self, owner: int, pairs: list[list[int]]) -> bool:
        """Send ``[[slot, gen], ...]`` to worker ``owner``; False if it could not be delivered
        (counted in ``dropped``; never raises: the owner's backstop scan finds the grant)."""
        name = self.names(owner)
        if not name:  # not bound (booting, or its name was taken): its backstop scan
            self.dropped += 1
            return False
        cached = self._addresses.get(owner)
        if cached is not None and cached[0] == name:
            addr = cached[1]
        else:
            addr = address(self.token, owner, name)
            self._addresses[owner] = (name, addr)
        ok = True
        for i in range(0, len(pairs), _PAIRS_PER_DATAGRAM):
            try:
                self.sock.sendto(msgpack.packb(pairs[i:i + _PAIRS_PER_DATAGRAM]), addr)
            except OSError as e:
                # EAGAIN (full), ECONNREFUSED/ENOENT (no such worker now) are ordinary; anything
                # else (EPERM from a security policy, ...) is logged once per errno
                self.dropped += 1
                ok = False
                if (e.errno not in _ORDINARY and e.errno not in self._logged
                        and len(self._logged) < _MAX_LOGGED):
                    self._logged.add(e.errno)
                    log.warning("apf: a grant datagram to worker %d could not be sent (%s); "
                                "that worker's ledger scan picks the grant up within 100 ms",
                                owner, e)
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
