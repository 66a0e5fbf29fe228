"""APF_USER_FROM: each identity source, its limits, and that unverified identities name the
flow only (a forged one never matches a FlowSchema written for a real user or group)."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apf_gunicorn.flowcontrol import identity
from apf_gunicorn.flowcontrol.identity import (
    MAX_SUBJECT_LENGTH,
    client_address,
    jwt_subject,
    key_digest,
    parse_user_from,
)
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.matching import Classifier
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.server.settings import SettingsError, load_settings

UNAUTH = ("system:unauthenticated",)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(claims, header=b'{"alg":"HS256","typ":"JWT"}', sig="c2ln") -> str:
    body = claims if isinstance(claims, bytes) else json.dumps(claims).encode()
    return f"{b64(header)}.{b64(body)}.{sig}"


def environ(**extra):
    env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/x", "QUERY_STRING": "",
           "REMOTE_ADDR": "192.0.2.1"}
    env.update(extra)
    return env


# --- parse_user_from / APF_USER_FROM ----------------------------------------------------------

def test_parse_keeps_order_and_normalizes():
    assert parse_user_from(" Proxy, header:X-Api-Key ,jwt-sub,address,proxy") == (
        "proxy", "header:X-Api-Key", "jwt-sub", "address")
    assert parse_user_from("remote_user") == ("remote_user",)


@pytest.mark.parametrize("text, words", [
    ("addr", "unknown identity source 'addr'"),
    ("header:", "header: needs an HTTP header name"),
    ("header:X Api", "header: needs an HTTP header name"),
    (" , ", "names no identity source"),
])
def test_parse_errors(text, words):
    with pytest.raises(ValueError, match=words):
        parse_user_from(text)


def test_setting_default_and_error():
    assert load_settings({}).user_from == ("proxy", "remote_user")
    assert load_settings({"APF_USER_FROM": "address"}).user_from == ("address",)
    with pytest.raises(SettingsError) as exc:
        load_settings({"APF_USER_FROM": "proxy,cookie"})
    assert str(exc.value).startswith("invalid APF_USER_FROM='proxy,cookie': unknown identity "
                                     "source 'cookie'")


# --- jwt-sub -----------------------------------------------------------------------------------

def test_jwt_subject_decodes_sub_without_verifying():
    assert jwt_subject("Bearer " + token({"sub": "alice", "iat": 1})) == "alice"
    assert jwt_subject("bearer " + token({"sub": "bob"}, sig="")) == "bob"  # unsigned too
    assert jwt_subject("Bearer " + token({"sub": "é-ü"})) == "é-ü"


@pytest.mark.parametrize("value", [
    None, 7, "", "Bearer", "Basic dXNlcjpwdw==", "Bearer abc", "Bearer a.b", "Bearer a.b.c.d",
    "Bearer " + token({"sub": 5}), "Bearer " + token({"name": "x"}), "Bearer " + token(["x"]),
    "Bearer " + token({"sub": ""}), "Bearer " + token(b"not json"),
    "Bearer " + token(b"\xff\xfe"),                      # not UTF-8
    "Bearer x.eyJzdWIiOiJhIn0!.y",                       # not base64url
    "Bearer x.e.y",                                      # bad padding length
    "Bearer " + token(b"[" * 5000 + b"]" * 5000),        # deep nesting, over the size limit
    "Bearer " + token(b"[" * 2000 + b"]" * 2000),        # deep nesting within it
    "Bearer " + "a" * 9000,                              # over the length limit
    "Bearer " + token({"sub": "a"}) + "," + token({"sub": "b"}),  # two headers joined
])
def test_jwt_subject_rejects(value):
    assert jwt_subject(value) == ""


def test_jwt_subject_control_characters_are_replaced():
    assert jwt_subject("Bearer " + token({"sub": "a\nb\r,c\x00"})) == "a\ufffdb\ufffd,c\ufffd"


def test_jwt_subject_is_bounded():
    assert jwt_subject("Bearer " + token({"sub": "s" * 5000})) == ""  # payload too long
    long_sub = "s" * 1000
    assert jwt_subject("Bearer " + token({"sub": long_sub})) == "s" * MAX_SUBJECT_LENGTH


@given(st.text(max_size=300))
def test_jwt_subject_never_raises(text):
    jwt_subject("Bearer " + text)
    jwt_subject("Bearer x." + text + ".y")


# --- header:NAME --------------------------------------------------------------------------------

def test_key_digest_is_stable_and_hides_the_value():
    d = key_digest("s3cr3t-api-key")
    assert d == key_digest("s3cr3t-api-key") and len(d) == 16 and "s3cr3t" not in d
    assert d != key_digest("s3cr3t-api-kez")
    assert key_digest("\u20ac") == key_digest("\u20ac")  # not latin-1: still a digest


# --- address ------------------------------------------------------------------------------------

def trusts(*addrs):
    return lambda a: a in addrs


@pytest.mark.parametrize("remote, xff, expected", [
    ("192.0.2.9", "", "192.0.2.9"),
    ("192.0.2.9", "203.0.113.1", "192.0.2.9"),             # untrusted peer: XFF ignored
    ("10.0.0.1", "203.0.113.1", "203.0.113.1"),            # trusted peer
    ("10.0.0.1", "198.51.100.7, 203.0.113.1, 10.0.0.2", "203.0.113.1"),  # skip trusted hops
    ("10.0.0.1", "10.0.0.2", "10.0.0.2"),                  # all trusted: the left-most
    ("10.0.0.1", "garbage, 203.0.113.1", "203.0.113.1"),
    ("10.0.0.1", "203.0.113.1, garbage", "10.0.0.1"),      # stops at the hop that added it
    ("10.0.0.1", "2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("::ffff:192.0.2.5", "", "192.0.2.5"),
    ("", "", ""),                                          # Unix socket, no proxy
    ("not an address", "", ""),
])
def test_client_address(remote, xff, expected):
    assert client_address(remote, xff, trusts("10.0.0.1", "10.0.0.2")) == expected


# --- the resolver -------------------------------------------------------------------------------

def test_default_sources_are_todays_behaviour():
    r = RequestInfoResolver(trusted_proxies=["192.0.2.1"])
    assert r.user_from == ("proxy", "remote_user")
    assert r(environ(HTTP_X_REMOTE_USER="alice")).user == "alice"
    assert r(environ(REMOTE_USER="bob")).groups == ("system:authenticated",)
    anon = r(environ(HTTP_AUTHORIZATION="Bearer " + token({"sub": "x"})))
    assert (anon.user, anon.groups) == ("system:anonymous", UNAUTH)


def test_first_remote_user_wins_groups_take_all():
    r = RequestInfoResolver(trusted_proxies=["192.0.2.1"])
    # gunicorn joins repeated headers with ","
    a = r(environ(HTTP_X_REMOTE_USER="alice,bob", HTTP_X_REMOTE_GROUP="g1,g2,g3"))
    assert a.user == "alice"
    assert a.groups == ("g1", "g2", "g3", "system:authenticated")
    assert r(environ(HTTP_X_REMOTE_USER=" ,bob")).user == "system:anonymous"


@pytest.mark.parametrize("user_from, extra, user", [
    ("header:X-Api-Key", {"HTTP_X_API_KEY": "k1"}, "key:" + key_digest("k1")),
    ("jwt-sub", {"HTTP_AUTHORIZATION": "Bearer " + token({"sub": "carol"})}, "jwt:carol"),
    ("address", {}, "addr:192.0.2.1"),
    ("remote_user", {"REMOTE_USER": "dave"}, "dave"),
])
def test_each_source(user_from, extra, user):
    r = RequestInfoResolver(user_from=parse_user_from(user_from))
    attrs = r(environ(**extra))
    assert attrs.user == user
    if user_from == "remote_user":
        assert attrs.groups == ("system:authenticated",)
    else:
        assert attrs.groups == UNAUTH  # unverified: never authenticated
    assert "k1" not in attrs.user


def test_sources_in_order_and_fallthrough():
    r = RequestInfoResolver(trusted_proxies=["192.0.2.1"],
                            user_from=("proxy", "jwt-sub", "header:X-Api-Key", "address"))
    jwt = "Bearer " + token({"sub": "carol"})
    assert r(environ(HTTP_X_REMOTE_USER="alice", HTTP_AUTHORIZATION=jwt)).user == "alice"
    assert r(environ(HTTP_AUTHORIZATION=jwt, HTTP_X_API_KEY="k")).user == "jwt:carol"
    assert r(environ(HTTP_AUTHORIZATION="Bearer junk", HTTP_X_API_KEY="k")).user.startswith(
        "key:")
    assert r(environ(HTTP_X_FORWARDED_FOR="203.0.113.4")).user == "addr:203.0.113.4"
    assert r(environ(REMOTE_ADDR="198.51.100.1", HTTP_X_FORWARDED_FOR="203.0.113.4")).user == (
        "addr:198.51.100.1")  # an untrusted peer's X-Forwarded-For is ignored
    r2 = RequestInfoResolver(user_from=("jwt-sub",))
    assert r2(environ()).user == "system:anonymous"  # nothing found: anonymous


def test_environ_keys_cover_every_input():
    base = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING")
    # no trusted proxy: the user header is read only to warn that it is ignored
    assert RequestInfoResolver().environ_keys == (*base, "HTTP_X_REMOTE_USER", "REMOTE_USER")
    assert RequestInfoResolver(trusted_proxies=["10.0.0.0/8"]).environ_keys == (
        *base, "REMOTE_ADDR", "HTTP_X_REMOTE_USER", "HTTP_X_REMOTE_GROUP", "REMOTE_USER")
    r = RequestInfoResolver(trusted_proxies=["10.0.0.0/8"], user_header="X-User",
                            user_from=("address", "header:X-Api-Key", "jwt-sub", "proxy"))
    assert r.environ_keys == (*base, "REMOTE_ADDR", "HTTP_X_FORWARDED_FOR", "HTTP_X_API_KEY",
                              "HTTP_AUTHORIZATION", "HTTP_X_USER", "HTTP_X_REMOTE_GROUP")
    assert RequestInfoResolver(user_from=("address",)).environ_keys == (*base, "REMOTE_ADDR")


EXEMPT_ALICE = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: exempt}
spec: {type: Exempt, exempt: {}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: root}
spec:
  matchingPrecedence: 50
  priorityLevelConfiguration: {name: exempt}
  rules:
  - subjects: [{kind: User, user: {name: alice}}, {kind: Group, group: {name: ops}}]
    nonResourceRules: [{verbs: ["*"], nonResourceURLs: ["*"]}]
"""


@pytest.mark.parametrize("user_from", ["jwt-sub", "header:X-Remote-User", "address"])
def test_forged_identity_is_never_exempt(tmp_path, user_from):
    path = tmp_path / "apf.yaml"
    path.write_text(EXEMPT_ALICE)
    classifier = Classifier(load_configuration(str(path)))
    real = RequestInfoResolver(trusted_proxies=["192.0.2.1"])
    assert classifier.classify(real(environ(HTTP_X_REMOTE_USER="alice"))).flow_schema.name == (
        "root")
    assert classifier.classify(real(environ(HTTP_X_REMOTE_USER="bob", HTTP_X_REMOTE_GROUP="ops"))
                               ).flow_schema.name == "root"
    r = RequestInfoResolver(user_from=parse_user_from(user_from))
    forged = environ(HTTP_AUTHORIZATION="Bearer " + token({"sub": "alice", "groups": ["ops"]}),
                     HTTP_X_REMOTE_USER="alice", HTTP_X_REMOTE_GROUP="ops")
    attrs = r(forged)
    assert attrs.groups == UNAUTH and attrs.user.split(":", 1)[0] in ("jwt", "key", "addr")
    c = classifier.classify(attrs)
    assert (c.flow_schema.name, c.priority_level.name) == ("catch-all", "catch-all")


def test_prefixes_are_the_documented_ones():
    assert (identity.KEY_PREFIX, identity.JWT_PREFIX, identity.ADDRESS_PREFIX) == (
        "key:", "jwt:", "addr:")


def test_shape_key_reads_exactly_the_environ_keys():
    r = RequestInfoResolver(trusted_proxies=["10.0.0.0/8"],
                            user_from=("proxy", "address", "header:X-Api-Key"))
    env = environ(HTTP_X_API_KEY="k", HTTP_X_FORWARDED_FOR="1.2.3.4", OTHER="x")
    assert r.shape_key(env.get)[:-1] == tuple(env.get(k) for k in r.environ_keys[:-1])
    # the API key only as its digest (tests/test_jwt_identity.py: no secret in any cache)
    assert r.shape_key(env.get)[-1] == identity.value_digest("k")
    assert len(r.shape_key(env.get)) == 8


def test_trusted_proxies_setting_accepts_unix():
    """The README promised `unix` (a proxy on the same host), and the resolver took it, but
    the setting refused it."""
    from apf_gunicorn.server.resolver import build_resolver

    s = load_settings({"APF_TRUSTED_PROXIES": "10.0.0.0/8, UNIX"})
    assert [str(n) for n in s.trusted_proxies] == ["10.0.0.0/8", "unix"]
    r = build_resolver(s)
    assert r(environ(REMOTE_ADDR="", HTTP_X_REMOTE_USER="alice")).user == "alice"
    with pytest.raises(SettingsError, match="not an IP address, a CIDR or 'unix'"):
        load_settings({"APF_TRUSTED_PROXIES": "unixx"})


def test_identity_headers_from_an_untrusted_peer_are_warned_about(caplog, monkeypatch):
    """Issue 25 item 18: without APF_TRUSTED_PROXIES, X-Remote-User was dropped without a word
    (alice and a flooding bob became one anonymous flow). A warning names the peer and the
    setting, at most once a minute; the shape key holds only whether the header is there."""
    import logging

    clock = [100.0]
    monkeypatch.setattr(logging.getLogger("apf_gunicorn"), "propagate", True)  # to caplog
    caplog.set_level(logging.WARNING, logger="apf_gunicorn.flowcontrol.requestinfo")
    r = RequestInfoResolver(clock=lambda: clock[0])
    assert r(environ()).user == "system:anonymous" and not caplog.records
    for user in ("alice", "bob"):
        assert r(environ(REMOTE_ADDR="127.0.0.1", HTTP_X_REMOTE_USER=user)).user == (
            "system:anonymous")
    (record,) = caplog.records
    text = record.getMessage()
    assert "X-Remote-User from peer 127.0.0.1 ignored" in text, text
    assert "APF_TRUSTED_PROXIES (empty)" in text and "APF_TRUSTED_PROXIES=127.0.0.1" in text
    clock[0] += 61
    r(environ(REMOTE_ADDR="", HTTP_X_REMOTE_USER="alice"))  # a Unix-socket peer
    assert len(caplog.records) == 2
    assert "a peer on a Unix socket" in caplog.records[1].getMessage()
    assert "APF_TRUSTED_PROXIES=unix" in caplog.records[1].getMessage()
    # trusted proxies set, another peer: the same warning, naming the list
    clock[0] += 61
    t = RequestInfoResolver(trusted_proxies=["10.0.0.0/8"], clock=lambda: clock[0])
    assert t(environ(REMOTE_ADDR="192.0.2.9", HTTP_X_REMOTE_USER="alice")).user == (
        "system:anonymous")
    assert "peer 192.0.2.9 ignored" in caplog.records[2].getMessage()
    assert "APF_TRUSTED_PROXIES (10.0.0.0/8)" in caplog.records[2].getMessage()
    assert t(environ(REMOTE_ADDR="10.1.1.1", HTTP_X_REMOTE_USER="alice")).user == "alice"
    assert len(caplog.records) == 3
    # the name never enters the shape key: shapes split only on the header's presence
    keys = {r.shape_key(environ(HTTP_X_REMOTE_USER=u).get) for u in ("alice", "bob")}
    assert len(keys) == 1 and "alice" not in repr(keys)
    assert r.shape_key(environ().get) not in keys


def test_start_warning_when_proxy_can_never_answer():
    from apf_gunicorn.server import startup

    # the defaults: remote_user still names users, so a note at info, not a warning
    ((level, message),) = startup.identity_notes(load_settings({}))
    assert level == logging.INFO
    assert "APF_USER_FROM=proxy,remote_user (the default) never names anybody" in message
    assert "APF_TRUSTED_PROXIES is empty" in message and "X-Remote-User" in message
    ((level, message),) = startup.identity_notes(load_settings({"APF_USER_FROM": "proxy"}))
    assert level == logging.WARNING
    assert "every request is system:anonymous" in message
    ((level, _),) = startup.identity_notes(load_settings({"APF_USER_FROM": "proxy,jwt-sub"}))
    assert level == logging.WARNING  # jwt-sub without a key names flows, nobody verified
    assert startup.identity_notes(load_settings({"APF_TRUSTED_PROXIES": "10.0.0.1"})) == []
    assert startup.identity_notes(load_settings({"APF_USER_FROM": "remote_user"})) == []
    ((level, message),) = startup.identity_notes(load_settings({"APF_USER_FROM":
                                                                "address,jwt-sub,header:X-Key"}))
    assert level == logging.WARNING
    assert message.startswith("identity sources jwt-sub,header:X-Key of APF_USER_FROM="
                              "address,jwt-sub,header:X-Key are asked only for peers on a Unix "
                              "socket"), message
    assert startup.identity_notes(load_settings({"APF_USER_FROM": "jwt-sub,address"})) == []
