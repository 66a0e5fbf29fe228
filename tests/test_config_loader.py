"""Loading: files, directories, list wrappers, YAML errors, duplicates, digest and shipped sets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from apf_gunicorn.flowcontrol.bootstrap import (
    BUILTIN_SOURCE,
    MANDATORY_FLOW_SCHEMAS,
    MANDATORY_PRIORITY_LEVELS,
    mandatory_manifests,
)
from apf_gunicorn.flowcontrol.configuration import dangling_message
from apf_gunicorn.flowcontrol.limits import compute_limits
from apf_gunicorn.flowcontrol.loader import (
    builtin_path,
    config_files,
    load_configuration,
    load_text,
    parse_object,
)
from apf_gunicorn.flowcontrol.matching import Classifier
from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.flowcontrol.validation import ConfigErrors

DATA = Path(__file__).parent / "data" / "config"

LEVEL = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {{name: {name}}}
spec:
  type: Limited
  limited: {{nominalConcurrencyShares: {shares}, limitResponse: {{type: Reject}}}}
"""
SCHEMA = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {{name: {name}}}
spec:
  matchingPrecedence: {prec}
  priorityLevelConfiguration: {{name: {pl}}}
  rules:
  - subjects: [{{kind: Group, group: {{name: g}}}}]
    nonResourceRules: [{{verbs: ["*"], nonResourceURLs: ["*"]}}]
"""


def write(tmp_path: Path, name: str, *docs: str) -> Path:
    path = tmp_path / name
    path.write_text("---\n".join(docs))
    return path


def test_kubectl_list_output_loads_as_is():
    cfg = load_configuration(DATA / "kubectl-list.yaml")
    assert [fs.name for fs in cfg.flow_schemas] == [
        "exempt",
        "probes",
        "global-default",
        "catch-all",
    ]
    assert set(cfg.priority_levels) == {"catch-all", "exempt", "global-default"}
    # metadata.uid is kept (it goes into the X-Kubernetes-PF-*-UID headers)
    assert cfg.flow_schemas[1].uid == "3b9e6d52-0c55-4c0e-bb0a-2b9f2d7c1a02"
    assert cfg.priority_levels["exempt"].uid == "2c8b5f77-9a0e-4d1c-8e3f-4b6a1d0c9b06"
    # the catch-all schema is not in the listing, so the built-in one is appended
    assert cfg.flow_schemas[-1] is MANDATORY_FLOW_SCHEMAS["catch-all"]
    assert [(fs.name, msg) for fs, msg in cfg.dangling] == [
        ("batch-jobs", dangling_message("batch"))
    ]
    assert dangling_message("batch") == (
        'This FlowSchema references the PriorityLevelConfiguration object named "batch" but '
        "there is no such object"
    )
    gd = cfg.priority_levels["global-default"]
    assert (gd.nominal_concurrency_shares, gd.lendable_percent, gd.queuing.queues) == (20, 50, 128)


def test_typed_list_items_inherit_kind():
    cfg = load_configuration(DATA / "typed-lists.yaml")
    assert "reports" in cfg.priority_levels
    assert [fs.name for fs in cfg.flow_schemas] == ["exempt", "reports", "catch-all"]
    assert cfg.priority_levels["reports"].queuing.queue_length_limit == 20


def test_directory_loads_yaml_and_yml_sorted_and_orders_schemas():
    files = config_files(DATA / "dir")
    assert [f.name for f in files] == ["10-levels.yml", "20-schemas.yaml"]
    cfg = load_configuration(DATA / "dir")
    # sorted by (matchingPrecedence, name), mandatory schemas around them
    assert [fs.name for fs in cfg.flow_schemas] == [
        "exempt",
        "early",
        "api-a",
        "api-b",
        "catch-all",
    ]
    assert cfg.sources == tuple(str(f) for f in files)
    assert cfg.priority_levels["api"].nominal_concurrency_shares == 30  # defaulted
    # mandatory levels are imagined from the bootstrap objects
    assert cfg.priority_levels["exempt"] is MANDATORY_PRIORITY_LEVELS["exempt"]
    assert cfg.priority_levels["catch-all"].source == BUILTIN_SOURCE


@pytest.mark.parametrize("level", ["exempt", "catch-all"])
def test_schema_may_name_an_undefined_mandatory_level(tmp_path, level):
    # In a cluster the bootstrap ensurer creates the mandatory objects before the controller
    # digests anything, so Kubernetes' own probe schema works without defining "exempt".
    path = write(tmp_path, "c.yaml", SCHEMA.format(name="ops", prec=50, pl=level))
    cfg = load_configuration(path)
    assert cfg.dangling == [] and cfg.warnings() == []
    assert [fs.name for fs in cfg.flow_schemas] == ["exempt", "ops", "catch-all"]
    assert cfg.flow_schemas[1].priority_level == level
    assert cfg.priority_levels[level] is MANDATORY_PRIORITY_LEVELS[level]


def test_schema_naming_a_missing_level_is_dangling_and_explained(tmp_path):
    path = write(tmp_path, "c.yaml", LEVEL.format(name="web", shares=5),
                 SCHEMA.format(name="ops", prec=50, pl="wbe"))
    cfg = load_configuration(path)
    assert [(fs.name, msg) for fs, msg in cfg.dangling] == [("ops", dangling_message("wbe"))]
    (err,) = cfg.dangling_errors()
    assert (err.file, err.kind, err.name, err.field) == (
        str(path), "FlowSchema", "ops", "spec.priorityLevelConfiguration.name")
    assert err.message.endswith(
        'the schema is dangling, so no request ever matches it. Define that '
        'PriorityLevelConfiguration or name an existing one ("web", "exempt", "catch-all")')
    assert cfg.warnings() == [str(err)]


def test_broken_exempt_level_gets_the_bootstrap_spec(tmp_path):
    # spec.exempt missing: the controller would find it broken, the ensurer rewrites it.
    path = write(
        tmp_path,
        "c.yaml",
        "apiVersion: flowcontrol.apiserver.k8s.io/v1\nkind: PriorityLevelConfiguration\n"
        "metadata: {name: exempt, uid: u1}\nspec: {type: Exempt}\n",
        SCHEMA.format(name="ops", prec=50, pl="exempt"),
    )
    cfg = load_configuration(path)
    assert cfg.broken == [] and cfg.dangling == []
    exempt = cfg.priority_levels["exempt"]
    assert (exempt.uid, exempt.source) == ("u1", str(path))
    assert exempt.type == "Exempt" and exempt.nominal_concurrency_shares == 0
    assert [(pl.name, reason) for pl, reason in cfg.repaired] == [
        ("exempt", "broken union structure at the top, for Exempt")]
    (warning,) = cfg.warnings()
    assert warning.startswith(f'{path}: PriorityLevelConfiguration "exempt": broken union')
    assert "as Kubernetes' ensurer rewrites it" in warning


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kind: FlowSchema\nmetadata:\n  name: x\n  - oops\n")
    with pytest.raises(ConfigErrors) as info:
        load_configuration(path)
    (err,) = info.value.errors
    assert err.file == str(path)
    assert str(err).startswith(f"{path}: invalid YAML: line 4, column 3: ")


def test_all_errors_of_all_files_are_collected(tmp_path):
    write(tmp_path, "a.yaml", SCHEMA.format(name="a", prec=0, pl="Bad"), "[1, 2]")
    write(tmp_path, "b.yaml", LEVEL.format(name="lvl", shares=-1), "just a string")
    with pytest.raises(ConfigErrors) as info:
        load_configuration(tmp_path)
    lines = str(info.value).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(
        f'{tmp_path}/a.yaml: FlowSchema "a": spec.priorityLevelConfiguration.name: Invalid value: "Bad"'
    )
    assert lines[1] == f"{tmp_path}/a.yaml: document 2 is not a map but a list"
    assert lines[2] == (f'{tmp_path}/b.yaml: PriorityLevelConfiguration "lvl": '
                        "spec.limited.nominalConcurrencyShares: Invalid value: -1: must be a non-negative integer")  # fmt: skip
    assert lines[3] == f"{tmp_path}/b.yaml: document 2 is not a map but a string"


def test_duplicate_names_of_same_kind_are_errors(tmp_path):
    write(
        tmp_path,
        "a.yaml",
        LEVEL.format(name="web", shares=1),
        SCHEMA.format(name="web", prec=5, pl="web"),
    )
    write(tmp_path, "b.yaml", LEVEL.format(name="web", shares=2))
    with pytest.raises(ConfigErrors) as info:
        load_configuration(tmp_path)
    assert [str(e) for e in info.value.errors] == [
        f'{tmp_path}/b.yaml: PriorityLevelConfiguration "web": metadata.name: Duplicate value: '
        f'"web" (already defined in {tmp_path}/a.yaml)'
    ]


def test_multi_document_file_with_empty_documents(tmp_path):
    path = write(tmp_path, "c.yaml", "", LEVEL.format(name="web", shares=3), "# only a comment\n",
                 SCHEMA.format(name="web", prec=5, pl="web"))  # fmt: skip
    cfg = load_configuration(path)
    assert [fs.name for fs in cfg.flow_schemas] == ["exempt", "web", "catch-all"]


def test_empty_list_and_list_with_bad_items():
    objs, errs = load_text("apiVersion: v1\nkind: List\nitems: []\n", "l.yaml")
    assert objs == [] and errs == []
    objs, errs = load_text("apiVersion: v1\nkind: List\nitems: 5\n", "l.yaml")
    assert [str(e) for e in errs] == ["l.yaml: List: items: must be a list"]
    objs, errs = load_text("apiVersion: v1\nkind: List\nitems: [7]\n", "l.yaml")
    assert [str(e) for e in errs] == [
        "l.yaml: List: items[0]: Invalid value: must be a map, not a number"
    ]


def test_missing_path_raises_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_configuration(tmp_path / "nope.yaml")


def test_not_utf8_is_an_error(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"kind: \xff\xfe\n")
    with pytest.raises(ConfigErrors, match="not UTF-8"):
        load_configuration(path)


def test_builtin_paths():
    assert builtin_path().name == "webapp"
    assert (builtin_path("kubernetes") / "mandatory.yaml").is_file()
    with pytest.raises(ValueError, match="available: kubernetes, mandatory, public, webapp"):
        builtin_path("nope")
    assert (
        load_configuration(None).flow_schemas == load_configuration("builtin:webapp").flow_schemas
    )


@pytest.mark.parametrize("name", ["webapp", "public", "kubernetes", "mandatory"])
def test_shipped_sets_are_clean(name):
    cfg = load_configuration(builtin_path(name))
    assert cfg.dangling == [] and cfg.broken == []
    assert all(pl.source != BUILTIN_SOURCE for pl in cfg.priority_levels.values())
    assert cfg.flow_schemas[0].name == "exempt" and cfg.flow_schemas[-1].name == "catch-all"


def test_kubernetes_set_matches_bootstrap_table():
    cfg = load_configuration(builtin_path("kubernetes"))
    got = [
        (fs.name, fs.matching_precedence, fs.priority_level, fs.distinguisher)
        for fs in cfg.flow_schemas
    ]
    assert got == [
        ("exempt", 1, "exempt", None),
        ("probes", 2, "exempt", None),
        ("system-leader-election", 100, "leader-election", "ByUser"),
        ("system-node-high", 400, "node-high", "ByUser"),
        ("system-nodes", 500, "system", "ByUser"),
        ("kube-controller-manager", 800, "workload-high", "ByNamespace"),
        ("kube-scheduler", 800, "workload-high", "ByNamespace"),
        ("kube-system-service-accounts", 900, "workload-high", "ByNamespace"),
        ("service-accounts", 9000, "workload-low", "ByUser"),
        ("global-default", 9900, "global-default", "ByUser"),
        ("catch-all", 10000, "catch-all", "ByUser"),
    ]
    node_high = cfg.flow_schemas[3]
    assert [rr.resources for rr in node_high.rules[0].resource_rules] == [
        ("nodes", "nodes/status"),
        ("leases",),
    ]
    assert [rr.cluster_scope for rr in node_high.rules[0].resource_rules] == [True, False]
    sle = cfg.flow_schemas[2].rules[0].subjects
    assert [(s.kind, s.name, s.namespace) for s in sle] == [
        ("User", "system:kube-controller-manager", ""),
        ("User", "system:kube-scheduler", ""),
        ("ServiceAccount", "*", "kube-system"),
    ]


def test_public_set_gives_every_client_the_limit():
    """builtin:public: probes exempt, every unauthenticated client its own flow on one level
    that holds (nearly) the whole limit; its shared objects are webapp's, byte for byte."""
    cfg = load_configuration(builtin_path("public"))
    assert [fs.name for fs in cfg.flow_schemas] == ["exempt", "probes", "anonymous", "catch-all"]
    limits = compute_limits(cfg.priority_levels.values(), 8)
    assert (limits["anonymous"].nominal, limits["catch-all"].nominal) == (8, 1)
    q = cfg.priority_levels["anonymous"].queuing
    assert (q.queues, q.hand_size, q.queue_length_limit) == (30, 3, 2)
    classifier = Classifier(cfg)
    for user in ("addr:203.0.113.9", "key:0123456789abcdef", "system:anonymous"):
        c = classifier.classify(RequestAttributes(user, ("system:unauthenticated",), "get", "/x"))
        assert (c.flow_schema.name, c.priority_level.name) == ("anonymous", "anonymous")
    probe = classifier.classify(
        RequestAttributes("addr:1.2.3.4", ("system:unauthenticated",), "get", "/healthz"))
    assert probe.priority_level.name == "exempt"
    webapp = load_configuration(builtin_path("webapp"))
    probes = [next(fs for fs in c.flow_schemas if fs.name == "probes") for c in (cfg, webapp)]
    assert dataclasses.replace(probes[0], source="") == dataclasses.replace(probes[1], source="")
    for name in ("mandatory.yaml",):
        assert ((builtin_path("public") / name).read_text()
                == (builtin_path("webapp") / name).read_text()
                == (builtin_path("mandatory") / name).read_text())


def test_webapp_set_shape():
    cfg = load_configuration(builtin_path("webapp"))
    by_name = {fs.name: fs for fs in cfg.flow_schemas}
    assert by_name["probes"].priority_level == "exempt"
    assert by_name["admins"].priority_level == "exempt"
    assert by_name["admins"].rules[0].subjects[0].name == "admins"
    assert by_name["users"].distinguisher == "ByUser"
    anonymous = cfg.priority_levels["anonymous"]
    users = cfg.priority_levels["users"]
    assert anonymous.nominal_concurrency_shares < users.nominal_concurrency_shares
    assert anonymous.borrowing_limit_percent == 0 and users.lendable_percent == 0



@pytest.mark.parametrize("server_limit", [8, 64])
def test_webapp_anonymous_level_keeps_its_seats_beside_a_probe(server_limit):
    """A flood of anonymous clients keeps the anonymous level's nominal seats through a
    borrowing round in which a health probe (exempt) was in flight: Kubernetes takes the
    exempt level's high watermark out of the lendable seats, so a level that lends would fall
    to its lower bound (1 of 2 seats at limit 8) and every other anonymous client would wait
    for half the seats (docs/configuration.md)."""
    from apf_gunicorn.flowcontrol.borrowing import DemandObservation, LevelInput, adjust
    from apf_gunicorn.flowcontrol.limits import compute_limits, nominal_sum

    cfg = load_configuration(builtin_path("webapp"))
    limits = compute_limits(cfg.priority_levels.values(), server_limit)
    demand = {"exempt": 1.0, "anonymous": float(2 * limits["anonymous"].nominal + 3)}
    levels = [LevelInput(name, cfg.priority_levels[name].is_exempt, lim.nominal, lim.lower,
                         lim.upper, DemandObservation(10.0, demand.get(name, 0.0), 0.0,
                                                      demand.get(name, 0.0)))
              for name, lim in limits.items()]
    got = {o.name: o.current_limit for o in adjust(levels, nominal_sum(limits),
                                                   server_limit).levels}
    assert got["anonymous"] == limits["anonymous"].nominal, got
    assert got["users"] == limits["users"].nominal, got

def test_webapp_anonymous_clients_are_shuffle_sharded():
    """With APF_USER_FROM=address each anonymous client is a flow (user addr:..., group
    system:unauthenticated): one flooding address fills only its own hand of queues, so
    another address finds a free queue unless its whole hand lies inside the flooder's."""
    from apf_gunicorn.flowcontrol.matching import Classifier, hand
    from apf_gunicorn.flowcontrol.objects import RequestAttributes

    cfg = load_configuration(builtin_path("webapp"))
    classifier = Classifier(cfg)

    def hand_of(address: str) -> set[int]:
        c = classifier.classify(RequestAttributes(f"addr:{address}",
                                                  ("system:unauthenticated",), "get", "/work"))
        assert (c.flow_schema.name, c.priority_level.name) == ("anonymous", "anonymous")
        return set(hand(c))

    flooder = hand_of("203.0.113.66")
    q = cfg.priority_levels["anonymous"].queuing
    assert len(flooder) == q.hand_size == 3
    blocked = sum(hand_of(f"198.51.{i // 256}.{i % 256}") <= flooder for i in range(2000))
    assert blocked / 2000 < 0.01  # 1 in C(12, 3) = 220 expected
    # one client parks at most hand x queueLengthLimit threads; the queues of both levels
    # together hold what the default 2 x 64 threads park beside the 64 executing seats
    assert q.hand_size * q.queue_length_limit == 3
    waiting = sum(pl.queuing.queues * pl.queuing.queue_length_limit
                  for pl in cfg.priority_levels.values() if pl.queuing is not None)
    assert waiting == 2 * (64 - 2) - 64


def test_mandatory_manifests_match_typed_bootstrap_objects():
    for manifest in mandatory_manifests():
        parsed, errs = parse_object(manifest, BUILTIN_SOURCE)
        assert errs == []
        table = (
            MANDATORY_FLOW_SCHEMAS
            if manifest["kind"] == "FlowSchema"
            else MANDATORY_PRIORITY_LEVELS
        )
        assert parsed.obj == table[parsed.name]


def test_empty_directory_is_an_error(tmp_path):
    (tmp_path / "README.txt").write_text("no yaml here")
    with pytest.raises(ConfigErrors) as info:
        load_configuration(tmp_path)
    assert str(info.value) == f"{tmp_path}: no *.yaml or *.yml files in directory"
