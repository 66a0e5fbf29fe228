"""What each server's own handling of the two X-Kubernetes-PF-* headers costs per response.

    .venv/bin/python benchmarks/bench_pf_headers.py [--small 1000] [--large 3000]

``bench_instructions.py --pf-headers-off`` measures APF_PF_HEADERS=on against off in a real
worker, where the event loop's timers are charged to the requests by how long the run took
(several thousand instructions per request on a loaded machine). This counts only the server's
code that handles a response's headers, in process under callgrind: the same response with the
app's two headers, and with the PF headers too, in the form the middleware hands each server
(``admission.core.Route``: gunicorn's WSGI ``Response`` gets them appended to its checked list,
the ASGI servers get lower-case bytes). The count of ``--small`` responses is subtracted from
that of ``--large`` ones, so start-up cancels out; the difference per response is printed:

* ``gthread``: gunicorn's ``Response``: ``start_response`` with the app's headers, ours
  appended unchecked (``Route.checked``), the head written;
* ``uvicorn``: uvicorn's h11 protocol: ``h11.Response`` and ``Connection.send`` (h11 validates
  every header with its regular expressions) and the body;
* ``gunicorn-asgi``: gunicorn's ``asgi`` worker: its header scan (two regular expressions per
  header) and the head it builds (its access log is off by default: not counted).

Needs valgrind (``apt-get install -y valgrind``); about a minute.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace as NS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from apf_gunicorn.admission.core import FS_UID_HEADER, PL_UID_HEADER, raw_headers  # noqa: E402

# uids as long as the built-in configurations' (UUIDs)
PF = [(FS_UID_HEADER, "b11f9dc7-477f-5d41-bc81-d21a88952cf7"),
      (PL_UID_HEADER, "d7136ae0-389a-52d6-886a-6af44d2dba00")]
SERVERS = ("gthread", "uvicorn", "gunicorn-asgi")


def respond(server: str, n: int, with_pf: bool) -> None:
    """``n`` responses of ``server``'s header handling, with or without the PF headers."""
    raw = raw_headers(PF) if with_pf else []
    app = [(b"content-type", b"text/plain"), (b"content-length", b"6")]
    if server == "gthread":
        from gunicorn.http.wsgi import Response

        class Sink:
            def sendall(self, data: bytes) -> None:
                pass

            send = sendall

        req = NS(version=(1, 1), method="GET", should_close=lambda: False)
        cfg = NS(protocol="http", sendfile=False, is_ssl=False)
        ours = PF if with_pf else []
        for _ in range(n):
            resp = Response(req, Sink(), cfg)
            resp.start_response("200 OK", [("Content-Type", "text/plain"),
                                           ("Content-Length", "6")])
            resp.headers.extend(ours)
            resp.write(b"hello\n")
    elif server == "uvicorn":
        import h11

        conn = h11.Connection(h11.SERVER)
        head = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
        headers = [(b"date", b"x"), (b"server", b"uvicorn"), *app, *raw]
        for _ in range(n):
            conn.receive_data(head)
            conn.next_event()
            conn.next_event()
            conn.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
            conn.send(h11.Data(data=b"hello\n"))
            conn.send(h11.EndOfMessage())
            conn.start_next_cycle()
    elif server == "gunicorn-asgi":
        from gunicorn.asgi import protocol

        stub = NS(_response_buffer=None)
        req = NS(version=(1, 1))
        headers = [*app, *raw]
        for _ in range(n):
            protocol._scan_response_headers(headers)
            protocol.ASGIProtocol._send_response_start(stub, 200, headers, req)
    else:
        raise ValueError(f"unknown server {server!r}")


def _count(server: str, n: int, with_pf: bool, tmp: str) -> int:
    out = os.path.join(tmp, f"cg.{server}.{n}.{with_pf}")
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    sys.executable, __file__, "--run", server, str(n),
                    "on" if with_pf else "off"], check=True, capture_output=True, cwd=ROOT)
    with open(out) as f:
        return int(re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M).group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--large", type=int, default=3000)
    ap.add_argument("--run", nargs=3, metavar=("SERVER", "N", "PF"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        server, n, pf = args.run
        respond(server, int(n), pf == "on")
        return 0
    if args.large <= args.small:
        ap.error("--large must be above --small")
    if not shutil.which("valgrind"):
        print("valgrind is not installed (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    print(f"instructions per response spent by the server on its headers ({args.large} - "
          f"{args.small} responses, callgrind, in process):")
    with tempfile.TemporaryDirectory() as tmp:
        for server in SERVERS:
            per = {}
            for with_pf in (False, True):
                big, small = (_count(server, k, with_pf, tmp) for k in (args.large, args.small))
                per[with_pf] = (big - small) / (args.large - args.small)
            print(f"  {server:14s} without {per[False]:9,.0f}  with the PF headers "
                  f"{per[True]:9,.0f}  the two headers: {per[True] - per[False]:+8,.0f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
