"""prometheus_client's documented gunicorn recipe for multiprocess mode, on top of
apf_gunicorn's conf: its own ``child_exit`` replaces ours (tests/test_server_recovery.py).

    PROMETHEUS_MULTIPROC_DIR=/tmp/x gunicorn -c python:tests.apps.prometheus_conf tests.apps.app:app

Each worker also sets a ``sum``-mode gauge to ``APP_GAUGE_VALUE`` (default 5) when it starts,
so the test can see what the master does with a dead worker's gauge files.
``APF_TEST_OWN_CHILD_EXIT=1`` keeps apf_gunicorn's child_exit (no recipe).
"""

import os

from prometheus_client import multiprocess

from apf_gunicorn.conf import *  # noqa: F403 - the whole product config
from apf_gunicorn.master import hooks


def post_worker_init(worker):
    hooks.post_worker_init(worker)
    from prometheus_client import Gauge

    Gauge("app_items", "items an app holds", multiprocess_mode="sum").set(
        float(os.environ.get("APP_GAUGE_VALUE", "5")))


if os.environ.get("APF_TEST_OWN_CHILD_EXIT") != "1":
    def child_exit(server, worker):  # the recipe, word for word
        multiprocess.mark_process_dead(worker.pid)
