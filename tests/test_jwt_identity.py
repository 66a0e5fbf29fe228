"""Verified ``jwt-sub`` (APF_JWT_KEY) with real signed tokens, and identity values kept out of
every cache (only digests, or the identity a token verifies to, are cache keys)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace as NS

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.flowcontrol.jwtauth import (
    DEFAULT_LEEWAY_S,
    JWTKeyError,
    JWTVerifier,
    load_jwt_key,
)
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.matching import Classifier
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec
from apf_gunicorn.server.resolver import build_resolver
from apf_gunicorn.server.settings import SettingsError, load_settings
from tests.test_identity import EXEMPT_ALICE, environ

SECRET = b"0123456789abcdef0123456789abcdef-test-secret"
NOW = time.time()
AUTH = ("system:authenticated",)


@pytest.fixture(scope="module")
def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem(private) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.PEM,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)


def claims(**extra):
    return {"sub": "alice", "groups": ["ops", "dev"], "exp": int(NOW) + 3600, **extra}


def bearer(token: str) -> str:
    return "Bearer " + token


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    return str(path)


@pytest.fixture
def pem_file(tmp_path, rsa_key):
    path = tmp_path / "key.pem"
    path.write_bytes(pem(rsa_key))
    return str(path)


def hs_verifier(secret_file, **kw) -> JWTVerifier:
    return JWTVerifier(load_jwt_key(secret_file), **kw)


# --- valid tokens of each key kind -----------------------------------------------------------

def test_hs256_secret_file(secret_file):
    v = hs_verifier(secret_file)
    assert load_jwt_key(secret_file).kind == "hmac"
    token = jwt.encode(claims(), SECRET, algorithm="HS256")
    assert v.identity(bearer(token)) == ("alice", ("ops", "dev", *AUTH))


def test_rs256_pem_public_key(pem_file, rsa_key):
    v = JWTVerifier(load_jwt_key(pem_file))
    token = jwt.encode(claims(sub="bob", groups="admins"), rsa_key, algorithm="RS256")
    assert v.identity(bearer(token)) == ("bob", ("admins", *AUTH))
    token = jwt.encode(claims(sub="carol", groups=None), rsa_key, algorithm="PS256")
    assert v.identity(bearer(token)) == ("carol", AUTH)


def test_pem_certificate_and_ed25519_key(tmp_path, rsa_key):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idp")])
    start = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(rsa_key.public_key()).serial_number(1).not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=36500))
            .sign(rsa_key, hashes.SHA256()))
    path = tmp_path / "cert.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    token = jwt.encode(claims(), rsa_key, algorithm="RS512")
    assert JWTVerifier(load_jwt_key(str(path))).identity(bearer(token))[0] == "alice"
    ed = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "ed.pem"
    path.write_bytes(pem(ed))
    key = load_jwt_key(str(path))
    assert key.keys[0].algorithms == ("EdDSA",)
    assert JWTVerifier(key).identity(bearer(jwt.encode(claims(), ed, algorithm="EdDSA")))
    assert JWTVerifier(key).identity(bearer(token)) is None  # an RS512 token: not this key's


def test_jwks_file_picks_the_key_by_kid(tmp_path, rsa_key):
    other = ec.generate_private_key(ec.SECP256R1())
    jwks = {"keys": [
        {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key())), "kid": "r1",
         "use": "sig"},
        {**json.loads(jwt.algorithms.ECAlgorithm.to_jwk(other.public_key())), "kid": "e1"},
        {"kty": "RSA", "use": "enc", "n": "x", "e": "AQAB"},  # an encryption key: skipped
    ]}
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks))
    key = load_jwt_key(str(path))
    assert key.kind == "jwks" and [k.kid for k in key.keys] == ["r1", "e1"]
    v = JWTVerifier(key, groups_claim="roles")
    rs = jwt.encode(claims(roles=["x"]), rsa_key, algorithm="RS256", headers={"kid": "r1"})
    es = jwt.encode(claims(sub="eve"), other, algorithm="ES256", headers={"kid": "e1"})
    assert v.identity(bearer(rs)) == ("alice", ("x", *AUTH))
    assert v.identity(bearer(es)) == ("eve", AUTH)  # no "roles" claim: no groups of its own
    # the right signature under the wrong kid, an unknown kid, no kid: nothing
    for token in (jwt.encode(claims(), rsa_key, algorithm="RS256", headers={"kid": "e1"}),
                  jwt.encode(claims(), rsa_key, algorithm="RS256", headers={"kid": "zz"}),
                  jwt.encode(claims(), rsa_key, algorithm="RS256")):
        assert v.check(bearer(token))[0] is None


# --- tokens that must not verify -------------------------------------------------------------

def test_expired_and_not_yet_valid(secret_file):
    v = hs_verifier(secret_file)
    expired = jwt.encode(claims(exp=int(NOW) - 10), SECRET, algorithm="HS256")
    early = jwt.encode(claims(nbf=int(NOW) + 600), SECRET, algorithm="HS256")
    no_exp = jwt.encode({"sub": "alice"}, SECRET, algorithm="HS256")
    assert v.check(bearer(expired)) == (None, "the token has expired")
    assert v.check(bearer(early)) == (None, "the token is not valid yet (nbf)")
    assert v.identity(bearer(no_exp)) is None  # exp is required


def test_wrong_key_wrong_audience_wrong_issuer(secret_file, rsa_key):
    v = hs_verifier(secret_file, audience="api", issuer="https://idp.example")
    good = claims(aud=["api", "other"], iss="https://idp.example")
    assert v.identity(bearer(jwt.encode(good, SECRET, algorithm="HS256")))[0] == "alice"
    for token in (jwt.encode(good, SECRET[::-1], algorithm="HS256"),                # wrong key
                  jwt.encode({**good, "aud": "other"}, SECRET, algorithm="HS256"),
                  jwt.encode({**good, "iss": "https://evil"}, SECRET, algorithm="HS256"),
                  jwt.encode(claims(), SECRET, algorithm="HS256"),                  # neither
                  jwt.encode(good, rsa_key, algorithm="RS256")):                    # not HS*
        assert v.identity(bearer(token)) is None, jwt.decode(token,
                                                            options={"verify_signature": False})


def test_alg_none_is_never_accepted(secret_file, pem_file):
    unsigned = jwt.encode(claims(), None, algorithm="none")
    for key in (secret_file, pem_file):
        assert JWTVerifier(load_jwt_key(key)).identity(bearer(unsigned)) is None


def test_hs256_signed_with_the_public_key_bytes_is_refused(pem_file, rsa_key):
    """The classic confusion: a verifier that takes alg from the token would check HS256 with
    the PEM text as the secret, which anybody has."""
    import hashlib
    import hmac

    def b64(data: bytes) -> str:
        import base64
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = (b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "."
                     + b64(json.dumps(claims(sub="mallory")).encode()))
    sig = hmac.new(pem(rsa_key), signing_input.encode(), hashlib.sha256).digest()
    forged = f"{signing_input}.{b64(sig)}"
    found, reason = JWTVerifier(load_jwt_key(pem_file)).check(bearer(forged))
    assert found is None
    # Refused for its algorithm, which the key does not allow: a verifier taking the
    # algorithms from the token would fail later, on the key (PyJWT will not use a public key
    # as an HMAC secret), with another reason; issue 25 item 15.
    assert "The specified alg value is not allowed" in reason, reason


@pytest.mark.parametrize("value", [None, 42, "", "Bearer", "Basic abc", "Bearer a.b",
                                   "Bearer ..", "Bearer " + "a" * 9000, "Bearer \x00.\xff.x"])
def test_garbage_never_raises(secret_file, value):
    assert hs_verifier(secret_file).identity(value) is None


# --- the cache -------------------------------------------------------------------------------

def test_a_cached_token_does_not_outlive_its_exp(secret_file):
    clock = [NOW]
    v = hs_verifier(secret_file, clock=lambda: clock[0])
    token = jwt.encode(claims(exp=int(NOW) + 60, nbf=int(NOW) - 1), SECRET, algorithm="HS256")
    assert v.identity(bearer(token))[0] == "alice"
    assert len(v.cached_digests()) == 1
    clock[0] = NOW + 61  # past exp, answered from the cache
    assert v.check(bearer(token)) == (None, "the token has expired")
    clock[0] = NOW - 1 - DEFAULT_LEEWAY_S - 1  # before nbf and its leeway (a clock stepped back)
    assert v.identity(bearer(token)) is None


def test_a_token_not_valid_yet_is_verified_again_later(secret_file):
    clock = [NOW]
    v = hs_verifier(secret_file, clock=lambda: clock[0])
    token = jwt.encode(claims(nbf=int(NOW) + DEFAULT_LEEWAY_S + 30), SECRET, algorithm="HS256")
    assert v.identity(bearer(token)) is None
    clock[0] = NOW + 31
    assert v.identity(bearer(token))[0] == "alice"


def test_the_cache_is_bounded_and_keeps_no_token(secret_file):
    v = hs_verifier(secret_file, cache_size=3)
    tokens = [jwt.encode(claims(sub=f"u{i}"), SECRET, algorithm="HS256") for i in range(5)]
    for t in tokens:
        assert v.identity(bearer(t)) is not None
    digests = v.cached_digests()
    assert len(digests) == 3 and all(isinstance(d, bytes) and len(d) == 16 for d in digests)
    assert not any(t.encode() in d or d in t.encode() for t in tokens for d in digests)


# --- the resolver: verified users, fallback, shape keys ---------------------------------------

def test_a_verified_token_is_a_real_user_and_a_bad_one_falls_through(tmp_path, secret_file):
    config = tmp_path / "apf.yaml"
    config.write_text(EXEMPT_ALICE)
    classifier = Classifier(load_configuration(str(config)))
    r = RequestInfoResolver(user_from=("jwt-sub", "address"),
                            jwt_verifier=hs_verifier(secret_file))
    good = jwt.encode(claims(sub="bob", groups=["ops"]), SECRET, algorithm="HS256")
    attrs = r(environ(HTTP_AUTHORIZATION=bearer(good)))
    assert (attrs.user, attrs.groups) == ("bob", ("ops", *AUTH))
    assert classifier.classify(attrs).flow_schema.name == "root"  # the group ops matches
    unsigned = jwt.encode(claims(sub="alice", groups=["ops"]), None, algorithm="none")
    expired = jwt.encode(claims(exp=int(NOW) - 1), SECRET, algorithm="HS256")
    for value in (bearer(unsigned), bearer(expired), "Bearer nonsense"):
        attrs = r(environ(HTTP_AUTHORIZATION=value))
        assert (attrs.user, attrs.groups) == ("addr:192.0.2.1", ("system:unauthenticated",))
        assert classifier.classify(attrs).flow_schema.name == "catch-all"


def test_shape_keys_hold_digests_never_the_secret(secret_file):
    """Review item: the raw API key and bearer token were the middleware cache's keys."""
    token = jwt.encode(claims(), SECRET, algorithm="HS256")
    env = environ(HTTP_X_API_KEY="s3cr3t-api-key-value", HTTP_AUTHORIZATION=bearer(token))
    for verifier in (None, hs_verifier(secret_file)):
        r = RequestInfoResolver(user_from=("header:X-Api-Key", "jwt-sub"), jwt_verifier=verifier)
        key = r.shape_key(env.get)
        text = repr(key)
        assert "s3cr3t" not in text and token not in text and token[:40] not in text
        other = r.shape_key({**env, "HTTP_X_API_KEY": "another-key"}.get)
        assert other != key  # different keys still make different shapes
    # verified: the shape carries the identity, so it changes when the token expires
    clock = [NOW]
    r = RequestInfoResolver(user_from=("jwt-sub",),
                            jwt_verifier=hs_verifier(secret_file, clock=lambda: clock[0]))
    before = r.shape_key(env.get)
    clock[0] = NOW + 7200
    assert r.shape_key(env.get) != before
    assert r(env).user == "system:anonymous"


def _middleware(resolver) -> APFMiddleware:
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure([LevelSpec("lvl", 0, 0, 0, 10)], ["fs"], 10**12)
    level, schema = NS(name="lvl", uid="u1", is_exempt=False), NS(name="fs", uid="u2")
    classifier = NS(classify=lambda attrs: NS(flow_schema=schema, priority_level=level,
                                              distinguisher="", flow_hash=7))
    ctx = WorkerContext(
        ledger=led, resolver=resolver, classifier=classifier, level_index=levels,
        fs_index=schemas, owner=0, parking=Parking(), deliver=lambda granted: None,
        add_linger=lambda *a: None, queue_wait_limit_ns=10**9, alive=lambda: True,
        clock=lambda: 10**12)

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]
    return APFMiddleware(app, ctx)


@pytest.mark.parametrize("verified", [False, True])
def test_the_middleware_cache_keeps_no_raw_identity_value(secret_file, verified):
    token = jwt.encode(claims(), SECRET, algorithm="HS256")
    verifier = hs_verifier(secret_file) if verified else None
    mw = _middleware(RequestInfoResolver(user_from=("header:X-Api-Key", "jwt-sub"),
                                         jwt_verifier=verifier))
    env = environ(HTTP_X_API_KEY="s3cr3t-api-key-value", HTTP_AUTHORIZATION=bearer(token),
                  **{"wsgi.input": None})
    body = mw(env, lambda status, headers, exc_info=None: None)
    assert b"".join(body) == b"ok"
    body.close()
    assert len(mw._cache) == 1
    text = repr(list(mw._cache))
    assert "s3cr3t" not in text and token[:40] not in text


# --- settings --------------------------------------------------------------------------------

def test_settings_build_the_verifier(secret_file):
    s = load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": secret_file,
                       "APF_JWT_AUDIENCE": "api", "APF_JWT_GROUPS_CLAIM": "roles"})
    r = build_resolver(s)
    good = jwt.encode(claims(aud="api", roles=["r"]), SECRET, algorithm="HS256")
    assert (r(environ(HTTP_AUTHORIZATION=bearer(good))).user,
            r(environ(HTTP_AUTHORIZATION=bearer(good))).groups) == ("alice", ("r", *AUTH))
    assert build_resolver(load_settings({"APF_USER_FROM": "jwt-sub"})).jwt_verifier is None


@pytest.mark.parametrize("content,words", [
    (b"short", "HMAC secret of 5 bytes; at least 32"),
    (b"", "empty"),
    (b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "not a readable PEM"),
    (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "private key"),
    (b'{"keys": [', "does not parse"),
    (b'{"keys": []}', "without a signature key"),
    (b'{"keys": [{"kty": "oct", "k": "c2hvcnQ"}]}', "keys[0]: an HMAC key of 5 bytes"),
    (b'{"keys": [{"kty": "oct", "k": "' + b"QUFB" * 16 + b'", "alg": "RS256"}]}',
     "keys[0]: Not an RSA key"),
    (b'{"keys": [{"kty": "oct", "k": "' + b"QUFB" * 16 + b'", "alg": "HS512"}]}',
     "alg 'HS512' does not fit the key (allowed: HS256, HS384)"),
    (b'{"kty": "XX"}', "Unsupported kty"),
    (b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ user@host-with-a-long-name", "OpenSSH"),
])
def test_a_bad_key_file_names_the_variable_the_file_and_the_problem(tmp_path, content, words):
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(SettingsError) as e:
        load_settings({"APF_USER_FROM": "proxy,jwt-sub", "APF_JWT_KEY": str(path)})
    assert "APF_JWT_KEY" in str(e.value) and str(path) in str(e.value)
    assert words in str(e.value), str(e.value)
    with pytest.raises(JWTKeyError):
        load_jwt_key(str(path))


def test_settings_errors(tmp_path, secret_file):
    with pytest.raises(SettingsError, match="APF_JWT_KEY.*cannot read the file"):
        load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": str(tmp_path / "nope")})
    with pytest.raises(SettingsError, match="does not list; add it"):
        load_settings({"APF_JWT_KEY": secret_file})
    with pytest.raises(SettingsError, match="APF_JWT_ISSUER.*set APF_JWT_KEY too"):
        load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_ISSUER": "x"})


# --- issue 25: what a review, an identity provider and a first try found ----------------------

def test_no_claim_can_name_a_system_group_or_user(tmp_path, secret_file):
    """Issue 25 item 1: a token's ``groups: ["system:masters"]`` made its holder exempt under
    builtin:webapp. No claim reaches the system: namespace, whatever the prefixes."""
    v = hs_verifier(secret_file)
    token = jwt.encode(claims(groups=["system:masters", "dev", "system:authenticated"]),
                       SECRET, algorithm="HS256")
    assert v.identity(bearer(token)) == ("alice", ("dev", *AUTH))
    found, reason = v.check(bearer(jwt.encode(claims(sub="system:kube-controller-manager"),
                                              SECRET, algorithm="HS256")))
    assert found is None and "system: namespace" in reason, reason
    # a prefix that completes to system: does not get there either
    v = hs_verifier(secret_file, user_prefix="sys", groups_prefix="sys")
    token = jwt.encode(claims(sub="tem:admin", groups=["tem:masters", "ops"]), SECRET,
                       algorithm="HS256")
    assert v.identity(bearer(token)) is None
    token = jwt.encode(claims(groups=["tem:masters", "ops"]), SECRET, algorithm="HS256")
    assert v.identity(bearer(token)) == ("sysalice", ("sysops", *AUTH))
    # classified: the group system:masters no longer reaches the mandatory exempt schema
    classifier = Classifier(load_configuration("builtin:webapp"))
    r = RequestInfoResolver(user_from=("jwt-sub",), jwt_verifier=hs_verifier(secret_file))
    token = jwt.encode(claims(groups=["system:masters"]), SECRET, algorithm="HS256")
    c = classifier.classify(r(environ(HTTP_AUTHORIZATION=bearer(token))))
    assert not c.priority_level.is_exempt and c.flow_schema.name == "users"


def test_user_and_groups_prefixes(secret_file):
    """Kubernetes' --oidc-username-prefix / --oidc-groups-prefix: put before every name."""
    s = load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": secret_file,
                       "APF_JWT_USER_PREFIX": "oidc:", "APF_JWT_GROUPS_PREFIX": "idp/"})
    r = build_resolver(s)
    token = jwt.encode(claims(groups=["ops", "system:masters"]), SECRET, algorithm="HS256")
    attrs = r(environ(HTTP_AUTHORIZATION=bearer(token)))
    assert (attrs.user, attrs.groups) == ("oidc:alice", ("idp/ops", "idp/system:masters", *AUTH))


@pytest.mark.parametrize("var,value,words", [
    ("APF_JWT_GROUPS_PREFIX", "system:", "reserved system: namespace"),
    ("APF_JWT_USER_PREFIX", "system:oidc:", "reserved system: namespace"),
    ("APF_JWT_GROUPS_PREFIX", "sys", "reserved system: namespace"),
    ("APF_JWT_USER_PREFIX", "a b", "without blanks"),
    ("APF_JWT_USER_PREFIX", "x" * 65, "at most 64"),
    ("APF_JWT_LEEWAY", "-1", "from 0 to 600"),
    ("APF_JWT_LEEWAY", "soon", "from 0 to 600"),
])
def test_bad_prefix_or_leeway_settings(secret_file, var, value, words):
    with pytest.raises(SettingsError) as e:
        load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": secret_file, var: value})
    assert var in str(e.value) and words in str(e.value), str(e.value)
    with pytest.raises(SettingsError, match=f"{var}.*set APF_JWT_KEY too"):
        load_settings({"APF_USER_FROM": "jwt-sub", var: "oidc:"})


def test_one_verification_per_request_when_exp_falls_between_two_reads(secret_file):
    """Issue 25 item 2: shape_key and the classification each asked the verifier; with exp
    between the two, the anonymous shape was cached under alice's key, and a fresh valid token
    of alice was then classified system:anonymous. The clock steps one second per reading."""
    t0 = int(NOW)
    clock = [t0 - 1.0]

    def tick() -> float:
        clock[0] += 1.0
        return clock[0]

    mw = _middleware(RequestInfoResolver(user_from=("jwt-sub",),
                                         jwt_verifier=hs_verifier(secret_file, clock=tick)))
    ending = jwt.encode(claims(exp=t0 + 1), SECRET, algorithm="HS256")  # valid at t0 only
    shape = mw.shape_of(environ(HTTP_AUTHORIZATION=bearer(ending)))
    assert shape.attrs.user == "alice"  # the identity the shape key holds
    fresh = jwt.encode(claims(exp=t0 + 3600), SECRET, algorithm="HS256")
    assert mw.shape_of(environ(HTTP_AUTHORIZATION=bearer(fresh))).attrs.user == "alice"
    # and the other way round: nbf reached between two reads files nobody's shape as alice's
    clock[0] = t0 - DEFAULT_LEEWAY_S - 2.0
    mw = _middleware(RequestInfoResolver(user_from=("jwt-sub",),
                                         jwt_verifier=hs_verifier(secret_file, clock=tick)))
    starting = jwt.encode(claims(nbf=t0), SECRET, algorithm="HS256")
    assert mw.shape_of(environ(HTTP_AUTHORIZATION=bearer(starting))).attrs.user == (
        "system:anonymous")
    garbage = mw.shape_of(environ(HTTP_AUTHORIZATION="Bearer not.a.token"))
    assert garbage.attrs.user == "system:anonymous"


def test_nbf_has_a_leeway_and_a_token_not_valid_yet_is_verified_once(secret_file,
                                                                     monkeypatch):
    """Issue 25 item 3: an identity provider whose clock runs a few seconds ahead made fresh
    tokens anonymous, and each such request paid a signature check again."""
    from apf_gunicorn.flowcontrol import jwtauth

    clock = [NOW]
    early = jwt.encode(claims(nbf=int(NOW) + 5), SECRET, algorithm="HS256")
    assert hs_verifier(secret_file, clock=lambda: clock[0]).identity(bearer(early))[0] == "alice"
    strict = hs_verifier(secret_file, leeway=0, clock=lambda: clock[0])
    decoded = []
    real_decode = jwtauth.jwt.decode
    monkeypatch.setattr(jwtauth.jwt, "decode",
                        lambda *a, **kw: decoded.append(1) or real_decode(*a, **kw))
    assert strict.check(bearer(early)) == (None, "the token is not valid yet (nbf)")
    for _ in range(3):
        assert strict.identity(bearer(early)) is None
    assert decoded == [1]  # verified once, remembered with its window
    clock[0] = NOW + 6
    assert strict.identity(bearer(early))[0] == "alice" and decoded == [1]
    s = load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": secret_file,
                       "APF_JWT_LEEWAY": "0"})
    assert s.jwt_leeway_s == 0 and build_resolver(s).jwt_verifier.leeway == 0
    assert load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": secret_file}
                         ).jwt_leeway_s == DEFAULT_LEEWAY_S


def test_garbage_tokens_do_not_push_verified_ones_out(secret_file):
    """Issue 25 item 5: failures were cached in the same 4096 entries as verified tokens."""
    from apf_gunicorn.flowcontrol.jwtauth import DEFAULT_CACHE_SIZE, DEFAULT_FAILURE_CACHE_SIZE

    v = hs_verifier(secret_file)
    good = bearer(jwt.encode(claims(), SECRET, algorithm="HS256"))
    assert v.identity(good)[0] == "alice"
    (digest,) = v.cached_digests()
    forged = jwt.encode(claims(), b"x" * 32, algorithm="HS256")
    for i in range(DEFAULT_CACHE_SIZE + 1):
        assert v.identity(f"Bearer {forged}{i}") is None
    assert v.cached_digests() == [digest]
    assert len(v.failure_digests()) == DEFAULT_FAILURE_CACHE_SIZE
    assert v.check(f"Bearer {forged}{DEFAULT_CACHE_SIZE}")[1].endswith("(a cached answer)")


def _der_public(private) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.mark.parametrize("kind", ["der", "der-cert", "der-private", "bom-pem", "bom-jwks",
                                  "text-before-pem", "base64-body", "utf16-pem"])
def test_a_key_in_another_form_is_refused_not_taken_for_a_secret(tmp_path, rsa_key, kind):
    """Issue 25 item 4: anything not starting with -----BEGIN or { became an HMAC secret that
    no token verifies with, and every user fell through to the next source silently."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    text = pem(rsa_key)
    jwks = json.dumps({"keys": [json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(
        rsa_key.public_key()))]}).encode()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idp")])
    start = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(rsa_key.public_key()).serial_number(1).not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=3650)).sign(rsa_key, hashes.SHA256()))
    body = b"".join(line for line in text.splitlines(keepends=True) if b"-----" not in line)
    content, words = {
        "der": (_der_public(rsa_key), "a DER (binary) public key: convert it to PEM"),
        "der-cert": (cert.public_bytes(serialization.Encoding.DER), "DER (binary) certificate"),
        "der-private": (rsa_key.private_bytes(serialization.Encoding.DER,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()),
                        "DER (binary) private key"),
        "bom-pem": (b"\xef\xbb\xbf" + text, "UTF-8 byte order mark"),
        "bom-jwks": (b"\xef\xbb\xbf" + jwks, "UTF-8 byte order mark"),
        "text-before-pem": (b"Public key of the IdP:\n" + text,
                            "PEM text after 23 bytes of something else ('Public key of the IdP:'"),
        "base64-body": (body, "base64 body of a public key without its PEM lines"),
        "utf16-pem": (text.decode().encode("utf-16"), "UTF-16"),
    }[kind]
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(SettingsError) as e:
        load_settings({"APF_USER_FROM": "jwt-sub", "APF_JWT_KEY": str(path)})
    assert "APF_JWT_KEY" in str(e.value) and str(path) in str(e.value)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("secret", [
    b"\x30" + bytes(range(1, 48)),            # binary, starts like DER, is not DER
    b"MIIB" + b"q" * 60 + b"\n",              # base64 text starting like a DER key's
])
def test_secrets_that_only_look_like_keys_still_load(tmp_path, secret):
    path = tmp_path / "secret"
    path.write_bytes(secret)
    assert load_jwt_key(str(path)).kind == "hmac"


def test_resolve_shape_takes_the_identity_from_a_paired_key_entry(secret_file):
    """Authorization both verified (jwt-sub) and hashed (header:Authorization): the shape key
    holds (identity, digest), and resolve_shape uses that identity, not a second check."""
    t0 = int(NOW)
    clock = [t0 - 1.0]

    def tick() -> float:
        clock[0] += 1.0
        return clock[0]

    r = RequestInfoResolver(user_from=("jwt-sub", "header:Authorization"),
                            jwt_verifier=hs_verifier(secret_file, clock=tick))
    env = environ(HTTP_AUTHORIZATION=bearer(jwt.encode(claims(exp=t0 + 1), SECRET,
                                                       algorithm="HS256")))
    key = r.shape_key(env.get)  # verified at t0: alice
    assert r.resolve_shape(env, key).user == "alice"
    assert r(env).user.startswith("key:")  # verified again at t0 + 1: expired, next source


@pytest.mark.parametrize("last", [b"\n", b"\r"])
def test_a_binary_secret_keeps_a_last_cr_or_lf_byte(tmp_path, last):
    """The secret was the file's bytes without trailing CR and LF, whatever the file: a binary
    secret ending in one (1 in 128 of ``openssl rand 32`` files) lost it, and no token
    signed with the real secret verified. Only a text secret (printable UTF-8) loses them."""
    secret = bytes(range(0x80, 0x80 + 31)) + last
    path = tmp_path / "secret"
    path.write_bytes(secret)
    v = JWTVerifier(load_jwt_key(str(path)))
    assert v.identity(bearer(jwt.encode(claims(), secret, algorithm="HS256"))) == \
        ("alice", ("ops", "dev", *AUTH))
    # a text secret of the same length still loses its line end (the secret_file fixture's too)
    text = b"x" * 32
    path.write_bytes(text + b"\r\n")
    v = JWTVerifier(load_jwt_key(str(path)))
    assert v.identity(bearer(jwt.encode(claims(), text, algorithm="HS256"))) == \
        ("alice", ("ops", "dev", *AUTH))
