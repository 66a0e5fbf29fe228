"""The configuration follows its file (issue 35, item 1): the master applies ``APF_CONFIG``
when its file or directory changes (a ConfigMap's ``..data`` swap included), as a HUP does,
without replacing the workers unless they classify by what changed; an invalid one is
refused with every error logged (``master/reload.py``, ``server/configwatch.py``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from apf_gunicorn.flowcontrol.loader import load_configuration, read_config_files
from apf_gunicorn.ledger import Capacity, Ledger
from apf_gunicorn.ledger.lock import NullLock
from apf_gunicorn.master import reload
from apf_gunicorn.server.configwatch import ChangeDetector, fingerprint, watchable
from apf_gunicorn.server.generation import (
    config_digest,
    configure_ledger,
    load_generation,
    worker_change_lines,
)
from apf_gunicorn.server.resolver import build_resolver
from apf_gunicorn.server.settings import SettingsError, load_settings
from apf_gunicorn.server.state import MasterState
from tests.conftest import APPS, free_port
from tests.test_server_observability import admin_get, parse_dump, scrape

BASE = (APPS / "apf.yaml").read_text()
NEW_LEVEL = """
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: batch, uid: uid-pl-batch}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 500
    lendablePercent: 0
    borrowingLimitPercent: 0
    limitResponse: {type: Reject}
"""
NEW_SCHEMA = """
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: batch, uid: uid-fs-batch}
spec:
  matchingPrecedence: 200
  priorityLevelConfiguration: {name: batch}
  rules:
  - subjects:
    - {kind: Group, group: {name: system:unauthenticated}}
    nonResourceRules:
    - {verbs: ["*"], nonResourceURLs: ["/other/batch"]}
"""
WORK_SHARES = ("metadata: {name: work, uid: uid-pl-work}\nspec:\n  type: Limited\n  limited:\n"
               "    nominalConcurrencyShares: 1000")
assert WORK_SHARES in BASE


def shares(text: str, work: int) -> str:
    return text.replace(WORK_SHARES, WORK_SHARES.replace("1000", str(work)))


# -- the change detector -----------------------------------------------------------------------

def test_a_change_is_reported_once_it_has_stayed_for_a_poll() -> None:
    files = {"fp": 1}
    watch = ChangeDetector("/cfg", stat=lambda _source: files["fp"])
    # the first stable poll is a change: the caller compares with what it loaded at start
    assert [watch.poll(), watch.poll(), watch.poll()] == [False, True, False]
    files["fp"] = 2  # being written: not yet
    assert watch.poll() is False
    files["fp"] = 3  # still moving
    assert watch.poll() is False
    assert [watch.poll(), watch.poll()] == [True, False]  # stayed: once
    files["fp"] = 1  # back to a state seen before is a change too
    assert [watch.poll(), watch.poll()] == [False, True]


def test_the_fingerprint_follows_a_configmap_swap_and_an_edit_in_place(tmp_path) -> None:
    root = tmp_path / "cm"
    configmap(root, {"apf.yaml": BASE}, "..2026_11_29_01_00_00.1")
    before = fingerprint(str(root))
    assert before == fingerprint(str(root)) and before[0][0] == "apf.yaml"
    configmap(root, {"apf.yaml": BASE}, "..2026_11_29_01_00_05.2")  # same bytes, new inode
    swapped = fingerprint(str(root))
    assert swapped != before
    (root / "apf.yaml").write_text(BASE + NEW_LEVEL)  # through the symlink, in place
    assert fingerprint(str(root)) != swapped
    assert fingerprint(str(tmp_path / "gone"))[0] == "error"
    assert watchable(str(root)) and not watchable("builtin:webapp") and not watchable(None)


def test_the_digest_is_sha256sum_of_a_file_and_of_a_directory_listing(tmp_path) -> None:
    cfg = tmp_path / "apf.yaml"
    cfg.write_text(BASE)
    assert (config_digest(str(cfg), read_config_files(str(cfg)))
            == "sha256:" + hashlib.sha256(BASE.encode()).hexdigest())
    (tmp_path / "b.yml").write_text(NEW_LEVEL)
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                      for p in (cfg, tmp_path / "b.yml"))
    assert (config_digest(str(tmp_path), read_config_files(str(tmp_path)))
            == "sha256:" + hashlib.sha256(listing.encode()).hexdigest())


def test_what_the_workers_must_be_replaced_for(tmp_path) -> None:
    """Workers classify with the FlowSchemas and how the levels they name are reached; a new
    unused level, shares and queue sizes reach them through the ledger."""
    def cfg(text: str):
        path = tmp_path / "x.yaml"
        path.write_text(text)
        return load_configuration(str(path))

    base = cfg(BASE)
    assert worker_change_lines(base, cfg(BASE + NEW_LEVEL)) == []
    assert worker_change_lines(base, cfg(shares(BASE, 3000))) == []
    assert worker_change_lines(base, cfg(BASE.replace("handSize: 4", "handSize: 2"))) == []
    assert worker_change_lines(base, cfg(BASE + NEW_LEVEL + NEW_SCHEMA)) == [
        "FlowSchemas: added 'batch'"]
    assert worker_change_lines(base, cfg(BASE.replace("queues: 16, handSize: 4", "queues: 1, handSize: 1"))) == [
        "priority level 'other': queuing.queues (one or several)",
        "priority level 'work': queuing.queues (one or several)"]


def test_apf_config_watch_setting() -> None:
    assert load_settings({}).config_watch is True
    for off in ("off", "0", "FALSE"):
        assert load_settings({"APF_CONFIG_WATCH": off}).config_watch is False
    for on in ("on", "1", "True"):
        assert load_settings({"APF_CONFIG_WATCH": on}).config_watch is True
    with pytest.raises(SettingsError, match="invalid APF_CONFIG_WATCH='sometimes': must be"):
        load_settings({"APF_CONFIG_WATCH": "sometimes"})


# -- the watcher in a master, without a server -------------------------------------------------

class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def _add(self, msg, *args, **_kw) -> None:
        self.lines.append(msg % args if args else msg)

    info = warning = error = debug = exception = _add


class Arbiter:
    """What the watcher uses of gunicorn's arbiter: its log, config and signal queue."""

    def __init__(self) -> None:
        self.log = Log()
        self.cfg = SimpleNamespace(workers=2, threads=8)
        self.queued: list[int] = []

    def signal(self, sig, _frame) -> None:
        self.queued.append(sig)


def master_on(path: Path) -> MasterState:
    settings = load_settings({"APF_CONFIG": str(path), "APF_CONCURRENCY_LIMIT": "16"},
                             workers=2, threads=8)
    gen = load_generation(settings)
    cap = Capacity()
    ledger = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    configure_ledger(ledger, gen, 1)
    return MasterState(settings=settings, token="t", segment=None, ledger=ledger, capacity=cap,
                       resolver=build_resolver(settings, gen.configuration), generation=gen)


def test_the_watcher_applies_refuses_and_replaces_workers_only_for_what_they_classify_by(
        tmp_path) -> None:
    cfg = tmp_path / "apf.yaml"
    cfg.write_text(BASE)
    m, arbiter = master_on(cfg), Arbiter()
    watcher = reload.ConfigWatcher(m, arbiter)

    def settle():
        """Poll until the detector has seen the files stay (two polls), the applied result."""
        return [watcher.check_once(), watcher.check_once()][1]

    assert settle() is None and m.reloads == {}  # the files it started from: nothing to do
    os.utime(cfg, ns=(1, 1))  # touched: looked at, same digest, nothing applied
    assert settle() is None and m.generation.number == 1

    cfg.write_text(BASE + NEW_LEVEL)
    gen = settle()
    assert gen is not None and gen.number == 2 and "batch" in m.generation.level_index
    assert m.reloads == {("applied", "file"): 1} and arbiter.queued == []
    assert any("configuration generation 2 applied (" + str(cfg) + " changed, sha256:"
               in line and "5 priority levels (1 added, 0 removed, 0 changed), 5 FlowSchemas "
               "(0 added, 0 removed, 0 changed)" in line
               for line in arbiter.log.lines), arbiter.log.lines

    cfg.write_text(shares(BASE + NEW_LEVEL, "high"))
    assert settle() is None and m.generation.number == 2
    assert m.reloads[("refused", "file")] == 1 and m.reload_errors == 1
    errors = [line for line in arbiter.log.lines if "nominalConcurrencyShares" in line]
    assert errors == [f'apf:   {cfg}: PriorityLevelConfiguration "work": '
                      'spec.limited.nominalConcurrencyShares: Invalid value: "high": '
                      'must be an integer'], arbiter.log.lines
    os.utime(cfg, ns=(2, 2))  # the same broken bytes: not refused (logged) again
    assert settle() is None and m.reloads[("refused", "file")] == 1
    cfg.unlink()  # gone (or unreadable): refused, logged
    assert settle() is None and m.reloads[("refused", "file")] == 2
    assert "No such file or directory" in arbiter.log.lines[-1] and m.generation.number == 2

    # a new FlowSchema: applied in the master, and the workers are replaced by a queued HUP
    cfg.write_text(BASE + NEW_LEVEL + NEW_SCHEMA)
    gen = settle()
    assert gen is not None and gen.number == 3 and arbiter.queued == [signal.SIGHUP]
    assert m.restart_digest == gen.digest
    # ...which gunicorn handles by calling on_reload: the same files, nothing applied again
    reload.on_hup(arbiter, m, str(cfg))
    assert m.generation is gen and m.restart_digest == ""
    assert "apf: new workers take configuration generation 3" in arbiter.log.lines[-1]
    # an operator's HUP applies (a new generation of the same files), counted as hup
    reload.on_hup(arbiter, m, str(cfg))
    assert m.generation.number == 4 and m.reloads[("applied", "hup")] == 1


# -- on a real server --------------------------------------------------------------------------

def configmap(root: Path, files: dict[str, str], stamp: str) -> None:
    """Write ``files`` as the kubelet updates a ConfigMap volume: a new ``..<timestamp>``
    directory, the ``..data`` symlink renamed over to it at once, the visible files symlinks
    through ``..data``."""
    root.mkdir(exist_ok=True)
    (root / stamp).mkdir()
    for name, text in files.items():
        (root / stamp / name).write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(stamp)
    os.replace(tmp, root / "..data")
    for name in files:
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")


@pytest.mark.server
def test_the_server_follows_its_configuration_file(server_factory, tmp_path) -> None:
    root = tmp_path / "apf"
    configmap(root, {"apf.yaml": BASE}, "..2026_11_29_01_00_00.1")
    aport = free_port()
    url = "/debug/api_priority_and_fairness/dump_priority_levels?includeFairness=1&includeSeats=1"
    times = []

    def seats() -> dict[str, str]:
        rows = [r for r in parse_dump(admin_get(aport, url)) if not r[0].startswith("#")]
        return {r[0]: r[rows[0].index("NominalSeats")] for r in rows[1:]}

    def change(write, until) -> None:
        t0 = time.monotonic()
        write()
        assert srv.wait_for(until, timeout=30), (seats(), srv.log()[-3000:])
        times.append(round(time.monotonic() - t0, 2))

    def metric(name: str, **labels: str) -> float:
        return scrape(aport).get((name, tuple(sorted(labels.items()))), 0.0)

    with server_factory(workers=2, threads=4, config=str(root),
                        env={"APF_ADMIN_BIND": f"127.0.0.1:{aport}"}) as srv:
        workers = sorted(srv.workers())
        assert seats()["work"] == "8"
        assert metric("apf_config_info", generation="1",
                      digest=config_digest(str(root), read_config_files(str(root)))[:23]) == 1

        # a new priority level: applied, no signal, the same workers
        change(lambda: (root / "apf.yaml").write_text(BASE + NEW_LEVEL),
               lambda: "batch" in seats())
        assert sorted(srv.workers()) == workers
        # a changed share (work 1000 -> 3000 of 4505 shares: 11 of 16 seats)
        change(lambda: (root / "apf.yaml").write_text(shares(BASE + NEW_LEVEL, 3000)),
               lambda: seats()["work"] == "11")
        assert sorted(srv.workers()) == workers
        assert metric("apf_config_reloads_total", result="applied", trigger="file") == 2

        # broken: refused, every error logged, the running configuration stays
        broken = shares(BASE + NEW_LEVEL, "high").replace("matchingPrecedence: 100",
                                                          "matchingPrecedence: 20000")
        change(lambda: (root / "apf.yaml").write_text(broken),
               lambda: metric("apf_config_reloads_total", result="refused", trigger="file"))
        log = srv.log()
        assert "apf: reload rejected (" + str(root) + " changed)" in log
        assert ('PriorityLevelConfiguration "work": spec.limited.nominalConcurrencyShares: '
                'Invalid value: "high": must be an integer') in log
        assert ('FlowSchema "probes": spec.matchingPrecedence: Invalid value: 20000: must not '
                'be greater than 10000') in log
        assert "(generation 3, sha256:" in log and "(2 error(s))" in log
        assert seats()["work"] == "11" and "batch" in seats()

        # the kubelet's swap: applied
        change(lambda: configmap(root, {"apf.yaml": shares(BASE, 500)},
                                 "..2026_11_29_01_00_09.2"),
               lambda: seats().get("batch", "") == "")  # removed: drains, then is dropped
        assert seats()["work"] == "6"  # 500 of 1505 shares
        assert sorted(srv.workers()) == workers and "Hang up" not in srv.log()
        assert metric("apf_config_info", generation="4",
                      digest=config_digest(str(root), read_config_files(str(root)))[:23]) == 1

        # a new FlowSchema: the workers classify by it, so they are replaced (a HUP)
        def schema_uid() -> str | None:
            try:
                return srv.request("/other/batch")[1]["X-Kubernetes-PF-FlowSchema-UID"]
            except OSError:  # a connection cut while the workers are replaced
                return None

        assert schema_uid() == "uid-fs-other"
        change(lambda: configmap(root, {"apf.yaml": BASE + NEW_LEVEL + NEW_SCHEMA},
                                 "..2026_11_29_01_00_12.3"),
               lambda: schema_uid() == "uid-fs-batch")
        assert srv.wait_for(lambda: "new workers take configuration generation 5" in srv.log())
        assert srv.wait_for(lambda: not set(srv.workers()) & set(workers))  # the old ones stop
        assert "generation 6" not in srv.log() and "Traceback" not in srv.log()
        assert metric("apf_config_reloads_total", result="applied", trigger="hup") == 0
        cli = subprocess.run([sys.executable, "-m", "apf_gunicorn", "dump", "levels",
                              "--admin", f"127.0.0.1:{aport}"],
                             capture_output=True, text=True, timeout=30)
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.splitlines()[-1] == "# configuration generation 5, digest " + \
            config_digest(str(root), read_config_files(str(root)))[:23]
    print(f"seconds from the write to the dump showing it: {times}")


@pytest.mark.server
def test_apf_config_watch_off_leaves_it_to_hup(server_factory, tmp_path) -> None:
    cfg = tmp_path / "apf.yaml"
    shutil.copy(APPS / "apf.yaml", cfg)
    with server_factory(workers=1, threads=4, config=str(cfg),
                        env={"APF_CONFIG_WATCH": "off"}) as srv:
        assert "APF_CONFIG_WATCH=off" in srv.log()
        cfg.write_text(BASE + NEW_LEVEL)
        # past the 2 s a watcher takes, nothing applied
        assert not srv.wait_for(lambda: "generation 2" in srv.log(), timeout=2.5)
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "configuration generation 2 applied (HUP" in srv.log())
