"""A throwaway PostgreSQL server for the tests: initdb in a temp dir, listening on a free
127.0.0.1 port (and a socket in the same dir), stopped and removed at the end.

    with PostgresServer.start() as pg:     # raises Unavailable (with the reason) if it cannot
        pg.dsn                              # "host=127.0.0.1 port=... user=postgres dbname=postgres"

The binaries are Debian's (``apt-get install postgresql``: initdb and pg_ctl under
``/usr/lib/postgresql/<version>/bin``; scripts/test.sh installs it). PostgreSQL refuses to run
as root: as root the server runs as the ``postgres`` user the package creates (``runuser``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time

from tests.apps.procs import free_port


class Unavailable(Exception):
    """PostgreSQL cannot be started here; the message says why."""


def _bin_dir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if not found:
        raise Unavailable("PostgreSQL is not installed (apt-get install postgresql: "
                          "scripts/test.sh does it as root)")
    return os.path.dirname(found[-1])


class PostgresServer:
    def __init__(self, base: str, port: int, bindir: str, as_user: list[str]) -> None:
        self.base = base
        self.port = port
        self.bindir = bindir
        self.as_user = as_user
        self.data = os.path.join(base, "data")
        self.dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    @classmethod
    @contextlib.contextmanager
    def start(cls, timeout: float = 60.0):
        bindir = _bin_dir()
        as_user: list[str] = []
        if os.geteuid() == 0:
            runuser = shutil.which("runuser")
            try:
                import pwd
                pwd.getpwnam("postgres")
            except KeyError:
                raise Unavailable("running as root and there is no 'postgres' user to run "
                                  "PostgreSQL as") from None
            if runuser is None:
                raise Unavailable("running as root and runuser is missing")
            as_user = [runuser, "-u", "postgres", "--"]
        base = tempfile.mkdtemp(prefix="apf-pg-")
        if as_user:
            shutil.chown(base, "postgres", "postgres")
        server = cls(base, free_port(), bindir, as_user)
        try:
            server._run("initdb", "-D", server.data, "-A", "trust", "-U", "postgres",
                        "--no-sync", "-E", "UTF8", timeout=timeout)
            opts = (f"-p {server.port} -h 127.0.0.1 -k {base} -F -c max_connections=60 "
                    "-c fsync=off -c full_page_writes=off")
            server._run("pg_ctl", "-D", server.data, "-o", opts, "-l",
                        os.path.join(base, "log"), "-w", "-t", str(int(timeout)), "start",
                        timeout=timeout + 5)
            yield server
        finally:
            with contextlib.suppress(Exception):
                server._run("pg_ctl", "-D", server.data, "-m", "immediate", "-w", "stop",
                            timeout=30, check=False)
            shutil.rmtree(base, ignore_errors=True)

    def _run(self, tool: str, *args: str, timeout: float, check: bool = True) -> None:
        cmd = [*self.as_user, os.path.join(self.bindir, tool), *args]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 cwd=self.base)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"{tool} failed: {e}") from e
        if check and res.returncode != 0:
            log = ""
            with contextlib.suppress(OSError):
                with open(os.path.join(self.base, "log")) as f:
                    log = f.read()[-2000:]
            raise Unavailable(f"{tool} exited {res.returncode}: {res.stderr.strip()[-2000:]}"
                              f"\n{log}")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until a connection succeeds (pg_ctl -w already waited; this checks psycopg)."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
