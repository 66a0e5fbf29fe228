"""The README's "Using it with your app", done as it says (issue 25, item 19): ``pip install .``
into a fresh virtual environment, then, from the root of the checkout, ``gunicorn -c
apf_gunicorn/conf.py myapp:app`` and ``gunicorn -c python:apf_gunicorn.conf myapp:app`` each
start with the built-in configuration and answer 200.

From the checkout root the checkout's ``apf_gunicorn/`` comes first on ``sys.path`` (gunicorn
puts its working directory there), hiding the installed package: everything the server
loads, the built-in configurations included, must be inside it.

The fresh environment gets apf_gunicorn from ``pip install .`` only; its dependencies come from
this test venv's site-packages (a ``.pth`` line, which does not run the editable install's
finder there), so no network is needed; pip gets ``--no-deps --no-index
--no-build-isolation`` for the same reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, Server, free_port, stop

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh venv into which ``pip install .`` installed the checkout."""
    venv = tmp_path_factory.mktemp("readme") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "deps-from-the-test-venv.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                          "--no-deps", "--no-index", "--no-build-isolation", "--quiet",
                          "--disable-pip-version-check", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    where = subprocess.run([str(python), "-c", "import apf_gunicorn; print(apf_gunicorn.__file__)"],
                           cwd="/", capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the installed copy
    # the installed package carries every built-in configuration
    builtins = subprocess.run(
        [str(python), "-c", "from apf_gunicorn.flowcontrol.loader import load_configuration\n"
         "for name in ('webapp', 'public', 'kubernetes', 'mandatory'):\n"
         "    assert load_configuration('builtin:' + name).priority_levels, name"],
        cwd="/", capture_output=True, text=True, timeout=60)
    assert builtins.returncode == 0, builtins.stderr
    return python


@pytest.mark.parametrize("conf", ["apf_gunicorn/conf.py", "python:apf_gunicorn.conf"])
def test_the_readme_command_from_the_checkout_root_serves(installed, tmp_path, conf) -> None:
    port = free_port()
    instance = "r" + uuid.uuid4().hex[:10]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("APF_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"APF_INSTANCE": instance, "APF_ADMIN_BIND": "off"})  # the built-in config
    log_path = tmp_path / "gunicorn.log"
    counter = tmp_path / "counter.bin"
    counter.write_bytes(bytes(256))
    env["APP_COUNTER"] = str(counter)
    # `gunicorn` of the README, as the fresh venv's python runs it
    cmd = [str(installed), "-m", "gunicorn", "-c", conf, "-w", "1", "--threads", "4",
           "-b", f"127.0.0.1:{port}", "tests.apps.app:app"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, port, instance, log_path, counter)
    try:
        def answered():
            if proc.poll() is not None:
                return "exited"
            try:
                return server.request("/work?ms=1", timeout=5)[0]
            except OSError:
                return None

        deadline = time.monotonic() + 60
        status = None
        while status is None and time.monotonic() < deadline:
            status = answered()
            if status is None:
                time.sleep(0.1)  # a boot poll: the server is not listening yet
        assert status == 200, f"{' '.join(cmd)}: {status}\n{server.log()}"
        assert "Traceback" not in server.log(), server.log()
    finally:
        stop(proc)
    assert not server.shm_entries()
