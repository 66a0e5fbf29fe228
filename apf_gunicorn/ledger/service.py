"""The service estimate G: what a dispatched request is charged until it finishes.

Kubernetes charges every dispatch ``initial seats x G`` with a fixed G (3 ms) and corrects the
charge at completion. A ledger created with ``learn_service=True`` lets each queuing level learn
its G from the requests it finishes: :func:`learn_service` is the integer update (shared with
``_fastpath.c``), ``ServiceEstimate._learn_locked`` applies it to a level's words::

    g = learn_service(g, n, ran_ns)    # n: finished requests so far, at most SERVICE_WINDOW
"""

from __future__ import annotations

from apf_gunicorn.ledger.layout import (
    L_SERVICE_N,
    L_SERVICE_NS,
)

DEFAULT_SERVICE_ESTIMATE_NS = 3_000_000  # Kubernetes' G (estimatedServiceDuration)
MAX_SERVICE_ESTIMATE_NS = 60_000_000_000  # a learnt G never exceeds Kubernetes' 60 s time-out
SERVICE_WINDOW = 16  # a learnt G averages about the last 16 finished requests


def learn_service(g: int, n: int, ran: int) -> int:
    """A level's next G after its ``n``-th finished request (counting from 1, at most
    :data:`SERVICE_WINDOW`) ran ``ran`` ns: the mean of the first 16, then an exponentially
    weighted average with weight 1/16, so the configured G is forgotten at the first finish.
    Integers only, so that the C fast path (``_fastpath.c``) computes the same word; ``ran``
    is clamped to [0, 60 s]."""
    ran = 0 if ran < 0 else (MAX_SERVICE_ESTIMATE_NS if ran > MAX_SERVICE_ESTIMATE_NS else ran)
    return g + (ran - g) // n if ran >= g else g - (g - ran) // n


class ServiceEstimate:
    """A level learning its G (a mixin of ``Ledger``)."""

    def _learn_locked(self, lb: int, ran: int) -> None:
        w = self._w
        n = w[lb + L_SERVICE_N]
        if n < SERVICE_WINDOW:
            n += 1
            w[lb + L_SERVICE_N] = n
        w[lb + L_SERVICE_NS] = learn_service(w[lb + L_SERVICE_NS], n, ran)
