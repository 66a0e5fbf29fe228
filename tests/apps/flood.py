"""A flood of keep-alive clients in a process of its own, so that its threads do not compete
for the test process's GIL with the clients whose latency a test measures.

    with Flood(port, "/work?ms=50", user="heavy", connections=48) as flood:
        ...                      # measure something while the flood runs
    flood.statuses               # {status: count} of every answer it got

Run as ``python -m tests.apps.flood PORT PATH USER CONNECTIONS``: floods until stdin closes,
then prints its status counts as JSON.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Flood:
    def __init__(self, port: int, path: str, *, user: str, connections: int) -> None:
        self.args = [str(port), path, user, str(connections)]
        self.statuses: dict[int, int] = {}
        self.errors = 0
        self.error_samples: list[str] = []  # the first few errors, to say what went wrong

    def __enter__(self) -> Flood:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.apps.flood", *self.args],
                                     cwd=str(ROOT), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        try:
            out, _ = self.proc.communicate(input="", timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        result = json.loads(out)
        self.statuses = {int(k): v for k, v in result["statuses"].items()}
        self.errors = result["errors"]
        self.error_samples = result["error_samples"]

    @property
    def count(self) -> int:
        return sum(self.statuses.values())


def main() -> None:
    from tests.apps.loadgen import Client

    port, path, user, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    stop = threading.Event()
    clients = [Client(port, path, user=user, stop=stop) for _ in range(n)]
    for c in clients:
        c.start()
    sys.stdin.read()  # until the parent closes it
    stop.set()
    for c in clients:
        c.join(30)
    statuses = collections.Counter(s for c in clients for s in c.statuses)
    errors = [e for c in clients for e in c.errors]
    print(json.dumps({"statuses": statuses, "errors": len(errors), "error_samples": errors[:5]}))


if __name__ == "__main__":
    main()
