"""What the request resolver reads, from an ASGI scope: a small WSGI-style environ.

Classification (``flowcontrol/requestinfo.py``) reads a request as WSGI keys: the method,
``PATH_INFO``, ``QUERY_STRING``, ``REMOTE_ADDR`` and the ``HTTP_*`` headers its identity
sources name. :class:`ScopeEnviron` builds exactly those from a scope, so an ASGI request is
classified by the same resolver, cache and FlowSchemas as a WSGI one::

    to_environ = ScopeEnviron(resolver.environ_keys)   # None: every header (a custom hook)
    environ = to_environ(scope)

Conversions follow PEP 3333 and the ASGI spec: header names are lower-case bytes in the scope
and become ``HTTP_NAME_WITH_UNDERSCORES`` (``CONTENT_TYPE`` and ``CONTENT_LENGTH`` without the
prefix); a header whose name holds an underscore is left out, as gunicorn's WSGI environ leaves
it out (its ``header_map=drop`` default: ``X_Remote_Group`` must not pass for
``X-Remote-Group``); values and the query string are latin-1 (native strings); repeated
headers are joined with ``,``. ``PATH_INFO`` is the path the app routes on, carried as latin-1
(WSGI's bytes-in-str convention): the scope's decoded ``path`` without the root path
(``SCRIPT_NAME``) where the path starts with it at a ``/`` boundary, as Starlette's
``get_route_path`` strips it (``/apiadmin/x`` under ``/api`` stays whole); the root path is the
scope's ``root_path``, or the app's own when it sets one over the server's (``FastAPI(root_path=
...)``: :func:`apf_gunicorn.starlette.app_root_path`). A WebSocket handshake is a ``GET``.
``REMOTE_ADDR`` is the scope's ``client`` host; for a peer on a Unix socket, which both ASGI
servers give no ``client``, it is ``""``, as gunicorn's WSGI environ has it (so
``APF_TRUSTED_PROXIES=unix`` trusts it). ASGI has no ``REMOTE_USER``: the ``remote-user``
identity source names nobody here. The environ also carries the scope itself (``asgi.scope``),
for an ``APF_WORK_ESTIMATOR`` or ``APF_REQUEST_INFO`` hook.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_UNPREFIXED = {"CONTENT_TYPE", "CONTENT_LENGTH"}
# the C gate's source codes (S_* in ledger/_fastpath.c): where an environ key comes from
S_METHOD, S_PATH, S_QUERY, S_CLIENT, S_HEADER, S_NONE = range(6)
_SCOPE_SOURCES = {"REQUEST_METHOD": S_METHOD, "PATH_INFO": S_PATH, "QUERY_STRING": S_QUERY,
                  "REMOTE_ADDR": S_CLIENT}
# the other keys ScopeEnviron builds, which the gate does not read
_BUILT = {"SCRIPT_NAME", "SERVER_PROTOCOL", "asgi.scope"}


def header_key(name: bytes) -> str:
    """The WSGI environ key of an ASGI header name (``b"x-api-key"`` -> ``HTTP_X_API_KEY``)."""
    key = name.decode("latin-1").upper().replace("-", "_")
    return key if key in _UNPREFIXED else "HTTP_" + key


def _native(text: str) -> str:
    """A decoded str as a WSGI native string (its UTF-8 bytes as latin-1)."""
    return text if text.isascii() else text.encode("utf-8").decode("latin-1")


def is_unix_peer(scope: dict[str, Any]) -> bool:
    """Whether a scope without a ``client`` came over a Unix socket.

    Both servers leave ``client`` out for a Unix-socket peer and give the listener as
    ``server``: uvicorn as ``(path, None)``, gunicorn's ASGI worker as the path cut into a
    tuple. A TCP listener is ``(host, port)`` with an int port; a scope with no ``server``
    says nothing, and is taken as no Unix peer (so ``APF_TRUSTED_PROXIES=unix`` never trusts
    it).
    """
    server = scope.get("server")
    if not server:
        return False
    return not (len(server) == 2 and isinstance(server[0], str)
                and isinstance(server[1], int))


class ScopeEnviron:
    """Builds the environ classification reads from an ASGI scope (see the module docstring).

    Args:
        keys: the environ keys the resolver reads (``RequestInfoResolver.environ_keys``); only
            their headers are copied. None: every header (a custom resolver may read any).
        root_path: the app's own root path, which it puts in the scope over the server's
            (:func:`apf_gunicorn.starlette.app_root_path`); ``""``: the scope's.
    """

    def __init__(self, keys: Iterable[str] | None, root_path: str = ""):
        self._all = keys is None
        self._root = root_path
        # header name as the scope has it -> environ key
        self._wanted: dict[bytes, str] = {}
        for key in keys or ():
            if key.startswith("HTTP_") or key in _UNPREFIXED:
                name = key[5:] if key.startswith("HTTP_") else key
                self._wanted[name.lower().replace("_", "-").encode("latin-1")] = key

    def key_sources(self, keys: Iterable[str]) -> tuple[tuple[int, ...], dict[bytes, int]] | None:
        """Where the C request gate (``Gate`` in ``ledger/_fastpath.c``) reads each of ``keys``
        (the resolver's environ keys, in shape-key order) from a scope, as this class builds
        them: ``(sources, headers)``, one ``S_*`` code per key and header name -> key index;
        None when the gate cannot read them (every header wanted, or the app's own root path:
        the Python path then builds the environ every time). The gate declines at run time
        what it does not read plainly (a root path, a non-ASCII path, no ``client``)."""
        if self._all or self._root:
            return None
        sources: list[int] = []
        headers: dict[bytes, int] = {}
        wanted = {key: name for name, key in self._wanted.items()}
        for i, key in enumerate(keys):
            if key in _SCOPE_SOURCES:
                sources.append(_SCOPE_SOURCES[key])
            elif key in wanted:
                sources.append(S_HEADER)
                headers[wanted[key]] = i
            elif key in _BUILT or key.startswith("HTTP_") or key in _UNPREFIXED:
                return None  # (a header not wanted cannot be: keys are what is wanted)
            else:
                sources.append(S_NONE)  # not in the environ: None, as environ.get says
        return tuple(sources), headers

    def __call__(self, scope: dict[str, Any]) -> dict[str, Any]:
        """The environ of ``scope`` (an ``http`` or ``websocket`` scope)."""
        # once a request on the event loop: no call for an ASCII path or root, or an empty query
        path = scope.get("path", "/")
        root = self._root or scope.get("root_path", "")
        query = scope.get("query_string", b"")
        # WSGI's PATH_INFO does not hold SCRIPT_NAME; stripped at a "/" boundary only
        if root:
            if path == root:
                path = "/"
            elif path.startswith(root) and path[len(root)] == "/":
                path = path[len(root):]
            else:  # not under the root: the app routes on the whole path
                root = ""
        env = {"REQUEST_METHOD": scope.get("method", "GET"),
               "PATH_INFO": path if path.isascii() else _native(path),
               "SCRIPT_NAME": root if root.isascii() else _native(root),
               "QUERY_STRING": query.decode("latin-1") if query else "",
               "SERVER_PROTOCOL": "HTTP/" + scope.get("http_version", "1.1"),
               "asgi.scope": scope}
        client = scope.get("client")
        if client:
            env["REMOTE_ADDR"] = client[0]
        elif is_unix_peer(scope):
            env["REMOTE_ADDR"] = ""  # gunicorn's WSGI REMOTE_ADDR for a Unix-socket peer
        wanted = None if self._all else self._wanted
        for name, value in scope.get("headers", ()):
            if wanted is None:
                if b"_" in name:  # dropped, as gunicorn's WSGI environ drops it
                    continue
                key = header_key(name)
            else:
                key = wanted.get(name)
                if key is None:
                    continue
            text = value.decode("latin-1")
            seen = env.get(key)
            env[key] = text if seen is None else seen + "," + text
        return env
