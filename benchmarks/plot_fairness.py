"""Draw docs/fairness.md's picture: per-flow seats over time in Kubernetes' TestWindup scenario,
under the ``kubernetes`` and the ``maxmin`` dispatch policies (``docs/images/fairness-windup.png``).

    .venv/bin/python benchmarks/plot_fairness.py [--out docs/images/fairness-windup.png]

The scenario (``tests/scenarios/kubernetes/k8s-13-windup-upper-bound.yaml``): 3 seats; flow 0
keeps two requests going for 40 s, flow 1 one for the first 20 s and two after. The max-min
fair share is 2 and 1 in the first half, 1.5 each in the second. The simulator runs the
production ledger in virtual time; each flow's executing seats are averaged over 2 s (the
requests last 1 s, so a flow served fairly alternates 1 and 2 seats second by second). Needs
matplotlib (the optional ``plot`` extra) only to draw; :func:`seats_per_second` does not.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from apf_gunicorn.simulate import load_scenario
from apf_gunicorn.simulate.backends import ledger_backend
from apf_gunicorn.simulate.harness import UniformHarness

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "scenarios" / "kubernetes" / "k8s-13-windup-upper-bound.yaml"
S = 1_000_000_000


class _Recording(UniformHarness):
    """The uniform harness, noting each client's executing seats at every change."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.changes: dict[str, list[tuple[int, int]]] = {c.spec.name: [(0, 0)]
                                                          for c in self.clients}

    def _start(self, handle, thread, k) -> None:
        super()._start(handle, thread, k)
        c = thread.client
        self.changes[c.spec.name].append((self.loop.now, c.exec_seats.x))

    def _end(self, handle, client) -> None:
        super()._end(handle, client)
        self.changes[client.spec.name].append((self.loop.now, client.exec_seats.x))


def seats_per_second(fairness: str, path: Path = SCENARIO) -> dict[str, list[float]]:
    """Each client's average executing seats in every second of the scenario's windows.

    Args:
        fairness: ``"kubernetes"`` or ``"maxmin"``.
        path: a ``queueSet`` scenario.
    Returns:
        {client name: [average seats in [i, i+1) s for each second up to the last window]}.
    """
    sc = load_scenario(str(path))
    qs = dataclasses.replace(sc.queue_set, fairness=fairness)
    harness = _Recording(sc.clients, sc.evaluate, ledger_backend(qs, sc.clients),
                         routes=[(0, c.hash) for c in sc.clients],
                         capacity=float(qs.concurrency_limit))
    harness.run()
    end = sc.evaluate[-1] // S
    out = {}
    for name, changes in harness.changes.items():
        area = [0] * end  # seat-ns per second
        for (t0, x), (t1, _) in zip(changes, changes[1:] + [(end * S, 0)], strict=True):
            t = t0
            while t < min(t1, end * S):
                sec = t // S
                nxt = min(t1, (sec + 1) * S)
                area[sec] += x * (nxt - t)
                t = nxt
        out[name] = [a / S for a in area]
    return out


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90, sharey=True)
    colors = {"client0": "#c0392b", "client1": "#2471a3"}
    labels = {"client0": "flow 0 (2 threads)", "client1": "flow 1 (1 thread, then 2 at 20 s)"}
    for ax, fairness in zip(axes, ("kubernetes", "maxmin"), strict=True):
        data = seats_per_second(fairness)
        for name, series in data.items():
            pairs = [(series[i] + series[i + 1]) / 2 for i in range(0, len(series) - 1, 2)]
            xs = [2 * i for i in range(len(pairs))] + [2 * len(pairs)]
            ax.step(xs, pairs + pairs[-1:], where="post", color=colors[name],
                    label=labels[name])
        ax.plot([0, 20], [2, 2], ":", color=colors["client0"], lw=1)
        ax.plot([0, 20], [1, 1], ":", color=colors["client1"], lw=1)
        ax.plot([20, 40], [1.5, 1.5], ":", color="#555555", lw=1, label="max-min fair share")
        ax.set_title(f"fairness: {fairness}")
        ax.set_xlabel("virtual time (s)")
        ax.set_xlim(0, 40)
        ax.set_ylim(0, 3.1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("executing seats (2 s average)")
    axes[1].legend(loc="lower left", fontsize=8)
    fig.suptitle("TestWindup (3 seats): seats per flow over time", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight", pil_kwargs={"optimize": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "fairness-windup.png"))
    args = parser.parse_args()
    plot(Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
