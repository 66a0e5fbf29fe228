"""Draw per-flow seats over time in Kubernetes' windup scenario under both fairnesses
(``docs/images/fairness.png``), from the simulator (virtual time: no server, about a second).

    .venv/bin/pip install '.[plot]'              # matplotlib, only for the picture
    .venv/bin/python benchmarks/plot_fairness.py [--out docs/images/fairness.png] [--json FILE]
    .venv/bin/python benchmarks/plot_fairness.py --only kubernetes    # one fairness, one panel

The scenario is Kubernetes' ``TestWindup`` (``tests/scenarios/kubernetes/
k8s-13-windup-upper-bound.yaml``): a limit of 3 seats, two flows of 2 threads each sending 1 s
requests back to back; the second flow runs one thread for the first 20 s and both after.
From 20 s on both want 2 seats, so the max-min fair share is 1.5 each. Kubernetes' queueset
remembers the first window (the second flow's queue "wound up" virtual time while it was
light) and splits the second window 1.25 / 1.75 (±16.7 %).

Each panel is one fairness: each flow's executing seats (``apf-gunicorn simulate --timeline``:
the exact average over each 100 ms step) and its fair share per window; the legend gives each
flow's second-window average and its deviation from the fair share. The numbers are printed and
written with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from apf_gunicorn.flowcontrol import fairness  # noqa: E402
from apf_gunicorn.simulate import load_scenario, simulate  # noqa: E402

WINDUP = ROOT / "tests" / "scenarios" / "kubernetes" / "k8s-13-windup-upper-bound.yaml"
POINTS = 400  # steps over the 40 s of evaluation: 100 ms each
COLORS = ("#2471a3", "#c0392b", "#229954", "#7d3c98")


def data(fairness_name: str, scenario: Path = WINDUP, points: int = POINTS) -> dict[str, Any]:
    """Run ``scenario`` under ``fairness_name`` and return what the picture draws.

    Args:
        fairness_name: ``kubernetes`` or ``maxmin`` (replaces the scenario's, as ``--fairness``).
        scenario: a queueSet or configuration-form scenario file.
        points: steps of the timeline up to the last evaluation.

    Returns:
        ``{"fairness", "scenario", "limit", "stepSeconds", "times", "flows": {name: [seats per
        step]}, "windows": [{"start", "end", "flows": {name: {"average", "fairShare",
        "deviation"}}}]}``; ``deviation`` is ``average / fairShare - 1``.
    """
    sc = load_scenario(str(scenario))
    result = simulate(sc, fairness=fairness_name, timeline=points)
    tl = result.timeline
    windows = []
    for w in result.windows:
        flows = {}
        for name, c in w.clients.items():
            fair = c.fair_share
            # rounded: 1.9999999999 seats against 2 is no deviation (+ 0.0 drops a -0.0)
            dev = round(c.average_executing_seats / fair - 1, 6) + 0.0 if fair else None
            flows[name] = {"average": c.average_executing_seats, "fairShare": fair,
                           "deviation": dev}
        windows.append({"start": w.start_ns / 1e9, "end": w.end_ns / 1e9, "flows": flows})
    limit = (sc.queue_set.concurrency_limit if sc.queue_set is not None
             else sc.config.server_concurrency_limit)
    try:
        shown = str(scenario.relative_to(ROOT))
    except ValueError:
        shown = str(scenario)
    return {"fairness": fairness_name, "scenario": shown, "limit": limit,
            "stepSeconds": tl.width_ns / 1e9, "times": tl.times(),
            "flows": {name: tl.series(i) for i, name in enumerate(tl.names)},
            "windows": windows}


def summary_lines(d: dict[str, Any]) -> list[str]:
    """One line per window and flow: average seats, fair share, deviation."""
    out = []
    for w in d["windows"]:
        for name, f in w["flows"].items():
            dev = "" if f["deviation"] is None else f" ({f['deviation']:+.1%})"
            out.append(f"{d['fairness']:<10} {w['start']:>4g}-{w['end']:<4g} s  {name}: "
                       f"{f['average']:.3f} seats, fair share {f['fairShare']:.3f}{dev}")
    return out


def plot(results: dict[str, dict[str, Any]], out: Path) -> None:
    """One panel per fairness, side by side, same axes; writes a PNG to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fairness_names = list(results)
    fig, axes = plt.subplots(1, len(fairness_names),
                             figsize=(4.8 * len(fairness_names) + 1.2, 4.0),
                             dpi=90, sharey=True, squeeze=False)
    for ax, fairness_name in zip(axes[0], fairness_names, strict=True):
        d = results[fairness_name]
        step = d["stepSeconds"]
        last = d["windows"][-1]
        for k, (name, seats) in enumerate(d["flows"].items()):
            color = COLORS[k % len(COLORS)]
            xs = [*d["times"], d["times"][-1] + step]
            ax.step(xs, [*seats, seats[-1]], where="post", lw=1.2, color=color,
                    label=f"{name}: {last['flows'][name]['average']:.2f} seats in the last "
                          f"window ({last['flows'][name]['deviation']:+.1%})")
            for w in d["windows"]:
                ax.hlines(w["flows"][name]["fairShare"], w["start"], w["end"], colors=color,
                          linestyles="dashed", lw=0.9, alpha=0.7)
        for w in d["windows"][1:]:
            ax.axvline(w["start"], color="#777777", lw=0.6, alpha=0.6)
        ax.set_title(f"fairness: {fairness_name}", fontsize=10, loc="left")
        ax.set_xlabel("seconds (virtual time)")
        ax.set_xlim(0, d["windows"][-1]["end"])
        ax.set_ylim(0, d["limit"] + 0.6)
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=7.5, loc="upper right", framealpha=0.9)
    axes[0][0].set_ylabel("executing seats (100 ms average)")
    fig.suptitle(f"Kubernetes' TestWindup: limit {results[fairness_names[0]]['limit']} seats, two "
                 "flows\n(dashed: each flow's max-min fair share per window)", fontsize=9.5)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "fairness.png"))
    parser.add_argument("--only", choices=fairness.NAMES,
                        help="draw this fairness alone (default: every fairness, side by side)")
    parser.add_argument("--scenario", default=str(WINDUP), help="scenario file (default: "
                        "TestWindup)")
    parser.add_argument("--points", type=int, default=POINTS, help="timeline steps (default "
                        f"{POINTS})")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    for fairness_name in [args.only] if args.only else list(fairness.NAMES):
        results[fairness_name] = data(fairness_name, Path(args.scenario), args.points)
    for d in results.values():
        print("\n".join(summary_lines(d)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_fairness: matplotlib is missing: .venv/bin/pip install '.[plot]'",
              file=sys.stderr)
        return 2
    plot(results, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
