"""The README's one command for the Django example (issue 25, item 21), run as it is written
(from the checkout root; only the port, the ledger's instance name and the admin endpoint are
the test's own): it serves a 4-seat report, and its log has no warning (no thread-budget
warning, no clamped-cost notes) and one time zone throughout (Django's default TIME_ZONE would
move the workers' timestamps to -0600)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import GUNICORN, ROOT, Server, free_port, stop
from tests.test_readme_install import code_lines

pytest.importorskip("django")

pytestmark = [pytest.mark.server]

STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ([+-]\d{4})\] \[(\d+)\] \[(\w+)\]", re.M)


def readme_command() -> list[str]:
    """The README's command that serves the Django example (exactly one)."""
    lines = [line.strip() for line in code_lines((ROOT / "README.md").read_text())
             if "examples.mysite.wsgi:application" in line and "gunicorn -c" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)


def test_the_readme_command_serves_the_django_example_without_a_warning(tmp_path) -> None:
    words = readme_command()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("APF_") and k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH")}
    while "=" in words[0]:  # the command's own VAR=value prefix
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[0] == "gunicorn", words
    port = free_port()
    instance = "d" + uuid.uuid4().hex[:10]
    env.update({"APF_INSTANCE": instance, "APF_ADMIN_BIND": "off"})
    cmd = [GUNICORN, *words[1:], "-b", f"127.0.0.1:{port}"]
    workers = int(words[words.index("-w") + 1])
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, port, instance, log_path, Path(os.devnull))
    try:
        def report():
            if proc.poll() is not None:
                return "exited"
            try:
                return server.request("/reports/2024/?ms=1", timeout=5)[0]
            except OSError:
                return None

        status = server.wait_for(report, timeout=60)
        assert status == 200, f"{' '.join(cmd)}: {status}\n{server.log()}"

        # the first worker (ledger index 0) logs the start-up notes in post_worker_init, then
        # starts its dispatcher thread: once it has a second thread, every note is written
        def first_worker_done():
            with server.attached_ledger() as led:
                pid = next((p for owner, p, _st, _hb in led.workers() if owner == 0), None)
            return pid is not None and len(os.listdir(f"/proc/{pid}/task")) >= 2

        assert server.wait_for(first_worker_done, timeout=60), server.log()
        assert server.wait_for(lambda: len(server.workers()) == workers, timeout=60)
    finally:
        stop(proc)
    text = server.log()
    lines = STAMP.findall(text)
    assert lines, text
    assert not [line for line in lines if line[2] != "INFO"], text
    assert "WARNING" not in text and "Traceback" not in text, text
    assert len({offset for offset, _pid, _level in lines}) == 1, text  # one time zone
    pids = {pid for _offset, pid, _level in lines}
    assert len(pids) == workers + 1, text  # the master's lines and each worker's
