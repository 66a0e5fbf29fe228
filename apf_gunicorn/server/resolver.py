"""The request resolver the server runs, built from its settings.

One construction for the master's ``on_starting`` and for ``apf-gunicorn explain``, so both
turn the same WSGI environ into the same request attributes:

    resolver = build_resolver(settings, cfg)     # raises ResolverError with a clear message
    attrs = resolver(environ)
    apply_path_parsing(resolver, settings, new_cfg)   # at a reload (APF_PATHS=auto)
    path_parsing_note(settings, cfg)   # "Kubernetes API requests (APF_PATHS=auto: ...)"

It is the built-in :class:`~apf_gunicorn.flowcontrol.requestinfo.RequestInfoResolver`
(Kubernetes API paths as ``APF_PATHS`` and the configuration say, ``APF_ROUTES``,
``APF_TRUSTED_PROXIES``, ``APF_USER_HEADER``/``APF_GROUP_HEADER``, ``APF_USER_FROM``, the
``APF_JWT_*`` token verifier), behind the ``APF_REQUEST_INFO`` hook when one is set.
"""

from __future__ import annotations

from typing import Any

from apf_gunicorn.flowcontrol.kube_paths import PATHS_PLAIN, path_parsing
from apf_gunicorn.flowcontrol.request_info_hook import HookedResolver, load_request_info_hook
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.flowcontrol.routes import load_routes


class ResolverError(ValueError):
    """The settings name a routes file or hook that cannot be used; ``str()`` says why."""


def build_resolver(settings: Any, configuration: Any = None
                   ) -> RequestInfoResolver | HookedResolver:
    """The server's resolver for ``settings`` (a :class:`~apf_gunicorn.server.settings.Settings`).

    Args:
        settings: validated settings; ``routes``, ``trusted_proxies``, ``user_header``,
            ``group_header``, ``user_from``, ``paths``, ``request_info`` and the ``jwt_*``
            fields are read.
        configuration: the loaded configuration: with ``APF_PATHS=auto`` its FlowSchemas
            decide whether ``/api/`` paths are Kubernetes API requests. None (a caller without
            one): only ``APF_PATHS=plain`` turns the Kubernetes parsing off.

    Returns:
        The built-in resolver, or the ``APF_REQUEST_INFO`` hook with it as fallback.

    Raises:
        ResolverError: an invalid ``APF_ROUTES`` file or an ``APF_REQUEST_INFO`` that cannot
            be imported (the message names the setting).
    """
    routes = None
    if settings.routes:
        try:
            routes = load_routes(settings.routes)
        except Exception as e:  # RouteError, or a file that vanished since the settings check
            raise ResolverError(f"invalid APF_ROUTES={settings.routes!r}: {e}") from None
    builtin = RequestInfoResolver(trusted_proxies=[str(n) for n in settings.trusted_proxies],
                                  user_header=settings.user_header,
                                  group_header=settings.group_header, routes=routes,
                                  user_from=settings.user_from,
                                  jwt_verifier=_jwt_verifier(settings))
    if configuration is not None:
        apply_path_parsing(builtin, settings, configuration)
    elif settings.paths == PATHS_PLAIN:
        builtin.kubernetes_paths = False
    if settings.request_info:
        try:
            return load_request_info_hook(settings.request_info, builtin)
        except Exception as e:
            raise ResolverError(str(e)) from None
    return builtin


def apply_path_parsing(resolver: Any, settings: Any, configuration: Any) -> None:
    """Set whether ``resolver`` parses Kubernetes API paths, for ``configuration`` (a reload
    may add or remove the resource rules ``APF_PATHS=auto`` looks for).

    Args:
        resolver: what :func:`build_resolver` returned.
        settings: the server's settings (``paths``).
        configuration: the configuration now in force.
    """
    kubernetes, _ = path_parsing(settings.paths, configuration.flow_schemas)
    builtin = getattr(resolver, "fallback", resolver)
    if isinstance(builtin, RequestInfoResolver):
        builtin.kubernetes_paths = kubernetes


def path_parsing_note(settings: Any, configuration: Any) -> str:
    """How ``/api/`` and ``/apis/`` paths are read under ``settings`` and ``configuration``,
    and why, for the start and reload log lines and ``apf-gunicorn explain``.

    Returns:
        E.g. ``"Kubernetes API requests (APF_PATHS=auto: FlowSchema 'system-nodes' has
        resource rules)"`` or ``"paths like any other (APF_PATHS=plain)"``.
    """
    kubernetes, reason = path_parsing(settings.paths, configuration.flow_schemas)
    how = "Kubernetes API requests" if kubernetes else "paths like any other"
    return f"{how} ({reason})"


def _jwt_verifier(settings: Any) -> Any:
    """The ``jwt-sub`` token verifier of ``settings`` (a ``JWTVerifier``), None without a key.

    PyJWT and cryptography are imported only when a key is set."""
    if getattr(settings, "jwt_key", None) is None:
        return None
    from apf_gunicorn.flowcontrol.jwtauth import JWTVerifier

    return JWTVerifier(settings.jwt_key, audience=settings.jwt_audience,
                       issuer=settings.jwt_issuer, groups_claim=settings.jwt_groups_claim,
                       user_prefix=settings.jwt_user_prefix,
                       groups_prefix=settings.jwt_groups_prefix, leeway=settings.jwt_leeway_s)


def token_notes(resolver: Any, environ: Any) -> list[str]:
    """What ``explain`` says about the request's bearer token when ``jwt-sub`` verifies tokens.

    Args:
        resolver: what :func:`build_resolver` returned.
        environ: the request's WSGI environ.

    Returns:
        One note saying whether the token verified and, if not, why (the next identity source
        answered then); none without a verifier or without a bearer token.
    """
    builtin = getattr(resolver, "fallback", resolver)
    verifier = getattr(builtin, "jwt_verifier", None)
    if verifier is None:
        return []
    found, reason = verifier.check(environ.get("HTTP_AUTHORIZATION"))
    if found is not None:
        return [f"bearer token verified (APF_JWT_KEY): user {found[0]!r}"]
    if not reason:
        return []
    return [f"bearer token ignored, {reason}: jwt-sub names nobody and the next APF_USER_FROM "
            "source answers"]
