"""``apf-gunicorn explain``: which FlowSchema, priority level, flow and queues a request gets.

    apf-gunicorn explain --config builtin:kubernetes --user alice --verb get --path /healthz
    apf-gunicorn explain --user system:node:n1 --group system:nodes --verb update \\
        --resource nodes --subresource status --name n1 --json

``--config`` takes what ``check`` takes (a YAML file, a directory, ``builtin:NAME``) and defaults
to the built-in configuration the server uses. As in the server, a named user other than
``system:anonymous`` also gets the group ``system:authenticated`` (and ``system:anonymous`` gets
``system:unauthenticated``). ``--path`` describes a non-resource request (the verb is the
lower-cased HTTP method); ``--resource`` a resource request.

JSON keys: ``flowSchema``, ``priorityLevel``, ``distinguisher``, ``flowHash``, ``hand`` (the
queue indices the flow is dealt; empty when the level does not queue).
Exit status: 0 explained, 1 invalid configuration, 2 unreadable configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from apf_gunicorn.flowcontrol.matching import Classification, Classifier, hand
from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.flowcontrol.requestinfo import identity_groups


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", default=None,
                        help="YAML file, directory or builtin:NAME (default: the built-in one)")
    parser.add_argument("--user", required=True, help="user name")
    parser.add_argument("--group", action="append", default=[], metavar="G",
                        help="a group of the user (repeatable)")
    parser.add_argument("--verb", required=True,
                        help="Kubernetes verb (get, list, create, ...) or, with --path, the "
                             "HTTP method")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--path", metavar="P", help="a non-resource request for this URL path")
    target.add_argument("--resource", metavar="R", help="a resource request for this resource")
    parser.add_argument("--api-group", default="", metavar="G", help='API group (default "")')
    parser.add_argument("--namespace", default="", metavar="NS",
                        help="namespace (default: none, i.e. cluster-scoped)")
    parser.add_argument("--subresource", default="", metavar="S")
    parser.add_argument("--name", default="", metavar="N")
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def request_attributes(args: argparse.Namespace) -> RequestAttributes:
    """The request the arguments describe, with the groups the server would give the user."""
    groups = identity_groups(args.user, dict.fromkeys(args.group))
    verb = args.verb.lower()
    if args.path is not None:
        return RequestAttributes(args.user, groups, verb, args.path)
    return RequestAttributes(args.user, groups, verb, "", True, args.api_group, "",
                             args.resource, args.subresource, args.namespace, args.name)


def explanation(classification: Classification) -> dict[str, Any]:
    """The ``--json`` object."""
    return {
        "flowSchema": classification.flow_schema.name,
        "priorityLevel": classification.priority_level.name,
        "distinguisher": classification.distinguisher,
        "flowHash": classification.flow_hash,
        "hand": list(hand(classification)),
    }


def render_text(attrs: RequestAttributes, result: dict[str, Any]) -> str:
    lines = [
        f"user: {attrs.user}",
        f"groups: {', '.join(attrs.groups)}",
        f"flowSchema: {result['flowSchema']}",
        f"priorityLevel: {result['priorityLevel']}",
        f"distinguisher: {result['distinguisher']}",
        f"flowHash: {result['flowHash']}",
        f"hand: {' '.join(map(str, result['hand'])) or '(no queues)'}",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from apf_gunicorn.cli.common import load_or_report

    cfg = load_or_report(args.config, "explain")
    if isinstance(cfg, int):
        return cfg
    attrs = request_attributes(args)
    result = explanation(Classifier(cfg).classify(attrs))
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(attrs, result))
    return 0
