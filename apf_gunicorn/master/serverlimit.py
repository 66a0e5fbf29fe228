"""The one path every run-time server limit takes (``auto``, master/autolimit.py; the pool
rule, master/poollimit.py): :func:`apply_server_limit`, and :func:`large_move`, which says
when a move is worth an info line.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from apf_gunicorn.flowcontrol.borrowing import BorrowingStates
from apf_gunicorn.flowcontrol.relimit import follow_server_limit

LARGE_MOVE = 0.25  # a move by more than this fraction of the old limit is logged at info


def apply_server_limit(master: Any, new: int, now: int,
                       lock: AbstractContextManager | None = None) -> None:
    """Set the running server's limit to ``new`` seats: every level's limits re-derived
    (:func:`follow_server_limit`), the generation's level limits and the settings'
    ``concurrency_limit`` replaced, the requests it dispatches granted. The one path every
    run-time limit takes (``auto``, the pool rule of ``master/poollimit.py``).

    Args:
        master: the master's state (``ledger``, ``generation``, ``settings``,
            ``borrowing_states``, ``sender``).
        new: the server limit, in seats (>= 1).
        now: monotonic ns.
        lock: held around the ledger operation (the master's ``SERVICE_LOCK``).
    """
    lock = lock if lock is not None else nullcontext()
    if master.borrowing_states is None:
        master.borrowing_states = BorrowingStates()
    with lock:
        gen = master.generation
        levels = gen.configuration.priority_levels
        triples = [(name, idx, levels[name].is_exempt)
                   for name, idx in gen.level_index.items() if name in levels]
        level_limits, granted = follow_server_limit(
            master.ledger, levels.values(), triples, master.borrowing_states, new, now)
        gen.limits = level_limits
        master.settings = dataclasses.replace(master.settings, concurrency_limit=new)
    if granted and getattr(master, "sender", None) is not None:
        master.sender.send_grants(granted)


def large_move(old: int, new: int) -> bool:
    """Whether a move from ``old`` to ``new`` seats is worth a log line (more than a quarter)."""
    return abs(new - old) > LARGE_MOVE * old
