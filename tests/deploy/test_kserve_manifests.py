"""deploy/kubernetes/kserve: the ServingRuntime and InferenceService fit the appliance.

KServe's CRDs are not in kubernetes-validate (and the full ones run to megabytes), so the
fields KServe reads are checked here one by one against what KServe does with them (the
model files at /mnt/models, {{.Name}} replaced by the InferenceService's name, the first
container port behind the Service's port 80 in RawDeployment mode) and against the
appliance's own config, loaded with the runtime's arguments.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from appliance.cli import build_parser
from appliance.config import AppConfig, load_config
from appliance.grpc.server import GrpcSettings
from appliance.http.app import ENDPOINTS
from tests.support.kubernetes import one, render

# Where KServe puts an InferenceService's storageUri for the runtime to read.
KSERVE_MODEL_DIR = "/mnt/models"
NAME_TEMPLATE = "{{.Name}}"


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return render("kserve")


@pytest.fixture(scope="module")
def runtime(objs) -> dict[str, Any]:
    return one(objs, "ServingRuntime")


@pytest.fixture(scope="module")
def isvc(objs) -> dict[str, Any]:
    return one(objs, "InferenceService")


@pytest.fixture(scope="module")
def container(runtime) -> dict[str, Any]:
    (c,) = runtime["spec"]["containers"]
    assert c["name"] == "kserve-container"  # the name KServe merges the predictor into
    return c


@pytest.fixture
def cfg(objs, runtime, isvc, container, tmp_path) -> AppConfig:
    """The config `appliance serve` builds in the predictor pod."""
    args = [a.replace(NAME_TEMPLATE, isvc["metadata"]["name"]) for a in container["args"]]
    parsed = build_parser().parse_args(["serve", *args])
    volume = next(v for v in runtime["spec"]["volumes"] if "configMap" in v)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    config_map = one(objs, "ConfigMap", volume["configMap"]["name"])
    key = Path(parsed.config).relative_to(mount["mountPath"]).as_posix()
    path = tmp_path / key
    path.write_text(config_map["data"][key])
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    assert env.get("APPLIANCE_CONFIG", parsed.config) == parsed.config
    return load_config(path, parsed.overrides, env)


def test_the_inference_service_selects_this_runtime_and_protocol(runtime, isvc) -> None:
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    # Only KServe v2 over gRPC: the HTTP port speaks OpenAI's API, not v2 REST.
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2"]
    assert model["protocolVersion"] == "grpc-v2"
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    # KServe names Services after it: a DNS-1035 label.
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", isvc["metadata"]["name"])


def test_the_model_is_served_under_the_inference_service_name(cfg, isvc) -> None:
    assert cfg.model.path == KSERVE_MODEL_DIR
    assert cfg.model.served_name == isvc["metadata"]["name"]
    # KServe's ModelInfer addresses that name: the gRPC frontend takes the engine's.
    assert GrpcSettings.from_server_config(cfg.server).model_name is None


def test_grpc_comes_first_and_both_ports_match_the_config(cfg, container) -> None:
    assert cfg.server.host == "0.0.0.0"
    first, *rest = container["ports"]
    assert (first["name"], first["containerPort"]) == ("h2c", cfg.server.grpc_port)
    assert [p["containerPort"] for p in rest] == [cfg.server.http_port]
    assert container["readinessProbe"]["grpc"]["port"] == cfg.server.grpc_port
    for probe in ("startupProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert ("GET", get["path"]) in ENDPOINTS and get["port"] == cfg.server.http_port


def test_the_grace_period_outlasts_the_prestop_pause_and_the_drain(cfg, isvc, container) -> None:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    grace = isvc["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace > int(command[1]) + cfg.server.shutdown_grace_s


def test_one_gpu_per_tensor_parallel_rank(cfg, container) -> None:
    resources = container["resources"]
    tp = cfg.parallel.tensor_parallel_size
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == tp


def test_the_storage_uri_is_the_gpu_overlays_model_on_the_same_claim(isvc, tmp_path) -> None:
    uri = isvc["spec"]["predictor"]["model"]["storageUri"]
    claim, _, subdir = uri.removeprefix("pvc://").partition("/")
    gpu = render("overlays/gpu")
    assert claim == one(gpu, "PersistentVolumeClaim")["metadata"]["name"]
    config = one(gpu, "ConfigMap")["data"]["config.yaml"]
    path = tmp_path / "config.yaml"
    path.write_text(config)
    assert Path(load_config(path).model.path).name == subdir
