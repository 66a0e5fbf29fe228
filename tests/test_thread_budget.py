"""The start-up thread-budget check, against the shipped defaults and a config that overflows."""

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
