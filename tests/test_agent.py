"""The HAProxy agent-check endpoint: what it answers (ready + weight, drain, down), its socket,
the drain on SIGTERM, and a real server's agent port through a flood, a worker restart, a HUP
and a graceful stop. (tests/test_haproxy.py puts a real HAProxy in front.)"""

from __future__ import annotations

import os
import signal
import socket
import time
from types import SimpleNamespace

import pytest

from apf_gunicorn.ledger import Capacity, Ledger, LevelSpec, NullLock
from apf_gunicorn.master.agent import (
    DOWN,
    DRAIN,
    AgentServer,
    AgentState,
    install_drain_on_term,
    ready_line,
)
from tests.apps.loadgen import Client
from tests.conftest import APPS, free_port

NOW = 1_000_000_000


def _ledger():
    cap = Capacity(levels=4, queues=16, slots=32, workers=4, flow_schemas=4, stats_entries=16)
    buf = bytearray(Ledger.size(cap))
    led = Ledger.create(buf, cap, lock=NullLock())
    levels, _ = led.configure([LevelSpec("work", 2, 1, 4, 4), LevelSpec("exempt", -1, 0, 0, 0)],
                              ["fs"], NOW)
    for owner in (0, 1):
        led.register_worker(owner, 1000 + owner, NOW)
    return led, levels, buf


def _arbiter(expected=2, running=2):
    return SimpleNamespace(num_workers=expected, WORKERS={i: None for i in range(running)},
                           log=SimpleNamespace(info=lambda *a: None))


def test_ready_with_a_weight_that_falls_as_seats_fill():
    led, levels, _ = _ledger()
    agent = AgentState(SimpleNamespace(ledger=led), _arbiter())
    assert agent.reply() == b"up ready 100%\n"
    seen = []
    for h in range(6):
        led.admit(levels["work"], h, 1, 0, 0, 0, NOW + h)
        seen.append(agent.reply())
    weights = [int(r.split()[-1].rstrip(b"%")) for r in seen]
    assert weights == sorted(weights, reverse=True) and weights[0] < 100
    assert weights[3] == 10 and weights[-1] < weights[3]  # full, then queuing
    # exempt requests take no seat of the limit
    led2, levels2, _ = _ledger()
    led2.admit(levels2["exempt"], 1, 1, 0, 0, 0, NOW)
    assert AgentState(SimpleNamespace(ledger=led2), _arbiter()).reply() == ready_line(100)


def test_drain_while_workers_restart_or_the_server_stops():
    led, _, _ = _ledger()
    master = SimpleNamespace(ledger=led)
    assert AgentState(master, _arbiter(2, 3)).reply() == DRAIN  # a HUP: old + new workers
    assert AgentState(master, _arbiter(2, 1)).reply() == DRAIN  # one is being replaced
    assert AgentState(master, _arbiter(3, 3)).reply() == DRAIN  # a new one not registered yet
    led.reap_worker(1, NOW)
    assert AgentState(master, _arbiter(2, 2)).reply() == DRAIN  # reaped, replacement booting
    led.register_worker(1, 2001, NOW)
    agent = AgentState(master, _arbiter(2, 2))
    assert agent.reply() == ready_line(100)
    agent.stopping = True
    assert agent.reply() == DRAIN


def test_down_when_the_ledger_is_unusable():
    led, _, buf = _ledger()
    agent = AgentState(SimpleNamespace(ledger=led), _arbiter())
    buf[0:8] = bytes(8)  # no longer a ledger
    assert agent.reply() == DOWN
    led2, _, _ = _ledger()
    led2.close()  # unmapped
    assert AgentState(SimpleNamespace(ledger=led2), _arbiter()).reply() == DOWN
    assert AgentState(SimpleNamespace(ledger=None), _arbiter()).reply() == DOWN


def _ask(port, send=b""):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if send:
            s.sendall(send)
        data = b""
        while True:
            chunk = s.recv(100)
            if not chunk:
                return data
            data += chunk


def test_agent_server_answers_each_connection_once_and_ignores_what_it_is_sent():
    replies = iter([b"up ready 50%\n", b"drain\n"])
    srv = AgentServer(("127.0.0.1", 0), lambda: next(replies))
    assert srv.start()
    try:
        assert _ask(srv.port) == b"up ready 50%\n"
        assert _ask(srv.port, b"be_app/a\n") == b"drain\n"  # HAProxy's agent-send
        assert _ask(srv.port) == DOWN  # the reply function failed: down, and still serving
        assert srv.served == 3
        taken = AgentServer(("127.0.0.1", srv.port), lambda: b"")
        assert taken.start() is False  # in use: logged, not raised
    finally:
        srv.stop()
    with pytest.raises(OSError):
        _ask(srv.port)


def test_idle_connections_never_hold_the_agent():
    """The agent answers each connection as it accepts it and keeps none: 300 connections that
    never send nor read (more than the listen backlog, more than the admin endpoint's places)
    each already hold their line, and the next one is answered too. (The agent has no places
    to fill, so nothing is dropped; benchmarks/bench_overload.py f times it.)"""
    srv = AgentServer(("127.0.0.1", 0), lambda: b"up ready 50%\n")
    assert srv.start()
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        assert _ask(srv.port) == b"up ready 50%\n"
        assert srv.served == 301
        for s in idle:  # answered and closed by the server, though never read
            reply = b""
            while chunk := s.recv(64):
                reply += chunk
            assert reply == b"up ready 50%\n"
    finally:
        for s in idle:
            s.close()
        srv.stop()


def test_sigterm_drains_first_then_stops():
    agent = AgentState(SimpleNamespace(ledger=None))
    stopped, timers = [], []
    arbiter = SimpleNamespace(log=SimpleNamespace(info=lambda *a: None))
    arbiter.handle_term = lambda: stopped.append(True)

    class FakeTimer:
        def __init__(self, delay, fn, args):
            timers.append((delay, fn, args))

        def start(self):
            pass

    install_drain_on_term(arbiter, agent, 2.5, timer=FakeTimer)
    install_drain_on_term(arbiter, agent, 2.5, timer=FakeTimer)  # idempotent
    arbiter.handle_term()
    assert agent.stopping and not stopped
    assert timers == [(2.5, os.kill, (os.getpid(), signal.SIGTERM))]
    arbiter.handle_term()  # the timer's (or a second) SIGTERM: gunicorn's stop
    assert stopped == [True]
    # a delay of 0: drain answered, stop at once
    agent0 = AgentState(SimpleNamespace(ledger=None))
    arb0 = SimpleNamespace(log=arbiter.log, handle_term=lambda: stopped.append(0))
    install_drain_on_term(arb0, agent0, 0.0, timer=FakeTimer)
    arb0.handle_term()
    assert agent0.stopping and stopped == [True, 0]


# -- a real server ------------------------------------------------------------------------------

def _wait_reply(port, want, timeout=20.0):
    """Poll the agent until ``want(reply)``; returns the replies seen."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = _ask(port).decode().strip()
        except OSError as e:
            reply = f"error {e}"
        seen.append(reply)
        if want(reply):
            return seen
        time.sleep(0.01)
    raise AssertionError(f"no matching agent reply in {timeout}s; last ones: {seen[-5:]}")


@pytest.mark.server
def test_agent_port_of_a_real_server(server_factory):
    agent_port = free_port()
    env = {"APF_AGENT_BIND": f"127.0.0.1:{agent_port}", "APF_AGENT_DRAIN_DELAY": "1.5",
           "APF_QUEUE_WAIT_LIMIT": "5"}
    with server_factory(config=str(APPS / "tight.yaml"), env=env, threads=12) as srv:
        _wait_reply(agent_port, lambda r: r == "up ready 100%")
        # a flood on "work" (8 of 16 seats, then queues): the weight falls, the port answers
        clients = [Client(srv.port, "/work?ms=300", user=f"u{i}", count=6) for i in range(12)]
        for c in clients:
            c.start()
        seen = _wait_reply(agent_port, lambda r: r.startswith("up ready") and int(
            r.split()[-1].rstrip("%")) <= 10)
        assert all(r.startswith("up ready") for r in seen), seen
        for c in clients:
            c.join(60)
        _wait_reply(agent_port, lambda r: r == "up ready 100%")

        # a worker dies: drain until its replacement has registered, then ready again
        os.kill(srv.workers()[0], signal.SIGKILL)
        _wait_reply(agent_port, lambda r: r == "drain")
        _wait_reply(agent_port, lambda r: r == "up ready 100%", timeout=30)

        # a HUP replaces every worker: drain while old and new ones overlap, then ready
        os.kill(srv.pid, signal.SIGHUP)
        _wait_reply(agent_port, lambda r: r == "drain")
        _wait_reply(agent_port, lambda r: r == "up ready 100%", timeout=30)

        # graceful stop: drain at once, still serving during the delay, then gone
        os.kill(srv.pid, signal.SIGTERM)
        _wait_reply(agent_port, lambda r: r == "drain", timeout=5)
        assert srv.request("/hello")[0] == 200
        srv.proc.wait(timeout=20)
        assert "APF_AGENT_DRAIN_DELAY" in srv.log()
        with pytest.raises(OSError):
            _ask(agent_port)


def test_master_services_retry_a_taken_agent_port():
    from apf_gunicorn.master.master import MasterServices

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    led, _, _ = _ledger()
    settings = SimpleNamespace(agent_bind=("127.0.0.1", port), agent_drain_delay_s=0.0)
    master = SimpleNamespace(settings=settings, ledger=led)
    services = MasterServices(master)
    arbiter = _arbiter()
    arbiter.handle_term = lambda: None
    services.start_agent(arbiter)
    assert services.agent is None and services.agent_retry  # the old master's port
    blocker.close()
    services.start_agent(quiet=True)  # what the services thread does every tick
    try:
        assert services.agent is not None and not services.agent_retry
        assert _ask(port) == ready_line(100)
    finally:
        services.stop()
    with pytest.raises(OSError):
        _ask(port)
