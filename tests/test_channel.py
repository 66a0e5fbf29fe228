"""Grant channel: msgpack [slot, gen] datagrams on abstract Unix sockets."""

import os
import socket

from apf_gunicorn.server.channel import GrantInbox, GrantSender, address


def _token():
    return f"t{os.getpid()}-{id(object())}"


def test_grants_reach_their_owner_grouped():
    token = _token()
    a, b = GrantInbox(token, 0), GrantInbox(token, 1)
    sender = GrantSender(token)
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
    sender = GrantSender(token)
    assert sender.send(3, [[1, 1]]) is False
    assert sender.dropped == 1
    sender.close()


def test_large_batches_and_garbage():
    token = _token()
    inbox = GrantInbox(token, 2)
    sender = GrantSender(token)
    try:
        pairs = [[i, i * 7] for i in range(10_000)]
        assert sender.send(2, pairs)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        raw.sendto(b"\xc1garbage", address(token, 2))
        raw.close()
        got = inbox.receive()
        assert got == [(i, i * 7) for i in range(10_000)]
    finally:
        inbox.close()
        sender.close()
