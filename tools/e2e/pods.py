"""Pods rendered from the shipped kustomizations, through the components in ``manifests/``.

``kubectl kustomize tools/e2e/manifests/<name>`` renders the shipped base, the hardened overlay or
the confidential-app example with the components that say what differs on the e2e node
(``this-machine``) and that nothing can be pulled (``no-pull``). A
DaemonSet becomes a static pod as the DaemonSet controller makes its pods: the pod template's
metadata and spec as they are, the DaemonSet's name and namespace. Other kinds (the
ServiceAccount) have no meaning to a standalone kubelet and are dropped.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

MANIFESTS = Path(__file__).resolve().parent / "manifests"
PLUGIN_CONTAINER = "pcc-device-plugin"
CONSUMER_CONTAINER = "app"


def render(name: str) -> list[Obj]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(MANIFESTS / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {MANIFESTS / name}: {result.stderr.strip()}")
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def _the(objects: list[Obj], kind: str) -> Obj:
    (found,) = (obj for obj in objects if obj["kind"] == kind)
    return found


def plugin_pod(name: str) -> Obj:
    """The plugin's static pod from the DaemonSet that `name` (plugin, plugin-hardened) renders."""
    daemonset = _the(render(name), "DaemonSet")
    template = daemonset["spec"]["template"]
    metadata = {
        "name": daemonset["metadata"]["name"],
        "namespace": daemonset["metadata"]["namespace"],
        **{key: template["metadata"][key] for key in ("labels", "annotations")},
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def yardstick_pod(binary: Path) -> Obj:
    """The base's pod with the Go yardstick (tools/e2e/yardstick) in place of the plugin's
    process: the same name, resources, privileges and device-plugin directory, so that kubelet
    and the kernel treat both alike; the binary from the node's `binary`, mounted read-only; no
    probes and no port, which the yardstick does not serve."""
    pod = plugin_pod("plugin")
    spec = pod["spec"]
    (container,) = spec["containers"]
    for key in ("args", "livenessProbe", "readinessProbe", "ports"):
        container.pop(key, None)
    container["command"] = [f"/yardstick/{binary.name}"]
    container["volumeMounts"].append(
        {"name": "yardstick", "mountPath": "/yardstick", "readOnly": True}
    )
    spec["volumes"].append(
        {"name": "yardstick", "hostPath": {"path": str(binary.parent), "type": "Directory"}}
    )
    return pod


def consumer_pod(namespace: str, name: str) -> Obj:
    """The confidential-app example, named `name` in `namespace`."""
    pod = _the(render("consumer"), "Pod")
    pod["metadata"]["name"] = name
    pod["metadata"]["namespace"] = namespace
    return pod


def cluster_consumer_pod() -> Obj:
    """The confidential-app example as the cluster runs it (its image the only change)."""
    return _the(render("cluster-consumer"), "Pod")


def cluster_dra_consumer() -> tuple[Obj, Obj]:
    """The dra-app example as the cluster runs it (its image the only change): its
    ResourceClaimTemplate and its pod."""
    objects = render("cluster-dra-consumer")
    return _the(objects, "ResourceClaimTemplate"), _the(objects, "Pod")


def images(pod: Obj) -> set[str]:
    return {container["image"] for container in pod["spec"]["containers"]}


def dump(pod: Obj) -> str:
    return yaml.safe_dump(pod, sort_keys=False)
