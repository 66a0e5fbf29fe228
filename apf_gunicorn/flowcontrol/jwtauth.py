"""Verified JSON Web Token identity: the ``jwt-sub`` source when ``APF_JWT_KEY`` names a key.

    key = load_jwt_key("/etc/apf/jwt.pem")      # raises JWTKeyError saying what is wrong
    verifier = JWTVerifier(key, audience="api", issuer="https://idp.example")
    verifier.identity("Bearer eyJ...")          # ("alice", ("dev", "system:authenticated"))
                                                # or None: not a token that verifies now

The key file is one of (told apart by its content):

* a PEM public key (``-----BEGIN PUBLIC KEY-----``, ``BEGIN RSA PUBLIC KEY``) or a PEM
  certificate (its public key): RSA allows RS256/384/512 and PS256/384/512; EC allows the ES
  algorithm of its curve; Ed25519/Ed448 allow EdDSA;
* a JWKS (a JSON object with ``keys``) or a single JWK (a JSON object with ``kty``): each key
  allows what its type allows, narrowed to its ``alg`` when it has one; keys with
  ``"use": "enc"`` are skipped; a token picks its key by ``kid`` (a set of one key also
  accepts a token without ``kid``);
* anything else is an HMAC secret, at least 32 bytes (RFC 7518 3.2), allowing HS256, and
  HS384/HS512 when it is 48/64 bytes or longer: a text secret (:func:`hmac_secret`: printable
  UTF-8 before its trailing line ends) without those line ends, any other file byte for byte
  (a binary secret, e.g. ``openssl rand 32``, may end in a CR or LF byte of its own).
  A file that is evidently a key in another form is refused rather than taken for a secret
  that no token would ever verify with (:func:`refuse_misread_key`): a byte order mark, PEM
  text after something else, a DER (binary) key or certificate, the base64 body of a PEM key
  without its ``-----BEGIN`` line, an OpenSSH key.

The allowed algorithms come from the key, never from the token: ``alg: none`` and a token
signed with HS256 using a public key's bytes as the secret never verify. A token verifies when
its signature does, its ``exp`` is in the future, its ``nbf`` (if any) is not more than
``leeway`` seconds ahead of the clock (an identity provider whose clock runs ahead), its
``sub`` is a non-empty string, and, when configured, its ``aud`` contains the audience and its
``iss`` is the issuer. The user is ``user_prefix`` + ``sub`` and the groups are
``groups_prefix`` + each string of a claim (default ``groups``: a list of strings, or one
string), with ``system:authenticated`` added as for any verified user. No claim can name a
``system:`` user or group, whatever the prefixes (that namespace is the server's: the
mandatory ``exempt`` FlowSchema matches the group ``system:masters``): such a group is dropped,
such a user makes the token name nobody.

Verified results are cached by a digest of the token (never the token), in a bounded LRU; a
cached identity is returned only inside its ``nbf``..``exp`` window by the verifier's clock (a
token not valid yet is cached too, with its window). Tokens that can never verify (bad
signature, expired, wrong audience, malformed) are remembered apart, in a smaller bounded
table, so that a client sending garbage cannot push verified tokens out of the cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from .identity import (
    MAX_GROUPS,
    MAX_NAME_LENGTH,
    bearer_token,
    identity_groups,
    is_reserved_name,
    printable_name,
)

#: Longest key file read (a JWKS of a few dozen keys is far smaller).
MAX_KEY_FILE = 1 << 20
#: Shortest HMAC secret accepted (RFC 7518 3.2: at least the hash's size, 256 bits for HS256).
MIN_HMAC_SECRET = 32
#: Verified tokens remembered per worker.
DEFAULT_CACHE_SIZE = 4096
#: Tokens that never verify remembered per worker (apart: they cannot evict verified ones).
DEFAULT_FAILURE_CACHE_SIZE = 1024
#: Seconds a token's ``nbf`` may be ahead of the clock (go-oidc, which Kubernetes uses, allows
#: five minutes; a minute covers the drift of a host whose time is kept).
DEFAULT_LEEWAY_S = 60.0
#: The claim holding the groups when ``APF_JWT_GROUPS_CLAIM`` is not set.
DEFAULT_GROUPS_CLAIM = "groups"

_RSA_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")
_EC_ALGORITHMS = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512",
                  "secp256k1": "ES256K"}
_HMAC_ALGORITHMS = (("HS256", 32), ("HS384", 48), ("HS512", 64))
_PUBLIC_PEM = (b"-----BEGIN PUBLIC KEY-----", b"-----BEGIN RSA PUBLIC KEY-----")
_CERT_PEM = b"-----BEGIN CERTIFICATE-----"
#: Claims checked by hand against the verifier's clock (PyJWT would read the wall clock).
_DECODE_OPTIONS = {"verify_exp": False, "verify_nbf": False, "verify_iat": False,
                   "require": ["exp", "sub"]}
_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_BASE64_TEXT = re.compile(rb"^[A-Za-z0-9+/=\s]+$")


class JWTKeyError(ValueError):
    """A key file that cannot verify tokens; ``str()`` says why."""


@dataclass(frozen=True)
class VerificationKey:
    """One key and the algorithms it may verify."""

    key: Any  # a cryptography public key, or the HMAC secret's bytes
    algorithms: tuple[str, ...]
    kid: str | None = None


@dataclass(frozen=True)
class JWTKey:
    """The keys of an ``APF_JWT_KEY`` file (:func:`load_jwt_key`)."""

    kind: str  # "hmac", "pem" or "jwks"
    keys: tuple[VerificationKey, ...]

    def select(self, kid: Any) -> VerificationKey | None:
        """The key a token's header ``kid`` names; with one key, also a token without kid.

        Args:
            kid: the token header's ``kid`` (anything: it is unverified input).

        Returns:
            The key, or None when no key fits.
        """
        if kid is None and len(self.keys) == 1:
            return self.keys[0]
        for candidate in self.keys:
            if candidate.kid is not None and candidate.kid == kid:
                return candidate
        if len(self.keys) == 1 and self.keys[0].kid is None:
            return self.keys[0]  # a key without kid accepts whatever kid a token claims
        return None


def _public_key_algorithms(key: Any) -> tuple[str, ...]:
    """The algorithms a public key verifies; raises JWTKeyError for another kind of key."""
    if isinstance(key, rsa.RSAPublicKey):
        return _RSA_ALGORITHMS
    if isinstance(key, ec.EllipticCurvePublicKey):
        alg = _EC_ALGORITHMS.get(key.curve.name)
        if alg is None:
            raise JWTKeyError(f"an EC key on curve {key.curve.name}, which JWT does not use")
        return (alg,)
    if isinstance(key, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
        return ("EdDSA",)
    raise JWTKeyError(f"a {type(key).__name__}, not an RSA, EC or Ed25519/Ed448 public key")


def _pem_key(data: bytes) -> JWTKey:
    if b"PRIVATE KEY-----" in data:
        raise JWTKeyError("a PEM private key: give the public key instead "
                          "(openssl pkey -in key.pem -pubout)")
    try:
        if _CERT_PEM in data:
            public = x509.load_pem_x509_certificate(data).public_key()
        else:
            public = serialization.load_pem_public_key(data)
    except ValueError as e:
        raise JWTKeyError(f"not a readable PEM public key or certificate ({e})") from None
    return JWTKey("pem", (VerificationKey(public, _public_key_algorithms(public)),))


def _jwk(entry: Any, where: str) -> VerificationKey:
    if not isinstance(entry, dict):
        raise JWTKeyError(f"{where} is not a JSON object")
    try:
        parsed = jwt.PyJWK(entry)
    except jwt.PyJWTError as e:
        raise JWTKeyError(f"{where}: {e}") from None
    kid = entry.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise JWTKeyError(f"{where}: kid must be a string")
    if entry.get("kty") == "oct":
        secret = parsed.key
        allowed = tuple(alg for alg, size in _HMAC_ALGORITHMS if len(secret) >= size)
        if not allowed:
            raise JWTKeyError(f"{where}: an HMAC key of {len(secret)} bytes; at least "
                              f"{MIN_HMAC_SECRET} (RFC 7518 3.2)")
    else:
        if "d" in entry:
            raise JWTKeyError(f"{where}: a private key; give only the public part")
        secret = parsed.key
        try:
            allowed = _public_key_algorithms(secret)
        except JWTKeyError as e:
            raise JWTKeyError(f"{where}: {e}") from None
    alg = entry.get("alg")
    if alg is not None:
        if alg not in allowed:
            raise JWTKeyError(f"{where}: alg {alg!r} does not fit the key (allowed: "
                              f"{', '.join(allowed)})")
        allowed = (alg,)
    return VerificationKey(secret, allowed, kid)


def _json_key(text: bytes) -> JWTKey:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise JWTKeyError(f"looks like JSON but does not parse ({e})") from None
    if isinstance(doc, dict) and "keys" in doc:
        entries = doc["keys"]
        if not isinstance(entries, list):
            raise JWTKeyError("a JWKS whose 'keys' is not a list")
        keys = [_jwk(e, f"keys[{i}]") for i, e in enumerate(entries)
                if not (isinstance(e, dict) and e.get("use") == "enc")]
        if not keys:
            raise JWTKeyError("a JWKS without a signature key")
        kids = [k.kid for k in keys]
        if len(keys) > 1 and (None in kids or len(set(kids)) != len(kids)):
            raise JWTKeyError("a JWKS of several keys needs a distinct kid on each key")
        return JWTKey("jwks", tuple(keys))
    if isinstance(doc, dict) and "kty" in doc:
        return JWTKey("jwks", (_jwk(doc, "the JWK"),))
    raise JWTKeyError("JSON that is neither a JWKS (an object with 'keys') nor a JWK "
                      "(an object with 'kty')")


def _der_kind(der: bytes) -> str | None:
    """What a DER structure is when it is a key or a certificate, else None."""
    if not der.startswith(b"\x30"):  # a DER key or certificate is a SEQUENCE
        return None
    loaders = (("public key", serialization.load_der_public_key),
               ("certificate", x509.load_der_x509_certificate),
               ("private key", lambda d: serialization.load_der_private_key(d, None)))
    for kind, load in loaders:
        try:
            load(der)
        except Exception:  # noqa: S112 - not this kind: try the next
            continue
        return kind
    return None


def refuse_misread_key(data: bytes) -> None:
    """Raise when a file that would be taken for an HMAC secret is evidently a key in another
    form: every token would then fail to verify, and every user fall through to the next
    source, with nothing said.

    Args:
        data: the file's bytes (not starting with ``-----BEGIN`` or ``{``).

    Raises:
        JWTKeyError: saying what the file looks like and how to give it instead.
    """
    if data.startswith(_UTF8_BOM):
        raise JWTKeyError("starts with a UTF-8 byte order mark (bytes EF BB BF, as some editors "
                          "save text): save the file without it")
    if data.startswith(_UTF16_BOMS):
        raise JWTKeyError("UTF-16 text (it starts with a UTF-16 byte order mark): save the key "
                          "as plain ASCII or UTF-8 text")
    at = data.find(b"-----BEGIN")
    if at >= 0:
        before = data[:at].decode("utf-8", "replace").strip()[:40]
        raise JWTKeyError(f"PEM text after {at} bytes of something else ({before!r}...): the "
                          "file must start with its -----BEGIN line; remove what comes before")
    kind = _der_kind(data)
    if kind is not None:
        raise JWTKeyError(f"a DER (binary) {kind}: convert it to PEM, e.g. openssl "
                          + ("x509 -inform DER -in cert.der -out cert.pem" if kind == "certificate"
                             else "pkey -pubin -inform DER -in key.der -out key.pem"
                             if kind == "public key" else
                             "pkey -inform DER -in key.der -pubout -out key.pem"))
    if data.lstrip().startswith(b"MI") and _BASE64_TEXT.match(data):
        try:
            der = base64.b64decode(b"".join(data.split()), validate=True)
        except (binascii.Error, ValueError):
            der = b""
        kind = _der_kind(der)
        if kind is not None:
            label = "CERTIFICATE" if kind == "certificate" else kind.upper()
            raise JWTKeyError(f"the base64 body of a {kind} without its PEM lines: add "
                              f"-----BEGIN {label}----- before it and -----END {label}----- "
                              "after it")
    if data.lstrip().startswith((b"ssh-", b"ecdsa-sha2-")):
        raise JWTKeyError("an OpenSSH public key: give it in PEM form "
                          "(ssh-keygen -e -m PKCS8 -f key.pub)")


def hmac_secret(data: bytes) -> bytes:
    """The HMAC secret a key file holds.

    A text secret (``openssl rand -base64 48 > key``, an editor's save) ends in a line end that
    is not part of it. The file is text when what comes before its trailing CR and LF bytes
    decodes as UTF-8 and is all printable (``str.isprintable``: no control characters, tab
    included): the secret is then those bytes. Anything else is binary and is the secret byte
    for byte, its last byte included: one random secret in 128 ends in a CR or LF.
    """
    text = data.rstrip(b"\r\n")
    if len(text) == len(data):
        return data
    try:
        printable = text.decode("utf-8").isprintable()
    except UnicodeDecodeError:
        printable = False
    return text if printable else data


def _hmac_key(data: bytes) -> JWTKey:
    refuse_misread_key(data)
    secret = hmac_secret(data)
    if len(secret) < MIN_HMAC_SECRET:
        raise JWTKeyError(f"an HMAC secret of {len(secret)} bytes; at least {MIN_HMAC_SECRET} "
                          "(RFC 7518 3.2), e.g. from: openssl rand -base64 48")
    allowed = tuple(alg for alg, size in _HMAC_ALGORITHMS if len(secret) >= size)
    return JWTKey("hmac", (VerificationKey(secret, allowed),))


def parse_jwt_key(data: bytes) -> JWTKey:
    """The keys in the content of a key file (see the module docstring for the formats).

    Args:
        data: the file's bytes.

    Returns:
        The keys and the algorithms each allows.

    Raises:
        JWTKeyError: a private key, an unreadable PEM or JSON key, a key type JWT does not
            use, an ``alg`` that does not fit its key, an HMAC secret shorter than 32 bytes, or
            a file that is a key in another form (:func:`refuse_misread_key`).
    """
    head = data.lstrip()
    if head.startswith(b"-----BEGIN"):
        return _pem_key(data)
    if head.startswith(b"{"):
        return _json_key(data)
    if not head:
        raise JWTKeyError("the file is empty")
    return _hmac_key(data)


def load_jwt_key(path: str) -> JWTKey:
    """The keys of the file ``path`` (:func:`parse_jwt_key`).

    Raises:
        JWTKeyError: the file cannot be read, is larger than 1 MiB, or holds no usable key.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as e:
        raise JWTKeyError(f"cannot read the file: {os.strerror(e.errno or 0) or e}") from None
    if len(data) > MAX_KEY_FILE:
        raise JWTKeyError(f"larger than {MAX_KEY_FILE} bytes; not a key file")
    return parse_jwt_key(data)


def _instant(value: Any) -> float | None:
    """A NumericDate claim as a number of seconds, None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _groups(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else ()
    groups: list[str] = []
    for item in items:
        if not isinstance(item, str):
            continue
        name = printable_name(item, MAX_NAME_LENGTH)
        if name and name not in groups:
            groups.append(name)
            if len(groups) >= MAX_GROUPS:
                break
    return tuple(groups)


Identity = tuple[str, tuple[str, ...]]


class JWTVerifier:
    """Bearer tokens -> verified (user, groups), cached. Thread-safe; never raises on input."""

    def __init__(self, key: JWTKey, *, audience: str | None = None,
                 issuer: str | None = None, groups_claim: str = DEFAULT_GROUPS_CLAIM,
                 user_prefix: str = "", groups_prefix: str = "",
                 leeway: float = DEFAULT_LEEWAY_S,
                 clock: Callable[[], float] | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 failure_cache_size: int = DEFAULT_FAILURE_CACHE_SIZE) -> None:
        """
        Args:
            key: the keys (:func:`load_jwt_key`).
            audience: when set, a token's ``aud`` must contain it.
            issuer: when set, a token's ``iss`` must equal it.
            groups_claim: the claim whose strings are the user's groups.
            user_prefix: put before ``sub`` to make the user name (Kubernetes'
                ``--oidc-username-prefix``).
            groups_prefix: put before each group of the claim (``--oidc-groups-prefix``).
            leeway: seconds a token's ``nbf`` may be ahead of the clock.
            clock: seconds since the epoch (default ``time.time``), for ``exp``/``nbf``.
            cache_size: verified tokens remembered (least recently used forgotten first).
            failure_cache_size: tokens that never verify remembered (oldest forgotten first).
        """
        self.key = key
        self.audience = audience
        self.issuer = issuer
        self.groups_claim = groups_claim
        self.user_prefix = user_prefix
        self.groups_prefix = groups_prefix
        self.leeway = leeway
        self._clock = clock or time.time
        self._size = max(1, cache_size)
        self._failure_size = max(1, failure_cache_size)
        self._cache: OrderedDict[bytes, tuple[Identity, float, float]] = OrderedDict()
        # digest -> why it does not verify; apart, so failures never evict verified tokens
        self._failures: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()
        self._options = {**_DECODE_OPTIONS, "verify_aud": audience is not None,
                         "verify_iss": issuer is not None}

    def identity(self, authorization: Any) -> Identity | None:
        """The verified identity of an ``Authorization`` value.

        Args:
            authorization: the header value (request input of any type).

        Returns:
            ``(user, groups)`` with ``system:authenticated`` among the groups, or None when the
            value is not a bearer token that verifies at this instant.
        """
        return self.check(authorization)[0]

    def check(self, authorization: Any) -> tuple[Identity | None, str]:
        """:meth:`identity` and, when there is none, why (for ``explain``).

        Returns:
            ``(identity, "")``, or ``(None, reason)``; ``reason`` is ``""`` when the value is
            no bearer token at all.
        """
        token = bearer_token(authorization)
        if not token:
            return None, ""
        digest = hashlib.blake2b(token.encode("utf-8", "surrogatepass"),
                                 digest_size=16).digest()
        now = self._clock()
        with self._lock:
            entry = self._cache.get(digest)
            if entry is not None:
                self._cache.move_to_end(digest)
            else:
                failure = self._failures.get(digest)
        if entry is None:
            if failure is not None:
                return None, f"{failure} (a cached answer)"
            entry, reason = self._verify(token, now)
            with self._lock:
                if entry is None:
                    table, size, value = self._failures, self._failure_size, reason
                else:
                    table, size, value = self._cache, self._size, entry
                table[digest] = value
                if len(table) > size:
                    table.popitem(last=False)
            if entry is None:
                return None, reason
        found, not_before, not_after = entry
        if now >= not_after:
            return None, "the token has expired"
        if now < not_before:
            return None, "the token is not valid yet (nbf)"
        return found, ""

    def _verify(self, token: str, now: float
                ) -> tuple[tuple[Identity, float, float] | None, str]:
        """(cache entry: identity and its validity window, ""), or (None, why it never
        verifies)."""
        try:
            header = jwt.get_unverified_header(token)
            chosen = self.key.select(header.get("kid"))
            if chosen is None:
                return None, f"no key for kid {str(header.get('kid'))[:64]!r}"
            claims = jwt.decode(token, chosen.key, algorithms=list(chosen.algorithms),
                                audience=self.audience, issuer=self.issuer,
                                options=self._options)
        except Exception as e:  # PyJWT's errors, and anything it lets through: no identity
            return None, f"the token does not verify: {str(e)[:200]}"
        exp = _instant(claims.get("exp"))
        nbf = _instant(claims["nbf"]) if "nbf" in claims else -math.inf
        sub = claims.get("sub")
        if exp is None or nbf is None:
            return None, "exp or nbf is not a number"
        if not isinstance(sub, str) or not printable_name(sub, MAX_NAME_LENGTH):
            return None, "sub is not a non-empty string"
        if now >= exp:
            return None, "the token has expired"
        user = self.user_prefix + printable_name(sub, MAX_NAME_LENGTH)
        if is_reserved_name(user):
            return None, (f"its user {user[:64]!r} would be in the system: namespace, which no "
                          "token may name (APF_JWT_USER_PREFIX)")
        groups = tuple(name for name in (self.groups_prefix + g
                                         for g in _groups(claims.get(self.groups_claim)))
                       if not is_reserved_name(name))
        # a token not valid yet is remembered with its window: it verifies once inside it
        return ((user, identity_groups(user, groups)), nbf - self.leeway, exp), ""

    def cached_digests(self) -> list[bytes]:
        """The verified tokens' cache keys (digests), for tests that check no token is kept."""
        with self._lock:
            return list(self._cache)

    def failure_digests(self) -> list[bytes]:
        """The keys (digests) of the tokens remembered as never verifying, oldest first."""
        with self._lock:
            return list(self._failures)

