"""Benchmark: request attributes + classification per request, and how classification cost
grows with the number of FlowSchemas.

    .venv/bin/python benchmarks/bench_classify.py [--requests N] [--repeat R]

Prints, against Kubernetes' suggested configuration (``builtin:kubernetes``, 11 FlowSchemas):
µs per request for the resolver, the classifier, and both; then the classify cost with 100
FlowSchemas divided by the cost with 11, for the indexed Classifier (warm per-user cache, and
with the cache defeated by a distinct user on every request) and for a plain linear scan, for
comparison. Times are this process's CPU time (less disturbed by other processes than wall
clock), best of ``--repeat`` runs; machines are still noisy, so read the ratios.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apf_gunicorn.flowcontrol.loader import load_configuration  # noqa: E402
from apf_gunicorn.flowcontrol.matching import Classifier, flow_schema_matches  # noqa: E402
from apf_gunicorn.flowcontrol.objects import (  # noqa: E402
    FlowSchema,
    NonResourceRule,
    PolicyRule,
    ResourceRule,
    Subject,
)
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver  # noqa: E402

PROXY = "10.0.0.7"


def environs(n: int, users: int, rng: random.Random) -> list[dict]:
    """A request mix: ordinary users on a REST API, nodes, service accounts, controllers,
    probes, anonymous clients; identity from a trusted proxy."""
    out = []
    for i in range(n):
        kind = rng.random()
        env = {"REQUEST_METHOD": "GET", "QUERY_STRING": "", "REMOTE_ADDR": PROXY,
               "SCRIPT_NAME": "", "SERVER_NAME": "localhost", "SERVER_PORT": "8000"}
        if kind < 0.55:
            u = rng.randrange(users)
            env.update(HTTP_X_REMOTE_USER=f"user-{u}", HTTP_X_REMOTE_GROUP=f"team-{u % 40}",
                       PATH_INFO=f"/api/v1/namespaces/tenant-{u % 50}/pods/p{i % 7}")
            env["REQUEST_METHOD"] = rng.choice(["GET", "GET", "GET", "PUT", "POST"])
        elif kind < 0.70:
            node = rng.randrange(50)
            env.update(HTTP_X_REMOTE_USER=f"system:node:n{node}", HTTP_X_REMOTE_GROUP="system:nodes",
                       REQUEST_METHOD="PUT", PATH_INFO=f"/api/v1/nodes/n{node}/status")
        elif kind < 0.80:
            env.update(HTTP_X_REMOTE_USER=f"system:serviceaccount:default:sa{rng.randrange(20)}",
                       HTTP_X_REMOTE_GROUP="system:serviceaccounts,system:serviceaccounts:default",
                       PATH_INFO="/apis/apps/v1/namespaces/default/deployments",
                       QUERY_STRING="watch=true&resourceVersion=1")
        elif kind < 0.85:
            env.update(HTTP_X_REMOTE_USER="system:kube-controller-manager", REQUEST_METHOD="PUT",
                       PATH_INFO="/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kcm")
        elif kind < 0.92:
            env.update(PATH_INFO="/healthz", REMOTE_ADDR="192.0.2.9")
        else:
            env.update(PATH_INFO=f"/static/app-{i % 13}.js", REMOTE_ADDR="192.0.2.9")
        out.append(env)
    return out


def grown_configuration(base, total: int) -> SimpleNamespace:
    """``base`` plus FlowSchemas up to ``total``: most name a team group or a service user;
    one in ten applies to every authenticated user for one tenant namespace (those are
    candidates for everybody, which is what makes a real configuration cost more)."""
    extra = []
    for i in range(total - len(base.flow_schemas)):
        if i % 10 == 0:
            subjects = (Subject("Group", "system:authenticated"),)
            rule = PolicyRule(subjects, (ResourceRule(("create", "delete"), ("shop",),
                                                      ("orders",), False, (f"shop-{i}",)),))
        elif i % 2:
            subjects = (Subject("Group", f"team-{i + 1000}"),)
            rule = PolicyRule(subjects, (ResourceRule(("*",), ("*",), ("*",), True, ("*",)),),
                              (NonResourceRule(("*",), ("*",)),))
        else:
            subjects = (Subject("User", f"svc-{i}"), Subject("ServiceAccount", "*", f"ns-{i}"))
            rule = PolicyRule(subjects, (), (NonResourceRule(("get",), (f"/svc/{i}",)),))
        extra.append(FlowSchema(f"extra-{i:03d}", "global-default", 1000 + i * 80, "ByUser",
                                (rule,)))
    schemas = sorted([*base.flow_schemas, *extra], key=lambda fs: (fs.matching_precedence, fs.name))
    return SimpleNamespace(flow_schemas=tuple(schemas), priority_levels=base.priority_levels)


def best_ns_per_item(fn, items, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time_ns()
        for item in items:
            fn(item)
        best = min(best, (time.process_time_ns() - start) / len(items))
    return best


def linear_classify(cfg):
    schemas = cfg.flow_schemas

    def classify(attrs):
        for fs in schemas:
            if flow_schema_matches(fs, attrs):
                return fs
        return None
    return classify


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(1)

    cfg = load_configuration("builtin:kubernetes")
    resolver = RequestInfoResolver([f"{PROXY}/32"])
    classifier = Classifier(cfg)
    envs = environs(args.requests, users=500, rng=rng)
    attrs = [resolver(e) for e in envs]

    def both(env):
        return classifier.classify(resolver(env))

    resolve_ns = best_ns_per_item(resolver, envs, args.repeat)
    classify_ns = best_ns_per_item(classifier.classify, attrs, args.repeat)
    both_ns = best_ns_per_item(both, envs, args.repeat)
    print(f"suggested configuration: {len(classifier.flow_schemas)} FlowSchemas, "
          f"{args.requests} requests, best of {args.repeat}")
    print(f"  resolve             {resolve_ns / 1000:7.2f} us/request")
    print(f"  classify            {classify_ns / 1000:7.2f} us/request")
    print(f"  resolve + classify  {both_ns / 1000:7.2f} us/request   (target < 20)")

    # Growth from the suggested 11 to 100 FlowSchemas.
    small, large = cfg, grown_configuration(cfg, 100)
    distinct = [a.__class__(**{**{f: getattr(a, f) for f in a.__dataclass_fields__ if f != "extra"},
                               "user": f"{a.user}#{i}"}) for i, a in enumerate(attrs)]
    rows = []
    for label, make, items in (
        ("indexed, warm per-user cache", lambda c: Classifier(c).classify, attrs),
        ("indexed, a new user every request", lambda c: Classifier(c).classify, distinct),
        ("plain linear scan (reference)", linear_classify, attrs),
    ):
        costs = []
        for c in (small, large):
            fn = make(c)
            for item in items[:2000]:  # warm up
                fn(item)
            costs.append(best_ns_per_item(fn, items, args.repeat))
        rows.append((label, costs[0], costs[1]))
    print(f"classify cost, {len(small.flow_schemas)} -> {len(large.flow_schemas)} FlowSchemas:")
    for label, a, b in rows:
        print(f"  {label:36s} {a / 1000:7.2f} -> {b / 1000:7.2f} us   ratio {b / a:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
