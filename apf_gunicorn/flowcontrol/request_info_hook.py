"""The ``APF_REQUEST_INFO`` hook: a user function in front of the built-in resolver.

The function takes the WSGI environ and returns a
:class:`~apf_gunicorn.flowcontrol.objects.RequestAttributes`, or a dict of some of its fields
(the rest come from the built-in resolver). When it raises or returns something unusable, the
built-in :class:`~apf_gunicorn.flowcontrol.requestinfo.RequestInfoResolver` answers instead,
and the failure is logged and flagged::

    resolver = load_request_info_hook("myapp.apf:resolve", RequestInfoResolver(...))
    attrs, failed = resolver.resolve(environ)     # or attrs = resolver(environ)

A spec that names nothing callable raises :class:`HookError` at load, never per request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from apf_gunicorn.flowcontrol.hookspec import import_callable
from apf_gunicorn.flowcontrol.identity import identity_groups
from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.flowcontrol.requestinfo import Environ, RequestInfoResolver, Resolver

log = logging.getLogger(__name__)

_FIELDS = {f.name for f in dataclasses.fields(RequestAttributes)}
_STR_FIELDS = _FIELDS - {"groups", "is_resource", "extra"}


class HookError(ValueError):
    """``APF_REQUEST_INFO`` names nothing callable (raised at load, never per request)."""


def attributes_from_hook_result(result: Any, fallback: Callable[[], RequestAttributes]
                                ) -> RequestAttributes:
    """Check and convert what a hook returned: a RequestAttributes, or a dict with some of its
    field names whose missing fields are taken from ``fallback()``. Raises TypeError/ValueError
    for anything else."""
    if isinstance(result, RequestAttributes):
        attrs = result
    elif isinstance(result, Mapping):
        unknown = set(result) - _FIELDS
        if unknown:
            raise ValueError(f"unknown request attribute(s) {sorted(map(str, unknown))}")
        changes = dict(result)
        if "groups" in changes:
            changes["groups"] = tuple(changes["groups"])
        elif "user" in changes:
            changes["groups"] = identity_groups(changes["user"], ())
        attrs = dataclasses.replace(fallback(), **changes)
    else:
        raise TypeError(f"expected RequestAttributes or a dict, got {type(result).__name__}")
    for name in _STR_FIELDS:
        if not isinstance(getattr(attrs, name), str):
            raise TypeError(f"request attribute {name!r} must be a str")
    if not isinstance(attrs.groups, tuple) or not all(isinstance(g, str) for g in attrs.groups):
        raise TypeError("request attribute 'groups' must be a sequence of str")
    if not isinstance(attrs.is_resource, bool):
        raise TypeError("request attribute 'is_resource' must be a bool")
    return attrs


class HookedResolver:
    """A user function in front of the built-in resolver.

    ``resolve(environ)`` returns ``(attributes, failed)``: ``failed`` is True when the hook
    raised or returned something unusable and the built-in resolver answered instead (the
    server counts it). Calling the object returns only the attributes.
    """

    def __init__(self, hook: Callable[[Environ], Any], fallback: Resolver, name: str = "") -> None:
        self.hook = hook
        self.fallback = fallback
        self.name = name or getattr(hook, "__qualname__", repr(hook))
        self.failures = 0  # approximate under threads; the server counts the flag instead

    def resolve(self, environ: Environ) -> tuple[RequestAttributes, bool]:
        try:
            return attributes_from_hook_result(self.hook(environ), lambda: self.fallback(environ)), False
        except Exception:
            self.failures += 1
            log.exception("APF_REQUEST_INFO hook %s failed; using the built-in resolver", self.name)
            return self.fallback(environ), True

    def __call__(self, environ: Environ) -> RequestAttributes:
        return self.resolve(environ)[0]


def load_request_info_hook(spec: str, fallback: Resolver | None = None) -> HookedResolver:
    """Import ``module:callable`` (dotted attribute paths allowed after the colon).

    Raises :class:`HookError` naming the spec when it cannot be imported or is not callable.
    ``fallback`` answers when the hook fails (default: a built-in resolver trusting no proxy).
    """
    obj = import_callable(spec, "APF_REQUEST_INFO", HookError)
    return HookedResolver(obj, fallback or RequestInfoResolver(), name=spec)
