"""gunicorn config for the lock-holder crash test: apf_gunicorn's conf, but the first worker
SIGKILLs itself inside its Nth ledger critical section (``APF_TEST_DIE_IN_LOCK=N``, read here
only), so the test sees the next locker repair the ledger after a holder died. That worker
logs ``apf test: worker PID dies in its Nth ledger critical section`` at its fork, so the test
knows which process to send requests to.

    gunicorn -c python:tests.apps.dying_conf tests.apps.app:app
"""

import os
import signal

from apf_gunicorn.admission import boot
from apf_gunicorn.conf import *  # noqa: F403 - the whole product config
from apf_gunicorn.ledger.lock import ProcessLock
from apf_gunicorn.master import hooks

DIE_AFTER = int(os.environ.get("APF_TEST_DIE_IN_LOCK", "0"))


class DyingLock(ProcessLock):
    """SIGKILLs this process while it holds the ledger lock, at its ``DIE_AFTER``th acquire."""

    count = 0

    def acquire(self):
        dead = super().acquire()
        DyingLock.count += 1
        if DyingLock.count == DIE_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        return dead


def post_fork(server, worker):
    hooks.post_fork(server, worker)
    if DIE_AFTER and worker.age == 1:  # the first worker only: its replacement lives
        boot.make_lock = DyingLock
        worker.log.info("apf test: worker %d dies in its %dth ledger critical section",
                        os.getpid(), DIE_AFTER)
