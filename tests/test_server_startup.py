"""Start-up refusals: wrong worker class, bad settings, invalid configuration (real gunicorn)."""

import pytest

pytestmark = pytest.mark.server

BAD_CONFIG = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: broken}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: -3
    limitResponse: {type: Queue, queuing: {queues: 4, handSize: 8}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: fs}
spec:
  matchingPrecedence: 20000
  priorityLevelConfiguration: {name: broken}
"""


def test_sync_worker_is_refused(server_factory):
    with server_factory(workers=1, threads=1, args=("-k", "sync"), expect_fail=True) as srv:
        assert srv.proc.returncode != 0
        log = srv.log()
        assert "worker class 'SyncWorker' is not supported" in log
        assert "gthread" in log


def test_bad_setting_names_variable_value_and_allowed(server_factory):
    with server_factory(env={"APF_QUEUE_WAIT_LIMIT": "soon"}, expect_fail=True) as srv:
        assert srv.proc.returncode == 1
        assert ("invalid APF_QUEUE_WAIT_LIMIT='soon': must be a number of seconds greater "
                "than 0") in srv.log()


def test_invalid_configuration_lists_every_error(server_factory, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_CONFIG)
    with server_factory(config=str(bad), expect_fail=True) as srv:
        assert srv.proc.returncode == 1
        log = srv.log()
        assert "invalid configuration" in log
        assert "nominalConcurrencyShares" in log
        assert "handSize" in log
        assert "matchingPrecedence" in log


def test_path_form_config_serves_with_apf(server_factory):
    with server_factory(workers=2, threads=8, conf=("-c", "apf_gunicorn/conf.py")) as srv:
        status, headers, _ = srv.request("/work?ms=1", headers={"X-Remote-User": "pf"})
        assert status == 200
        assert headers["X-Kubernetes-PF-FlowSchema-UID"] == "uid-fs-work"
