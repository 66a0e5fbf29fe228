"""Faults at scale, long form: the chaos tests' scenarios (``tests/apps/chaos.py``) at the sizes
of issue 11, against real gunicorn servers on 127.0.0.1 (2 workers x 8 threads, the test app).

    .venv/bin/python benchmarks/soak.py                  # everything, ~5-10 minutes
    .venv/bin/python benchmarks/soak.py --only kills,hups --kills 30
    .venv/bin/python benchmarks/soak.py --worker uvicorn      # the same on an ASGI worker

Scenarios: ``kills`` (random worker SIGKILLs under mixed load: slow requests, clients that
disconnect while queued, ``?timeout=`` expiries, exempt health checks), ``master`` (master
SIGKILL, then a restart on the same ``APF_INSTANCE``), ``soak`` (keep-alive requests with
abandoned connections alongside; worker RSS growth), ``hostile`` (random bytes, oversized
lines and headers, duplicate and non-UTF-8 identity headers, garbage ``?timeout=``,
pipelining, half-closes), ``hups`` (HUPs under load, alternating valid and invalid
configurations). Each prints what the clients saw and every broken promise; the exit status is
1 if any scenario found one.

``--worker`` picks the worker class: ``gthread`` (the Flask test app, 2 workers x 8 threads) or
an ASGI worker, ``uvicorn`` (``apf_gunicorn.asgi.UvicornWorker``) or ``asgi``
(``apf_gunicorn.asgi.ASGIWorker``), serving ``tests/apps/asgi_app.py``: the same routes, async,
its tracked requests reading their body first as frameworks do. The soak's bound on each
worker's RSS growth is 5 MiB on gthread and 8 MiB on the ASGI workers: the stock servers
(without APF) grow by 0.7-1.4 KiB per connection abandoned mid-request (uvicorn-worker 3.1 MiB
and gunicorn's asgi 4.2 MiB in this soak's 160,000 requests, 3,200-4,400 abandoned;
docs/asgi.md).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.apps import chaos  # noqa: E402
from tests.conftest import APPS, serve  # noqa: E402

SCENARIOS = ("kills", "master", "soak", "hostile", "hups")
#: ``--worker`` -> the ``-k`` worker class (None: gthread, apf_gunicorn.conf's default)
WORKERS = {"gthread": None, "uvicorn": "apf_gunicorn.asgi.UvicornWorker",
           "asgi": "apf_gunicorn.asgi.ASGIWorker"}
#: the soak's bound on each worker's RSS growth, KiB (see the docstring)
RSS_BOUND_KIB = {"gthread": 5 * 1024, "uvicorn": 8 * 1024, "asgi": 8 * 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SCENARIOS),
                    help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--masters", type=int, default=3, help="master kill + restart rounds")
    ap.add_argument("--requests", type=int, default=150_000, help="soak requests")
    ap.add_argument("--hostile", type=int, default=2000)
    ap.add_argument("--hups", type=int, default=20)
    ap.add_argument("--worker", choices=sorted(WORKERS), default="gthread",
                    help="the worker class (default gthread)")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    totals = {"requests": 0, "kills": 0, "hups": 0, "broken promises": 0}
    for name in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            track = str(tmp_path / "track.log")
            start = functools.partial(serve, tmp_path, worker=WORKERS[args.worker],
                                      boot_timeout=60.0)
            t0 = time.monotonic()
            if name == "master":
                report, problems = chaos.scenario_master_kill(start, args.masters)
            else:
                env = {"APP_TRACK": track}
                extra: dict = {}
                config = tmp_path / "apf.yaml"
                if name == "hups":
                    config.write_text((APPS / "apf.yaml").read_text())
                    env["APF_CONFIG"] = str(config)
                    env.update(chaos.HUP_ONLY)
                    extra["args"] = ("--graceful-timeout", "2")
                with start(workers=2, threads=8, env=env, **extra) as srv:
                    if name == "kills":
                        report, problems = chaos.scenario_kills(srv, track, args.kills)
                    elif name == "soak":
                        report, problems = chaos.scenario_soak(
                            srv, track, args.requests, rss_bound_kib=RSS_BOUND_KIB[args.worker])
                    elif name == "hostile":
                        report, problems = chaos.scenario_hostile(srv, args.hostile)
                    else:
                        valid = config.read_text()
                        invalid = valid.replace("handSize: 4", "handSize: 40")
                        report, problems = chaos.scenario_hups(srv, track, config, valid,
                                                               invalid, args.hups)
            print(f"== {name} on {args.worker} ({time.monotonic() - t0:.0f} s): {report}")
            for p in problems:
                print(f"   PROBLEM: {p}")
            print(f"   {'FAILED' if problems else 'ok'}", flush=True)
            totals["requests"] += sum(report.get("clients", {}).values()) + report.get("sent", 0)
            totals["kills"] += report.get("kills", 0)
            totals["hups"] += report.get("hups", 0)
            totals["broken promises"] += len(problems)
    print(f"== total on {args.worker}: {totals}")
    return 1 if totals["broken promises"] else 0


if __name__ == "__main__":
    sys.exit(main())
