"""The start-up thread-budget check, against the shipped defaults and a config that overflows."""

import re

import pytest

from apf_gunicorn import conf
from apf_gunicorn.flowcontrol.limits import compute_limits
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.matching import Classifier
from apf_gunicorn.server.generation import thread_budget
from apf_gunicorn.server.settings import load_settings
from apf_gunicorn.server.state import Generation


def _generation(path):
    cfg = load_configuration(path)
    settings_limit = 64
    return Generation(cfg, compute_limits(cfg.priority_levels.values(), settings_limit),
                      Classifier(cfg), {}, {})


def test_quick_start_defaults_hold_every_queued_request():
    # The README's quick start: conf.py's workers and threads, the built-in webapp set, the
    # default limit. Its first run must not warn about its own defaults.
    settings = load_settings({}, workers=conf.workers, threads=conf.threads)
    assert thread_budget(_generation(None), settings, conf.workers, conf.threads) is None


def test_kubernetes_set_on_default_threads_warns_with_numbers():
    settings = load_settings({}, workers=conf.workers, threads=conf.threads)
    msg = thread_budget(_generation("builtin:kubernetes"), settings, conf.workers, conf.threads)
    assert msg is not None and "26400 queued" in msg and "60 waiting requests" in msg


def test_fewer_threads_than_the_limit_is_called_out():
    settings = load_settings({"APF_CONCURRENCY_LIMIT": "200"}, workers=2, threads=64)
    msg = thread_budget(_generation(None), settings, 2, 64)
    assert msg is not None and "cannot even run the concurrency limit of 200" in msg


def test_an_unset_limit_is_named_as_the_default_with_its_formula():
    # An ordinary size with the default limit: the warning must not blame APF_CONCURRENCY_LIMIT
    # (not set) and must say where the limit came from.
    settings = load_settings({}, workers=2, threads=16)
    msg = thread_budget(_generation(None), settings, 2, 16)
    assert msg is not None
    assert "16 seats (the default, workers x threads / 2 = 2 x 16 / 2; " \
           "APF_CONCURRENCY_LIMIT is not set)" in msg, msg
    assert "(APF_CONCURRENCY_LIMIT)" not in msg
    settings = load_settings({"APF_CONCURRENCY_LIMIT": "20"}, workers=2, threads=16)
    assert "20 seats (APF_CONCURRENCY_LIMIT)" in thread_budget(_generation(None), settings, 2, 16)


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("threads", [3, 4, 8, 16, 32])
@pytest.mark.parametrize("limit", [None, "4", "16", "50"])
def test_the_named_threads_and_limit_fit(workers, threads, limit):
    """Every warning names a --threads, and an APF_CONCURRENCY_LIMIT when one fits the present
    threads; with either, the check passes (the default limit grows with the threads)."""
    env = {} if limit is None else {"APF_CONCURRENCY_LIMIT": limit}
    gen = _generation(None)
    msg = thread_budget(gen, load_settings(env, workers=workers, threads=threads),
                        workers, threads)
    if msg is None:
        return
    m = re.search(r"--threads (\d+) fits", msg)
    assert m, msg
    more = int(m.group(1))
    assert more > threads
    assert thread_budget(gen, load_settings(env, workers=workers, threads=more),
                         workers, more) is None, msg
    assert thread_budget(gen, load_settings(env, workers=workers, threads=more - 1),
                         workers, more - 1) is not None, "not the smallest: " + msg
    m = re.search(r"APF_CONCURRENCY_LIMIT=(\d+) with these threads", msg)
    if m:
        fitted = {"APF_CONCURRENCY_LIMIT": m.group(1)}
        assert thread_budget(gen, load_settings(fitted, workers=workers, threads=threads),
                             workers, threads) is None, msg
    else:
        assert "cannot hold its 60 at any limit" in msg, msg
