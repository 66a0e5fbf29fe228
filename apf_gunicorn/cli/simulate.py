"""`apf-gunicorn simulate SCENARIO [--json] [--fairness P] [--timeline N]`: run the production
fair-queuing code against a synthetic workload in virtual time and report what each client got
(SPEC section 9).

``--fairness kubernetes|maxmin`` runs that fairness instead of the scenario's
(``queueSet.fairness``, or the configuration form's ``fairness``; annotated levels keep
theirs). ``--timeline N`` adds each client's executing seats over time in N steps to the JSON.

Exit status: 0 on success, 1 for an invalid scenario (the message names the field), 2 for a
bad command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.simulate import (
    ScenarioError,
    format_table,
    load_scenario,
    simulate,
    to_json,
)

#: --timeline keeps clients x steps integers in memory (tens of bytes each): a bound
MAX_TIMELINE_NUMBERS = 1_000_000

LEGEND = """\
Virtual time, production fair-queuing and borrowing code. Per evaluation window and client:
  avg seats    seats its requests held, averaged over the window (what it got)
  demand       seats it would hold if never throttled: threads x seats x exec / (exec + think)
  fair share   Kubernetes' fair allocation of the limit given every client's demand
  seat demand  the ledger's seat-demand statistics (borrowing's input) checked against
               the harness's own count
Totals per client: dispatched, completed, and rejected by reason (queue-full: its queue
was full; conc-limit: a level without queues was at its limit; time-out: waited too long).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO", help="scenario file (YAML or JSON)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--max-clients", type=int, default=50, metavar="N",
                        help="list at most N clients in the table output (default 50)")
    parser.add_argument("--fairness", choices=fairness.NAMES, default=None,
                        help="fairness to run instead of the scenario's (a level's "
                             "apf-gunicorn.io/fairness annotation still wins)")
    parser.add_argument("--timeline", type=int, default=None, metavar="N",
                        help="JSON: add each client's executing seats over time, averaged over "
                             "N equal steps up to the last evaluation (1..100000; clients x N "
                             "at most 1000000)")


def run(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
    except OSError as exc:
        print(f"apf-gunicorn simulate: {exc}", file=sys.stderr)
        return 1
    except ScenarioError as exc:
        errors = getattr(exc, "errors", None) or [exc]
        if len(errors) == 1:
            print(f"apf-gunicorn simulate: {args.scenario}: {exc}", file=sys.stderr)
        else:
            print(f"apf-gunicorn simulate: {args.scenario}: {len(errors)} errors:",
                  file=sys.stderr)
            for err in errors:
                print(f"  {err}", file=sys.stderr)
        return 1
    if args.timeline is not None:
        clients = len(scenario.clients)
        if not 1 <= args.timeline <= 100_000 or clients * args.timeline > MAX_TIMELINE_NUMBERS:
            print(f"apf-gunicorn simulate: --timeline must be from 1 to 100000 steps, and at "
                  f"most {MAX_TIMELINE_NUMBERS} numbers in all: {clients} clients x "
                  f"{args.timeline} steps", file=sys.stderr)
            return 1
    started = time.perf_counter()
    try:
        result = simulate(scenario, fairness=args.fairness, timeline=args.timeline)
    except ScenarioError as exc:  # the configuration form's objects, checked when run
        print(f"apf-gunicorn simulate: {args.scenario}: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    if args.json:
        doc = to_json(result, {"wallSeconds": round(elapsed, 3)})
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(LEGEND)
        print(format_table(result, max_clients=args.max_clients))
        print(f"simulated in {elapsed:.2f} s of wall time")
    return 0
