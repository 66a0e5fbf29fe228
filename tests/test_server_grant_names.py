"""A worker's grant socket name is drawn per process (issue 32, item 14).

Names were one per worker index: a process that read a worker's name in ``/proc/net/unix``
could bind it once that worker died, and its successor at the index then booted without an
inbox (grants only through the 100 ms ledger scan; the squatter received its datagrams).
tests/test_channel.py shows where the grants go; this shows the server's respawn.
"""

from __future__ import annotations

import os
import signal
import socket

from tests.test_channel import _bound_names


def test_a_respawned_worker_binds_a_name_a_squatter_of_the_old_one_cannot_hold(
        server_factory) -> None:
    with server_factory(workers=1, threads=4) as srv:
        prefix = f"\0apf-{srv.instance}_{srv.pid}_".encode()
        (old,) = _bound_names(prefix)
        (victim,) = srv.workers()
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            os.kill(victim, signal.SIGKILL)

            def squat() -> bool:  # the name is free once the dead worker's socket is gone
                try:
                    squatter.bind(old)
                except OSError:
                    return False
                return True

            assert srv.wait_for(squat), "the dead worker's name never became free"
            new = srv.wait_for(lambda: _bound_names(prefix) - {old})
            assert new, f"the respawned worker bound no grant socket:\n{srv.log()}"
            assert "is taken by another process" not in srv.log()
            (name,) = new
            with srv.attached_ledger() as led:
                # the name the senders read from its ledger record
                assert name.endswith(f"-w0-{led.grant_name(0):x}".encode()), name
            status, _, _ = srv.request("/healthz")
            assert status == 200
        finally:
            squatter.close()
