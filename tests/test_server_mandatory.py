"""A FlowSchema may name the mandatory levels without the configuration defining them (real
gunicorn): as in a cluster, where the bootstrap ensurer creates ``exempt`` and ``catch-all``,
a health-check schema sending ``GET /healthz`` to ``exempt`` makes the probe exempt."""

from __future__ import annotations

import contextlib
import http.client
import threading

import pytest

from apf_gunicorn.flowcontrol.objects import derived_uid

pytestmark = pytest.mark.server

PL_UID = "X-Kubernetes-PF-PriorityLevel-UID"

# "web" takes every request but the probe; with APF_CONCURRENCY_LIMIT=1 it has one seat and
# rejects when that seat is held. The probe schema names a level the file does not define.
WEB_LEVEL = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: web, uid: uid-pl-web}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 1
    lendablePercent: 0
    borrowingLimitPercent: 0
    limitResponse: {type: Reject}
"""


def schema(name: str, precedence: int, level: str, verbs: str, urls: str) -> str:
    """A FlowSchema for every client, anonymous or not."""
    return f"""\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {{name: {name}}}
spec:
  matchingPrecedence: {precedence}
  priorityLevelConfiguration: {{name: {level}}}
  rules:
  - subjects:
    - {{kind: Group, group: {{name: system:authenticated}}}}
    - {{kind: Group, group: {{name: system:unauthenticated}}}}
    nonResourceRules: [{{verbs: {verbs}, nonResourceURLs: {urls}}}]
"""


@pytest.mark.parametrize("level", ["exempt", "catch-all"])
def test_probe_schema_naming_an_undefined_mandatory_level(server_factory, tmp_path, level):
    path = tmp_path / "apf.yaml"
    path.write_text("---\n".join([WEB_LEVEL, schema("web", 500, "web", '["*"]', '["*"]'),
                                   schema("health", 100, level, "[get]", "[/healthz]")]))
    env = {"APF_CONCURRENCY_LIMIT": "1"}
    with server_factory(workers=1, threads=4, config=str(path), env=env) as srv:
        assert "no such object" not in srv.log()  # no dangling-schema warning
        assert srv.level("web").concurrency_limit == 1
        # Holds web's only seat for far longer than the test needs; stopping the server ends it.
        def hold() -> None:
            with contextlib.suppress(OSError, http.client.HTTPException):  # cut by the stop
                srv.request("/work?ms=60000", timeout=90)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert srv.wait_for(lambda: srv.level("web").seats_in_use == 1, timeout=30), \
            "the holding request never took web's seat"
        status, _, _ = srv.request("/hello")
        assert status == 429  # the seat really is held
        status, headers, body = srv.request("/healthz")
        assert (status, body) == (200, b"ok\n")
        assert headers[PL_UID] == derived_uid("PriorityLevelConfiguration", level)
        assert srv.level("web").seats_in_use == 1 and holder.is_alive()
    holder.join(30)
