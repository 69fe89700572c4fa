"""deploy/ parses, and names the flags, paths, ports and metrics the daemon really has:
each file's daemon flags go through the daemon's own flag parser and configuration
checks; the dashboard's queries name only declared metrics and cover all of them."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from tiercache_service import config as service_config
from tiercache_service.config import ServiceConfig, host_port
from tiercache_service.metrics import METRICS
from tiercache_service.server import SERVICE_NAME
from tests.service.daemon import needs_promtool
from tiercache_service.handover import handover_path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def daemon_config(argv: list[str]) -> ServiceConfig:
    """What `tiercache serve ARGV` would run with (no file, no environment)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    service_config.add_flags(parser)
    args = parser.parse_args(argv)
    return service_config.load(None, environ={},
                               flags={f.name: getattr(args, f.name) for f in fields(ServiceConfig)})


def documents(name: str) -> dict[str, list[dict]]:
    """deploy/kubernetes/NAME's objects by kind."""
    found: dict[str, list[dict]] = {}
    for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()):
        found.setdefault(d["kind"], []).append(d)
    return found


def pod() -> dict:
    return documents("pod.yaml")["Pod"][0]


def check_socket_mounts(daemon: dict, worker: dict, config: ServiceConfig) -> tuple[str, str]:
    """The socket's directory is mounted by both containers at the same place, and the
    worker's client is pointed at it; returns the volumes the daemon and the worker
    mount there."""
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (daemon, worker)}
    socket_dir = str(Path(config.socket_path).parent)
    assert socket_dir in mounts[daemon["name"]] and socket_dir in mounts[worker["name"]]
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["TIERCACHE_ADDRESS"] == f"unix:{config.socket_path}"
    # ... and finds the buffer handover beside it
    assert Path(handover_path(config.socket_path)).parent == Path(socket_dir)
    return mounts[daemon["name"]][socket_dir], mounts[worker["name"]][socket_dir]


def check_ports_and_probes(daemon: dict, annotations: dict, config: ServiceConfig) -> None:
    """Metrics and health listen on the pod's address, where Prometheus and the kubelet
    connect; the probes and the scrape annotations name those ports."""
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert host_port(config.metrics_address, "") == ("0.0.0.0", ports["metrics"])
    assert host_port(config.health_address, "") == ("0.0.0.0", ports["health"])
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    assert annotations["prometheus.io/path"] == "/metrics"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["grpc"]["port"] == ports["health"]
    assert daemon["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_the_pod_shares_socket_memory_and_gpu_and_probes_real_ports():
    spec = pod()["spec"]
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "tiercache")
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up first, down last
    config = daemon_config(sidecar["args"])
    assert check_socket_mounts(sidecar, worker, config) == ("socket", "socket")  # one volume
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["cache"] == config.data_dir
    # one GPU claim for both; one uid for both (the socket is 0600)
    assert sidecar["resources"]["claims"] == worker["resources"]["claims"] == [{"name": "gpu"}]
    assert "runAsUser" in spec["securityContext"] and not any(
        "runAsUser" in c.get("securityContext", {}) for c in (sidecar, worker))
    check_ports_and_probes(sidecar, pod()["metadata"]["annotations"], config)
    # the pod waits long enough for the drain, the grace and then some flushing
    assert spec["terminationGracePeriodSeconds"] > config.drain_seconds + config.grace_seconds
    # no Kubernetes service links (TIERCACHE_PORT=tcp://...) in the containers' environment
    assert spec["enableServiceLinks"] is False


def test_the_node_daemon_shares_host_directories_with_the_workers_of_its_node():
    found = documents("daemonset.yaml")
    template = found["DaemonSet"][0]["spec"]["template"]
    spec, worker_spec = template["spec"], found["Pod"][0]["spec"]
    daemon = next(c for c in spec["containers"] if c["name"] == "tiercache")
    worker = worker_spec["containers"][0]
    config = daemon_config(daemon["args"])
    socket_volume, workers_volume = check_socket_mounts(daemon, worker, config)
    # the socket's directory and the disk tier are directories of the node: the workers'
    # socket volume is the daemon's host directory
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    assert host[socket_volume] == str(Path(config.socket_path).parent)
    assert host[next(n for n, path in mounts.items() if path == config.data_dir)] == config.data_dir
    workers_host = {v["name"]: v["hostPath"]["path"] for v in worker_spec["volumes"]}
    assert workers_host[workers_volume] == host[socket_volume]
    # one uid for the daemon and every worker (the socket is 0600), and the directories
    # made the daemon's by an init container that runs as root
    uid = spec["securityContext"]["runAsUser"]
    assert worker_spec["securityContext"]["runAsUser"] == uid
    prepare = spec["initContainers"][0]
    assert prepare["securityContext"]["runAsUser"] == 0
    assert prepare["command"][:6] == ["install", "-d", "-o", str(uid), "-g", str(uid)]
    assert set(prepare["command"][8:]) == {m["mountPath"] for m in prepare["volumeMounts"]} == {
        str(Path(config.socket_path).parent), config.data_dir}
    # all of the node's GPUs, beside the workers' claims; CUDA IPC across pods
    claim = found["ResourceClaimTemplate"][0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert claim["allocationMode"] == "All" and claim["adminAccess"] is True
    namespace = found["Namespace"][0]["metadata"]
    assert namespace["labels"]["resource.kubernetes.io/admin-access"] == "true"
    assert found["DaemonSet"][0]["metadata"]["namespace"] == namespace["name"]
    assert spec["hostPID"] and spec["hostIPC"] and worker_spec["hostPID"] and worker_spec["hostIPC"]
    assert worker_spec["resourceClaims"][0]["resourceClaimTemplateName"] == \
        documents("pod.yaml")["ResourceClaimTemplate"][0]["metadata"]["name"]
    check_ports_and_probes(daemon, template["metadata"]["annotations"], config)
    assert spec["terminationGracePeriodSeconds"] > config.drain_seconds + config.grace_seconds


def dockerfile(name: str) -> dict[str, list[str]]:
    """Instructions by keyword, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / name).read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found.setdefault(keyword, []).append(rest.strip())
    return found


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_images_run_the_daemon_with_flags_it_has_and_expose_its_ports(name):
    image = dockerfile(name)
    assert json.loads(image["ENTRYPOINT"][0]) == ["tiercache", "serve"]
    config = daemon_config(json.loads(image["CMD"][0]))
    assert config.socket_path == "/run/tiercache/tiercache.sock"
    sidecar = pod()["spec"]["initContainers"][0]
    assert config.data_dir == next(m["mountPath"] for m in sidecar["volumeMounts"] if m["name"] == "cache")
    exposed = {int(p) for p in image["EXPOSE"][0].split()}
    assert exposed == {host_port(config.metrics_address, "")[1], host_port(config.health_address, "")[1]}
    # installed as the Makefile installs: its torch pin, then the package's own directories
    torch = re.search(r"^TORCH \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert any(f'pip install "{torch}"' in run for run in image["RUN"])
    assert {c.split()[0] for c in image["COPY"]} >= {"pyproject.toml", "tiercache", "service"}
    assert "setup.py" in " ".join(image["COPY"])  # it builds the C module
    assert any(run.startswith("pip install .") for run in image["RUN"])


def apt_installs(name: str) -> list[str]:
    """The packages the Dockerfile's `apt-get install` commands name."""
    packages = []
    for run in dockerfile(name).get("RUN", []):
        for command in run.split("&&"):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                packages += [w for w in words[2:] if not w.startswith("-")]
    return packages


def debian_release() -> str:
    """This machine's Debian release (codename), or "" elsewhere."""
    try:
        release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().split("\n")
                       if "=" in line)
    except OSError:
        return ""
    return release.get("VERSION_CODENAME", "").strip('"') if release.get("ID") == "debian" else ""


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_apt_packages_are_pinned_to_versions_of_the_images_debian_release(name):
    packages = apt_installs(name)
    assert all(re.fullmatch(r"[a-z0-9.+-]+=\S+", p) for p in packages), packages  # hadolint DL3008
    if not packages:
        return
    # the base image names its Debian release: its pins are that release's
    release = re.fullmatch(r"python:[\d.]+-slim-(\w+)", dockerfile(name)["FROM"][0]).group(1)
    if debian_release() != release or shutil.which("apt-cache") is None:
        pytest.skip(f"the pins are checked on Debian {release} (apt-cache madison)")
    for package in packages:
        package, version = package.split("=", 1)
        known = subprocess.run(["apt-cache", "madison", package], capture_output=True, text=True,
                               timeout=60).stdout
        if not known:
            pytest.skip("apt has no package lists here: run apt-get update")
        assert version in {line.split("|")[1].strip() for line in known.splitlines()}, (
            f"{package}={version} is not in Debian {release} (apt-cache madison: {known}): "
            f"pin the candidate of `apt-cache policy {package}`")


def unit() -> dict[str, str]:
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "systemd" / "tiercache.service").read_text())
    return dict(line.split("=", 1) for line in text.splitlines()
                if "=" in line and not line.startswith("#"))


def test_the_systemd_unit_runs_the_daemon_in_its_own_directories():
    settings = unit()
    argv = shlex.split(settings["ExecStart"])
    assert argv[0].endswith("/.venv/bin/tiercache") and argv[1] == "serve"  # made by `make env`
    config = daemon_config(argv[2:])
    assert Path(config.socket_path).parent == Path("/run") / settings["RuntimeDirectory"]
    assert Path(config.data_dir) == Path("/var/lib") / settings["StateDirectory"]
    assert host_port(config.metrics_address, "")[0] == "127.0.0.1"  # a host service: local only
    assert settings["KillSignal"] == "SIGTERM"
    assert float(settings["TimeoutStopSec"]) > config.grace_seconds
    # the venv's Python may live under /home (ProtectHome=yes would hide it); nothing
    # there is written, and /usr, /etc are read-only too
    assert settings["ProtectHome"] == "read-only" and settings["ProtectSystem"] == "strict"
    assert "make env PYTHON=/usr/bin/python3" in (DEPLOY / "systemd" / "tiercache.service").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    # verify checks that the program exists: point it at this environment's entry point
    program = Path(sys.executable).parent / "tiercache"
    if not program.exists():
        pytest.skip(f"{program} is missing: install the package (make env) first")
    text = (DEPLOY / "systemd" / "tiercache.service").read_text()
    (tmp_path / "tiercache.service").write_text(text.replace("/opt/tiercache/.venv/bin/tiercache",
                                                             str(program)))
    checked = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "tiercache.service")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and not checked.stderr.strip(), checked.stderr


def scrape_config() -> dict:
    return yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())


def test_prometheus_scrapes_the_ports_the_daemon_serves_metrics_on():
    jobs = {job["job_name"]: job for job in scrape_config()["scrape_configs"]}
    local = daemon_config(shlex.split(unit()["ExecStart"])[2:]).metrics_address
    assert jobs["tiercache"]["static_configs"][0]["targets"] == [local]
    keep = next(r for r in jobs["tiercache-pods"]["relabel_configs"]
                if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"])
    for containers in (pod()["spec"]["initContainers"],
                       documents("daemonset.yaml")["DaemonSet"][0]["spec"]["template"]["spec"]["containers"]):
        names = {p["name"] for c in containers for p in c.get("ports", ())}
        assert keep["action"] == "keep" and keep["regex"] in names


@needs_promtool
def test_promtool_accepts_the_scrape_config(tmp_path):
    # Debian's promtool is built without Kubernetes discovery: check everything else,
    # with the pods job given a static target instead
    config = scrape_config()
    for job in config["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": ["pod:9477"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "tiercache.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    return [t["expr"] for p in panels for t in p["targets"]]


def test_the_dashboard_queries_every_declared_metric_and_nothing_else():
    exposed = {m.exposed: m for m in METRICS.values()}
    used = set()
    for expr in queries():
        metrics = []
        for name in re.findall(r"\btiercache_\w+", expr):
            metric = exposed.get(name) or exposed.get(re.sub(r"_(bucket|sum|count)$", "", name))
            assert metric is not None, f"{name} in {expr!r} is not a metric the daemon serves"
            assert name == metric.exposed or metric.kind == "histogram", name
            metrics.append(metric)
        # every label it groups by is one its metrics have
        labels = {"le"}.union(*(m.labels for m in metrics))
        for grouped in re.findall(r"by \(([^)]*)\)", expr):
            assert {w.strip() for w in grouped.split(",")} <= labels, expr
        used |= {m.exposed for m in metrics}
    assert used == set(exposed)


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{n}", "expr": expr.replace("$__rate_interval", "5m")
                                                        .replace("$instance", ".*")}
        for n, expr in enumerate(queries())]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    checked = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_two_node_compose_file_shares_one_cluster_and_one_secret():
    compose = yaml.safe_load((DEPLOY / "compose" / "two-nodes.yaml").read_text())
    services = compose["services"]
    daemons = {name: daemon_config(s["command"]) for name, s in services.items()
               if name.startswith("tiercache-")}
    assert len(daemons) == 2
    # one cluster, one secret (so both mask keys alike), one remote namespace
    assert len({c.remote for c in daemons.values()}) == 1
    assert len({c.secret_path for c in daemons.values()}) == 1
    assert all(not c.remote_namespace for c in daemons.values())
    secret = next(iter(daemons.values())).secret_path
    assert all(s["secrets"][0]["target"] == secret for n, s in services.items() if n in daemons)
    # every node the URL names is a Redis service that the init job puts in the cluster
    nodes = {a.rsplit(":", 1)[0] for a in next(iter(daemons.values())).remote.split("//")[1].split(",")}
    redis = {n for n in services if re.fullmatch(r"redis-\d", n)}
    assert nodes == redis
    init = services["redis-init"]["command"]
    assert all(f"{n}:7000" in init for n in redis) and "--cluster create" in init
    # Redis as a cache: LRU eviction, no persistence, the rest serving while a node is down
    for name in redis:
        server = services[name]["command"]
        for setting in ("--cluster-enabled yes", "--maxmemory-policy allkeys-lru",
                        "--cluster-require-full-coverage no", "--appendonly no"):
            assert setting in server, (name, setting)
    # each daemon publishes KV events under its own pod name, on a port it exposes
    pods = {c.kv_events_pod for c in daemons.values()}
    assert len(pods) == 2
    for name, config in daemons.items():
        assert config.kv_events.endswith(":5557") and config.kv_events_replay.endswith(":5558")
        assert any(p.endswith(":5557") for p in services[name]["ports"])
