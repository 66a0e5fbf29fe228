"""Draw the adaptive limit and a light user's latency over time, from the simulator
(``docs/images/adaptive.png``; virtual time: no server, a few seconds).

    .venv/bin/pip install '.[plot]'              # matplotlib, only for the picture
    .venv/bin/python benchmarks/plot_adaptive.py [--out docs/images/adaptive.png] [--json FILE]

The scenario is ``tests/scenarios/adaptive/pool-long.yaml``: a backend of 8 connections
(50 ms a query) that holds 4 from 20 s to 40 s; alice sends one query every 200 ms, bob floods
with 32 threads. It runs with the limit tuned by hand to the pool (10), the server's default
for 2 workers x 20 threads (20), and ``auto:2-64`` starting at 32, each evaluated every 2 s.
The top panel is the server limit, the middle one alice's p99 latency per 2 s, the bottom one
bob's requests per second. The numbers are printed and written with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from apf_gunicorn.simulate import parse_scenario, simulate, to_json  # noqa: E402

SCENARIO = ROOT / "tests" / "scenarios" / "adaptive" / "pool-long.yaml"
STEP_S = 2
RUNS = (("static 10 (hand-tuned)", 10, "#229954"), ("static 20 (default)", 20, "#c0392b"),
        ("auto:2-64", None, "#2471a3"))


def data(scenario: Path = SCENARIO) -> dict[str, Any]:
    """Run the scenario with each limit of :data:`RUNS`; per run, per 2 s window: the limit
    (auto: its time-weighted mean), alice's p99 in ms and bob's requests per second."""
    base = yaml.safe_load(scenario.read_text(encoding="utf-8"))
    end = int(base["evaluate"][-1].rstrip("s"))
    base["evaluate"] = [f"{t}s" for t in range(STEP_S, end + 1, STEP_S)]
    out: dict[str, Any] = {}
    for label, limit, _color in RUNS:
        doc = json.loads(json.dumps(base))
        if limit is not None:
            doc["queueSet"]["concurrencyLimit"] = limit
            doc.pop("controller", None)
        result = to_json(simulate(parse_scenario(doc, base_dir=str(scenario.parent))))
        rows = []
        for w in result["evaluations"]:
            alice, bob = w["latency"]["alice"], w["latency"]["bob"]
            lim = w["concurrencyLimit"]["mean"] if "concurrencyLimit" in w else limit
            rows.append({"end": w["end"], "limit": lim,
                         "aliceP99ms": None if alice["p99"] is None else alice["p99"] * 1000,
                         "bobPerSecond": bob["throughput"]})
        out[label] = rows
    return out


def draw(numbers: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for label, _limit, color in RUNS:
        rows = numbers[label]
        t = [r["end"] for r in rows]
        axes[0].step(t, [r["limit"] for r in rows], where="pre", color=color, label=label)
        axes[1].step(t, [r["aliceP99ms"] for r in rows], where="pre", color=color, label=label)
        axes[2].step(t, [r["bobPerSecond"] for r in rows], where="pre", color=color, label=label)
    for ax in axes:
        ax.axvspan(20, 40, color="#dddddd", alpha=0.5, lw=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("server limit (seats)")
    axes[1].set_ylabel("alice p99 (ms)")
    axes[2].set_ylabel("bob requests/s")
    axes[2].set_xlabel("virtual time (s); grey: the pool holds 4 connections instead of 8")
    axes[0].legend(loc="upper right", fontsize=8)
    fig.suptitle("Adaptive limit (simulator): pool of 8, 4 from 20 s to 40 s, per 2 s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "adaptive.png")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    numbers = data()
    for label, rows in numbers.items():
        print(label)
        for r in rows:
            p99 = "-" if r["aliceP99ms"] is None else f"{r['aliceP99ms']:.0f}"
            print(f"  {r['end']:>5.0f} s  limit {r['limit']:>5.1f}  alice p99 {p99:>5} ms  "
                  f"bob {r['bobPerSecond']:>6.1f}/s")
    if args.json is not None:
        args.json.write_text(json.dumps(numbers, indent=1), encoding="utf-8")
    try:
        draw(numbers, args.out)
    except ImportError:
        print("matplotlib is missing: .venv/bin/pip install '.[plot]'", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
