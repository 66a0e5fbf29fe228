"""gunicorn config for API Priority and Fairness: ``gunicorn -c python:apf_gunicorn.conf app:app``
(or ``-c apf_gunicorn/conf.py`` from a checkout with the package installed).

No state and no logic here: the path form re-runs this file on every HUP. Everything lives in
:mod:`apf_gunicorn.master.hooks`. Command-line options (``-w``, ``--threads``, ``-b``) override
these values. Your own config can start with ``from apf_gunicorn.conf import *``.
"""

from apf_gunicorn.master.hooks import (  # noqa: F401 - gunicorn reads these names
    child_exit,
    on_exit,
    on_reload,
    on_starting,
    post_fork,
    post_worker_init,
    pre_fork,
    when_ready,
    worker_abort,
    worker_exit,
)

# gthread that stops accepting while all its threads are busy (see apf_gunicorn/gthread/worker.py)
worker_class = "apf_gunicorn.gthread.worker.ApfThreadWorker"
workers = 2
# A parked request holds a thread: 64 threads per worker run the default limit
# (APF_CONCURRENCY_LIMIT = workers x threads / 2 = 64 seats) and hold as many waiting requests.
threads = 64
# gunicorn's control socket is one path per user; two servers would fight over it.
control_socket_disable = True
