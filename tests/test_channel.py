"""Grant channel: msgpack [slot, gen] datagrams on abstract Unix sockets."""

import os
import select
import socket

from apf_gunicorn.admission.channel import GrantInbox, GrantSender, address


def _token():
    return f"t{os.getpid()}-{id(object())}"


def test_grants_reach_their_owner_grouped():
    token = _token()
    a, b = GrantInbox(token, 0), GrantInbox(token, 1)
    sender = GrantSender(token, {0: a.name, 1: b.name}.get)
    try:
        assert a.receive() == []
        sender.send_grants([(5, 1, 0), (6, 2, 1), (7, 3, 0), (8, 4, 9)], skip_owner=9)
        assert sorted(a.receive()) == [(5, 1), (7, 3)]
        assert b.receive() == [(6, 2)]
    finally:
        for x in (a, b, sender):
            x.close()


def test_missing_receiver_is_dropped_not_raised():
    token = _token()
    sender = GrantSender(token, {3: 77}.get)  # a name nobody bound
    assert sender.send(3, [[1, 1]]) is False
    assert sender.dropped == 1
    assert sender.send(4, [[1, 1]]) is False  # no name published
    assert sender.dropped == 2
    sender.close()


def test_large_batches_and_garbage():
    token = _token()
    inbox = GrantInbox(token, 2)
    sender = GrantSender(token, {2: inbox.name}.get)
    try:
        pairs = [[i, i * 7] for i in range(10_000)]
        assert sender.send(2, pairs)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        raw.sendto(b"\xc1garbage", address(token, 2, inbox.name))
        raw.close()
        got = inbox.receive()
        assert got == [(i, i * 7) for i in range(10_000)]
    finally:
        inbox.close()
        sender.close()


def test_datagrams_from_processes_outside_the_server_are_refused(caplog):
    """Abstract names can be reached by any process in the network namespace (another container
    of the pod): the inbox keeps only datagrams whose kernel-given sender pid it trusts."""
    from apf_gunicorn.admission.channel import PeerCheck

    token = _token()
    allowed = {12345}  # this test process is not one of "the server's" pids
    inbox = GrantInbox(token, 0, trusted=PeerCheck(1, lambda: allowed, refresh_s=0.0))
    sender = GrantSender(token, {0: inbox.name}.get)
    try:
        assert sender.send(0, [[1, 1]])
        assert inbox.receive() == []
        assert inbox.refused == 1
        assert "not a process of this server" in caplog.text
        allowed.add(os.getpid())  # a worker that registered since: read again on a miss
        assert sender.send(0, [[2, 5]])
        assert inbox.receive() == [(2, 5)]
    finally:
        inbox.close()
        sender.close()


def test_peer_check_refuses_other_uids_and_rereads_pids_at_most_every_refresh():
    from apf_gunicorn.admission.channel import PeerCheck

    reads = []
    now = [0.0]

    def pids():
        reads.append(now[0])
        return {7}

    check = PeerCheck(5, pids, uid=1000, refresh_s=0.1, clock=lambda: now[0])
    assert check(5, 0)  # the master, whatever its uid (gunicorn --user: workers drop to 1000)
    assert not check(7, 0)  # a worker's pid, another uid
    assert not check(0, 1000)  # pid 0: a sender outside our pid namespace
    assert check(7, 1000) and reads == [0.0]
    for _ in range(100):  # a flood of unknown pids costs one read per refresh period
        assert not check(99, 1000)
    assert len(reads) == 1
    now[0] = 0.2
    assert not check(99, 1000) and len(reads) == 2


def test_send_errors_are_counted_and_logged_never_raised(caplog):
    """EPERM (a security policy) escaped from ``send`` and out of the middleware as a 500,
    leaking the seats of the request whose admission dispatched the grant."""
    class Refusing:
        def sendto(self, data, addr):
            raise PermissionError(1, "Operation not permitted")

        def close(self):
            pass

    sender = GrantSender(_token(), lambda owner: 5)
    sender.sock.close()
    sender.sock = Refusing()
    sender.send_grants([(1, 1, 3), (2, 1, 4)])
    assert sender.dropped == 2
    assert caplog.text.count("could not be sent") == 1  # once per errno


def test_grant_socket_names_cannot_be_known_before_the_master_starts():
    """The name was ``\\0apf-<instance>_<master pid>-w<index>``: with the master as pid 1 in a
    container, ``\\0apf-_1-w0`` was there for any process of the pod to bind first (the
    worker then failed to boot) or to flood. The token now carries 128 random bits."""
    from apf_gunicorn.admission.channel import grant_token

    first, second = grant_token("", 1), grant_token("", 1)
    assert first != second
    assert not address(first, 0, 1).startswith(b"\0apf-_1-w0")
    random_part = first.rsplit("_", 1)[1]
    assert len(random_part) == 32 and int(random_part, 16) >= 0  # 128 bits, hex


def test_a_worker_whose_name_is_taken_still_boots(caplog, monkeypatch):
    """Binding a worker's name first raised EADDRINUSE in the worker's setup (gunicorn then
    halts). The worker now boots without an inbox and says so; its grants come from its
    ledger scan. (A name has 48 random bits per process: here the draw is forced.)"""
    from apf_gunicorn.admission import channel

    token = _token()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    squatter.bind(address(token, 0, 5))
    monkeypatch.setattr(channel, "draw_name", lambda: 5)
    try:
        inbox = GrantInbox(token, 0)
        try:
            assert inbox.bound is False and inbox.name == 0
            assert inbox.receive() == []
            assert "grant socket name of worker 0 is taken" in caplog.text
        finally:
            inbox.close()
    finally:
        squatter.close()
    inbox = GrantInbox(token, 0)  # the name is free again: bound as usual
    assert inbox.bound is True
    inbox.close()


FLOOD = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
name = bytes.fromhex(sys.argv[1])
for _ in range(int(sys.argv[2])):
    s.sendto(b"\\x91\\x92\\x01\\x01", name)   # [[1, 1]]: well-formed, from a stranger
"""


def test_a_flood_of_forged_datagrams_costs_one_batch_per_wake_up():
    """A flood from a process outside the server kept the dispatcher in one ``receive`` for as
    long as it lasted (189k datagrams refused in a second): no lingering seats released, no
    finishes, no backstop scan meanwhile. One call now reads at most ``BATCH`` datagrams."""
    import subprocess
    import sys

    from apf_gunicorn.admission.channel import BATCH, PeerCheck

    token = _token()
    me = os.getpid()
    inbox = GrantInbox(token, 0, trusted=PeerCheck(me, lambda: {me}, refresh_s=0.0))
    sender = GrantSender(token, {0: inbox.name}.get)
    n = 20 * BATCH
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, address(token, 0, inbox.name).hex(),
                              str(n)])
    try:
        while inbox.refused < n:
            # wait for datagrams (the flood may be slower than this loop), or the flood's end
            readable, _, _ = select.select([inbox], [], [], 1.0)
            before = inbox.refused
            assert inbox.receive() == []
            assert inbox.refused - before <= BATCH
            if not readable:
                assert flood.poll() is None, f"the flood ended, {inbox.refused} of {n} came"
        assert flood.wait(timeout=60) == 0
        assert inbox.refused == n
        assert sender.send(0, [[7, 3]])  # a real grant after the flood gets through
        assert inbox.receive() == [(7, 3)]
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
        inbox.close()
        sender.close()


def test_the_longest_name_fits_a_unix_socket_address():
    """APF_INSTANCE (40 characters at most), the largest pid Linux gives and a four-digit
    worker index, with the random part: still under the 108 bytes of ``sun_path``."""
    from apf_gunicorn.admission.channel import grant_token

    token = grant_token("i" * 40, 4_194_304)
    inbox = GrantInbox(token, 9999)
    try:
        assert inbox.bound and len(address(token, 9999, (1 << 48) - 1)) <= 108
    finally:
        inbox.close()


def _bound_names(prefix: bytes) -> set[bytes]:
    """The abstract Unix socket names in ``/proc/net/unix`` (what any local process can read)
    that start with ``prefix``."""
    with open("/proc/net/unix", "rb") as f:
        next(f)
        paths = [line.split()[7] for line in f if len(line.split()) > 7]
    return {b"\0" + p[1:] for p in paths if p.startswith(b"@") and (b"\0" + p[1:]).startswith(prefix)}


def test_a_squatter_on_a_dead_workers_name_gets_none_of_its_successors_grants():
    """Names were ``\\0apf-<token>-w<index>``, the same for every process at an index: a
    process that read a worker's name in /proc/net/unix could bind it when that worker died;
    its successor at the index then booted without an inbox (grants only by the 100 ms
    backstop scan) and the squatter received its grants. Each process now draws its own name
    and publishes it in its ledger record, where the senders read it."""
    from apf_gunicorn.ledger import Capacity, Ledger
    from apf_gunicorn.ledger.lock import NullLock

    token = _token()
    cap = Capacity(workers=4)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    sender = GrantSender(token, led.grant_name)
    first = GrantInbox(token, 0)
    led.register_worker(0, 1001, 0, first.name)
    (seen,) = _bound_names(f"\0apf-{token}-w0".encode())
    first.close()  # the worker dies; its name is free
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    squatter.bind(seen)
    squatter.setblocking(False)
    second = GrantInbox(token, 0)  # its successor at index 0
    try:
        assert second.bound and second.name != 0
        led.register_worker(0, 1002, 0, second.name)
        assert sender.send_grants([(3, 4, 0)]) is None and sender.dropped == 0
        readable, _, _ = select.select([second], [], [], 30)
        assert readable and second.receive() == [(3, 4)]
        try:
            got = squatter.recv(100)
        except BlockingIOError:
            got = None
        assert got is None
    finally:
        for s in (second, squatter, sender):
            s.close()
