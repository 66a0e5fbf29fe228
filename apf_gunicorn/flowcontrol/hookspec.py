"""Loading the user hooks named by settings such as ``APF_REQUEST_INFO=module:callable``.

    fn = import_callable("myapp.apf:resolve", "APF_REQUEST_INFO", HookError)

Dotted attribute paths are allowed after the colon. Every failure raises ``error`` with a message
that names the setting and the spec; it happens at start, never per request.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(spec: str, setting: str, error: type[Exception]) -> Callable:
    module_name, sep, attr_path = spec.strip().partition(":")
    if not sep or not module_name or not attr_path:
        raise error(f"{setting}={spec!r}: expected 'module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise error(f"{setting}={spec!r}: cannot import {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise error(f"{setting}={spec!r}: {module_name!r} has no {attr_path!r}") from None
    if not callable(obj):
        raise error(f"{setting}={spec!r}: {attr_path!r} is not callable")
    return obj
