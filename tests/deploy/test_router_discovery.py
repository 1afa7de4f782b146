"""The router, run with the manifest's own arguments, finds the replicas Kubernetes shows it.

No cluster: vllm-router (the pinned wheel, the one the router image installs) reads a
kubeconfig that points at FakeKubeAPI, which serves the pods of the namespace: two
appliance replicas (the real HTTP app over a fake engine, on 127.0.0.2 and 127.0.0.3, the
pods' IPs), a third appliance pod that is not Ready, and a router pod. Only the host and
ports move to loopback; the selector, namespace and policy are the rendered Deployment's.
What the router asks the API for must be what router-rbac.yaml grants, and a replica that
is deleted (terminating) or turns not Ready must leave the rotation.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ServerConfig
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from appliance.metrics import ApplianceMetrics
from engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeLLMEngine
from tests.support.fake_kube_api import TOKEN, FakeKubeAPI, fake_kube_api, pod
from tests.support.kubernetes import one, render
from tests.support.waiting import HANG_S, wait_for

OVERLAY = "overlays/cpu"
REPLICA_IPS = ("127.0.0.2", "127.0.0.3")
CHAT_ROUTE = "/v1/chat/completions"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _router_exe() -> str:
    exe = Path(sys.executable).with_name("vllm-router")
    found = str(exe) if exe.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed (dev extra)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    ip: str
    server: BackgroundServer
    metrics: ApplianceMetrics

    def arrivals(self, route: str) -> int:
        """HTTP responses this replica gave on `route`, whatever their status."""
        return int(
            sum(
                s.value
                for f in self.metrics.registry.collect()
                if f.name == "appliance_http_responses"
                for s in f.samples
                if s.name.endswith("_total") and s.labels["route"] == route
            )
        )


@contextmanager
def _replicas() -> Iterator[list[Replica]]:
    """The appliance's HTTP app on each REPLICA_IPS address, all on one port (as pods)."""
    with ExitStack() as stack:
        replicas: list[Replica] = []
        port = 0
        for ip in REPLICA_IPS:
            aeng = AsyncEngine(FakeLLMEngine())
            stack.callback(lambda a=aeng: asyncio.run(a.shutdown()))  # after its server stops
            metrics = ApplianceMetrics(aeng)
            cfg = ServerConfig(host=ip)
            server = BackgroundServer(build_app(aeng, cfg, metrics=metrics), cfg, port).start()
            stack.callback(server.stop)
            port = server.port
            replicas.append(Replica(ip, server, metrics))
        yield replicas


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


def _router_metrics(url: str) -> dict[str, list]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _active_workers(metrics_url: str) -> float:
    return _router_metrics(metrics_url)["vllm_router_active_workers"][0].value


@pytest.fixture
def routed(tmp_path) -> Iterator[tuple[FakeKubeAPI, list[Replica], str, str]]:
    objs = render(OVERLAY)
    deployment = one(objs, "Deployment", "appliance-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    namespace = deployment["metadata"]["namespace"]
    server_labels = one(objs, "Deployment", "appliance")["spec"]["template"]["metadata"]["labels"]
    router_labels = deployment["spec"]["template"]["metadata"]["labels"]
    exe = _router_exe()
    with _replicas() as replicas:
        pods = [
            pod("appliance-a", namespace, REPLICA_IPS[0], server_labels),
            pod("appliance-b", namespace, REPLICA_IPS[1], server_labels),
            pod("appliance-starting", namespace, "127.0.0.4", server_labels, ready=False),
            pod("appliance-router-x", namespace, "127.0.0.5", router_labels),
        ]
        with fake_kube_api(namespace, pods) as api:
            port, metrics_port = _free_port(), _free_port()
            args = [a.replace("$(POD_NAMESPACE)", namespace) for a in container["args"]]
            args = _set_flag(args, "--host", "127.0.0.1")
            args = _set_flag(args, "--port", str(port))
            args = _set_flag(args, "--prometheus-host", "127.0.0.1")
            args = _set_flag(args, "--prometheus-port", str(metrics_port))
            args = _set_flag(args, "--service-discovery-port", str(replicas[0].server.port))
            env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
            env["KUBECONFIG"] = str(api.kubeconfig(tmp_path / "kubeconfig"))
            log = (tmp_path / "router.log").open("w")
            proc = subprocess.Popen([exe, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                yield api, replicas, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
            finally:
                proc.terminate()
                proc.wait(HANG_S)
                log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readiness", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _send_and_count(url: str, replicas: list[Replica], n: int) -> list[int]:
    """Sends `n` chat requests through the router; how many reached each replica. A
    replica counts a response once it is sent, so the total is awaited, not read."""
    before = [r.arrivals(CHAT_ROUTE) for r in replicas]
    for _ in range(n):
        httpx.post(f"{url}{CHAT_ROUTE}", json=CHAT, timeout=HANG_S)

    def reached() -> list[int]:
        return [r.arrivals(CHAT_ROUTE) - b for r, b in zip(replicas, before, strict=True)]

    wait_for(lambda: sum(reached()) == n, f"{n} requests answered by the replicas")
    return reached()


def test_the_router_routes_to_the_ready_replicas_it_discovers(routed) -> None:
    api, replicas, url, metrics_url = routed
    wait_for(lambda: _ready(url) and _active_workers(metrics_url) == 2, "router with 2 workers")
    health = _router_metrics(metrics_url)["vllm_router_worker_health"]
    port = replicas[0].server.port
    assert {s.labels["worker"] for s in health} == {f"http://{ip}:{port}" for ip in REPLICA_IPS}

    # What the router asked the API: the pods of its namespace, list then watch, with its
    # token: the verbs router-rbac.yaml's Role grants.
    objs = render(OVERLAY)
    role = one(objs, "Role", "appliance-router")
    granted = {v for rule in role["rules"] for v in rule["verbs"]}
    paths = {path for path, _, _ in api.requests}
    assert paths == {f"/api/v1/namespaces/{api.namespace}/pods"}
    verbs = {"watch" if q.get("watch") else "list" for _, q, _ in api.requests}
    assert verbs == {"list", "watch"} and verbs <= granted
    assert {auth for _, _, auth in api.requests} == {f"Bearer {TOKEN}"}

    _send_and_count(url, replicas, 4)


@pytest.mark.parametrize(
    "change",
    [
        # Deleted (scale-down, rollout, eviction): marked terminating at once, still Ready,
        # while its preStop pause runs and before it gets SIGTERM.
        {"ready": True, "terminating": True},
        # Its readiness probe fails: /ready says 503 (draining, engine stopped accepting).
        {"ready": False},
    ],
    ids=["terminating", "not-ready"],
)
def test_a_replica_leaves_the_rotation_when_it_stops_being_eligible(routed, change) -> None:
    api, replicas, url, metrics_url = routed
    wait_for(lambda: _ready(url) and _active_workers(metrics_url) == 2, "router with 2 workers")
    api.modify("appliance-b", **change)
    wait_for(lambda: _active_workers(metrics_url) == 1, "the replica removed")
    assert _send_and_count(url, replicas, 4) == [4, 0]
