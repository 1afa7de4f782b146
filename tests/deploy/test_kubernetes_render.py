"""deploy/kubernetes renders with kustomize and every object validates offline.

Core objects are checked whole against the strict Kubernetes schemas of the oldest minor
version the manifests support and of the newest the pinned kubernetes-validate ships.
Custom resources (KServe's ServingRuntime and InferenceService, the Prometheus Operator's
PodMonitor) have no schema there; their core parts are validated against the core
definitions, and tests/deploy/test_kserve_manifests.py checks their own fields.
"""

from __future__ import annotations

import pytest
from kubernetes_validate import ValidationError

from tests.support.kubernetes import (
    SCHEMA_VERSIONS,
    embedded_errors,
    load_file,
    one,
    pod_containers,
    render,
    validate_object,
)

KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "overlays/cpu-kv-tier-pvc", "kserve")
PLAIN_MANIFESTS = ("jobs/fill-models.yaml", "autoscaling/podmonitor.yaml")
# Objects no Kubernetes release defines: (apiVersion, kind).
CUSTOM_KINDS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    ("serving.kserve.io/v1beta1", "InferenceService"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}
STACK_KINDS = {
    "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "PersistentVolumeClaim",
    "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler",
}  # fmt: skip


def _core(objs):
    return [o for o in objs if (o["apiVersion"], o["kind"]) not in CUSTOM_KINDS]


@pytest.mark.parametrize(
    "rel", ("base", "overlays/cpu", "overlays/gpu", "overlays/cpu-kv-tier-pvc")
)
def test_each_overlay_renders_the_whole_stack_with_unique_names(rel: str) -> None:
    objs = render(rel)
    assert STACK_KINDS <= {o["kind"] for o in objs}
    keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), keys
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"} == {
        "appliance",
        "appliance-router",
    }
    if rel != "base":  # the overlays pick the namespace; RBAC subjects follow it
        assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {
            "appliance"
        }
        binding = one(objs, "RoleBinding")
        assert [s.get("namespace") for s in binding["subjects"]] == ["appliance"]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_core_objects_validate_against_the_strict_kubernetes_schemas(
    rel: str, version: str
) -> None:
    objs = _core(render(rel))
    assert objs
    for obj in objs:
        try:
            validate_object(obj, version)
        except ValidationError as e:
            pytest.fail(f"{rel}: {obj['kind']}/{obj['metadata']['name']} on {version}: {e}")


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("rel", PLAIN_MANIFESTS)
def test_plain_manifests_validate_too(rel: str, version: str) -> None:
    for obj in _core(load_file(rel)):
        validate_object(obj, version)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_custom_resources_core_parts_validate(version: str) -> None:
    kserve = render("kserve")
    runtime = one(kserve, "ServingRuntime")
    errors = []
    for c in pod_containers(runtime["spec"]):
        errors += embedded_errors(c, "container-v1", version)
    for v in runtime["spec"]["volumes"]:
        errors += embedded_errors(v, "volume-v1", version)
    predictor = one(kserve, "InferenceService")["spec"]["predictor"]
    if "resources" in predictor["model"]:
        errors += embedded_errors(
            predictor["model"]["resources"], "resourcerequirements-v1", version
        )
    monitor = one(load_file("autoscaling/podmonitor.yaml"), "PodMonitor")
    errors += embedded_errors(monitor["spec"]["selector"], "labelselector-meta-v1", version)
    assert not errors, errors


def test_the_validation_catches_a_misspelt_field_and_a_bad_value() -> None:
    """The checks above can fail: strict schemas reject what the API server would."""
    deployment = one(render("overlays/gpu"), "Deployment", "appliance")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(ValidationError, match="readinesProbe"):
        validate_object(deployment, SCHEMA_VERSIONS[-1])

    runtime = one(render("kserve"), "ServingRuntime")
    runtime["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    errors = embedded_errors(runtime["spec"]["containers"][0], "container-v1", SCHEMA_VERSIONS[-1])
    assert any("containerPort" in e for e in errors), errors
