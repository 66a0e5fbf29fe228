"""`apf-gunicorn dump [--admin HOST:PORT] levels|queues|requests|flows|pools|cpu [--details] [--kubernetes]`.

Fetches one of the debug dumps from a running server's admin endpoint and prints it. ``levels``
and ``queues`` end with each level's fairness and virtual time (``?includeFairness=1``),
and ``levels`` with its nominal, current and used seats (``&includeSeats=1``) and a last line
naming the running configuration's generation and digest, unless
``--kubernetes`` asks for Kubernetes' exact layout; ``flows`` lists the active flows of
``maxmin`` levels; ``pools`` the app's connection pools, summed over the workers
(docs/signals.md); ``cpu`` each worker's share of its GIL and the host's CPU
(docs/adaptive.md). The address defaults to ``APF_ADMIN_BIND`` when set, else the built-in
default.

    $ apf-gunicorn dump requests --details --admin 127.0.0.1:9180
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

from apf_gunicorn.master.admin import DEFAULT_BIND, DUMP_PREFIX, parse_bind

WHAT = {"levels": "dump_priority_levels", "queues": "dump_queues", "requests": "dump_requests",
        "flows": "dump_flows", "pools": "dump_pools", "cpu": "dump_cpu"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=sorted(WHAT), help="which dump to print")
    parser.add_argument("--admin", metavar="HOST:PORT", default=None,
                        help=f"admin endpoint (default: $APF_ADMIN_BIND or {DEFAULT_BIND})")
    parser.add_argument("--details", action="store_true",
                        help="requests: add user, verb, path and resource columns")
    parser.add_argument("--kubernetes", action="store_true",
                        help="levels, queues: Kubernetes' exact columns, without the fairness, "
                             "virtual time and seats appended")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")


def url_for(admin: str, what: str, details: bool, kubernetes: bool = False) -> str:
    """The dump's URL on the admin endpoint ``admin`` (``HOST:PORT``).

    Args:
        admin: the admin endpoint's address; what: a key of :data:`WHAT`;
        details: requests: ask for the request details;
        kubernetes: levels, queues: leave out the fairness (and seat) columns.
    Returns:
        The URL.
    Raises:
        ValueError: ``admin`` is not ``HOST:PORT``.
    """
    host, port = parse_bind(admin)
    if ":" in host:
        host = f"[{host}]"
    url = f"http://{host}:{port}{DUMP_PREFIX}{WHAT[what]}"
    if details and what == "requests":
        url += "?includeRequestDetails=1"
    elif what == "levels" and not kubernetes:
        url += "?includeFairness=1&includeSeats=1"
    elif what == "queues" and not kubernetes:
        url += "?includeFairness=1"
    return url


def run(args: argparse.Namespace) -> int:
    admin = args.admin or os.environ.get("APF_ADMIN_BIND") or DEFAULT_BIND
    if admin.lower() == "off":
        print("apf-gunicorn dump: the admin endpoint is off (APF_ADMIN_BIND=off); "
              "pass --admin HOST:PORT", file=sys.stderr)
        return 2
    try:
        url = url_for(admin, args.what, args.details, args.kubernetes)
    except ValueError as exc:
        print(f"apf-gunicorn dump: {exc}", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            body = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode("utf-8", "replace").strip()
        print(f"apf-gunicorn dump: {url} answered {exc.code}: {text}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"apf-gunicorn dump: cannot reach the admin endpoint at {admin} ({reason}); is "
              "the server running, and is APF_ADMIN_BIND the same?", file=sys.stderr)
        return 1
    sys.stdout.write(body)
    return 0
