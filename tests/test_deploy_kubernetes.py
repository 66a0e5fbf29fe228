"""deploy/kubernetes/ (issue 35, item 4), checked without a cluster.

- Every manifest parses and validates against Kubernetes' own schema, strictly (an unknown or
  misspelt field is an error, as with ``kubectl apply --validate=strict``), for the oldest
  Kubernetes it claims (1.30: the first with the preStop ``sleep`` action on by default) and the
  newest the validator knows. kubernetes-validate carries its schemas in the package: nothing
  is downloaded at test time.
- The ConfigMap's files, laid out as the kubelet mounts a ConfigMap (``..data`` symlink to a
  timestamped directory), pass the real ``apf-gunicorn check`` at the Deployment's workers and
  threads, and the Deployment mounts that ConfigMap, as a directory, where ``APF_CONFIG``
  points.
- Every probe's request, as the kubelet sends it, is exempt: ``apf-gunicorn explain`` with the
  container's environment, and a real server started with the container's command.
- The grace period covers the preStop sleep, any ``APF_AGENT_DRAIN_DELAY`` and gunicorn's
  ``graceful_timeout``, all read from the manifest and from gunicorn's own configuration
  loading of the container's command.
- The worker class that command runs is one apf_gunicorn accepts, and the resources and threads
  follow deploy/kubernetes/README.md's rules.

Each check is a function returning its problems, run on the shipped manifests (none) and on a
broken copy (the problem named), so none of them passes whatever the manifests say.
"""

from __future__ import annotations

import contextlib
import copy
import io
import ipaddress
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from gunicorn.app.wsgiapp import WSGIApplication

from apf_gunicorn import cli
from apf_gunicorn.flowcontrol.limits import compute_limits
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.matching import Classifier
from apf_gunicorn.flowcontrol.objects import derived_uid
from apf_gunicorn.master.hooks import check_worker_class
from apf_gunicorn.server import startup
from apf_gunicorn.server.generation import thread_budget
from apf_gunicorn.server.settings import load_settings
from apf_gunicorn.server.state import Generation
from tests.conftest import GUNICORN, ROOT, Server, free_port, stop

DEPLOY = ROOT / "deploy" / "kubernetes"
CLI = str(Path(sys.executable).parent / "apf-gunicorn")
#: the oldest Kubernetes the manifests are for, and the newest the validator has schemas of
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
#: what the kubelet's HTTP probes send besides the probe's own httpHeaders (its prober, which
#: opens a connection per probe)
KUBELET_HEADERS = {"User-Agent": "kube-probe/1.37", "Accept": "*/*", "Connection": "close"}
#: seconds the master needs after its workers are gone (its services thread and admin
#: endpoint stop, the ledger is unlinked): about 2 s measured on an idle server here
MASTER_EXIT_S = 3
#: deploy/kubernetes/README.md's memory rule: the RSS allowed per gunicorn process (master and
#: each worker; the example app measures 36-50 MiB)
PROCESS_MIB = 64
#: ... plus the ledger's shared memory (/dev/shm, counted in the pod's memory): its size for
#: these workers, checked on the real server below
LEDGER_MIB = 8
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


# -- reading the manifests ----------------------------------------------------------------------

def manifests() -> list[dict]:
    """Every object of every ``*.yaml`` in deploy/kubernetes/, in file name order."""
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kubernetes/, found {len(found)}"
    return found[0]


def app_container(docs: list[dict]) -> dict:
    return only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def container_env(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in app_container(docs).get("env", [])}


def kubelet_mount(docs: list[dict], root: Path) -> Path:
    """The ConfigMap's data written as the kubelet's atomic writer lays out a ConfigMap volume:
    the files in a timestamped hidden directory, ``..data`` pointing to it, and one symlink per
    key through ``..data`` (a ConfigMap update swaps ``..data``)."""
    data = only(docs, "ConfigMap")["data"]
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "..2026_11_29_00_00_00.000000001"
    stamp.mkdir()
    for key, text in data.items():
        (stamp / key).write_text(text)
        (root / key).symlink_to(Path("..data") / key)
    (root / "..data").symlink_to(stamp.name)
    return root


def gunicorn_config(docs: list[dict], monkeypatch):
    """gunicorn's configuration for the container's command, loaded by gunicorn itself: the
    ``-c`` file (apf_gunicorn.conf), then ``GUNICORN_CMD_ARGS`` from the container's env, then
    the command line, as ``gunicorn`` does at start."""
    command = app_container(docs)["command"] + app_container(docs).get("args", [])
    assert command[0] == "gunicorn", command
    monkeypatch.setattr(sys, "argv", command)
    monkeypatch.setattr(sys, "path", list(sys.path))  # gunicorn puts its chdir first
    monkeypatch.delenv("GUNICORN_CMD_ARGS", raising=False)
    if "GUNICORN_CMD_ARGS" in container_env(docs):
        monkeypatch.setenv("GUNICORN_CMD_ARGS", container_env(docs)["GUNICORN_CMD_ARGS"])
    monkeypatch.chdir(ROOT)
    return WSGIApplication("%(prog)s [OPTIONS] [APP_MODULE]", prog="gunicorn").cfg


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def mebibytes(quantity: str) -> float:
    units = {"Ki": 2**-10, "Mi": 1, "Gi": 2**10, "k": 1e3 / 2**20, "M": 1e6 / 2**20,
             "G": 1e9 / 2**20}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity)
    assert m and (m.group(2) in units or not m.group(2)), f"memory quantity {quantity!r}"
    return int(m.group(1)) * units.get(m.group(2), 2**-20)


def container_port(container: dict, port) -> int:
    """A probe's or Service's port (a number, or the name of one of the container's ports)."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    assert port in named, f"port {port!r} is not a port of the container"
    return named[port]


def bind_port(cfg) -> int:
    (address,) = cfg.bind
    return int(address.rsplit(":", 1)[1])


# -- the checks: each returns its problems --------------------------------------------------------

def schema_problems(docs: list[dict], version: str) -> list[str]:
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.absolute_path)
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {where}: {e.message}")
    return problems


def mount_problems(docs: list[dict]) -> list[str]:
    """The ConfigMap is mounted whole (no subPath: a subPath mount never follows updates)
    where APF_CONFIG points."""
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    name = only(docs, "ConfigMap")["metadata"]["name"]
    volumes = [v["name"] for v in pod.get("volumes", [])
               if v.get("configMap", {}).get("name") == name]
    mounts = [m for m in app_container(docs).get("volumeMounts", []) if m["name"] in volumes]
    config = container_env(docs).get("APF_CONFIG")
    if not any(m["mountPath"] == config and "subPath" not in m for m in mounts):
        return [f"APF_CONFIG={config} is not where ConfigMap {name} is mounted as a directory "
                f"(mounts: {mounts})"]
    return []


def exempt_problems(docs: list[dict], mount: Path, cfg, monkeypatch) -> list[str]:
    """Every probe's request through ``apf-gunicorn explain`` (in this process) with the
    container's APF_* environment (APF_CONFIG at the kubelet-style mount) and gunicorn's
    workers and threads; and every probe goes to gunicorn's port, where APF is."""
    container = app_container(docs)
    for name in [k for k in os.environ if k.startswith("APF_")]:
        monkeypatch.delenv(name)
    for name, value in dict(container_env(docs), APF_CONFIG=str(mount)).items():
        monkeypatch.setenv(name, value)
    problems = []
    for kind in PROBES:
        probe = container.get(kind)
        if probe is None:
            continue
        get = probe.get("httpGet")
        if get is None:
            problems.append(f"{kind} is not an HTTP GET: nothing says it is exempt")
            continue
        headers = dict(KUBELET_HEADERS, **{h["name"]: h["value"]
                                           for h in get.get("httpHeaders", [])})
        port = container_port(container, get["port"])
        if port != bind_port(cfg):
            problems.append(f"{kind} probes port {port}, not gunicorn's {cfg.bind}")
        argv = ["explain", "--request", f"GET {get['path']}", "--remote-addr", "192.0.2.1",
                "--workers", str(cfg.workers), "--threads", str(cfg.threads), "--json"]
        for name, value in headers.items():
            argv += ["--header", f"{name}: {value}"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = cli.main(argv)
        if status != 0:
            problems.append(f"{kind}: explain exited {status}")
            continue
        level = json.loads(out.getvalue())["priorityLevel"]
        if level != "exempt":
            problems.append(f"{kind} GET {get['path']} lands in priority level {level!r}")
    return problems


def grace_problems(docs: list[dict], cfg) -> list[str]:
    """terminationGracePeriodSeconds must cover what happens between the pod's deletion and
    the master's exit: the preStop sleep (the kubelet sends SIGTERM after it), apf_gunicorn's
    own drain delay if its agent endpoint is on, gunicorn's graceful_timeout, and the master's
    exit."""
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    grace = pod.get("terminationGracePeriodSeconds", 30)
    pre_stop = app_container(docs).get("lifecycle", {}).get("preStop", {})
    sleep = pre_stop.get("sleep", {}).get("seconds", 0)
    settings = load_settings({k: v for k, v in container_env(docs).items()
                              if k != "APF_CONFIG"})
    agent_drain = settings.agent_drain_delay_s if settings.agent_bind is not None else 0
    drain = sleep + agent_drain
    if drain <= 0:
        return ["nothing keeps the pod serving while proxies learn it is going: no preStop "
                "sleep and no APF_AGENT_DRAIN_DELAY"]
    need = drain + cfg.graceful_timeout + MASTER_EXIT_S
    if grace < need:
        return [f"terminationGracePeriodSeconds {grace} < preStop sleep {sleep} + "
                f"APF_AGENT_DRAIN_DELAY {agent_drain} + graceful_timeout "
                f"{cfg.graceful_timeout} + {MASTER_EXIT_S} s for the master to exit"]
    return []


def resource_problems(docs: list[dict], cfg, mount: Path) -> list[str]:
    """deploy/kubernetes/README.md's rules: one core of limit per worker (a worker runs Python
    one thread at a time), memory requested = limited and enough for (workers + 1) processes
    plus each worker's head buffer; the threads hold the limit and the ConfigMap's queues
    (the server's own start-up check)."""
    resources = app_container(docs).get("resources", {})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    problems = []
    if "cpu" not in requests or "memory" not in requests or "memory" not in limits:
        return [f"resources need cpu and memory requests and a memory limit: {resources}"]
    if "cpu" in limits and cpu_cores(limits["cpu"]) < cfg.workers:
        problems.append(f"cpu limit {limits['cpu']} < {cfg.workers} workers: each worker "
                        "throttled below a core slows every admitted request, probes included")
    if cpu_cores(requests["cpu"]) < cfg.workers / 2:
        problems.append(f"cpu request {requests['cpu']} < half a core per worker")
    env = dict(container_env(docs), APF_CONFIG=str(mount))
    settings = load_settings(env, workers=cfg.workers, threads=cfg.threads)
    need = ((cfg.workers + 1) * PROCESS_MIB
            + cfg.workers * settings.head_buffer_limit / 2**20 + LEDGER_MIB)
    if mebibytes(limits["memory"]) != mebibytes(requests["memory"]):
        problems.append(f"memory request {requests['memory']} != limit {limits['memory']}")
    if mebibytes(limits["memory"]) < need:
        problems.append(f"memory limit {limits['memory']} < {need:.0f} MiB: "
                        f"({cfg.workers} workers + 1) x {PROCESS_MIB} MiB + {cfg.workers} x "
                        f"APF_HEAD_BUFFER_LIMIT + {LEDGER_MIB} MiB of ledger")
    config = load_configuration(str(mount))
    gen = Generation(config, compute_limits(config.priority_levels.values(),
                                            settings.concurrency_limit),
                     Classifier(config), {}, {})
    warning = thread_budget(gen, settings, cfg.workers, cfg.threads)
    if warning:
        problems.append(warning)
    return problems


def environment_problems(docs: list[dict], mount: Path) -> list[str]:
    """The APF_* variables the container gets, service links included unless the pod turns
    them off (a Service named apf-... gives APF_..._SERVICE_HOST and the like), are all ones
    the server knows: otherwise it warns about each at every start."""
    env = dict(container_env(docs), APF_CONFIG=str(mount))
    if only(docs, "Deployment")["spec"]["template"]["spec"].get("enableServiceLinks", True):
        for svc in (d for d in docs if d["kind"] == "Service"):
            prefix = svc["metadata"]["name"].upper().replace("-", "_")
            env[f"{prefix}_SERVICE_HOST"] = "10.96.0.10"
            for port in svc["spec"]["ports"]:
                env[f"{prefix}_PORT_{port['port']}_TCP"] = f"tcp://10.96.0.10:{port['port']}"
    return startup.unknown_variable_warnings(env)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host == "localhost"


def service_problems(docs: list[dict]) -> list[str]:
    """The Service selects the pods, targets ports the container has, and its scrape
    annotation names the admin endpoint's port (APF_ADMIN_BIND, on the pod's address)."""
    svc, container = only(docs, "Service"), app_container(docs)
    labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    problems = []
    if any(labels.get(k) != v for k, v in svc["spec"]["selector"].items()):
        problems.append(f"Service selector {svc['spec']['selector']} misses the pods {labels}")
    targets = {container_port(container, p["targetPort"]) for p in svc["spec"]["ports"]}
    settings = load_settings({k: v for k, v in container_env(docs).items()
                              if k != "APF_CONFIG"})
    if settings.admin_bind is None:
        return problems + ["APF_ADMIN_BIND=off: no metrics"]
    host, port = settings.admin_bind
    if is_loopback(host):
        problems.append(f"the admin endpoint listens on {host}:{port}: Prometheus cannot "
                        "reach it from another pod")
    scrape = svc["metadata"].get("annotations", {})
    if (scrape.get("prometheus.io/scrape") != "true"
            or scrape.get("prometheus.io/port") != str(port)):
        problems.append(f"the scrape annotations {scrape} do not name port {port}")
    if port not in targets:
        problems.append(f"the Service does not expose the admin port {port}")
    return problems


# -- the tests ----------------------------------------------------------------------------------

@pytest.fixture
def docs() -> list[dict]:
    return manifests()


@pytest.fixture
def mount(docs, tmp_path) -> Path:
    return kubelet_mount(docs, tmp_path / "etc-apf-gunicorn")


def test_the_directory_holds_what_the_readme_applies(docs):
    # and nothing else: `kubectl apply -f deploy/kubernetes/` would give a FlowSchema there to
    # the cluster's own API server
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "NetworkPolicy",
                                               "Service"]
    readme = (ROOT / "README.md").read_text() + (DEPLOY / "README.md").read_text()
    named = set(re.findall(r"deploy/kubernetes/[\w./-]*\w", readme))
    assert named and all((ROOT / p).exists() for p in named), named


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_matches_the_kubernetes_schema_strictly(docs, version):
    assert schema_problems(docs, version) == []
    broken = copy.deepcopy(docs)
    container = app_container(broken)
    container["readinesProbe"] = container.pop("readinessProbe")
    only(broken, "Service")["spec"]["ports"][0]["port"] = "80"
    problems = schema_problems(broken, version)
    assert len(problems) == 2 and "'readinesProbe' was unexpected" in problems[0], problems


def test_the_configmap_passes_apf_gunicorn_check(docs, mount, monkeypatch):
    cfg = gunicorn_config(docs, monkeypatch)
    out = subprocess.run([CLI, "check", str(mount), "--workers", str(cfg.workers), "--threads",
                          str(cfg.threads), "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["valid"] and report["concurrencyLimit"] == cfg.workers * cfg.threads // 2
    # each key of the ConfigMap is a file the server reads, none hidden by the mount's layout
    sources = {fs["source"] for fs in report["flowSchemas"]} | {
        pl["source"] for pl in report["priorityLevels"]}
    assert {Path(s).name for s in sources if s.startswith(str(mount))} == set(
        only(docs, "ConfigMap")["data"]), sources
    assert mount_problems(docs) == []
    broken = copy.deepcopy(docs)
    app_container(broken)["volumeMounts"][0]["subPath"] = "flow-schemas.yaml"
    assert "is not where ConfigMap" in mount_problems(broken)[0]


def test_every_probe_is_exempt_in_the_shipped_configuration(docs, mount, monkeypatch):
    container = app_container(docs)
    assert all(kind in container for kind in PROBES)
    cfg = gunicorn_config(docs, monkeypatch)
    assert exempt_problems(docs, mount, cfg, monkeypatch) == []
    broken = copy.deepcopy(docs)
    app_container(broken)["readinessProbe"]["httpGet"]["path"] = "/ready"
    app_container(broken)["livenessProbe"]["httpGet"]["port"] = "metrics"
    assert exempt_problems(broken, mount, cfg, monkeypatch) == [
        "livenessProbe probes port 9180, not gunicorn's ['0.0.0.0:8000']",
        "readinessProbe GET /ready lands in priority level 'anonymous'"]


def test_the_grace_period_covers_the_drain_and_the_graceful_timeout(docs, monkeypatch):
    cfg = gunicorn_config(docs, monkeypatch)
    assert cfg.graceful_timeout == 20  # from the command line, over gunicorn's default 30
    assert grace_problems(docs, cfg) == []
    broken = copy.deepcopy(docs)
    only(broken, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 27
    assert grace_problems(broken, cfg) == [
        "terminationGracePeriodSeconds 27 < preStop sleep 5 + APF_AGENT_DRAIN_DELAY 0 + "
        "graceful_timeout 20 + 3 s for the master to exit"]
    # apf_gunicorn's own drain delay counts when its agent endpoint is on
    app_container(broken)["lifecycle"]["preStop"]["sleep"]["seconds"] = 0
    app_container(broken)["env"] += [{"name": "APF_AGENT_BIND", "value": "127.0.0.1:9200"},
                                     {"name": "APF_AGENT_DRAIN_DELAY", "value": "4"}]
    only(broken, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    assert grace_problems(broken, cfg) == []
    del app_container(broken)["env"][-2:]
    assert "nothing keeps the pod serving" in grace_problems(broken, cfg)[0]


def test_the_command_runs_a_worker_class_apf_gunicorn_accepts(docs, monkeypatch):
    cfg = gunicorn_config(docs, monkeypatch)
    assert cfg.worker_class_str == "apf_gunicorn.gthread.worker.ApfThreadWorker"
    assert check_worker_class(cfg.worker_class, cfg) is None
    broken = copy.deepcopy(docs)
    app_container(broken)["command"].insert(1, "--worker-class=gthread")
    cfg = gunicorn_config(broken, monkeypatch)
    assert "is not supported" in check_worker_class(cfg.worker_class, cfg)


def test_resources_and_threads_follow_the_workers(docs, mount, monkeypatch):
    cfg = gunicorn_config(docs, monkeypatch)
    assert (cfg.workers, cfg.threads) == (2, 32)  # as deploy/kubernetes/README.md says
    assert resource_problems(docs, cfg, mount) == []
    broken = copy.deepcopy(docs)
    broken_cfg = gunicorn_config(broken, monkeypatch)
    broken_cfg.set("threads", 16)  # 2 x 14 threads: the 16 seats and 12 of the 24 queued
    (problem,) = resource_problems(broken, broken_cfg, mount)
    assert "plus only 12 waiting requests" in problem and "allows 24 queued" in problem
    broken_cfg.set("threads", 32)
    broken_cfg.set("workers", 3)
    assert [p.split(":")[0] for p in resource_problems(broken, broken_cfg, mount)] == [
        "cpu limit 2 < 3 workers", "cpu request 1 < half a core per worker",
        "memory limit 256Mi < 312 MiB"]


def test_the_pods_environment_has_no_unknown_apf_variable(docs, mount):
    assert environment_problems(docs, mount) == []
    broken = copy.deepcopy(docs)
    del only(broken, "Deployment")["spec"]["template"]["spec"]["enableServiceLinks"]
    assert any("APF_EXAMPLE_SERVICE_HOST" in w for w in environment_problems(broken, mount))


def test_the_service_exposes_the_app_and_the_scraped_admin_endpoint(docs):
    assert service_problems(docs) == []
    broken = copy.deepcopy(docs)
    del app_container(broken)["env"][1]  # APF_ADMIN_BIND: the default, on loopback
    assert service_problems(broken) == [
        "the admin endpoint listens on 127.0.0.1:9180: Prometheus cannot reach it from another "
        "pod"]


def image_app_dir(root: Path) -> Path:
    """The image's working directory as the Dockerfile's last stage fills it (its COPY lines
    after ``WORKDIR``), under ``root``; apf_gunicorn and its dependencies are this venv's."""
    text = (DEPLOY / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM "):]
    assert "WORKDIR /app" in final
    for line in re.findall(r"^COPY (?!--)(.+)$", final, re.M):
        *sources, target = line.split()
        dest = root / target
        dest.mkdir(parents=True, exist_ok=True)
        for source in sources:
            (dest / Path(source).name).write_bytes((ROOT / source).read_bytes())
    return root


def test_the_dockerfile_copies_what_the_command_serves(docs):
    text = (DEPLOY / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (?!--)(.+)$", text, re.M):
        *sources, _target = line.split()
        missing = [s for s in sources if not (ROOT / s).exists()]
        assert not missing, f"Dockerfile copies {missing}, not in the checkout"
    assert f"-t {app_container(docs)['image']} ." in text  # its build command's tag


@pytest.mark.server
def test_the_container_command_serves_its_probes_exempt(docs, mount, tmp_path):
    """The container's command and environment on 127.0.0.1 (the binds moved to free ports,
    APF_CONFIG at the kubelet-style mount), in a directory holding what the Dockerfile copies
    into the image's /app:
    it starts without a warning, each probe's request as the kubelet sends it answers 200
    through the ConfigMap's probes FlowSchema on the exempt level (the UID headers), and the
    admin endpoint serves /metrics."""
    container = app_container(docs)
    port, admin = free_port(), free_port()
    instance = "k" + uuid.uuid4().hex[:10]
    argv = [GUNICORN if a == "gunicorn" else
            f"--bind=127.0.0.1:{port}" if a.startswith("--bind=") else a
            for a in container["command"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("APF_")}
    env.update(container_env(docs), APF_CONFIG=str(mount), APF_INSTANCE=instance,
               APF_ADMIN_BIND=f"127.0.0.1:{admin}")
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=image_app_dir(tmp_path / "app"), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, port, instance, log_path, tmp_path / "unused")
    try:
        def answered(path):
            try:
                return server.request(path, headers=KUBELET_HEADERS, timeout=5)
            except OSError:
                return None
        assert server.wait_for(lambda: proc.poll() is not None or "apf: ready" in server.log())
        assert proc.poll() is None, server.log()
        # the ConfigMap's objects carry no uid: the server sends the one derived from the name
        expected = {"X-Kubernetes-PF-FlowSchema-UID": derived_uid("FlowSchema", "probes"),
                    "X-Kubernetes-PF-PriorityLevel-UID": derived_uid(
                        "PriorityLevelConfiguration", "exempt")}
        for kind in PROBES:
            path = container[kind]["httpGet"]["path"]
            got = server.wait_for(lambda p=path: proc.poll() is not None or answered(p))
            assert proc.poll() is None and got and got[0] == 200, (kind, got, server.log())
            assert {k: got[1].get(k) for k in expected} == expected, (kind, got[1])
        admin_server = Server(proc, admin, instance, log_path, None)
        status, _, body = admin_server.request("/metrics", timeout=10)
        assert status == 200 and b"apf_current_limit_seats" in body
        # deploy/kubernetes/README.md's `apf-gunicorn dump levels --admin 127.0.0.1:9180`, run
        # in the pod: the ConfigMap's levels are the live ones
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["dump", "levels", "--admin", f"127.0.0.1:{admin}"]) == 0
        assert {line.split(",")[0].strip() for line in out.getvalue().splitlines()[1:]} >= {
            "users", "anonymous", "exempt", "catch-all"}, out.getvalue()
        assert "apf-gunicorn dump levels --admin 127.0.0.1:9180" in (DEPLOY / "README.md").read_text()
        (segment,) = server.shm_entries()
        assert os.path.getsize(f"/dev/shm/{segment}") <= LEDGER_MIB * 2**20
        warnings = [line for line in server.log().splitlines()
                    if "[WARNING]" in line or "[ERROR]" in line]
        assert not warnings, warnings
    finally:
        stop(proc)
