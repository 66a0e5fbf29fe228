"""Who sent a request: the identity sources of ``APF_USER_FROM``, tried in order.

    sources = parse_user_from("proxy,jwt-sub,address")   # raises ValueError naming the bad one
    bearer_token("Bearer eyJ...")                         # "eyJ...", or "" for anything else
    jwt_subject("Bearer eyJ...")                          # the unverified ``sub`` claim, or ""
    key_digest("s3cr3t-api-key")                           # 16 hex digits; the key never kept
    client_address("10.0.0.5", "203.0.113.9, 10.0.0.7", is_trusted)   # "203.0.113.9"

Sources (:class:`~apf_gunicorn.flowcontrol.requestinfo.RequestInfoResolver` asks them in the
order given; the first that names somebody wins, and with none the request is anonymous):

``proxy``
    ``X-Remote-User``/``X-Remote-Group`` from a peer in ``APF_TRUSTED_PROXIES`` (verified).
``remote_user``
    ``REMOTE_USER`` set by a WSGI layer in front of the app (verified).
``header:NAME``
    any request header, e.g. an API key; the value is hashed (:func:`key_digest`) and only the
    digest is used: user ``key:<digest>``.
``jwt-sub``
    the ``sub`` claim of an ``Authorization: Bearer`` JSON Web Token. Without ``APF_JWT_KEY``
    it is decoded WITHOUT checking the signature: user ``jwt:<sub>``. With a key the token is
    verified (:mod:`.jwtauth`): user ``<sub>`` with the token's groups (verified; each with
    ``APF_JWT_USER_PREFIX``/``APF_JWT_GROUPS_PREFIX`` before it, never a ``system:`` name), and
    a token that does not verify names nobody.
``address``
    the peer address, or the client address ``X-Forwarded-For`` names when the peer is a
    trusted proxy: user ``addr:<ip>`` (IPv6 clients by their /64 network).

The last three (``jwt-sub`` without a key) are *unverified*: anybody can send any header, token or (through a proxy they
control) any address. They name the flow only. Their user name carries the source's prefix,
and their only group is ``system:unauthenticated``, so a forged value can never match a
FlowSchema subject written for a real user or group (only one written for that prefixed name,
or for unauthenticated requests).

Every function here is pure and never raises on request input.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import json
import re
from collections.abc import Callable, Iterable

ANONYMOUS_USER = "system:anonymous"
AUTHENTICATED_GROUP = "system:authenticated"
UNAUTHENTICATED_GROUP = "system:unauthenticated"
#: The namespace of the users and groups the server itself and Kubernetes define
#: (``system:masters``, ``system:authenticated``, ``system:kube-controller-manager`` ...).
SYSTEM_PREFIX = "system:"

#: Longest user or group name kept (longer ones are truncated). Kubernetes service-account user
#: names are at most ~340 characters; 1024 leaves room for any real identity provider.
MAX_NAME_LENGTH = 1024
#: Most groups kept from the group header (further ones are dropped).
MAX_GROUPS = 64


def identity_groups(user: str, groups: Iterable[str]) -> tuple[str, ...]:
    """Groups of an identified user as Kubernetes' authenticated-group adder leaves them.

    ``system:authenticated`` is added unless the groups already say authenticated or
    unauthenticated; the anonymous user instead gets ``system:unauthenticated``.
    """
    groups = tuple(groups)
    if AUTHENTICATED_GROUP in groups or UNAUTHENTICATED_GROUP in groups:
        return groups
    if user == ANONYMOUS_USER:
        return (*groups, UNAUTHENTICATED_GROUP)
    return (*groups, AUTHENTICATED_GROUP)


def is_reserved_name(name: str) -> bool:
    """Whether a user or group name is in the ``system:`` namespace, which an identity
    provider's claims must never reach (the mandatory ``exempt`` FlowSchema matches the group
    ``system:masters``)."""
    return name.startswith(SYSTEM_PREFIX)


PROXY = "proxy"
REMOTE_USER = "remote_user"
HEADER = "header"
JWT_SUB = "jwt-sub"
ADDRESS = "address"

#: The default ``APF_USER_FROM``: trusted proxy headers, then REMOTE_USER.
DEFAULT_USER_FROM: tuple[str, ...] = (PROXY, REMOTE_USER)
#: Sources whose identity is a real user (it may match User and Group subjects).
VERIFIED_SOURCES = frozenset((PROXY, REMOTE_USER))

#: User name prefix of each unverified source.
KEY_PREFIX = "key:"
JWT_PREFIX = "jwt:"
ADDRESS_PREFIX = "addr:"

#: Longest ``Authorization`` value decoded at all (bearer tokens are far shorter).
MAX_TOKEN_LENGTH = 8192
#: Longest base64url payload segment decoded (its JSON is at most 3/4 of that).
MAX_PAYLOAD_LENGTH = 6144
#: Longest subject kept (longer ones are truncated).
MAX_SUBJECT_LENGTH = 256
#: Most X-Forwarded-For entries looked at (from the right).
MAX_FORWARDED_HOPS = 16
#: IPv6 clients are one flow per network of this size (a host gets a whole /64).
IPV6_CLIENT_PREFIX = 64

_HEADER_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")
_BEARER = "bearer "


def parse_user_from(text: str) -> tuple[str, ...]:
    """The source list of an ``APF_USER_FROM`` value (comma-separated, order kept).

    Args:
        text: e.g. ``"proxy,header:X-Api-Key,address"``.

    Returns:
        The sources, each ``proxy``, ``remote_user``, ``jwt-sub``, ``address`` or
        ``header:<Header-Name>``, duplicates dropped.

    Raises:
        ValueError: an unknown source, a ``header:`` without a valid header name, or an
            empty list; the message names the culprit and what is allowed.
    """
    out: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        low = item.lower()
        if low in (PROXY, REMOTE_USER, JWT_SUB, ADDRESS):
            source = low
        elif low.startswith(HEADER + ":"):
            name = item.split(":", 1)[1].strip()
            if not _HEADER_TOKEN.match(name):
                raise ValueError(f"{item!r}: header: needs an HTTP header name, e.g. "
                                 "header:X-Api-Key")
            source = f"{HEADER}:{name}"
        else:
            raise ValueError(f"unknown identity source {item!r}; known: proxy, remote_user, "
                             "header:NAME, jwt-sub, address")
        if source not in out:
            out.append(source)
    if not out:
        raise ValueError("names no identity source; known: proxy, remote_user, header:NAME, "
                         "jwt-sub, address")
    return tuple(out)


def header_environ_key(name: str) -> str:
    """The WSGI environ key of a request header (``X-Api-Key`` -> ``HTTP_X_API_KEY``)."""
    return "HTTP_" + name.strip().upper().replace("-", "_")


def key_digest(value: str) -> str:
    """A short, stable digest of a secret header value (SHA-256, first 64 bits in hex).

    The same value always gives the same digest (so ``explain`` reproduces the server's flow);
    the value itself is never stored, logged or shown.
    """
    try:
        data = value.encode("latin-1")  # WSGI carries header bytes as latin-1
    except UnicodeEncodeError:
        data = value.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:16]


def jwt_subject(authorization: str) -> str:
    """The ``sub`` claim of ``Bearer <JWT>``, decoded without verifying anything.

    Args:
        authorization: the ``Authorization`` header value.

    Returns:
        The subject (at most :data:`MAX_SUBJECT_LENGTH` characters, control characters
        replaced by U+FFFD so it cannot break a log line or a dump row), or ``""`` when the value
        is not a bearer token of three base64url segments whose middle one is a JSON object
        with a non-empty string ``sub``. Never raises.
    """
    parts = bearer_token(authorization).split(".")
    if len(parts) != 3:
        return ""
    payload = parts[1]
    if not payload or len(payload) > MAX_PAYLOAD_LENGTH or not _B64URL.match(payload):
        return ""
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        claims = json.loads(raw)
    except (ValueError, binascii.Error, RecursionError, UnicodeDecodeError):
        return ""
    if not isinstance(claims, dict):
        return ""
    sub = claims.get("sub")
    if not isinstance(sub, str):
        return ""
    return printable_name(sub, MAX_SUBJECT_LENGTH)


def bearer_token(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value.

    Args:
        authorization: the header value (anything: request input).

    Returns:
        The token without surrounding blanks, or ``""`` when the value is not a str, is longer
        than :data:`MAX_TOKEN_LENGTH` or is not of the ``Bearer`` scheme (any case).
    """
    if not isinstance(authorization, str) or len(authorization) > MAX_TOKEN_LENGTH:
        return ""
    if authorization[:7].lower() != _BEARER:
        return ""
    return authorization[7:].strip()


def printable_name(text: str, limit: int) -> str:
    """A name from a token claim, fit for a log line or a dump row: blanks stripped, cut to
    ``limit`` characters, control characters (which JSON can carry and a header cannot)
    replaced by U+FFFD."""
    text = text.strip()[:limit]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else "\ufffd" for c in text)
    return text


def value_digest(value: object) -> bytes | None:
    """A 128-bit BLAKE2b digest of a secret request value, to key caches by (never the value).

    Args:
        value: an environ value (a WSGI latin-1 str, normally), or None when absent.

    Returns:
        The digest, or None for a value that is not a non-empty str (so an absent header and an
        empty one stay apart from any real value). Never raises.
    """
    if not isinstance(value, str) or not value:
        return None
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _normalized(text: str) -> str | None:
    """The canonical text of one address (IPv6 clients as their /64), None if not one."""
    try:
        addr = ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        net = ipaddress.IPv6Network((addr, IPV6_CLIENT_PREFIX), strict=False)
        return str(net)
    return str(addr)


def client_address(remote_addr: str, forwarded_for: str,
                   is_trusted: Callable[[str], bool]) -> str:
    """The client's address, as far as can be told.

    Args:
        remote_addr: the peer (``REMOTE_ADDR``; ``""`` for a Unix-socket peer).
        forwarded_for: the ``X-Forwarded-For`` value (repeated headers joined with ``,``).
        is_trusted: whether an address (text, as ``REMOTE_ADDR``) is a trusted proxy.

    Returns:
        The peer address, unless the peer is trusted: then the right-most address of
        ``X-Forwarded-For`` that is not itself a trusted proxy (or the left-most one if all
        are); an entry that is not an address stops the walk at the hop that added it.
        IPv6 clients are named by their /64 network. ``""`` when there is no address.
    """
    current = _normalized(remote_addr) if remote_addr else None
    if not isinstance(forwarded_for, str) or not forwarded_for or not is_trusted(remote_addr):
        return current or ""
    hops = forwarded_for.rsplit(",", MAX_FORWARDED_HOPS)[-MAX_FORWARDED_HOPS:]
    for hop in reversed(hops):
        text = hop.strip()
        addr = _normalized(text)
        if addr is None:
            break
        current = addr
        if not is_trusted(text):
            break
    return current or ""
