"""A HUP logs what it changed: the FlowSchemas and priority levels added, removed and changed
(issue 25, item 23), on a real gunicorn server."""

import os
import shutil
import signal

import pytest

from tests.conftest import APPS
from tests.test_server_reload import EXTRA

pytestmark = [pytest.mark.server]


def test_a_reload_names_the_flowschemas_and_levels_added_removed_and_changed(
        server_factory, tmp_path):
    cfg = tmp_path / "apf.yaml"
    shutil.copy(APPS / "apf.yaml", cfg)
    text = cfg.read_text()
    docs = text.split("\n---\n")
    other_fs = [d for d in docs if "metadata: {name: other, uid: uid-fs-other}" in d]
    assert len(other_fs) == 1
    shares = "metadata: {name: work, uid: uid-pl-work}\nspec:\n  type: Limited\n  limited:\n" \
             "    nominalConcurrencyShares: 1000"
    assert shares in text
    # the HUP path alone (the file watcher would apply the file before the HUP)
    with server_factory(workers=1, threads=4, config=str(cfg),
                        env={"APF_CONFIG_WATCH": "off"}) as srv:
        new = "\n---\n".join(d for d in docs if d is not other_fs[0])
        cfg.write_text(new.replace(shares, shares.replace("1000", "3000")) + EXTRA)
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "configuration generation 2 applied" in srv.log(),
                            timeout=30), srv.log()
        assert srv.wait_for(lambda: "apf:   priority levels:" in srv.log(), timeout=30)
        log = srv.log()
        assert "reload rejected" not in log
        assert "apf:   FlowSchemas: added 'extra'; removed 'other'\n" in log, log
        assert ("apf:   priority levels: added 'extra'; changed 'work' "
                "(nominalConcurrencyShares)\n") in log, log


def test_the_change_lines_name_fields_inside_queuing_and_ignore_the_file() -> None:
    import dataclasses

    from apf_gunicorn.flowcontrol.loader import load_configuration
    from apf_gunicorn.server.generation import config_change_lines

    old = load_configuration(str(APPS / "apf.yaml"))
    work = old.priority_levels["work"]
    new = dataclasses.replace(old, priority_levels={
        **old.priority_levels,
        "work": dataclasses.replace(work, queuing=dataclasses.replace(work.queuing, hand_size=2),
                                    source="elsewhere.yaml")})
    assert config_change_lines(old, new) == [
        "FlowSchemas: unchanged", "priority levels: changed 'work' (queuing.handSize)"]
    assert config_change_lines(old, old) == ["FlowSchemas: unchanged",
                                             "priority levels: unchanged"]
