"""APF_PF_HEADERS (issue 34 item 2): the X-Kubernetes-PF-FlowSchema-UID and
X-Kubernetes-PF-PriorityLevel-UID headers on every answer (on, the default, as Kubernetes
sends them), or on none (off: served responses, 429s and 503s alike; a 429 keeps its
Retry-After). Off changes nothing else: the response is byte for byte the one with the headers
on, less their two lines, on gthread and both ASGI workers (real servers)."""

from __future__ import annotations

import importlib.util
import re
import socket
from types import SimpleNamespace as NS

import pytest

from apf_gunicorn.admission.core import FS_UID_HEADER, PL_UID_HEADER, rejection_headers
from apf_gunicorn.gthread.pollreject import RejectionBytes
from apf_gunicorn.server.settings import SettingsError, load_settings
from tests.conftest import serve
from tests.test_middleware_headers import PF, app_with, middleware, run


def test_the_setting_is_on_by_default_and_says_what_it_allows() -> None:
    assert load_settings({}).pf_headers is True
    assert load_settings({"APF_PF_HEADERS": "on"}).pf_headers is True
    assert load_settings({"APF_PF_HEADERS": " OFF "}).pf_headers is False
    with pytest.raises(SettingsError) as ei:
        load_settings({"APF_PF_HEADERS": "no"})
    assert str(ei.value).startswith("invalid APF_PF_HEADERS='no': must be 'on'")
    assert "or 'off'" in str(ei.value)


def _quiet(mw):
    mw.ctx.pf_headers = False  # as boot.py sets it from the settings, before any route
    return mw


def test_off_hands_the_app_the_servers_own_start_response() -> None:
    seen = []

    def start_response(status, headers, exc_info=None):
        seen.append(headers)

    def app(environ, sr):
        seen.append(sr)
        return app_with([("Content-Type", "text/plain")])(environ, sr)

    run(_quiet(middleware(app)), start_response)
    assert seen == [start_response, [("Content-Type", "text/plain")]]


def test_off_leaves_them_out_of_429s_and_503s_which_keep_their_retry_after() -> None:
    mw = _quiet(middleware(app_with([])))
    on = middleware(app_with([]))
    shape, shape_on = mw.shape_of({"PATH_INFO": "/x"}), on.shape_of({"PATH_INFO": "/x"})
    assert shape.route.headers == [] and shape.route.raw_headers == []
    assert shape_on.route.headers == PF
    rejected = mw.reject_headers(shape.route)
    assert rejected == [h for h in on.reject_headers(shape_on.route) if h not in PF]
    assert ("Retry-After", "1") in rejected
    assert [h for h in mw.stopping_headers(shape.route) if h[0].startswith("X-Kubernetes")] == []
    # the poller's 429 (gthread): gunicorn's bytes of the same headers
    cfg = NS(is_ssl=False, secure_scheme_headers={}, forwarded_allow_ips=[],
             sendfile=False, strip_header_spaces=False, protocol="http")
    data, _ = RejectionBytes(cfg).get(shape.route, 1, (1, 1), "GET", True)
    assert b"Retry-After: 1\r\n" in data and b"X-Kubernetes" not in data
    assert rejection_headers(shape_on.route, 1)[-2:] == PF


def _raw_get(port: int, path: str) -> bytes:
    """The whole response to one GET on a fresh connection, its Date value masked."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return re.sub(rb"(?im)^(date): [^\r\n]*", rb"\1: -", data)


_WORKERS = [None, "apf_gunicorn.asgi.UvicornWorker", "apf_gunicorn.asgi.ASGIWorker"]


@pytest.mark.server
@pytest.mark.parametrize("worker", _WORKERS, ids=["gthread", "uvicorn", "gunicorn-asgi"])
def test_off_removes_exactly_the_two_lines_on_a_real_server(tmp_path, worker) -> None:
    if worker and worker.endswith("UvicornWorker") and not importlib.util.find_spec(
            "uvicorn_worker"):
        pytest.skip("needs uvicorn-worker")
    conf = {"worker": worker, "workers": 1, "boot_timeout": 60.0}
    answers = {}
    for value in ("on", "off"):
        with serve(tmp_path, env={"APF_PF_HEADERS": value}, **conf) as srv:
            answers[value] = _raw_get(srv.port, "/hello")
    on, off = answers["on"], answers["off"]
    assert on.startswith(b"HTTP/1.1 200 ") and on.endswith(b"\r\n\r\nhello\n"), on
    pf = [line for line in on.split(b"\r\n") if line.lower().startswith(b"x-kubernetes-pf-")]
    # on: both headers, as every answer carried them before the setting existed
    assert [line.split(b":")[0].lower() for line in pf] == [FS_UID_HEADER.lower().encode(),
                                                            PL_UID_HEADER.lower().encode()]
    assert all(line.split(b": ", 1)[1] for line in pf)  # their uids
    assert off == b"\r\n".join(line for line in on.split(b"\r\n") if line not in pf)


@pytest.mark.parametrize("server", ["gthread", "uvicorn", "gunicorn-asgi"])
def test_bench_pf_headers_drives_each_servers_header_code(server) -> None:
    """benchmarks/bench_pf_headers.py's loop (what it runs under callgrind) runs as written."""
    from benchmarks.bench_pf_headers import respond

    if server == "uvicorn":
        pytest.importorskip("h11")
    respond(server, 2, True)
    respond(server, 2, False)
