"""Which of apf_gunicorn's gunicorn hooks a user config replaced, logged at start.

A config that does ``from apf_gunicorn.conf import *`` and then defines a hook of the same name
replaces ours (gunicorn keeps one function per hook). prometheus_client's multiprocess recipe
does exactly that with ``child_exit``. ``on_starting`` calls :func:`log_replaced_hooks`: for each
of our hooks that is not installed, it logs what is lost and how to chain ours. A function that
looks as if it calls ours (it names one of our hook functions, by any name, e.g.
``hooks.child_exit(server, worker)`` or an imported alias) is logged at info level only; that
reading of its code is a hint, not a proof. ``on_starting`` itself cannot be checked: when it
is replaced, none of this runs, and the first worker stops the server ("the master did not set
up the ledger").

    log_replaced_hooks(server.cfg, server.log, hooks)   # hooks: the module of our hook functions
"""

from __future__ import annotations

import types
from typing import Any

# hook name -> what is lost when the config's function does not call ours
LOST = {
    "child_exit": "a dead worker's seats come back only at the master's next check (about 2 s) "
                  "instead of at once",
    "worker_exit": "a stopping worker neither answers its parked requests 503 nor returns its "
                   "seats; they come back only when the master sees the process gone",
    "worker_abort": "a worker killed for its timeout does not answer its parked requests first",
    "pre_fork": "workers get no ledger index: every worker serves WITHOUT priority and fairness",
    "post_fork": "workers keep the master's admin and agent-check sockets and grant sender, and "
                 "APF_WORKER_OOM_SCORE_ADJ is not applied",
    "post_worker_init": "workers never attach the ledger: requests bypass priority and fairness",
    "when_ready": "no master services: no borrowing between levels, no admin endpoint "
                  "(/metrics, dumps), no agent-check, no periodic reclaim of dead workers' seats",
    "on_reload": "a HUP does not load the APF configuration again",
    "on_exit": "the shared memory segment stays in /dev/shm until the next start removes it",
}


def seems_to_call(fn: Any, target: Any) -> bool:
    """Whether function ``fn`` names ``target`` in its code: a global bound to it, or an
    attribute of the same name on a global module that holds it (``hooks.child_exit``).

    Args:
        fn: the config's hook; target: our hook function.
    Returns:
        True when such a reference is found (a hint that ``fn`` chains ours).
    """
    code = getattr(fn, "__code__", None)
    glob = getattr(fn, "__globals__", None)
    if code is None or glob is None:
        return False
    names = set(code.co_names)
    for name in names:
        value = glob.get(name)
        if value is target:
            return True
        if (isinstance(value, types.ModuleType) and target.__name__ in names
                and getattr(value, target.__name__, None) is target):
            return True
    return False


def replaced_hooks(cfg: Any, ours: types.ModuleType) -> list[tuple[str, Any, bool]]:
    """Our hooks that ``cfg`` does not run as installed.

    Args:
        cfg: gunicorn's ``Config`` (``cfg.child_exit`` ... are the functions gunicorn calls).
        ours: the module that defines our hook functions (:mod:`apf_gunicorn.master.hooks`,
            handed in by it, so this module need not import the one that calls it).
    Returns:
        ``[(name, the config's function, whether it seems to call ours)]``.
    """
    out = []
    for name in LOST:
        fn = getattr(cfg, name, None)
        our_fn = getattr(ours, name)
        if fn is our_fn:
            continue
        out.append((name, fn, seems_to_call(fn, our_fn)))
    return out


def log_replaced_hooks(cfg: Any, glog: Any, ours: types.ModuleType) -> None:
    """Log each replaced hook (see the module's docstring): a warning naming what is lost and
    how to chain ours, or an info line when the config's function seems to call ours.

    Args:
        cfg: gunicorn's ``Config``; glog: gunicorn's logger; ours: as :func:`replaced_hooks`.
    """
    for name, fn, chained in replaced_hooks(cfg, ours):
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        if chained:
            glog.info("apf: the config's %s hook (%s) replaces apf_gunicorn's and seems to call "
                      "it", name, where)
            continue
        glog.warning("apf: the config's %s hook (%s) replaces apf_gunicorn's and does not call "
                     "it: %s. Call apf_gunicorn.master.hooks.%s from yours (from "
                     "apf_gunicorn.server import hooks; hooks.%s(...)).",
                     name, where, LOST[name], name, name)
