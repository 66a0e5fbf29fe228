"""``apf-gunicorn explain``: what the server would do with a request, and why.

    apf-gunicorn explain --request "GET /api/v1/namespaces/default/pods" --user bob
    APF_USER_FROM=address apf-gunicorn explain --request "GET /work" --remote-addr 203.0.113.9
    apf-gunicorn explain --request "POST /reports/2024" --app myapp:app --json

The request form (``--request "METHOD PATH[?QUERY]"``) builds the WSGI environ gunicorn would
build and resolves it with the server's own resolver (:mod:`apf_gunicorn.server.resolver`:
Kubernetes API paths, ``APF_ROUTES``, ``APF_REQUEST_INFO``, ``APF_TRUSTED_PROXIES``,
``APF_USER_HEADER``/``APF_GROUP_HEADER``, ``APF_USER_FROM``), read from the environment as the
server reads it. Then it classifies the request and estimates its cost as the server does:
FlowSchema, priority level, flow (distinguisher and hash), hand, seats and the fairness.

Who sends it: ``--header "K: V"`` (repeatable; repeated names are joined with ``,`` as
gunicorn joins them) and ``--remote-addr IP`` (default 127.0.0.1) are sent as given.
``--user U`` and ``--group G`` are the identity an authenticating proxy would assert: they go
in the trusted proxy headers from a trusted address (the first of ``APF_TRUSTED_PROXIES``,
unless ``--remote-addr`` says otherwise), or, without trusted proxies, in ``REMOTE_USER``. An
empty ``--user ""`` is what an empty header is to the server: nobody (``system:anonymous``).

The attribute form (``--verb`` with ``--path`` for a non-resource request or ``--resource``
and its fields) skips the resolver and classifies those attributes as they are.

``--config`` takes what ``check`` takes (a YAML file, a directory, ``builtin:NAME``) and
defaults to ``APF_CONFIG``, else the built-in configuration the server would run
(``builtin:webapp``, or ``builtin:public`` when ``APF_USER_FROM`` names no verified identity). ``--app
module:app`` (a Flask app, or a Django project's ``mysite.wsgi:application``) names the view
that serves the request and lets its ``@cost`` count; a view cost the app cannot read (Flask's
decorator on a Django view, or the reverse) becomes a note; ``APF_ROUTES`` costs and the
``APF_WORK_ESTIMATOR`` hook count when set. Seats are clamped to the level's maximum, which
depends on the concurrency limit: ``--concurrency-limit``, else ``APF_CONCURRENCY_LIMIT``,
else the server's default for ``--workers`` x ``--threads`` (workers x threads / 2; both
default to apf_gunicorn's ``conf.py``, as in ``check``). The output starts with the
configuration and the limit used, and where each came from. A dangling FlowSchema (one naming
a level the configuration lacks) that matches the request ahead of the chosen one gets a note.

JSON keys: ``config`` (the path, or ``builtin:NAME``), ``configSource`` (``from --config``,
``from APF_CONFIG`` or the default), ``concurrencyLimit`` and ``concurrencyLimitSource``,
``flowSchema``, ``priorityLevel``, ``flowSchemaUID``, ``priorityLevelUID``,
``flow`` (who the flow is, by the FlowSchema's distinguisher method, on every level),
``distinguisher`` and ``flowHash`` (Kubernetes': empty and 0 unless the level has more than
one queue), ``hand`` (the queue indices the flow is dealt; empty when the
level does not queue), ``user``, ``groups``, ``attributes`` (the resolved request), ``seats``
(``initial``, ``final``, ``additionalLatency``, ``longRunning``, ``source``, ``view`` (the
``--app`` view that serves the request, or null), ``requested``, ``maxSeats``,
``maxSeatsFrom``, ``concurrencyLimit``), ``fairness`` (the level's fairness,
``kubernetes`` or ``maxmin``; null on the exempt level), ``fairnessSource`` (``annotation
apf-gunicorn.io/fairness``, ``APF_FAIRNESS``, ``default`` or ``exempt``), ``paths`` (whether
``/api/`` and ``/apis/`` paths are Kubernetes API requests here, and why: ``APF_PATHS`` and the
FlowSchemas' resource rules; null in the attribute form), ``notes``.
Exit status: 0 explained, 1 invalid configuration, 2 unusable arguments, settings or files.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import sys
from typing import Any

from apf_gunicorn.cli.common import (
    ServerLimit,
    add_limit_arguments,
    load_or_report,
    server_limit,
)
from apf_gunicorn.flowcontrol import fairness, identity
from apf_gunicorn.flowcontrol.configuration import Configuration
from apf_gunicorn.flowcontrol.gomath import format_duration
from apf_gunicorn.flowcontrol.identity import ANONYMOUS_USER, identity_groups
from apf_gunicorn.flowcontrol.kube_paths import parse_kubernetes_path, path_parsing
from apf_gunicorn.flowcontrol.limits import compute_limits, max_seats_origin
from apf_gunicorn.flowcontrol.matching import (
    Classification,
    Classifier,
    flow_distinguisher,
    flow_schema_matches,
    hand,
)
from apf_gunicorn.flowcontrol.objects import FlowSchema, RequestAttributes
from apf_gunicorn.flowcontrol.workestimate import (
    ONE_SEAT,
    WorkEstimate,
    clamp,
    declared_estimate,
    level_max_seats,
    load_estimator_hook,
)

DEFAULT_REMOTE_ADDR = "127.0.0.1"
_HTTP_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))


class UsageError(ValueError):
    """Arguments or settings explain cannot use; the message says why (exit status 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request", metavar='"METHOD PATH"',
                        help='the request line, e.g. "GET /api/v1/namespaces/ns/pods?watch=1"')
    parser.add_argument("--config", metavar="PATH", default=None,
                        help="YAML file, directory or builtin:NAME (default: APF_CONFIG, else "
                             "the built-in one)")
    parser.add_argument("--user", default=None,
                        help="user name an authenticating proxy asserts (\"\": nobody)")
    parser.add_argument("--group", action="append", default=[], metavar="G",
                        help="a group of the user (repeatable)")
    parser.add_argument("--header", action="append", default=[], metavar='"K: V"',
                        help="a request header (repeatable)")
    parser.add_argument("--remote-addr", metavar="IP", default=None,
                        help=f"the peer address (default {DEFAULT_REMOTE_ADDR}, or a trusted "
                             "proxy's with --user)")
    parser.add_argument("--app", metavar="MODULE:APP", default=None,
                        help="the WSGI app (Flask, or Django's mysite.wsgi:application): its "
                             "views and their @cost declarations")
    add_limit_arguments(parser)
    attrs = parser.add_argument_group("attribute form (instead of --request)")
    attrs.add_argument("--verb", help="Kubernetes verb (get, list, create, ...) or, with "
                                      "--path, the HTTP method")
    target = attrs.add_mutually_exclusive_group()
    target.add_argument("--path", metavar="P", help="a non-resource request for this URL path")
    target.add_argument("--resource", metavar="R", help="a resource request for this resource")
    attrs.add_argument("--api-group", default="", metavar="G", help='API group (default "")')
    attrs.add_argument("--namespace", default="", metavar="NS",
                       help="namespace (default: none, i.e. cluster-scoped)")
    attrs.add_argument("--subresource", default="", metavar="S")
    attrs.add_argument("--name", default="", metavar="N")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(_parser=parser)


# -- the request form -----------------------------------------------------------------------

def _wsgi(text: str) -> str:
    """Text as a WSGI native string (its UTF-8 bytes carried as latin-1), as gunicorn gives it."""
    return text.encode("utf-8").decode("latin-1")


def _trusted_address(settings: Any) -> str | None:
    """An address the resolver trusts as a proxy ("" for a Unix-socket peer), or None."""
    for net in settings.trusted_proxies:
        return "" if isinstance(net, str) else str(net.network_address)  # "unix": no address
    return None


def build_environ(args: argparse.Namespace, settings: Any) -> tuple[dict[str, Any], list[str]]:
    """The WSGI environ gunicorn would build for the arguments, and notes on how the identity
    arguments were carried. Raises UsageError for a malformed request line, header or
    address."""
    parts = args.request.split()
    if len(parts) != 2 or not parts[0].isalpha():
        raise UsageError(f'--request {args.request!r}: expected "METHOD PATH", e.g. "GET /"')
    method, target = parts[0].upper(), parts[1]
    if not target.startswith("/"):
        raise UsageError(f"--request {args.request!r}: the path must start with /")
    from gunicorn.util import unquote_to_wsgi_str

    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method, "PATH_INFO": unquote_to_wsgi_str(path),
        "QUERY_STRING": query, "SCRIPT_NAME": "", "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
    }
    notes: list[str] = []
    for header in args.header:
        name, sep, value = header.partition(":")
        name = name.strip()
        if not sep or not name or not all(c.isalnum() or c in "-_" for c in name):
            raise UsageError(f'--header {header!r}: expected "Name: value"')
        if "_" in name:
            notes.append(f"header {name!r} dropped: gunicorn drops header names with '_'")
            continue
        key = identity.header_environ_key(name)
        if key in ("HTTP_CONTENT_TYPE", "HTTP_CONTENT_LENGTH"):
            key = key[5:]
        value = _wsgi(value.strip())
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    remote = args.remote_addr
    if remote is not None and remote != "":
        try:
            ipaddress.ip_address(remote)
        except ValueError:
            raise UsageError(f"--remote-addr {remote!r} is not an IP address") from None
    if args.user is not None:
        remote = _carry_identity(args, settings, environ, remote, notes)
    elif args.group:
        raise UsageError("--group needs --user")
    environ["REMOTE_ADDR"] = DEFAULT_REMOTE_ADDR if remote is None else remote
    return environ, notes


def _carry_identity(args: argparse.Namespace, settings: Any, environ: dict[str, Any],
                    remote: str | None, notes: list[str]) -> str | None:
    """Put --user/--group where the server's identity sources read them; returns the peer."""
    sources = settings.user_from
    trusted = _trusted_address(settings)
    if identity.PROXY in sources and trusted is not None:
        user_key = identity.header_environ_key(settings.user_header)
        environ[user_key] = _wsgi(args.user)
        if args.group:
            environ[identity.header_environ_key(settings.group_header)] = _wsgi(
                ",".join(args.group))
        notes.append(f"--user sent as {settings.user_header} by a trusted proxy")
        return trusted if remote is None else remote
    if identity.REMOTE_USER in sources:
        if args.group:
            raise UsageError("--group reaches the server only in a trusted proxy's "
                             f"{settings.group_header}: set APF_TRUSTED_PROXIES")
        environ["REMOTE_USER"] = _wsgi(args.user)
        notes.append("--user set as REMOTE_USER (no trusted proxy is configured)")
        return remote
    notes.append(f"--user ignored: APF_USER_FROM={','.join(sources)} reads no proxy header "
                 "or REMOTE_USER")
    return remote


# -- the attribute form ---------------------------------------------------------------------

def request_attributes(args: argparse.Namespace) -> RequestAttributes:
    """The request the attribute-form arguments describe, with the groups the server would
    give the user (an empty user is anonymous, as in the server)."""
    user = args.user.strip()
    if not user:
        user = ANONYMOUS_USER
    groups = identity_groups(user, dict.fromkeys(args.group))
    verb = args.verb.lower()
    if args.path is not None:
        return RequestAttributes(user, groups, verb, args.path)
    return RequestAttributes(user, groups, verb, "", True, args.api_group, "",
                             args.resource, args.subresource, args.namespace, args.name)


# -- cost -----------------------------------------------------------------------------------

def _load_app(spec: str | None) -> Any:
    """The ``--app`` WSGI application, imported as gunicorn would; None without ``--app``."""
    if not spec:
        return None
    from apf_gunicorn.flowcontrol.hookspec import import_callable

    return import_callable(spec, "--app", UsageError)


def _estimate(app, settings, resolver, environ, attrs, c, server_limit: int,
              limits: dict) -> dict[str, Any]:
    """The seats the server would admit the request with, where they come from, and the view
    of ``app`` that serves it."""
    from apf_gunicorn.appcosts import view_costs_for_app, view_names_for_app

    est: WorkEstimate | None = None
    source = ""
    view = None
    if environ is not None and app is not None:
        names = view_names_for_app(app)
        view = names.name(environ["REQUEST_METHOD"], attrs.path) if names else None
    if environ is not None and settings.work_estimator:
        est = load_estimator_hook(settings.work_estimator)(environ, attrs, c)
        source = "APF_WORK_ESTIMATOR" if est is not None else ""
    if est is None and environ is not None:
        from apf_gunicorn.server.generation import route_table

        view_costs = view_costs_for_app(app) if app is not None else None
        routes = route_table(resolver)
        est, source = declared_estimate(environ["REQUEST_METHOD"], attrs.path, view_costs,
                                        routes if getattr(routes, "has_costs", False) else None)
    if est is None:
        est, source = ONE_SEAT, "default"
    level = c.priority_level
    widest = level_max_seats(limits[level.name], level.is_exempt, server_limit)
    out = clamp(est, widest)
    return {
        "initial": out.initial_seats, "final": out.final_seats,
        "additionalLatency": format_duration(out.additional_latency_ns),
        "longRunning": out.long_running or attrs.verb == "watch", "source": source,
        "view": view,
        "requested": {"initial": est.initial_seats, "final": est.final_seats},
        "maxSeats": widest, "maxSeatsFrom": max_seats_origin(level),
        "concurrencyLimit": server_limit,
    }


# -- output ---------------------------------------------------------------------------------

def _attributes(attrs: RequestAttributes) -> dict[str, Any]:
    out = {"verb": attrs.verb, "path": attrs.path, "isResource": attrs.is_resource}
    if attrs.is_resource:
        out.update(apiGroup=attrs.api_group, apiVersion=attrs.api_version,
                   namespace=attrs.namespace, resource=attrs.resource,
                   subresource=attrs.subresource, name=attrs.name)
    return out


def explanation(classification: Classification) -> dict[str, Any]:
    """The classification keys of the ``--json`` object."""
    return {
        "flowSchema": classification.flow_schema.name,
        "priorityLevel": classification.priority_level.name,
        "flowSchemaUID": classification.flow_schema.uid,
        "priorityLevelUID": classification.priority_level.uid,
        "distinguisher": classification.distinguisher,
        "flowHash": classification.flow_hash,
        "hand": list(hand(classification)),
    }


def _limit_text(result: dict[str, Any]) -> str:
    """``"20 seats"``, or ``auto (starts at 20 seats, bounds ...)`` for an adaptive limit."""
    auto = result.get("concurrencyLimitAuto")
    limit = result["concurrencyLimit"]
    return ServerLimit(limit, "", None if auto is None else (auto["min"], auto["max"])).describe()


def render_text(result: dict[str, Any]) -> str:
    a = result["attributes"]
    if a["isResource"]:
        what = (f"resource request: verb={a['verb']} apiGroup={a['apiGroup']!r} "
                f"apiVersion={a['apiVersion']!r} namespace={a['namespace']!r} "
                f"resource={a['resource']!r} subresource={a['subresource']!r} "
                f"name={a['name']!r}")
    else:
        what = f"non-resource request: verb={a['verb']} path={a['path']}"
    s = result["seats"]
    seats = f"{s['initial']} ({s['source']})"
    if s["final"]:
        seats += f", then {s['final']} for {s['additionalLatency']}"
    if (s["requested"]["initial"], s["requested"]["final"]) != (s["initial"], s["final"]):
        seats += (f"; asked {s['requested']['initial']} (final {s['requested']['final']}), "
                  f"clamped to the level's max {s['maxSeats']} ({s['maxSeatsFrom']})")
    if s["longRunning"]:
        seats += "; held until the app returns its iterable (long-running)"
    lines = [
        f"configuration: {result['config']} ({result['configSource']})",
        f"concurrency limit: {_limit_text(result)}, {result['concurrencyLimitSource']}",
        f"user: {result['user']}",
        f"groups: {', '.join(result['groups'])}",
        f"request: {what}",
        *([f"paths: /api/ and /apis/ are {result['paths']}"] if result["paths"] else []),
        *([f"view: {s['view']}"] if s["view"] else []),
        f"flowSchema: {result['flowSchema']} (uid {result['flowSchemaUID']})",
        f"priorityLevel: {result['priorityLevel']} (uid {result['priorityLevelUID']})",
        f"flow: {result['flow'] or '(one flow for the whole FlowSchema)'}",
        f"distinguisher: {result['distinguisher']}",
        f"flowHash: {result['flowHash']}",
        f"hand: {' '.join(map(str, result['hand'])) or '(no queues)'}",
        f"seats: {seats} (limit {s['concurrencyLimit']} seats)",
        "fairness: " + (f"{result['fairness']} ({result['fairnessSource']})"
                        if result["fairness"] else "none (exempt: never queued)"),
    ]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


# -- run --------------------------------------------------------------------------------------

def _settings(args: argparse.Namespace) -> tuple[Any, str, str]:
    """The server's settings as explain uses them, where the configuration comes from and
    where the concurrency limit comes from."""
    from apf_gunicorn.server.settings import SettingsError, load_settings

    env = dict(os.environ)
    if args.config is not None:
        env.pop("APF_CONFIG", None)  # --config wins; the loader reports its problems
    try:
        settings = load_settings(env, workers=args.workers, threads=args.threads)
    except SettingsError as e:
        raise UsageError(str(e)) from None
    if args.config is not None:
        settings = dataclasses.replace(settings, config_path=args.config)
        config_source = "from --config"
    elif settings.config_path is not None:
        config_source = "from APF_CONFIG"
    else:
        config_source = "the default: APF_CONFIG is not set"
        if settings.builtin_reason:
            config_source += f", and {settings.builtin_reason}"
    from_env: int | str | None = None
    if env.get("APF_CONCURRENCY_LIMIT", "").strip():
        from_env = (settings.concurrency_limit if settings.concurrency_auto is None
                    else env["APF_CONCURRENCY_LIMIT"])
    chosen = server_limit(args, from_env)
    return (dataclasses.replace(settings, concurrency_limit=chosen.seats,
                                concurrency_auto=chosen.auto),
            config_source, chosen.source)


def _fairness(level: Any, settings: Any) -> tuple[str | None, str]:
    """The fairness of ``level`` and where it comes from (the annotation, else
    APF_FAIRNESS, else the server's default); None for the exempt level."""
    source = "APF_FAIRNESS" if os.environ.get("APF_FAIRNESS", "").strip() else "default"
    return fairness.level_fairness(level, settings.fairness, source)


def _check_form(args: argparse.Namespace) -> None:
    parser = args._parser
    if args.request is not None:
        if args.verb or args.path is not None or args.resource is not None:
            parser.error("--request describes the whole request: drop --verb/--path/--resource")
        return
    if not args.verb or (args.path is None and args.resource is None) or args.user is None:
        parser.error("give --request \"METHOD PATH\", or --user, --verb and --path or "
                     "--resource")


def dangling_notes(cfg: Configuration, attrs: RequestAttributes,
                   chosen: FlowSchema) -> list[str]:
    """A note for each dangling FlowSchema that matches the request and would have been chosen
    before ``chosen``: why the request went elsewhere.

    Args:
        cfg: the configuration.
        attrs: the request.
        chosen: the schema the request got.

    Returns:
        One line per such schema, naming it, its file and the missing level.
    """
    rank = (chosen.matching_precedence, chosen.name)
    notes = []
    for fs, msg in cfg.dangling:
        if (fs.matching_precedence, fs.name) < rank and flow_schema_matches(fs, attrs):
            notes.append(f"FlowSchema {fs.name!r} ({fs.source}, matchingPrecedence "
                         f"{fs.matching_precedence}) matches this request but was skipped: "
                         f"{msg} (it is dangling; `apf-gunicorn check` says how to fix it)")
    return notes


def run(args: argparse.Namespace) -> int:
    from apf_gunicorn.server.resolver import (
        ResolverError,
        build_resolver,
        path_parsing_note,
        token_notes,
    )

    _check_form(args)
    # As gunicorn does: the app and the APF_* hooks import from the current directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        settings, config_source, limit_source = _settings(args)
        cfg = load_or_report(settings.config_source, "explain")
        if isinstance(cfg, int):
            return cfg
        notes: list[str] = []
        environ = resolver = None
        if args.request is not None:
            resolver = build_resolver(settings, cfg)
            environ, notes = build_environ(args, settings)
            attrs = resolver(environ)
            notes += token_notes(resolver, environ)
        else:
            attrs = request_attributes(args)
            method = args.verb.upper()
            if method not in _HTTP_METHODS:
                method = "GET"
            if args.path is not None and path_parsing(
                    settings.paths, cfg.flow_schemas)[0] and parse_kubernetes_path(
                    method, args.path.partition("?")[0], "") is not None:
                notes.append(f"--path is a non-resource request here, but the server parses "
                             f"{args.path} as a resource request: ask with --request "
                             f"\"{method} {args.path}\" for the server's answer")
        c = Classifier(cfg).classify(attrs)
        notes += dangling_notes(cfg, attrs, c.flow_schema)
        limits = compute_limits(cfg.priority_levels.values(), settings.concurrency_limit)
        app = _load_app(args.app)
        seats = _estimate(app, settings, resolver, environ, attrs, c,
                          settings.concurrency_limit, limits)
        if app is not None:
            from apf_gunicorn.appcosts import unusable_costs

            notes += unusable_costs(app)
    except (UsageError, ResolverError) as e:
        print(f"apf-gunicorn explain: {e}", file=sys.stderr)
        return 2
    level = c.priority_level
    if args.request is not None and level.queuing is not None and level.queuing.queues <= 1:
        notes.append(f"priority level {level.name!r} has at most one queue: all its flows "
                     "share it (no fairness between them)")
    fairness_name, fairness_source = _fairness(level, settings)
    result = {"config": settings.config_source, "configSource": config_source,
              "concurrencyLimit": settings.concurrency_limit,
              "concurrencyLimitSource": limit_source,
              "concurrencyLimitAuto": (None if settings.concurrency_auto is None else
                                       {"start": settings.concurrency_limit,
                                        "min": settings.concurrency_auto[0],
                                        "max": settings.concurrency_auto[1]}),
              **explanation(c), "flow": flow_distinguisher(c.flow_schema, attrs),
              "user": attrs.user, "groups": list(attrs.groups),
              "attributes": _attributes(attrs), "seats": seats,
              "fairness": fairness_name, "fairnessSource": fairness_source,
              "paths": path_parsing_note(settings, cfg) if args.request is not None else None,
              "notes": notes}
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(result))
    return 0
