"""benchmarks/bench_asgi.py in a short form, so that it cannot rot: real gunicorn servers with
uvicorn's workers (bare, and with ``limit_concurrency``) serve benchmarks/effect_asgi_app.py
against its backend process; every window reports its numbers, the peer's 503s are counted,
the table has a row per server, and the picture is drawn when matplotlib is installed. Ours
(``apf_gunicorn.asgi``) runs the same way, and is skipped while it is missing. Latencies and
rates are reported, never asserted: on a shared machine they are not facts of the code."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_asgi",
                                                  ROOT / "benchmarks" / "bench_asgi.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_asgi", mod)
    spec.loader.exec_module(mod)
    return mod


def short(bench, **kw):
    # 2 s alone (counted from 0.5 s), 3 s of flood (counted from its 1 s)
    return bench.Options(alone=2.0, flood=3.0, warmup=0.5, settle=1.0, **kw)


def test_short_run_of_bare_and_limited_uvicorn_workers(bench, tmp_path):
    pytest.importorskip("uvicorn_worker")
    opts = short(bench)
    lines: list[str] = []
    events, numbers = bench.measure(["bare", "limited"], opts, tmp_path, out=lines.append)
    assert list(numbers) == ["bare", "limited"], lines
    for name in ("bare", "limited"):
        for window in ("alone", "flood"):
            assert any(line.startswith(f"{name:8} {window}") for line in lines), lines
        alone = numbers[name]["alone"]
        assert alone["light_n"] > 0 and math.isfinite(alone["light_p99_ms"]), (name, alone)
    bare = numbers["bare"]["flood"]
    # bare uvicorn workers queue everything: every answer is a 200
    assert set(bare["light_statuses"]) == {"200"} and set(bare["flood_statuses"]) == {"200"}
    assert bare["flood_200_per_s"] > 0 and numbers["bare"]["alone"]["flood_statuses"] == {}
    # 32 flood connections over 2 workers: each holds more than limit_concurrency=4 open
    assert numbers["limited"]["flood"]["flood_statuses"].get("503", 0) > 0, numbers["limited"]
    assert bench.verdicts(numbers, opts) == []  # ours did not run: nothing decided
    table = bench.table(numbers, opts).splitlines()
    assert len(table) == 4 and "limit_concurrency=4" in table[3] and "503" in table[3], table
    if importlib.util.find_spec("matplotlib") is None:
        return
    out = tmp_path / "asgi.png"
    bench.plot(events, numbers, opts, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("worker", ["asgi"])  # (--apf-worker uvicorn: the same code, another -k)
def test_short_run_of_ours(bench, tmp_path, worker):
    opts = short(bench, apf_worker=worker)
    _args, missing = bench.worker_args("apf", opts)
    if missing:
        lines: list[str] = []
        _events, numbers = bench.measure(["apf"], opts, tmp_path, out=lines.append)
        assert numbers == {} and lines == [f"apf      SKIPPED: {missing}"]
        pytest.skip(missing)
    _events, numbers = bench.measure(["apf"], opts, tmp_path, out=lambda line: None)
    for window in ("alone", "flood"):
        w = numbers["apf"][window]
        assert w["light_n"] > 0 and set(w["light_statuses"]) == {"200"}, (window, w)
    assert numbers["apf"]["flood"]["flood_200_per_s"] > 0
    lines = bench.verdicts(numbers, opts)
    assert len(lines) == 3 and all(isinstance(met, bool) for met, _ in lines)


def test_bad_options_are_refused(bench, capsys):
    for argv in (["--only", "bare,nginx"], ["--alone", "0.5"], ["--limit-concurrency", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2, argv
    assert "--only takes bare, limited, apf, gasgi; not ['nginx']" in capsys.readouterr().err


def test_app_and_backend_answer_every_route_and_refuse_bad_input(tmp_path, monkeypatch):
    """effect_asgi_app called directly (no server) against its backend in the same loop: the
    routes answer, a bad ``ms`` is a 400 that says why, and the backend answers a bad line
    with an error and keeps the connection."""
    import asyncio

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import effect_asgi_app as effect
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    sock = str(tmp_path / "backend.sock")
    monkeypatch.setenv("EFFECT_BACKEND", sock)

    async def call(path: str, query: bytes = b"") -> tuple[int, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await effect.app({"type": "http", "method": "GET", "path": path,
                          "query_string": query, "headers": []}, receive, send)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        return sent[0]["status"], sent[1]["body"]

    async def main() -> None:
        ready = asyncio.Event()
        backend = asyncio.create_task(effect.serve_backend(sock, 2, ready))
        await asyncio.wait_for(ready.wait(), 10)
        try:
            assert await call("/ok") == (200, b"ok\n")
            assert await call("/hello") == (200, b"Hello, World!\n")
            assert await call("/query", b"ms=5") == (200, b"queried 5 ms\n")
            # four at once through a pool of 2: all served, on connections kept for reuse
            got = await asyncio.gather(*(call("/query", b"ms=1") for _ in range(4)))
            assert got == [(200, b"queried 1 ms\n")] * 4
            assert len(effect._client().idle) == 4
            for bad in (b"ms=x", b"ms=-1", b"ms=10001"):
                status, body = await call("/query", bad)
                assert status == 400 and body.startswith(b"ms must be a whole number"), body
            assert (await call("/nope"))[0] == 404
            reader, writer = await asyncio.open_unix_connection(sock)
            writer.write(b"soon\n2\n")
            assert (await reader.readline()).startswith(b"error: not a number of millis")
            assert await reader.readline() == b"ok\n"
            writer.close()
        finally:
            effect._client().close()
            backend.cancel()
            with pytest.raises(asyncio.CancelledError):
                await backend
        status, body = await call("/query", b"ms=1")  # nothing listens now
        assert status == 502 and body.startswith(b"backend unreachable"), body

    asyncio.run(main())
