"""Rendering and reading the shipped manifests for tests: kubectl kustomize, YAML, paths.

Every kustomization under manifests/ is rendered with ``kubectl kustomize`` (the kustomize built
into kubectl, as operators run it). Without kubectl the tests that need it are skipped with the
reason, except under CI (``CI`` set) or ``nox -s manifests`` (``PCC_REQUIRE_KUBECTL=1``), where
a missing kubectl fails them: the checks must really run there. The same holds for NFD's CRDs,
which ``nox -s manifests`` fetches with a file of NFD's source and names in ``PCC_NFD_MODULE``.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

import pytest
import yaml

import pcc_plugin

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"

# Offline schema validation (kubernetes-validate, strict: unknown fields are errors) covers
# every Kubernetes minor version in this range: upstream's supported releases (1.35 to 1.37 on
# 2026-12-07), the range docs/deploy.md claims.
OLDEST_KUBERNETES = (1, 35)
NEWEST_KUBERNETES = (1, 37)
KUBERNETES_VERSIONS = tuple(
    f"{OLDEST_KUBERNETES[0]}.{minor}.0"
    for minor in range(OLDEST_KUBERNETES[1], NEWEST_KUBERNETES[1] + 1)
)

NAME = "pcc-device-plugin"
NAMESPACE = "kube-system"
RESOURCE = "tke.cloud.tencent.com/pcc-device"
NODE_LABEL = "tke.cloud.tencent.com/pcc-device-plugin"
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
HOST_ROOT = "/host"
DEVICE = "/dev/sev-guest"
PCC_DIR = "/var/run/pcc"
DEFAULT_IMAGE = "localhost/pcc-device-plugin"
# The daemon's defaults for --metrics-bind-address and --cdi-spec-dir (pcc_plugin/flags.py).
METRICS_BIND_ADDRESS = ":8080"
CDI_SPEC_DIR = "/var/run/cdi"

Obj = dict[str, Any]

# Kinds that are not in the Kubernetes API, so not in kubernetes-validate's schemas: each is
# validated instead against this schema, written from its CRD (strict like kubernetes-validate:
# a field it does not list is an error). It lists only the fields the manifests use, so a
# manifest that needs another field must add it here, checked against the CRD.
_LABEL_SELECTOR: Obj = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
}
# monitoring.coreos.com_podmonitors.yaml of the Prometheus Operator (field names as in v0.91.0).
PODMONITOR_SCHEMA: Obj = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"port": {"type": "string"}, "path": {"type": "string"}},
                    },
                },
            },
        },
    },
}
CUSTOM_RESOURCES: dict[tuple[str, str], Obj] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR_SCHEMA,
}
# Node Feature Discovery's rule (manifests/components/node-feature-rule) is validated against
# the whole schema of NFD's own CRD instead, at the version noxfile.py pins.
NODE_FEATURE_RULE = ("nfd.k8s-sigs.io/v1alpha1", "NodeFeatureRule")


def required(message: str) -> NoReturn:
    """Skip the test with `message`, or fail it where the checks must run (CI, nox)."""
    if os.environ.get("CI") or os.environ.get("PCC_REQUIRE_KUBECTL"):
        pytest.fail(message)
    pytest.skip(message)


def strict(schema: Obj) -> Obj:
    """A CRD's structural schema as the API server applies it to a request that kubectl sends
    with --validate=strict (its default): a field that an object's `properties` do not list is
    an error, unless the object keeps unknown fields."""
    schema = copy.deepcopy(schema)

    def visit(node: object) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


# What of Node Feature Discovery's Go module the checks read (noxfile.py pins the module).
NFD_CRDS = "deployment/base/nfd-crds/nfd-api-crds.yaml"
NFD_KERNEL_SOURCE = "source/kernel/kernel.go"


@functools.cache
def crd_schema(path: Path, api_version: str, kind: str) -> Obj:
    """The strict openAPIV3Schema of `kind` at `api_version` among the CRDs in `path`, for
    JSON Schema draft 4, which OpenAPI 3.0's schema objects follow."""
    group, _, version = api_version.partition("/")
    for crd in yaml.safe_load_all(path.read_text()):
        if not crd or crd["spec"]["group"] != group or crd["spec"]["names"]["kind"] != kind:
            continue
        for served in crd["spec"]["versions"]:
            if served["name"] == version and served["served"]:
                schema: Obj = served["schema"]["openAPIV3Schema"]
                return {"$schema": "http://json-schema.org/draft-04/schema#", **strict(schema)}
    raise AssertionError(f"{path} defines no served {kind} {api_version}")


def nfd_file(name: str) -> Path:
    """A file of NFD's Go module, as `nox -s manifests` fetched it (PCC_NFD_MODULE)."""
    directory = os.environ.get("PCC_NFD_MODULE")
    if not directory:
        required("NFD's CRD and source are fetched by `nox -s manifests` (PCC_NFD_MODULE)")
    return Path(directory) / name


def custom_resource_schema(obj: Obj) -> Obj | None:
    """The schema of a kind listed above or of the NodeFeatureRule (NFD's CRD); None for every
    other kind, which kubernetes-validate checks (and fails when it does not know the kind)."""
    key = (obj["apiVersion"], obj["kind"])
    if key == NODE_FEATURE_RULE:
        return crd_schema(nfd_file(NFD_CRDS), *key)
    return CUSTOM_RESOURCES.get(key)


def is_custom_resource(obj: Obj) -> bool:
    """Not in the Kubernetes API: validated by custom_resource_schema, not kubernetes-validate."""
    return (obj["apiVersion"], obj["kind"]) in {*CUSTOM_RESOURCES, NODE_FEATURE_RULE}


def project_version() -> str:
    return pcc_plugin.__version__


def kustomizations() -> list[str]:
    """Every directory under manifests/ that kubectl kustomize can build, relative to the root.

    Components (kind: Component) build only as part of another kustomization.
    """
    found = []
    for path in sorted(MANIFESTS.rglob("kustomization.yaml")):
        data = yaml.safe_load(path.read_text())
        if data.get("kind", "Kustomization") == "Kustomization":
            found.append(path.parent.relative_to(ROOT).as_posix())
    return found


def components() -> list[str]:
    return sorted(
        path.parent.relative_to(ROOT).as_posix()
        for path in MANIFESTS.rglob("kustomization.yaml")
        if yaml.safe_load(path.read_text()).get("kind") == "Component"
    )


def kubectl() -> str:
    """kubectl's path; skips the test without it, or fails it where the checks must run."""
    found = shutil.which("kubectl")
    if found:
        return found
    required(
        "kubectl is not installed: the manifest checks render with `kubectl kustomize` "
        "(Debian package kubectl; .ci/run installs it)"
    )


@functools.cache
def _render(directory: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", directory],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return result.stdout


def render(directory: str) -> list[Obj]:
    """The objects ``kubectl kustomize DIRECTORY`` prints (a fresh copy on every call)."""
    return [obj for obj in yaml.safe_load_all(_render(directory)) if obj is not None]


def the(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    matches = [
        obj
        for obj in objects
        if obj["kind"] == kind and (name is None or obj["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def daemonsets(directory: str) -> list[Obj]:
    return [obj for obj in render(directory) if obj["kind"] == "DaemonSet"]


def plugin_container(daemonset: Obj) -> Obj:
    containers: list[Obj] = daemonset["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [NAME]
    return containers[0]


def flag(container: Obj, name: str, default: str) -> str:
    """The value of ``--name=value`` in the container's args (the form the manifests use)."""
    values = [
        arg.split("=", 1)[1] for arg in container.get("args", []) if arg.startswith(f"--{name}=")
    ]
    assert len(values) <= 1, f"--{name} given {len(values)} times"
    return values[0] if values else default


def host_mounts(daemonset: Obj) -> Iterator[tuple[Obj, Obj]]:
    """(volumeMount, hostPath volume source) for each of the container's hostPath mounts."""
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"].get("volumes", [])}
    for mount in plugin_container(daemonset).get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            yield mount, volume["hostPath"]


def mount_showing(daemonset: Obj, container_path: str) -> tuple[Obj, Obj]:
    """The hostPath mount through which the container sees ``container_path`` (deepest wins)."""
    target = PurePosixPath(container_path)
    covering = [
        (mount, source)
        for mount, source in host_mounts(daemonset)
        if PurePosixPath(mount["mountPath"]) in (target, *target.parents)
    ]
    assert covering, f"no hostPath mount shows {container_path} in the container"
    return max(covering, key=lambda pair: len(PurePosixPath(pair[0]["mountPath"]).parts))
