"""The shape key without trusted proxies (flowcontrol/requestinfo.py): ``proxy``'s user header
enters it only as "present or not" (read only to warn that it is ignored). When the same
header is also an identity source of its own (``header:X-Remote-User``, an unverified key
whose digest names the flow, or ``APF_USER_HEADER=Authorization`` beside ``jwt-sub``), the
key must still hold what that source reads: else the middleware's shape cache files every
client under the first one's identity and flow.
"""

from __future__ import annotations

from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver


def _environ(value: str) -> dict:
    return {"REQUEST_METHOD": "GET", "PATH_INFO": "/x", "QUERY_STRING": "",
            "REMOTE_ADDR": "10.0.0.9", "HTTP_X_REMOTE_USER": value}


def test_a_header_source_on_the_user_header_keeps_its_digest_in_the_shape_key():
    resolver = RequestInfoResolver(user_from=("proxy", "header:X-Remote-User"))
    a, b = _environ("key-of-alice"), _environ("key-of-bob")
    assert resolver(a).user != resolver(b).user  # two clients, two flows
    # so the middleware's cache must not file them under one key
    assert resolver.shape_key(a.get) != resolver.shape_key(b.get)
    # and no secret value enters the key
    assert "key-of-alice" not in repr(resolver.shape_key(a.get))


def test_the_untrusted_user_header_alone_is_only_present_or_not():
    resolver = RequestInfoResolver(user_from=("proxy", "remote_user"))
    a, b = _environ("alice"), _environ("bob")
    assert resolver(a).user == resolver(b).user == "system:anonymous"
    assert resolver.shape_key(a.get) == resolver.shape_key(b.get)


def test_a_verified_token_in_the_user_header_is_still_its_identity_in_the_shape(tmp_path):
    import time

    import jwt

    from apf_gunicorn.flowcontrol.jwtauth import JWTVerifier, load_jwt_key

    secret = b"0123456789abcdef0123456789abcdef-test-secret"
    path = tmp_path / "secret"
    path.write_bytes(secret)
    verifier = JWTVerifier(load_jwt_key(str(path)))
    resolver = RequestInfoResolver(user_header="Authorization", user_from=("proxy", "jwt-sub"),
                                   jwt_verifier=verifier)
    token = jwt.encode({"sub": "alice", "exp": int(time.time()) + 3600}, secret,
                       algorithm="HS256")
    env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/x", "QUERY_STRING": "",
           "REMOTE_ADDR": "10.0.0.9", "HTTP_AUTHORIZATION": "Bearer " + token}
    key = resolver.shape_key(env.get)
    # the middleware classifies through resolve_shape with the key it cached the shape under
    assert resolver.resolve_shape(env, key).user == resolver(env).user == "alice"
