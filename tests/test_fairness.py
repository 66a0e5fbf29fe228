"""Choosing the fairness (issue 12 item 2): precedence annotation > APF_FAIRNESS >
kubernetes, exempt levels without one, and the boundary where the choice reaches the ledger
(server/generation.py ``level_specs``), which refuses maxmin until this build implements it."""

from __future__ import annotations

import pytest

from apf_gunicorn.flowcontrol.fairness import level_fairness
from apf_gunicorn.flowcontrol.objects import PriorityLevel, QueuingConfig
from apf_gunicorn.ledger import Capacity, Ledger, NullLock
from apf_gunicorn.server.generation import (
    configure_ledger,
    fairness_by_level,
    level_specs,
    load_generation,
)
from apf_gunicorn.server.settings import load_settings

LIMITED = PriorityLevel("tenants", "Limited", queuing=QueuingConfig(8, 2, 5),
                        limit_response="Queue")

ANNOTATED = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata:
  name: tenants
  annotations: {{apf-gunicorn.io/fairness: {fairness}}}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 10
    limitResponse: {{type: Queue, queuing: {{queues: 8, handSize: 2, queueLengthLimit: 5}}}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {{name: plain}}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 10
    limitResponse: {{type: Queue, queuing: {{queues: 8, handSize: 2, queueLengthLimit: 5}}}}
"""


def test_precedence_annotation_then_default():
    assert level_fairness(LIMITED, "kubernetes") == ("kubernetes", "default")
    assert level_fairness(LIMITED, "maxmin", "APF_FAIRNESS") == ("maxmin", "APF_FAIRNESS")
    annotated = PriorityLevel("tenants", "Limited", fairness="kubernetes")
    assert level_fairness(annotated, "maxmin", "APF_FAIRNESS") == (
        "kubernetes", "annotation apf-gunicorn.io/fairness")
    exempt = PriorityLevel("exempt", "Exempt")
    assert level_fairness(exempt, "maxmin", "APF_FAIRNESS") == (None, "exempt")


def _generation(tmp_path, fairness: str, env: dict | None = None):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ANNOTATED.format(fairness=fairness))
    return load_generation(load_settings({"APF_CONFIG": str(cfg), **(env or {})}))


def test_server_levels_carry_their_fairness(tmp_path):
    gen = _generation(tmp_path, "kubernetes")
    assert fairness_by_level(gen) == {
        "tenants": ("kubernetes", "annotation apf-gunicorn.io/fairness"),
        "plain": ("maxmin", "APF_FAIRNESS"),
        "exempt": (None, "exempt"), "catch-all": ("maxmin", "APF_FAIRNESS")}
    assert [s.name for s in level_specs(gen)] == ["catch-all", "exempt", "plain", "tenants"]


def test_annotation_beats_apf_fairness(tmp_path):
    gen = _generation(tmp_path, "kubernetes", {"APF_FAIRNESS": "maxmin"})
    by_level = fairness_by_level(gen)
    assert by_level["tenants"][0] == "kubernetes" and by_level["plain"] == ("maxmin",
                                                                         "APF_FAIRNESS")


@pytest.mark.parametrize("fairness, env, expected", [
    ("maxmin", {"APF_FAIRNESS": "kubernetes"},
     {"tenants": "maxmin", "plain": "kubernetes", "catch-all": "kubernetes"}),
    ("kubernetes", {}, {"tenants": "kubernetes", "plain": "maxmin", "catch-all": "maxmin"}),
])
def test_each_level_runs_its_fairness_in_the_ledger(tmp_path, fairness, env, expected):
    """Start and reload both go through level_specs: the ledger's levels run the fairness the
    annotation or APF_FAIRNESS chose, and a reload switches a level's fairness in place."""
    led = Ledger.create(bytearray(Ledger.size(Capacity())), Capacity(), lock=NullLock())
    configure_ledger(led, _generation(tmp_path, "kubernetes", {"APF_FAIRNESS": "kubernetes"}), 0)
    assert {lv.name: lv.fairness for lv in led.snapshot(0).levels if lv.name != "exempt"} == {
        "tenants": "kubernetes", "plain": "kubernetes", "catch-all": "kubernetes"}
    configure_ledger(led, _generation(tmp_path, fairness, env), 1)
    assert {lv.name: lv.fairness for lv in led.snapshot(1).levels
            if lv.name != "exempt"} == expected
