"""Settings validation: every APF_* variable, defaults, and the error texts."""

import pytest

from apf_gunicorn.server.settings import SettingsError, default_concurrency_limit, load_settings


def test_defaults():
    s = load_settings({}, workers=4, threads=16)
    assert s.config_path is None
    assert s.concurrency_limit == default_concurrency_limit(4, 16) == 32
    assert s.queue_wait_limit_ns == 15_000_000_000
    assert s.trusted_proxies == ()
    assert (s.user_header, s.group_header) == ("X-Remote-User", "X-Remote-Group")
    assert s.request_info is None and s.routes is None
    assert s.admin_bind == ("127.0.0.1", 9180)
    assert s.metrics_prefix == "apf"


def test_values(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("")
    s = load_settings({
        "APF_CONFIG": str(cfg), "APF_CONCURRENCY_LIMIT": "12", "APF_QUEUE_WAIT_LIMIT": "2.5",
        "APF_TRUSTED_PROXIES": "10.0.0.0/8, 127.0.0.1,::1", "APF_USER_HEADER": "X-User",
        "APF_REQUEST_INFO": "pkg.mod:func", "APF_ADMIN_BIND": "off",
        "APF_METRICS_PREFIX": "my_apf", "APF_INSTANCE": "t1",
    })
    assert s.concurrency_limit == 12
    assert s.queue_wait_limit_ns == 2_500_000_000
    assert [str(n) for n in s.trusted_proxies] == ["10.0.0.0/8", "127.0.0.1/32", "::1/128"]
    assert s.user_header == "X-User"
    assert s.admin_bind is None
    assert load_settings({"APF_ADMIN_BIND": "[::1]:0"}).admin_bind == ("::1", 0)


@pytest.mark.parametrize("var,value,allowed", [
    ("APF_CONFIG", "/nonexistent/x.yaml", "existing YAML file"),
    ("APF_CONCURRENCY_LIMIT", "0", "integer number of seats from 1"),
    ("APF_CONCURRENCY_LIMIT", "ten", "integer number of seats from 1"),
    ("APF_QUEUE_WAIT_LIMIT", "-1", "greater than 0"),
    ("APF_QUEUE_WAIT_LIMIT", "abc", "greater than 0"),
    ("APF_TRUSTED_PROXIES", "10.0.0.0/8,bogus", "'bogus' is not an IP address"),
    ("APF_USER_HEADER", "X User", "HTTP header name"),
    ("APF_GROUP_HEADER", "X:G", "HTTP header name"),
    ("APF_REQUEST_INFO", "nocolon", "module:callable"),
    ("APF_ROUTES", "/nonexistent/routes.yaml", "existing YAML file"),
    ("APF_ADMIN_BIND", "localhost", "host:port"),
    ("APF_ADMIN_BIND", "127.0.0.1:99999", "host:port"),
    ("APF_METRICS_PREFIX", "9bad", "Prometheus name prefix"),
    ("APF_INSTANCE", "a/b", "at most 40 characters"),
    ("APF_SERVICE_ESTIMATE", "fast", "'learn'"),
    ("APF_SERVICE_ESTIMATE", "-1ms", "from 0 to 60s"),
    ("APF_SERVICE_ESTIMATE", "61s", "from 0 to 60s"),
    ("APF_SERVICE_ESTIMATE", "nan", "from 0 to 60s"),
    ("APF_FAIRNESS", "fifo", "'kubernetes'"),
    ("APF_FAIRNESS", "max-min", "or 'maxmin'"),
    ("APF_ACCEPT_GRACE", "-0.1", "from 0 to 10"),
    ("APF_ACCEPT_GRACE", "soon", "from 0 to 10"),
    ("APF_ACCEPT_GRACE", "11", "from 0 to 10"),
])
def test_bad_values_name_variable_value_and_allowed(var, value, allowed):
    with pytest.raises(SettingsError) as ei:
        load_settings({var: value})
    msg = str(ei.value)
    assert msg.startswith(f"invalid {var}={value!r}: ")
    assert allowed in msg


@pytest.mark.parametrize("value, ns, learn", [
    (None, 3_000_000, True), ("learn", 3_000_000, True), ("LEARN", 3_000_000, True),
    ("3ms", 3_000_000, False), ("0.25", 250_000_000, False), ("1m", 60_000_000_000, False),
    ("0", 0, False),
])
def test_service_estimate_is_learnt_unless_fixed(value, ns, learn):
    s = load_settings({} if value is None else {"APF_SERVICE_ESTIMATE": value})
    assert (s.service_estimate_ns, s.learn_service) == (ns, learn)


@pytest.mark.parametrize("value, fairness", [
    (None, "maxmin"), ("", "maxmin"), ("kubernetes", "kubernetes"), ("Kubernetes", "kubernetes"),
    ("maxmin", "maxmin"), ("MaxMin", "maxmin"), (" maxmin ", "maxmin"),
])
def test_fairness_setting(value, fairness):
    """APF_FAIRNESS: maxmin unless set (an empty value is unset), any case."""
    s = load_settings({} if value is None else {"APF_FAIRNESS": value})
    assert s.fairness == fairness


@pytest.mark.parametrize("value,workers,threads,start,bounds", [
    ("auto", 2, 20, 20, (1, 20)),  # plain auto: 1 to the default (half the threads)
    ("AUTO:2-64", 2, 20, 20, (2, 64)),
    ("auto:2-4", 2, 20, 4, (2, 4)),  # the default, within the bounds
    ("auto:30-64", 2, 20, 30, (30, 64)),
    (" auto: 3 - 5 ", 1, 1, 3, (3, 5)),
])
def test_auto_concurrency_limit(value, workers, threads, start, bounds):
    s = load_settings({"APF_CONCURRENCY_LIMIT": value}, workers=workers, threads=threads)
    assert (s.concurrency_limit, s.concurrency_auto) == (start, bounds)
    assert s.concurrency_limit_set and s.adaptive_tick_s == 1.0
    assert load_settings({}).concurrency_auto is None  # the default stays a number
    assert load_settings({"APF_CONCURRENCY_LIMIT": "12"}).concurrency_auto is None


@pytest.mark.parametrize("var,value", [
    ("APF_CONCURRENCY_LIMIT", "auto:0-8"), ("APF_CONCURRENCY_LIMIT", "auto:9-8"),
    ("APF_CONCURRENCY_LIMIT", "auto:8"), ("APF_CONCURRENCY_LIMIT", "auto:a-b"),
    ("APF_CONCURRENCY_LIMIT", "automatic"), ("APF_CONCURRENCY_LIMIT", "auto:1-2000000"),
    ("APF_ADAPTIVE_TICK", "0"), ("APF_ADAPTIVE_TICK", "soon"),
])
def test_bad_auto_settings(var, value):
    with pytest.raises(SettingsError) as e:
        load_settings({var: value}, workers=2, threads=8)
    assert e.value.var == var and e.value.value == value.strip()
    assert ("auto:MIN-MAX" if var == "APF_CONCURRENCY_LIMIT" else "0.05 to 60") in str(e.value)
    load_settings({"APF_ADAPTIVE_TICK": "0.25"})  # a short tick for tests is fine


@pytest.mark.parametrize("env, builtin", [
    ({}, "webapp"),  # proxy,remote_user: verified
    ({"APF_USER_FROM": "remote_user"}, "webapp"),
    ({"APF_USER_FROM": "proxy,address"}, "webapp"),  # signed-in users and address flows
    ({"APF_USER_FROM": "address"}, "public"),
    ({"APF_USER_FROM": "header:X-Api-Key,address"}, "public"),
    ({"APF_USER_FROM": "jwt-sub"}, "public"),  # unverified tokens name flows, not users
    ({"APF_USER_FROM": "address", "APF_REQUEST_INFO": "mod:fn"}, "webapp"),  # a hook may sign in
])
def test_the_builtin_configuration_follows_who_can_be_signed_in(env, builtin):
    s = load_settings(env)
    assert (s.config_path, s.builtin, s.config_source) == (None, builtin, f"builtin:{builtin}")
    s = load_settings({**env, "APF_CONFIG": "builtin:kubernetes"})
    assert (s.builtin, s.config_source) == (builtin, "builtin:kubernetes")  # APF_CONFIG wins


def test_a_verified_jwt_source_keeps_the_webapp_configuration(tmp_path):
    key = tmp_path / "secret"
    key.write_bytes(b"k" * 32)
    s = load_settings({"APF_USER_FROM": "jwt-sub,address", "APF_JWT_KEY": str(key)})
    assert s.config_source == "builtin:webapp"
