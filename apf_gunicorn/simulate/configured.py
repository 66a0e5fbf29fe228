"""The configuration form of a scenario: classify clients, run every level, borrow every 10 s.

Needs the configuration loader, the classifier and the borrowing code
(``flowcontrol/loader.py``, ``matching.py``, ``borrowing.py``); until all three exist it
refuses with :class:`~.backends.SimulationUnavailable`.
"""

from __future__ import annotations

import importlib

from .backends import SimulationUnavailable
from .harness import RunResult
from .scenario import Scenario

REQUIRED = ("loader", "matching", "borrowing", "limits")


def _require() -> dict[str, object]:
    modules, missing = {}, []
    for name in REQUIRED:
        try:
            modules[name] = importlib.import_module(f"apf_gunicorn.flowcontrol.{name}")
        except ImportError:
            missing.append(f"flowcontrol/{name}.py")
    if missing:
        raise SimulationUnavailable(
            "the configuration form needs " + ", ".join(missing)
            + ", which this installation does not have yet; use the queueSet form")
    return modules


def run_configured(scenario: Scenario) -> RunResult:
    _require()
    raise SimulationUnavailable(
        "the configuration form is not implemented yet in this version; use the queueSet form")
