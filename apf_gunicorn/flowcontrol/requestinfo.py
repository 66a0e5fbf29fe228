"""WSGI environ -> :class:`~apf_gunicorn.flowcontrol.objects.RequestAttributes`.

This is what the classifier sees of a request: who sent it (user and groups) and what it does
(a Kubernetes resource request, or a non-resource path and a lower-cased method).

    resolver = RequestInfoResolver(trusted_proxies=["10.0.0.0/8"], routes=load_routes(path))
    attrs = resolver(environ)        # never raises

Identity: the sources of ``user_from`` (``APF_USER_FROM``, :mod:`.identity`) in order; the
default ``proxy,remote_user`` is:

1. ``proxy``: ``X-Remote-User`` (header name configurable) when ``REMOTE_ADDR`` is in one of the
   trusted proxy CIDRs; groups from ``X-Remote-Group``. WSGI servers join repeated headers with
   ``,``: as Kubernetes' request-header authenticator, the first user value wins and every
   group value counts (each value also split at commas). Headers from any other peer are
   ignored, and a warning says so (at most once a minute per resolver: the peer, and
   ``APF_TRUSTED_PROXIES``).
2. ``remote_user``: ``REMOTE_USER`` set by an upstream WSGI layer.
3. otherwise ``system:anonymous`` in group ``system:unauthenticated``.

A verified user also gets ``system:authenticated`` (Kubernetes' AuthenticatedGroupAdder).
The unverified sources (``header:NAME``, ``jwt-sub`` without a key, ``address``) give a
prefixed user name (``key:``, ``jwt:``, ``addr:``) in group ``system:unauthenticated`` only:
they name the flow, never a real user. With a ``jwt_verifier`` (``APF_JWT_KEY``,
:mod:`.jwtauth`), ``jwt-sub`` is verified: a token that verifies is the user ``sub`` with its
groups; any other value names nobody and the next source answers.

:attr:`RequestInfoResolver.environ_keys` lists every environ key the result depends on, and
``shape_key(environ.get)`` reads them: the middleware's per-shape cache keys on exactly those.
Secret values (API keys, bearer tokens) enter the shape key only as digests, and a verified
token as the identity it verifies to at that instant, so a cached shape never outlives the
token's ``exp``. :meth:`RequestInfoResolver.resolve_shape` classifies a request by the identity
its shape key holds, so a token is verified once per request and the shape cached under a key
is always the key's (a token whose ``exp`` falls between two verifications would otherwise
file one identity's shape under the other's key). Without trusted proxies, the shape key of
``proxy`` holds only whether the user header is present: enough to warn about it.

What the request does, in this order: a declarative route (:mod:`.routes`) if one matches;
Kubernetes API paths under ``/api/`` and ``/apis/`` parsed exactly as Kubernetes'
``RequestInfoFactory`` (:mod:`.kube_paths`) when ``kubernetes_paths`` is on; anything else is a
non-resource request whose verb is the lower-cased method. Whether Kubernetes paths are parsed
is the server's ``APF_PATHS`` (:func:`.kube_paths.path_parsing`): ``kubernetes``, ``plain``, or
``auto`` (the default): only when some FlowSchema has resource rules that can tell the two
apart, so a web app's REST-style ``/api/v1/items`` is classified like ``/items``.

Hostile input never raises: headers and paths are decoded from WSGI's latin-1 transport as UTF-8
with replacement characters, and values are truncated to the bounds below (the query string to
:data:`.kube_paths.MAX_QUERY_LENGTH`).

The ``APF_REQUEST_INFO`` hook (:func:`.request_info_hook.load_request_info_hook`) replaces this
resolver with a user function, falling back to it when the function fails.
"""

from __future__ import annotations

import ipaddress
import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import identity as sources
from .identity import (
    ANONYMOUS_USER,
    MAX_GROUPS,
    MAX_NAME_LENGTH,
    UNAUTHENTICATED_GROUP,
    identity_groups,
)
from .kube_paths import MAX_QUERY_LENGTH, parse_kubernetes_path
from .objects import RequestAttributes

if TYPE_CHECKING:
    from .jwtauth import JWTVerifier

log = logging.getLogger(__name__)

#: Longest header value read at all (identity headers); the rest is ignored before splitting.
MAX_HEADER_LENGTH = 16384
#: Longest path kept; longer paths are truncated (gunicorn's request line limit is 4094).
MAX_PATH_LENGTH = 8192
#: Longest method kept.
MAX_METHOD_LENGTH = 32

Environ = Mapping[str, Any]
Resolver = Callable[[Environ], RequestAttributes]

_ANONYMOUS_GROUPS = (UNAUTHENTICATED_GROUP,)
_TRUST_CACHE_SIZE = 4096
#: The trusted-proxy entry that trusts peers connected over a Unix socket.
UNIX_PEER = "unix"
_IDENTITY_CACHE_SIZE = 4096
#: Seconds between two warnings about identity headers from a peer that is not trusted.
UNTRUSTED_WARNING_INTERVAL_S = 60.0


def wsgi_str(value: Any, limit: int) -> str:
    """A WSGI "native string" (bytes carried as latin-1) as real text, truncated to ``limit``.

    Non-UTF-8 bytes become U+FFFD; a value that is not a str at all becomes ``""``.
    """
    if not isinstance(value, str):
        return ""
    if value.isascii():  # the common case: nothing to re-decode
        return value[:limit]
    if len(value) > limit * 4:  # at most 4 UTF-8 bytes per character: cut before decoding
        value = value[: limit * 4]
    try:
        text = value.encode("latin-1").decode("utf-8", "replace")
    except UnicodeEncodeError:  # not a WSGI native string (a test or a hook); use as is
        text = value
    return text[:limit]


def _header_key(name: str) -> str:
    return "HTTP_" + name.strip().upper().replace("-", "_")


def _split_groups(raw: str) -> tuple[str, ...]:
    groups: list[str] = []
    for part in raw.split(","):
        part = part.strip()
        if part and part not in groups:
            groups.append(part[:MAX_NAME_LENGTH])
            if len(groups) >= MAX_GROUPS:
                break
    return tuple(groups)


def key_function(keys: Iterable[str],
                 transforms: Mapping[str, Callable[[Any], Any]] | None = None,
                 ) -> Callable[[Callable[[str], Any]], tuple]:
    """A function ``get -> (get(k0), get(k1), ...)`` for a fixed set of keys.

    It is compiled from a tuple display of calls with the keys as constants: the per-request
    shape key is read with no loop and no iterator (``tuple(map(get, keys))`` costs ~1,000
    more instructions for four keys). The keys enter the source only as ``repr()`` literals.

    Args:
        keys: the environ keys, in order.
        transforms: for some keys, a function applied to the value (``f(get(k))``), e.g. a
            digest so that a secret value is never part of the key.

    Returns:
        The function.
    """
    transforms = transforms or {}
    names: dict[str, Any] = {"__builtins__": {}}
    body = ""
    for key in keys:
        if not isinstance(key, str):
            continue
        if key in transforms:
            name = f"t{len(names)}"
            names[name] = transforms[key]
            body += f"{name}(get({key!r})), "
        else:
            body += f"get({key!r}), "
    return eval(f"lambda get: ({body})", names)  # noqa: S307 - literals only


class _IdentityAndDigest:
    """The shape key's entry for ``Authorization`` when it is both a verified token and an
    API-key header: what the token verifies to, and the value's digest."""

    __slots__ = ("identity",)

    def __init__(self, identity: Callable[[Any], Any]) -> None:
        self.identity = identity

    def __call__(self, value: Any) -> tuple:
        return self.identity(value), sources.value_digest(value)


class RequestInfoResolver:
    """The built-in resolver. Build one per configuration; calls are thread-safe."""

    def __init__(
        self,
        trusted_proxies: Iterable[str] = (),
        user_header: str = "X-Remote-User",
        group_header: str = "X-Remote-Group",
        routes: Any = None,
        user_from: Iterable[str] = sources.DEFAULT_USER_FROM,
        jwt_verifier: JWTVerifier | None = None,
        kubernetes_paths: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``trusted_proxies``: CIDRs (or single addresses) whose identity headers are honoured,
        and ``unix`` for peers on a Unix socket (a proxy on the same host); a bad entry raises
        ValueError naming it. ``routes``: a :class:`.routes.RouteTable` or
        None. ``user_from``: identity sources in order (:func:`.identity.parse_user_from`
        output; a bad one raises ValueError). ``jwt_verifier``: verifies ``jwt-sub`` tokens
        (:class:`.jwtauth.JWTVerifier`); None: ``jwt-sub`` reads ``sub`` unverified.
        ``kubernetes_paths``: parse ``/api/`` and ``/apis/`` paths as Kubernetes API requests
        (:func:`.kube_paths.path_parsing` decides it for the server); False: they are
        non-resource requests like any other path. ``clock``: seconds, to space the warnings
        about identity headers from untrusted peers."""
        networks = []
        self.trust_unix = False
        for cidr in trusted_proxies:
            cidr = cidr.strip()
            if not cidr:
                continue
            if cidr.lower() == UNIX_PEER:
                self.trust_unix = True
                continue
            try:
                networks.append(ipaddress.ip_network(cidr, strict=False))
            except ValueError as exc:
                raise ValueError(f"trusted proxy {cidr!r} is not an IP address or CIDR: {exc}") from None
        self.trusted_networks = tuple(networks)
        self.user_header = user_header
        self.user_key = _header_key(user_header)
        self.group_key = _header_key(group_header)
        self._clock = clock
        self._next_untrusted_warning = -float("inf")
        self.routes = routes
        self.kubernetes_paths = kubernetes_paths
        self._trust_cache: dict[str, bool] = {}
        # (raw user header, raw group header) -> (user, groups): clients repeat themselves
        self._identity_cache: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        self.jwt_verifier = jwt_verifier
        self.user_from = sources.parse_user_from(",".join(user_from))
        self._sources = tuple(self._source(name) for name in self.user_from)
        self.environ_keys = self._environ_keys()
        transforms = self._secret_keys()
        if (sources.PROXY in self.user_from and not self.trusting
                and self.user_key not in transforms):
            # never read, but its presence is worth a warning (_from_proxy); unless another
            # source reads the same header (header:X-Remote-User): its digest stays the key's
            transforms[self.user_key] = operator.not_
        #: ``shape_key(environ.get)``: what the result depends on, as a tuple: the values of
        #: :attr:`environ_keys`, secret ones as digests and a verified token as its identity
        self.shape_key = key_function(self.environ_keys, transforms)
        #: what :attr:`shape_key` applies to some keys' values (key -> function): the C
        #: request gate (``ledger/_fastpath.c``) computes the same key
        self.key_transforms = dict(transforms)
        # where shape_key holds the verified token's identity (resolve_shape), if anywhere
        self._token_at = -1
        self._token_paired = False
        if jwt_verifier is not None and sources.JWT_SUB in self.user_from:
            self._token_at = self.environ_keys.index("HTTP_AUTHORIZATION")
            self._token_paired = isinstance(transforms["HTTP_AUTHORIZATION"],
                                            _IdentityAndDigest)
        self._jwt_at = (self.user_from.index(sources.JWT_SUB)
                        if sources.JWT_SUB in self.user_from else -1)

    @property
    def trusting(self) -> bool:
        """Whether any peer is trusted (``APF_TRUSTED_PROXIES`` is not empty)."""
        return bool(self.trusted_networks or self.trust_unix)

    def _source(self, name: str) -> Callable[[Environ], tuple[str, tuple[str, ...]] | None]:
        if name == sources.PROXY:
            return self._from_proxy
        if name == sources.REMOTE_USER:
            return self._from_remote_user
        if name == sources.JWT_SUB:
            return self._from_jwt
        if name == sources.ADDRESS:
            return self._from_address
        key = sources.header_environ_key(name.split(":", 1)[1])
        return lambda environ: self._from_header(environ, key)

    def _environ_keys(self) -> tuple[str, ...]:
        """Every environ key the resolution reads, in a fixed order."""
        keys = ["REQUEST_METHOD", "PATH_INFO", "QUERY_STRING"]
        trusting = self.trusting
        for name in self.user_from:
            if name == sources.PROXY:
                # untrusted, the user header is read only to warn that it is ignored
                keys += [self.user_key] if not trusting else [
                    "REMOTE_ADDR", self.user_key, self.group_key]
            elif name == sources.REMOTE_USER:
                keys.append("REMOTE_USER")
            elif name == sources.JWT_SUB:
                keys.append("HTTP_AUTHORIZATION")
            elif name == sources.ADDRESS:
                keys += ["REMOTE_ADDR", "HTTP_X_FORWARDED_FOR"] if trusting else ["REMOTE_ADDR"]
            else:
                keys.append(sources.header_environ_key(name.split(":", 1)[1]))
        return tuple(dict.fromkeys(keys))

    def _secret_keys(self) -> dict[str, Callable[[Any], Any]]:
        """The environ keys whose values are secrets, and what the shape key keeps of each."""
        secret: dict[str, Callable[[Any], Any]] = {}
        for name in self.user_from:
            if name.startswith(sources.HEADER + ":"):
                secret[sources.header_environ_key(name.split(":", 1)[1])] = sources.value_digest
        if sources.JWT_SUB in self.user_from:
            auth = "HTTP_AUTHORIZATION"
            if self.jwt_verifier is None:
                secret[auth] = sources.value_digest
            elif auth in secret:  # also an API-key header: both what it names and its digest
                secret[auth] = _IdentityAndDigest(self.jwt_verifier.identity)
            else:
                secret[auth] = self.jwt_verifier.identity
        return secret

    def is_trusted(self, remote_addr: Any) -> bool:
        """Whether a peer address is inside a trusted CIDR (cached per address)."""
        if not isinstance(remote_addr, str):
            return False
        if remote_addr == "":  # gunicorn's REMOTE_ADDR for a Unix-socket peer
            return self.trust_unix
        cached = self._trust_cache.get(remote_addr)
        if cached is not None:
            return cached
        try:
            addr = ipaddress.ip_address(remote_addr.split("%", 1)[0])
        except ValueError:
            trusted = False
        else:
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
            trusted = any(addr in net for net in self.trusted_networks)
        if len(self._trust_cache) >= _TRUST_CACHE_SIZE:
            self._trust_cache.clear()
        self._trust_cache[remote_addr] = trusted
        return trusted

    def identity(self, environ: Environ, token: tuple | None = None
                 ) -> tuple[str, tuple[str, ...]]:
        """(user, groups) of a request: the first source of ``user_from`` that names one.

        Args:
            environ: the request's WSGI environ.
            token: ``(identity,)``: what the bearer token verified to for this request
                (``jwt-sub`` answers that instead of asking the verifier again); None: ask.
        """
        jwt_at = self._jwt_at if token is not None else -1
        for i, source in enumerate(self._sources):
            found = token[0] if i == jwt_at else source(environ)
            if found is not None:
                return found
        return ANONYMOUS_USER, _ANONYMOUS_GROUPS

    def _untrusted_headers(self, remote_addr: Any) -> None:
        """Warn (at most once per :data:`UNTRUSTED_WARNING_INTERVAL_S`) that a peer that is not
        a trusted proxy sent the user header, which is then ignored."""
        now = self._clock()
        if now < self._next_untrusted_warning:
            return
        self._next_untrusted_warning = now + UNTRUSTED_WARNING_INTERVAL_S
        peer = (f"peer {remote_addr}" if remote_addr
                else "a peer on a Unix socket" if isinstance(remote_addr, str) else "a peer")
        entry = remote_addr if remote_addr else UNIX_PEER
        trusted = ",".join([str(n) for n in self.trusted_networks]
                           + ([UNIX_PEER] if self.trust_unix else [])) or "empty"
        log.warning("identity header %s from %s ignored: that peer is not in "
                    "APF_TRUSTED_PROXIES (%s), so the request is classified as if it had none "
                    "(by the next APF_USER_FROM source, else as system:anonymous); if it is "
                    "your proxy, add it (APF_TRUSTED_PROXIES=%s) (said at most every %g s)",
                    self.user_header, peer, trusted, entry, UNTRUSTED_WARNING_INTERVAL_S)

    def _from_proxy(self, environ: Environ) -> tuple[str, tuple[str, ...]] | None:
        remote = environ.get("REMOTE_ADDR")
        if not self.trusting or not self.is_trusted(remote):
            if environ.get(self.user_key):
                self._untrusted_headers(remote)
            return None
        raw_user = environ.get(self.user_key)
        if not raw_user or not isinstance(raw_user, str):
            return None
        raw_groups = environ.get(self.group_key)
        if not isinstance(raw_groups, str):
            raw_groups = ""
        key = (raw_user, raw_groups)
        cached = self._identity_cache.get(key)
        if cached is not None:
            return cached
        # Repeated headers arrive joined with ",": the first value is Kubernetes' user.
        user = wsgi_str(raw_user, MAX_HEADER_LENGTH).split(",", 1)[0].strip()[:MAX_NAME_LENGTH]
        if not user:
            return None
        groups = _split_groups(wsgi_str(raw_groups, MAX_HEADER_LENGTH))
        found = (user, identity_groups(user, groups))
        if len(self._identity_cache) >= _IDENTITY_CACHE_SIZE:
            self._identity_cache.clear()
        self._identity_cache[key] = found
        return found

    def _from_remote_user(self, environ: Environ) -> tuple[str, tuple[str, ...]] | None:
        user = wsgi_str(environ.get("REMOTE_USER"), MAX_NAME_LENGTH).strip()
        return (user, identity_groups(user, ())) if user else None

    def _from_header(self, environ: Environ, key: str) -> tuple[str, tuple[str, ...]] | None:
        value = environ.get(key)
        if not value or not isinstance(value, str):
            return None
        return sources.KEY_PREFIX + sources.key_digest(value), _ANONYMOUS_GROUPS

    def _from_jwt(self, environ: Environ) -> tuple[str, tuple[str, ...]] | None:
        if self.jwt_verifier is not None:
            return self.jwt_verifier.identity(environ.get("HTTP_AUTHORIZATION"))
        sub = sources.jwt_subject(environ.get("HTTP_AUTHORIZATION"))
        if not sub:
            return None
        return sources.JWT_PREFIX + sub, _ANONYMOUS_GROUPS

    def _from_address(self, environ: Environ) -> tuple[str, tuple[str, ...]] | None:
        remote = environ.get("REMOTE_ADDR")
        if not isinstance(remote, str):
            return None
        addr = sources.client_address(remote, environ.get("HTTP_X_FORWARDED_FOR"),
                                      self.is_trusted)
        return (sources.ADDRESS_PREFIX + addr, _ANONYMOUS_GROUPS) if addr else None

    def __call__(self, environ: Environ) -> RequestAttributes:
        return self.resolve_shape(environ, None)

    def resolve_shape(self, environ: Environ, key: tuple | None) -> RequestAttributes:
        """The request's attributes, as ``self(environ)``, but with the bearer token's
        identity taken from ``key`` when it holds one: verified once for this request, so the
        attributes are those of the shape ``key`` names, even when the token's ``exp`` or
        ``nbf`` falls between the two reads. Never raises.

        Args:
            environ: the request's WSGI environ.
            key: ``shape_key(environ.get)``, computed for this request; None: verify anew.
        """
        try:
            token = None
            if key is not None and self._token_at >= 0:
                found = key[self._token_at]
                token = (found[0] if self._token_paired else found,)
            return self._resolve(environ, token)
        except Exception:  # a bug or an environ beyond imagination: classify as anonymous
            log.exception("request attributes: cannot read the request; treating it as anonymous")
            return RequestAttributes(ANONYMOUS_USER, _ANONYMOUS_GROUPS, "", "/")

    def _resolve(self, environ: Environ, token: tuple | None = None) -> RequestAttributes:
        user, groups = self.identity(environ, token)
        method = wsgi_str(environ.get("REQUEST_METHOD"), MAX_METHOD_LENGTH).upper() or "GET"
        path = wsgi_str(environ.get("PATH_INFO"), MAX_PATH_LENGTH) or "/"
        if self.routes is not None:
            fields = self.routes.match(method, path)
            if fields is not None:
                return RequestAttributes(user, groups, path=path, is_resource=True, **fields)
        # Kubernetes trims every leading "/"
        if self.kubernetes_paths and path.lstrip("/").startswith("api"):
            query = wsgi_str(environ.get("QUERY_STRING"), MAX_QUERY_LENGTH)
            fields = parse_kubernetes_path(method, path, query)
            if fields is not None:
                return RequestAttributes(user, groups, path=path, is_resource=True, **fields)
        return RequestAttributes(user, groups, method.lower(), path)
