"""What operators install: the rendered manifests, the Containerfile, and the deploy docs.

The manifests are checked as ``kubectl kustomize`` renders them, so that an edit to a base, an
overlay or a patch cannot silently drop the node selector, the mounts, the requests or the
hardened settings. Every rendered object is validated offline against the Kubernetes schemas of
each minor version from OLDEST_KUBERNETES to NEWEST_KUBERNETES; the kinds outside the Kubernetes
API are validated against their CRDs instead: the Prometheus Operator's PodMonitor against the
fields of its CRD it uses (manifests_support.CUSTOM_RESOURCES), Node Feature Discovery's
NodeFeatureRule against the whole schema of NFD's own CRD, which ``nox -s manifests`` fetches.
The hardened deployments' security contexts are applied to the daemon itself, in either mode.
``nox -s manifests`` runs this file (and hadolint); without kubectl (or NFD's CRD, or root for
the security contexts) these tests skip, except under CI where they fail.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import attrs
import pytest
import trio
import yaml
from daemon_support import log_line
from dra_support import SHARES, DraNode, published, registered
from manifests_support import (
    CDI_SPEC_DIR,
    DEFAULT_IMAGE,
    DEVICE,
    HOST_ROOT,
    KUBERNETES_VERSIONS,
    METRICS_BIND_ADDRESS,
    NAME,
    NAMESPACE,
    NEWEST_KUBERNETES,
    NFD_KERNEL_SOURCE,
    NODE_LABEL,
    OLDEST_KUBERNETES,
    PCC_DIR,
    PLUGIN_DIR,
    RESOURCE,
    ROOT,
    Obj,
    components,
    custom_resource_schema,
    daemonsets,
    flag,
    host_mounts,
    is_custom_resource,
    kubectl,
    kustomizations,
    mount_showing,
    nfd_file,
    plugin_container,
    project_version,
    render,
    the,
)
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pcc_plugin import kernel, main
from pcc_plugin.configuration import read
from pcc_plugin.dra import node_facts
from pcc_plugin.flags import DEFAULT_DRIVER_NAME as DRIVER_NAME
from pcc_plugin.flags import parse
from pcc_plugin.profiles import load
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon, run_blocking

# Every kustomization, by what it deploys. A new one must be added here, so that the invariants
# below apply to it.
PRIVILEGED = [
    "manifests/base",
    "manifests/examples/custom-image",
    "manifests/overlays/no-surge",
    "manifests/overlays/profiles",
    "manifests/overlays/cdi",
    "manifests/overlays/node-feature-rule",
    "manifests/overlays/mixed-pool",
]
HARDENED = [
    "manifests/overlays/hardened",
    "manifests/examples/hardened-pcc-dir-only",
    "manifests/examples/hardened-cdi-podmonitor",
    "manifests/examples/hardened-tsm-report",
]
PLUGIN = PRIVILEGED + HARDENED
# Deployments that mount only the PCC directory itself (manifests/components/pcc-dir-only): the
# trade-off is written down there and in docs/deploy.md.
PCC_DIR_ONLY = ["manifests/examples/hardened-pcc-dir-only"]
# Deployments with an optional feature (manifests/components/<feature>); every other deployment
# must behave as the base does in that respect.
NO_SURGE = ["manifests/overlays/no-surge"]
PROFILES = ["manifests/overlays/profiles", "manifests/overlays/mixed-pool"]
CDI = ["manifests/overlays/cdi", "manifests/examples/hardened-cdi-podmonitor"]
PODMONITOR = ["manifests/examples/hardened-cdi-podmonitor"]
NODE_FEATURE_RULES = ["manifests/overlays/node-feature-rule"]
# Deployments that show the plugin the host's configfs (the TSM report directory, with
# --tsm-report) or securityfs (a vTPM's event log), which a container's own /sys lacks,
# read-only under /host.
TSM_REPORT = ["manifests/examples/hardened-tsm-report"]
SECURITYFS = ["manifests/overlays/mixed-pool"]
# The deployment each of these builds on: they add their features to it and change nothing else.
BUILT_ON = {
    "manifests/overlays/no-surge": "manifests/base",
    "manifests/overlays/profiles": "manifests/base",
    "manifests/overlays/cdi": "manifests/base",
    "manifests/overlays/node-feature-rule": "manifests/base",
    "manifests/overlays/mixed-pool": "manifests/base",
    "manifests/examples/hardened-cdi-podmonitor": "manifests/overlays/hardened",
    "manifests/examples/hardened-tsm-report": "manifests/overlays/hardened",
}
APPS = ["manifests/examples/confidential-app"]
# The DRA mode (docs/dra.md): the base's DaemonSet with --mode=dra, privileged or hardened (the
# hardened overlay's security context: manifests/components/hardened), and a workload with a
# claim.
DRA = ["manifests/overlays/dra", "manifests/overlays/dra-hardened"]
DRA_HARDENED = ["manifests/overlays/dra-hardened"]
DRA_APPS = ["manifests/examples/dra-app"]
# Every deployment of the daemon, in either mode.
DAEMONS = PLUGIN + DRA

CONTAINERFILE = ROOT / "Containerfile"
DOCS = ROOT / "docs" / "deploy.md"
LABELS = ("name", "component", "part-of", "version", "managed-by")
# Surge by default (issue 26: a gap between the old and the new pod refuses pods), on half the
# nodes at once (issue 47: a fleet's rollout in minutes; a release that never becomes ready
# harms no node); the way back for clusters that cannot run two plugin pods on a node is
# manifests/components/no-surge, a tenth of the nodes at once. docs/deploy.md has the arithmetic.
BASE_UPDATE_STRATEGY = {
    "type": "RollingUpdate",
    "rollingUpdate": {"maxSurge": "50%", "maxUnavailable": 0},
}
NO_SURGE_UPDATE_STRATEGY = {
    "type": "RollingUpdate",
    "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "10%"},
}
# What the components add: volume names, and the shipped profile (manifests/overlays/profiles).
CDI_VOLUME = "cdi-specs"
INSTANCE_LABEL = "app.kubernetes.io/instance"
INSTANCE_ENV = "INSTANCE_NAME"
PROFILES_VOLUME = "profiles"
PROFILES_CONFIGMAP = f"{NAME}-profiles"
PROFILE_FILE = ROOT / "manifests" / "overlays" / "profiles" / "profiles.yaml"
MIXED_POOL_FILE = ROOT / "manifests" / "overlays" / "mixed-pool" / "profiles.yaml"
PROFILE_FILES = {
    "manifests/overlays/profiles": PROFILE_FILE,
    "manifests/overlays/mixed-pool": MIXED_POOL_FILE,
}
EXAMPLES = ROOT / "docs" / "examples"
PCC_EXAMPLE = EXAMPLES / "pcc.yaml"
POWER_EXAMPLE = EXAMPLES / "power-block.yaml"
CONFIGFS_VOLUME = "host-configfs"
SECURITYFS_VOLUME = "host-securityfs"


def daemonset(directory: str) -> Obj:
    (found,) = daemonsets(directory)
    return found


def pod_spec(directory: str) -> Obj:
    spec: Obj = daemonset(directory)["spec"]["template"]["spec"]
    return spec


def is_proper_ancestor(parent: str, path: str) -> bool:
    return PurePosixPath(parent) in PurePosixPath(path).parents


def volume_named(directory: str, name: str) -> Obj | None:
    found = [v for v in pod_spec(directory)["volumes"] if v["name"] == name]
    assert len(found) <= 1, f"{len(found)} volumes named {name}"
    return found[0] if found else None


def mounts_of(directory: str, volume: str) -> list[Obj]:
    container = plugin_container(daemonset(directory))
    return [m for m in container.get("volumeMounts", []) if m["name"] == volume]


# Rendering and schemas


def test_every_kustomization_is_classified() -> None:
    assert sorted(kustomizations()) == sorted(PLUGIN + APPS + DRA + DRA_APPS)


@pytest.mark.parametrize("directory", PLUGIN + APPS + DRA + DRA_APPS)
def test_renders(directory: str) -> None:
    objects = render(directory)
    assert objects
    for obj in objects:
        assert obj["apiVersion"]
        assert obj["kind"]
        assert obj["metadata"]["name"]


@pytest.mark.parametrize("directory", PLUGIN + APPS + DRA + DRA_APPS)
def test_validates_against_kubernetes_schemas(directory: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    failures = []
    for version in KUBERNETES_VERSIONS:
        for obj in render(directory):
            if is_custom_resource(obj):
                continue  # not in the Kubernetes API: test_custom_resources_validate_against_crd
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except Exception as exc:  # collect the failures of every version
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                failures.append(f"Kubernetes {version}, {name}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("directory", PLUGIN + APPS + DRA + DRA_APPS)
def test_custom_resources_validate_against_crd(directory: str) -> None:
    """Kinds outside the Kubernetes API, each against its CRD's schema (the PodMonitor: the
    fields of its CRD that are used)."""
    jsonschema = pytest.importorskip("jsonschema")
    custom = []
    for obj in render(directory):
        if is_custom_resource(obj):
            schema = custom_resource_schema(obj)
            assert schema is not None
            jsonschema.validate(obj, schema)
            custom.append(obj["kind"])
    expected = ["PodMonitor"] * (directory in PODMONITOR) + ["NodeFeatureRule"] * (
        directory in NODE_FEATURE_RULES
    )
    assert sorted(custom) == sorted(expected)


def test_every_component_is_used() -> None:
    used: set[str] = set()
    for directory in kustomizations():
        text = (ROOT / directory / "kustomization.yaml").read_text()
        data: Obj = yaml.safe_load(text)
        for component in data.get("components", []):
            used.add((ROOT / directory / component).resolve().relative_to(ROOT).as_posix())
    assert set(components()) <= used


# The plugin's DaemonSet, in every deployment


@pytest.mark.parametrize("directory", PLUGIN)
def test_objects_and_no_api_access(directory: str) -> None:
    objects = render(directory)
    expected = [("DaemonSet", NAME), ("ServiceAccount", NAME)]
    if directory in PROFILES:
        # configMapGenerator appends a hash of the content to the name.
        (configmap,) = [obj for obj in objects if obj["kind"] == "ConfigMap"]
        assert re.fullmatch(rf"{PROFILES_CONFIGMAP}-[a-z0-9]{{10}}", configmap["metadata"]["name"])
        expected.append(("ConfigMap", configmap["metadata"]["name"]))
    if directory in PODMONITOR:
        expected.append(("PodMonitor", NAME))
    if directory in NODE_FEATURE_RULES:
        expected.append(("NodeFeatureRule", NAME))
    assert sorted((obj["kind"], obj["metadata"]["name"]) for obj in objects) == sorted(expected)
    for obj in objects:
        if obj["kind"] == "NodeFeatureRule":
            assert "namespace" not in obj["metadata"], "cluster-scoped"
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE
    account = the(objects, "ServiceAccount", NAME)
    assert account["automountServiceAccountToken"] is False
    spec = pod_spec(directory)
    assert spec["serviceAccountName"] == NAME
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("directory", DAEMONS)
def test_scheduling(directory: str) -> None:
    ds = daemonset(directory)
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {NODE_LABEL: "true"}
    assert spec["priorityClassName"] == "system-node-critical"
    # Tolerates every taint: the node selector alone decides where it runs.
    assert {"operator": "Exists"} in spec["tolerations"]
    for host_namespace in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host_namespace), host_namespace


@pytest.mark.parametrize("directory", DAEMONS)
def test_update_strategy(directory: str) -> None:
    """Surge, unless a deployment asks for no-surge (docs/deploy.md says what that costs)."""
    strategy = daemonset(directory)["spec"]["updateStrategy"]
    if directory in NO_SURGE:
        assert strategy == NO_SURGE_UPDATE_STRATEGY
    else:
        assert strategy == BASE_UPDATE_STRATEGY
    # The API server takes an int or a percentage: a string "0" (what a strategic merge of 0
    # over "50%" renders) is refused, and kubernetes-validate's schemas do not say so.
    for value in strategy["rollingUpdate"].values():
        assert isinstance(value, int) or re.fullmatch(r"[1-9][0-9]?%|100%", value), value


def test_base_starts_the_new_pod_before_it_stops_the_old_one() -> None:
    """No node goes without a plugin during an update (nox -s cluster measures it)."""
    assert daemonset("manifests/base")["spec"]["updateStrategy"] == BASE_UPDATE_STRATEGY


@pytest.mark.parametrize("directory", DAEMONS)
def test_labels(directory: str) -> None:
    version = project_version()
    ds = daemonset(directory)
    account = the(render(directory), "ServiceAccount", NAME)
    expected = {
        "app.kubernetes.io/name": NAME,
        "app.kubernetes.io/component": "device-plugin",
        "app.kubernetes.io/part-of": NAME,
        "app.kubernetes.io/version": version,
        "app.kubernetes.io/managed-by": "kustomize",
    }
    for labels in (
        ds["spec"]["template"]["metadata"]["labels"],
        account["metadata"]["labels"],
        # Every object: the ConfigMap and PodMonitor of the overlays as well.
        *(obj["metadata"]["labels"] for obj in render(directory)),
    ):
        assert {key: labels.get(key) for key in expected} == expected
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    # The selector is immutable: a version in it would break every upgrade.
    assert "app.kubernetes.io/version" not in selector


@pytest.mark.parametrize("directory", DAEMONS)
def test_resources(directory: str) -> None:
    resources = plugin_container(daemonset(directory))["resources"]
    # Sized by `nox -s bench` (BENCHMARKS.md): idle, and with every bounded input at its bound,
    # and the doctor beside it when run in the container (docs/deploy.md says how much).
    assert resources["requests"] == {"cpu": "100m", "memory": "64Mi"}
    # A memory limit, and no CPU limit (throttling multiplies Python's start-up time).
    assert set(resources["limits"]) == {"memory"}
    assert resources["limits"]["memory"] == "128Mi"


@pytest.mark.parametrize("directory", PLUGIN)
def test_args(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    assert "command" not in container, "the image's entry point starts the plugin"
    # First, so that docs/deploy.md's `kubectl patch` of args/0 raises the verbosity.
    assert container["args"][0] == "--v=1"
    assert flag(container, "host-root", "") == HOST_ROOT
    # The base's args, then only what the deployment's features add.
    base_args = plugin_container(daemonset("manifests/base"))["args"]
    assert base_args == ["--v=1", f"--host-root={HOST_ROOT}"]
    args = container["args"]
    assert args[: len(base_args)] == base_args
    added = sorted(arg.split("=", 1)[0] for arg in args[len(base_args) :])
    expected = (
        ["--cdi", "--instance-name"] * (directory in CDI)
        + ["--config"] * (directory in PROFILES)
        + ["--tsm-report"] * (directory in TSM_REPORT)
    )
    assert added == sorted(expected)


@pytest.mark.parametrize("directory", DAEMONS)
def test_image(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    name, _, tag = container["image"].rpartition(":")
    assert tag == project_version()
    assert container["imagePullPolicy"] == "IfNotPresent"
    if directory == "manifests/examples/custom-image":
        assert name == "registry.example.com/pcc/pcc-device-plugin"
    else:
        assert name == DEFAULT_IMAGE


@pytest.mark.parametrize("directory", PLUGIN)
def test_no_hostpath_can_create_anything_on_the_host(directory: str) -> None:
    volumes = pod_spec(directory)["volumes"]
    assert volumes
    for volume in volumes:
        if volume["name"] == PROFILES_VOLUME and directory in PROFILES:
            assert set(volume) == {"name", "configMap"}
            continue
        # type "" creates a missing path as a directory; so do DirectoryOrCreate/FileOrCreate.
        # The exception: the runtime's CDI directory, which may not exist yet
        # (manifests/components/cdi says why that is the right thing there).
        expected = "Directory"
        if volume["name"] == CDI_VOLUME and directory in CDI:
            assert volume["hostPath"]["path"] == CDI_SPEC_DIR
            expected = "DirectoryOrCreate"
        assert volume["hostPath"]["type"] == expected, volume


@pytest.mark.parametrize("directory", PLUGIN)
def test_kubelet_socket_dir_is_mounted_read_write(directory: str) -> None:
    ds = daemonset(directory)
    plugin_dir = flag(plugin_container(ds), "device-plugin-path", PLUGIN_DIR)
    mount, source = mount_showing(ds, plugin_dir)
    assert mount["mountPath"] == plugin_dir == PLUGIN_DIR
    assert source["path"] == PLUGIN_DIR
    assert not mount.get("readOnly", False)


@pytest.mark.parametrize("directory", PLUGIN)
def test_host_paths_are_read_only_under_the_host_root(directory: str) -> None:
    ds = daemonset(directory)
    host_root = flag(plugin_container(ds), "host-root", "")
    for mount, source in host_mounts(ds):
        if mount["mountPath"] == PLUGIN_DIR:
            continue
        if directory in CDI and mount["name"] == CDI_VOLUME:
            continue  # written by the plugin: test_cdi
        assert mount["mountPath"] == host_root + source["path"], mount
        assert mount["readOnly"] is True, mount


@pytest.mark.parametrize("directory", DAEMONS)
def test_device_is_seen_live_through_a_parent(directory: str) -> None:
    ds = daemonset(directory)
    container = plugin_container(ds)
    device = flag(container, "pcc-device", DEVICE)
    _, source = mount_showing(ds, flag(container, "host-root", "") + device)
    assert is_proper_ancestor(source["path"], device), source


@pytest.mark.parametrize("directory", DAEMONS)
def test_pcc_dir_is_seen_live_through_a_parent(directory: str) -> None:
    ds = daemonset(directory)
    container = plugin_container(ds)
    pcc_dir = flag(container, "pcc-socket-path", PCC_DIR)
    _, source = mount_showing(ds, flag(container, "host-root", "") + pcc_dir)
    if directory in PCC_DIR_ONLY:
        assert source["path"] == pcc_dir
    else:
        assert is_proper_ancestor(source["path"], pcc_dir), source


# Probes and metrics


def metrics_port(container: Obj) -> Obj:
    """The container port named `metrics`, checked against --metrics-bind-address."""
    ports: list[Obj] = container["ports"]
    (port,) = ports
    assert port == {"name": "metrics", "containerPort": port["containerPort"], "protocol": "TCP"}
    host, _, bound = flag(container, "metrics-bind-address", METRICS_BIND_ADDRESS).rpartition(":")
    # kubelet probes and Prometheus scrape the pod's IP: the plugin must listen on every address.
    assert host in ("", "0.0.0.0", "::"), "probes reach the pod's IP, not its loopback"
    assert port["containerPort"] == int(bound) == 8080
    return port


@pytest.mark.parametrize("directory", DAEMONS)
def test_metrics_port(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    port = metrics_port(container)
    # In the pod's own network namespace: no hostPort, so a surge pod on the same node cannot
    # clash with the old one.
    assert "hostPort" not in port


@pytest.mark.parametrize("directory", DAEMONS)
def test_probes(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    port = metrics_port(container)
    liveness = container["livenessProbe"]
    readiness = container["readinessProbe"]
    assert liveness["httpGet"] == {"path": "/livez", "port": port["name"]}
    assert readiness["httpGet"] == {"path": "/readyz", "port": port["name"]}
    # Lenient liveness: restarting the plugin cannot fix a slow kubelet, and restart loops back
    # off for minutes. /livez answers within about a second of start, so no start-up delay or
    # startupProbe is needed; only minutes of silence restart the container.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120
    assert liveness["timeoutSeconds"] >= 5
    assert liveness.get("successThreshold", 1) == 1
    assert "startupProbe" not in container
    # Readiness (registered with the current kubelet) gates rollouts and alerts, quickly.
    assert readiness["periodSeconds"] <= 10
    assert readiness.get("successThreshold", 1) == 1


@pytest.mark.parametrize("directory", DAEMONS)
def test_prometheus_scrape_annotations(directory: str) -> None:
    ds = daemonset(directory)
    port = metrics_port(plugin_container(ds))
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port["containerPort"]),
        "prometheus.io/path": "/metrics",
    }


@pytest.mark.parametrize("directory", PODMONITOR)
def test_podmonitor_scrapes_the_plugin_pods(directory: str) -> None:
    ds = daemonset(directory)
    monitor = the(render(directory), "PodMonitor", NAME)
    # In the pods' namespace: a PodMonitor selects pods in its own namespace by default.
    assert monitor["metadata"]["namespace"] == ds["metadata"]["namespace"] == NAMESPACE
    assert "namespaceSelector" not in monitor["spec"]
    # The DaemonSet's own selector: exactly its pods.
    assert monitor["spec"]["selector"] == ds["spec"]["selector"]
    port = metrics_port(plugin_container(ds))
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": port["name"], "path": annotations["prometheus.io/path"]}
    ]


# Placement by Node Feature Discovery (manifests/components/node-feature-rule)


def node_feature_rule() -> Obj:
    (directory,) = NODE_FEATURE_RULES
    return the(render(directory), "NodeFeatureRule", NAME)


@pytest.mark.parametrize("directory", NODE_FEATURE_RULES)
def test_the_node_feature_rule_labels_the_nodes_the_daemonset_selects(directory: str) -> None:
    """NFD sets the DaemonSet's own node label where the kernel has loaded sev_guest, which
    loads only on an SEV-SNP guest (nodefeaturerule.yaml says why), and does nothing else."""
    (rule,) = the(render(directory), "NodeFeatureRule", NAME)["spec"]["rules"]
    assert rule["labels"] == pod_spec(directory)["nodeSelector"] == {NODE_LABEL: "true"}
    # /proc/modules names a module with underscores: sev-guest.ko is sev_guest there.
    assert rule["matchFeatures"] == [
        {"feature": "kernel.loadedmodule", "matchExpressions": {"sev_guest": {"op": "Exists"}}}
    ]
    assert set(rule) == {"name", "labels", "matchFeatures"}, "no taints, annotations, matchAny"
    # nfd-master refuses labels in kubernetes.io and its subdomains, but for its own.
    namespace = NODE_LABEL.partition("/")[0]
    assert namespace != "kubernetes.io"
    assert not namespace.endswith(".kubernetes.io")


def test_the_node_feature_rule_matches_a_feature_nfd_publishes() -> None:
    """A feature NFD does not publish matches nothing, silently (the CRD does not list
    features): the rule's is the flag set of loaded modules in NFD's own kernel source, at the
    version the CRD comes from."""
    source = nfd_file(NFD_KERNEL_SOURCE).read_text()
    (domain,) = re.findall(r'^const Name = "(\w+)"', source, re.M)
    (feature,) = re.findall(r'^\s*LoadedModuleFeature\s*= "(\w+)"', source, re.M)
    assert re.search(r"Flags\[LoadedModuleFeature\] = \w+\.NewFlagFeatures\(kmods\.\.\.\)", source)
    assert "getLoadedModules()" in source
    (rule,) = node_feature_rule()["spec"]["rules"]
    assert [term["feature"] for term in rule["matchFeatures"]] == [f"{domain}.{feature}"]


def misspelled_key(rule: Obj) -> None:
    rule["spec"]["rules"][0]["matchFeature"] = rule["spec"]["rules"][0].pop("matchFeatures")


def unknown_operator(rule: Obj) -> None:
    rule["spec"]["rules"][0]["matchFeatures"][0]["matchExpressions"]["sev_guest"]["op"] = "Exist"


def unquoted_label_value(rule: Obj) -> None:
    rule["spec"]["rules"][0]["labels"][NODE_LABEL] = True


def no_rule_name(rule: Obj) -> None:
    del rule["spec"]["rules"][0]["name"]


@pytest.mark.parametrize(
    "mistake", [misspelled_key, unknown_operator, unquoted_label_value, no_rule_name]
)
def test_the_crd_check_refuses_a_broken_node_feature_rule(mistake: Callable[[Obj], None]) -> None:
    """What the API server would refuse of the rule, the check refuses too."""
    jsonschema = pytest.importorskip("jsonschema")
    rule = node_feature_rule()
    schema = custom_resource_schema(rule)
    assert schema is not None
    jsonschema.validate(rule, schema)
    mistake(rule)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, schema)


# Optional features: no-surge (above), profiles, CDI; and nothing else changes


@pytest.mark.parametrize("directory", PLUGIN)
def test_profiles_mounted_read_only_where_config_points(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    volume = volume_named(directory, PROFILES_VOLUME)
    config = flag(container, "config", "")
    if directory not in PROFILES:
        assert volume is None
        assert config == ""
        return
    assert volume is not None
    (mount,) = mounts_of(directory, PROFILES_VOLUME)
    assert mount["readOnly"] is True
    assert "subPath" not in mount
    # --config names a key of the ConfigMap, in the directory the ConfigMap is mounted at.
    config_path = PurePosixPath(config)
    assert (
        config_path.parent
        == PurePosixPath(mount["mountPath"])
        == PurePosixPath("/etc/pcc-device-plugin")
    )
    configmap = the(render(directory), "ConfigMap", volume["configMap"]["name"])
    assert configmap["metadata"]["name"].startswith(f"{PROFILES_CONFIGMAP}-")
    assert "items" not in volume["configMap"]
    assert configmap["data"] == {config_path.name: PROFILE_FILES[directory].read_text()}


@pytest.mark.parametrize("directory", PLUGIN)
def test_configmap_volumes_name_a_rendered_configmap(directory: str) -> None:
    """manifests/components/profiles needs the ConfigMap from the kustomization using it."""
    names = {obj["metadata"]["name"] for obj in render(directory) if obj["kind"] == "ConfigMap"}
    for volume in pod_spec(directory)["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] in names, volume


def as_flag_profile(spec: ResourceSpec) -> ResourceSpec:
    """``spec`` without the label that the PCC profile from the flags gives its mount."""
    return attrs.evolve(
        spec, mounts=tuple(attrs.evolve(mount, label="mount") for mount in spec.mounts)
    )


def uncommented(text: str) -> str:
    """The profile with its commented-out example resource put back in."""
    return re.sub(r"^(\s*)# (?=- |  )", r"\1", text, flags=re.M)


def test_shipped_profile_is_the_pcc_profile() -> None:
    """As shipped, the profiles overlay serves what the base serves from its flags."""
    shipped = load(str(PROFILE_FILE)).specs
    assert shipped == load(str(PCC_EXAMPLE)).specs
    args = plugin_container(daemonset("manifests/base"))["args"]
    base_config, _ = parse(args, "pcc-device-plugin", main.DESCRIPTION, main.EPILOG)
    assert shipped == [as_flag_profile(base_config.pcc_resource())]
    (spec,) = shipped
    assert spec.name == RESOURCE
    assert [node.host_path for node in spec.device_nodes] == [DEVICE]
    assert [mount.host_path for mount in spec.mounts] == [PCC_DIR]


def test_shipped_profile_example_loads_when_uncommented(tmp_path: Path) -> None:
    text = uncommented(PROFILE_FILE.read_text())
    assert text != PROFILE_FILE.read_text(), "the commented example is gone"
    edited = tmp_path / "profiles.yaml"
    edited.write_text(text)
    assert load(str(edited)).specs == (
        load(str(PCC_EXAMPLE)).specs + load(str(POWER_EXAMPLE)).specs
    )


def test_mixed_pool_profile_is_the_examples_each_only_on_its_hardware() -> None:
    """The PCC profile on SEV-SNP guests, and the TDX and vTPM examples (docs/profiles.md)."""
    (pcc,) = load(str(PCC_EXAMPLE)).specs
    tdx, vtpm = (load(str(EXAMPLES / name)).specs[0] for name in ("tdx.yaml", "vtpm.yaml"))
    assert load(str(MIXED_POOL_FILE)).specs == [attrs.evolve(pcc, only_on="sev-snp"), tdx, vtpm]


@pytest.mark.parametrize("directory", PROFILES)
def test_profile_host_paths_are_seen_live_by_the_plugin(directory: str, tmp_path: Path) -> None:
    """Every host path of the profile, its example too, is under a mount of a parent at /host."""
    ds = daemonset(directory)
    host_root = flag(plugin_container(ds), "host-root", "")
    edited = tmp_path / "profiles.yaml"
    edited.write_text(uncommented(PROFILE_FILES[directory].read_text()))
    for spec in load(str(edited)).specs:
        for node in spec.device_nodes:
            # A glob is watched through its directory.
            path = str(PurePosixPath(node.host_path).parent) if node.is_glob else node.host_path
            _, source = mount_showing(ds, host_root + path)
            assert source["path"] == path or is_proper_ancestor(source["path"], path), node
        for mount in spec.mounts:
            _, source = mount_showing(ds, host_root + mount.host_path)
            assert is_proper_ancestor(source["path"], mount.host_path), mount


def host_filesystem_mounted(directory: str, volume_name: str, path: str, wanted: bool) -> None:
    """The host's `path` (configfs, securityfs) is mounted as `volume_name`, live (it may be
    mounted after the pod starts), exactly in the deployments that want it."""
    volume = volume_named(directory, volume_name)
    if not wanted:
        assert volume is None
        return
    assert volume == {"name": volume_name, "hostPath": {"path": path, "type": "Directory"}}
    (mount,) = mounts_of(directory, volume_name)
    assert mount["mountPropagation"] == "HostToContainer"


@pytest.mark.parametrize("directory", PLUGIN)
def test_tsm_report_is_seen_live_through_the_hosts_configfs(directory: str) -> None:
    """configfs is not in a container's own /sys: the plugin sees the host's, read-only."""
    ds = daemonset(directory)
    container = plugin_container(ds)
    wanted = directory in TSM_REPORT
    host_filesystem_mounted(directory, CONFIGFS_VOLUME, "/sys/kernel/config", wanted)
    assert ("--tsm-report" in container["args"]) == wanted
    if wanted:
        host_root = flag(container, "host-root", "")
        config, _ = parse(container["args"], "pcc-device-plugin", main.DESCRIPTION, main.EPILOG)
        (report,) = [m for m in config.pcc_resource().mounts if m.label == "TSM report"]
        _, source = mount_showing(ds, host_root + report.host_path)
        assert is_proper_ancestor(source["path"], report.host_path), source


@pytest.mark.parametrize("directory", PLUGIN)
def test_the_hosts_securityfs_only_where_a_profile_needs_it(directory: str) -> None:
    wanted = directory in SECURITYFS
    host_filesystem_mounted(directory, SECURITYFS_VOLUME, "/sys/kernel/security", wanted)


@pytest.mark.parametrize("directory", PLUGIN)
def test_cdi(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    cdi_dir = flag(container, "cdi-spec-dir", CDI_SPEC_DIR)
    volume = volume_named(directory, CDI_VOLUME)
    if directory not in CDI:
        assert "--cdi" not in container["args"]
        assert volume is None
        return
    assert "--cdi" in container["args"]
    assert volume is not None
    # The runtime reads the host's directory; the plugin writes the path as it sees it (not
    # under --host-root): the same path on both sides, read-write.
    (mount,) = mounts_of(directory, CDI_VOLUME)
    assert mount["mountPath"] == cdi_dir == volume["hostPath"]["path"] == CDI_SPEC_DIR
    assert not mount.get("readOnly", False)
    assert "subPath" not in mount
    # The deepest mount there is this one: nothing mounted below it hides the specs.
    assert mount_showing(daemonset(directory), cdi_dir + "/spec.json")[0] == mount


@pytest.mark.parametrize("directory", PLUGIN)
def test_the_instance_name_is_the_daemonsets_through_a_pod_label(directory: str) -> None:
    """The downward API cannot read the DaemonSet's name: a pod label carries it."""
    ds = daemonset(directory)
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert labels[INSTANCE_LABEL] == ds["metadata"]["name"]
    container = plugin_container(ds)
    if directory not in CDI:
        assert flag(container, "instance-name", "") == ""
        assert "env" not in container
        return
    assert flag(container, "instance-name", "") == f"$({INSTANCE_ENV})"
    assert container["env"] == [
        {
            "name": INSTANCE_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{INSTANCE_LABEL}']"}},
        }
    ]
    # The args as kubelet expands them are flags the plugin takes.
    expanded = [
        arg.replace(f"$({INSTANCE_ENV})", labels[INSTANCE_LABEL]) for arg in container["args"]
    ]
    config, _ = parse(expanded, "pcc-device-plugin", main.DESCRIPTION, main.EPILOG)
    assert config.instance_name == ds["metadata"]["name"]


def as_built_on(ds: Obj) -> Obj:
    """The DaemonSet with the optional features taken out again, as their components add them."""
    ds = copy.deepcopy(ds)
    ds["spec"]["updateStrategy"] = copy.deepcopy(BASE_UPDATE_STRATEGY)
    spec = ds["spec"]["template"]["spec"]
    added = (CDI_VOLUME, PROFILES_VOLUME, CONFIGFS_VOLUME, SECURITYFS_VOLUME)
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in added]
    container = spec["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in added]
    container["args"] = [
        arg
        for arg in container["args"]
        if arg not in ("--cdi", "--tsm-report")
        and not arg.startswith(("--config=", "--instance-name="))
    ]
    container.pop("env", None)
    return ds


@pytest.mark.parametrize("directory", sorted(BUILT_ON))
def test_features_change_nothing_else(directory: str) -> None:
    assert as_built_on(daemonset(directory)) == daemonset(BUILT_ON[directory])
    account = the(render(directory), "ServiceAccount", NAME)
    assert account == the(render(BUILT_ON[directory]), "ServiceAccount", NAME)


@pytest.mark.parametrize("directory", [*PRIVILEGED, "manifests/overlays/dra"])
def test_privileged_as_the_product_documents(directory: str) -> None:
    container = plugin_container(daemonset(directory))
    assert container["securityContext"] == {"privileged": True}


@pytest.mark.parametrize("directory", HARDENED + DRA_HARDENED)
def test_hardened(directory: str) -> None:
    context = plugin_container(daemonset(directory))["securityContext"]
    assert context == {
        "privileged": False,
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
        "seLinuxOptions": {"type": "container_device_plugin_t"},
    }
    assert pod_spec(directory)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def without_security(ds: Obj) -> Obj:
    ds = copy.deepcopy(ds)
    spec = ds["spec"]["template"]["spec"]
    spec.pop("securityContext", None)
    for container in spec["containers"]:
        container.pop("securityContext", None)
    return ds


@pytest.mark.parametrize(
    ("directory", "built_on"),
    [("manifests/overlays/hardened", "manifests/base"),
     ("manifests/overlays/dra-hardened", "manifests/overlays/dra")],
)  # fmt: skip
def test_hardened_changes_nothing_but_the_security_context(directory: str, built_on: str) -> None:
    assert without_security(daemonset(directory)) == without_security(daemonset(built_on))
    assert [o for o in render(directory) if o["kind"] != "DaemonSet"] == [
        o for o in render(built_on) if o["kind"] != "DaemonSet"
    ]


def test_pcc_dir_only_changes_nothing_but_that_mount() -> None:
    def without_run_mounts(ds: Obj) -> Obj:
        ds = copy.deepcopy(ds)
        spec = ds["spec"]["template"]["spec"]
        spec["volumes"] = [v for v in spec["volumes"] if not v["name"].startswith("host-pcc")]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "host-var-run"]
        container = spec["containers"][0]
        container["volumeMounts"] = [
            m for m in container["volumeMounts"] if not m["mountPath"].startswith("/host/var/run")
        ]
        return ds

    narrow = daemonset("manifests/examples/hardened-pcc-dir-only")
    assert without_run_mounts(narrow) == without_run_mounts(
        daemonset("manifests/overlays/hardened")
    )
    assert {v["hostPath"]["path"] for v in narrow["spec"]["template"]["spec"]["volumes"]} == {
        "/dev",
        PCC_DIR,
        PLUGIN_DIR,
    }


# The hardened security context, applied to the daemon itself


def as_the_container_runs(ds: Obj, writable: Path) -> list[str]:
    """A command prefix that starts a process as a runtime starts the container of `ds`, as
    far as a mount namespace and setpriv can: its user and group, no capability in any set
    (the manifests add none), no_new_privs, and a read-only root but for `writable` (where the
    pod's hostPath volumes would be). Seccomp and SELinux are the runtime's and the node's: the
    cluster check applies those."""
    context = plugin_container(ds)["securityContext"]
    assert context["privileged"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}, "a capability the tests do not apply"
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    mounts = 'mount --bind "$0" "$0" && mount -o remount,bind,ro / && exec "$@"'
    return [
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", mounts, str(writable),
        "setpriv", f"--reuid={context['runAsUser']}", f"--regid={context['runAsGroup']}",
        "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
    ]  # fmt: skip


def can_run_as_a_container() -> None:
    """Root and util-linux: CI has them (it fails without); a developer's `nox -s manifests`
    as another user skips these with the reason."""
    missing = [tool for tool in ("unshare", "setpriv", "sh") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        message = (
            "running the daemon as a hardened container runs needs root, unshare and setpriv "
            f"(util-linux); missing: {', '.join(missing) or 'root'}"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def assert_runs_as_the_container(daemon: Daemon) -> None:
    status = Path(f"/proc/{daemon.pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split() == ["0"] * 4
    for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[capabilities], 16) == 0, capabilities
    assert fields["NoNewPrivs"].strip() == "1"
    # Its root, seen through its own mount namespace: the interpreter's tree is read-only.
    with pytest.raises(OSError, match="Read-only file system") as written:
        Path(f"/proc/{daemon.pid}/root{sys.prefix}/written-by-a-test").touch()
    assert written.value.errno == errno.EROFS


async def test_the_hardened_device_plugin_needs_no_more_than_its_security_context(
    fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon
) -> None:
    """manifests/overlays/hardened: it registers, allocates and removes its socket at SIGTERM
    with no capability on a read-only root (kubelet's directory root's, 0750, as kubelet
    makes it)."""
    can_run_as_a_container()
    with trio.fail_after(60):
        ds = await run_blocking(daemonset, "manifests/overlays/hardened")
        fake_node.plugin_dir.chmod(0o750)
        wrapper = as_the_container_runs(ds, fake_node.root)
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1), wrapper=wrapper)
        await log_line(daemon, "Registered device plugin with Kubelet")
        assert_runs_as_the_container(daemon)
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-3"]])
        (container,) = response.container_responses
        assert [device.host_path for device in container.devices] == [DEVICE]
        assert await run_blocking(daemon.terminate) == 0
        assert not list(fake_node.plugin_dir.glob("pcc-*.sock"))


async def test_the_hardened_daemon_has_no_capability_that_bypasses_permissions(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """The check above is not hollow: as the container runs, UID 0 cannot write into a
    directory of another owner (which CAP_DAC_OVERRIDE would allow)."""
    can_run_as_a_container()
    with trio.fail_after(30):
        ds = await run_blocking(daemonset, "manifests/overlays/hardened")
        fake_node.plugin_dir.mkdir(mode=0o750)
        os.chown(fake_node.plugin_dir, 65534, 65534)
        wrapper = as_the_container_runs(ds, fake_node.root)
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1), wrapper=wrapper)
        await log_line(daemon, re.compile(r"cannot serve in \S+: \[Errno 13\] Permission denied"))
        assert_runs_as_the_container(daemon)


async def test_the_hardened_dra_driver_needs_no_more_than_its_security_context(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """manifests/overlays/dra-hardened: it registers, publishes, prepares a claim (its CDI
    spec, its checkpoint and lock) and unprepares it, and removes its sockets at SIGTERM, with
    no capability on a read-only root (kubelet's directories root's, 0750, as kubelet makes
    them)."""
    can_run_as_a_container()
    dra = dra_node
    with trio.fail_after(60):
        ds = await run_blocking(daemonset, "manifests/overlays/dra-hardened")
        for directory in (dra.registry, dra.plugins):
            directory.chmod(0o750)
        wrapper = as_the_container_runs(ds, dra.node.root)
        daemon = start_daemon(*dra.daemon_args(), wrapper=wrapper)
        await registered(dra)
        await published(dra, SHARES)
        assert_runs_as_the_container(daemon)
        dra.claim("app", "uid-1")
        claim = [("default", "app", "uid-1")]
        prepared = await run_blocking(dra.kubelet.prepare, DRIVER_NAME, claim)
        assert prepared.claims["uid-1"].error == ""
        assert (dra.cdi / f"{DRIVER_NAME}-claim_uid-1.json").exists()
        assert list(dra.checkpoint()) == ["uid-1"]
        unprepared = await run_blocking(dra.kubelet.unprepare, DRIVER_NAME, claim)
        assert unprepared.claims["uid-1"].error == ""
        assert dra.checkpoint() == {}
        assert await run_blocking(daemon.terminate) == 0
        assert not list(dra.registry.glob("*.sock"))
        assert not list(dra.state.glob("*.sock"))


# The DRA mode


DRA_VOLUMES = {
    "plugins-registry": "/var/lib/kubelet/plugins_registry",
    "plugins": "/var/lib/kubelet/plugins",
    CDI_VOLUME: CDI_SPEC_DIR,
    "host-sys": "/sys",
}
DRA_ENV = {"NODE_NAME": "spec.nodeName", "POD_UID": "metadata.uid"}
DRA_ARGS = ["--mode=dra", "--node-name=$(NODE_NAME)", "--pod-uid=$(POD_UID)"]
SERVICE_ACCOUNT_USER = f"system:serviceaccount:{NAMESPACE}:{NAME}"


def as_device_plugin(ds: Obj) -> Obj:
    """The DRA overlay's DaemonSet with what it changes put back as the base has it."""
    ds = copy.deepcopy(ds)
    spec = ds["spec"]["template"]["spec"]
    spec["automountServiceAccountToken"] = False
    spec["volumes"] = [
        {"name": "device-plugins", "hostPath": {"path": PLUGIN_DIR, "type": "Directory"}},
        *(v for v in spec["volumes"] if v["name"] not in DRA_VOLUMES),
    ]
    container = spec["containers"][0]
    container["volumeMounts"] = [
        {"name": "device-plugins", "mountPath": PLUGIN_DIR},
        *(m for m in container["volumeMounts"] if m["name"] not in DRA_VOLUMES),
    ]
    container["args"] = [arg for arg in container["args"] if arg not in DRA_ARGS]
    container.pop("env")
    return ds


@pytest.mark.parametrize("directory", DRA)
def test_dra_daemonset_is_the_base_with_the_dra_mode(directory: str) -> None:
    """The same DaemonSet as the device plugin's (so applying one replaces the other, node by
    node: never both modes on a node), with --mode=dra, its env, mounts and token."""
    ds = daemonset(directory)
    device_plugin = "manifests/overlays/hardened" if directory in DRA_HARDENED else "manifests/base"
    assert as_device_plugin(ds) == daemonset(device_plugin)
    container = plugin_container(ds)
    assert container["args"][-3:] == DRA_ARGS
    assert container["env"] == [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in DRA_ENV.items()
    ]
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


@pytest.mark.parametrize("directory", DRA)
def test_dra_driver_reads_its_node_attributes_from_the_hosts_sysfs(directory: str) -> None:
    """configfs (tsm/report) is in the host's /sys only, not in the container's own."""
    ds = daemonset(directory)
    host_root = flag(plugin_container(ds), "host-root", "")
    for path in (kernel.SEV_SNP_GUEST, kernel.TSM_REPORT):
        mount, source = mount_showing(ds, host_root + path)
        assert source == {"path": node_facts.SYSFS, "type": "Directory"}
        assert mount["readOnly"] is True
        assert mount["mountPropagation"] == "HostToContainer"


@pytest.mark.parametrize("directory", DRA)
def test_dra_args_are_flags_the_plugin_takes_and_its_directories_are_mounted(
    directory: str,
) -> None:
    ds = daemonset(directory)
    container = plugin_container(ds)
    expanded = [
        arg.replace("$(NODE_NAME)", "node-a").replace("$(POD_UID)", "0a0a0a0a-1111-2222")
        for arg in container["args"]
    ]
    config, _ = parse(expanded, "pcc-device-plugin", main.DESCRIPTION, main.EPILOG)
    served = read(config)
    assert served.mode == "dra"
    assert (config.node_name, config.pod_uid) == ("node-a", "0a0a0a0a-1111-2222")
    for path in (config.kubelet_registry_path, config.kubelet_plugins_path, config.cdi_spec_dir):
        mount, source = mount_showing(ds, path)
        # At the host's path, read-write: kubelet and the runtime find there what the driver
        # writes.
        assert mount["mountPath"] == source["path"] == path
        assert not mount.get("readOnly", False)
    assert {v["name"]: v["hostPath"]["path"] for v in pod_spec(directory)["volumes"]
            if v["name"] in DRA_VOLUMES} == DRA_VOLUMES  # fmt: skip
    assert volume_named(directory, "device-plugins") is None


@pytest.mark.parametrize("directory", DRA)
def test_dra_api_access_is_what_the_driver_needs(directory: str) -> None:
    objects = render(directory)
    assert sorted((obj["kind"], obj["metadata"]["name"]) for obj in objects) == sorted(
        [
            ("DaemonSet", NAME),
            ("ServiceAccount", NAME),
            ("DeviceClass", DRIVER_NAME),
            ("ClusterRole", f"{NAME}-dra"),
            ("ClusterRoleBinding", f"{NAME}-dra"),
            ("ValidatingAdmissionPolicy", f"{NAME}-own-node-slices"),
            ("ValidatingAdmissionPolicyBinding", f"{NAME}-own-node-slices"),
        ]
    )
    assert the(objects, "ServiceAccount", NAME)["automountServiceAccountToken"] is True
    role = the(objects, "ClusterRole")
    assert {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    } == {
        ("resource.k8s.io", "resourceclaims"): ["get"],
        ("resource.k8s.io", "resourceslices"): sorted(
            ["list", "watch", "create", "update", "delete"]
        ),
        ("", "nodes"): ["get"],
    }
    binding = the(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    policy = the(objects, "ValidatingAdmissionPolicy")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert sorted(rule["operations"]) == ["CREATE", "DELETE", "UPDATE"]
    assert rule["apiVersions"] == ["*"]
    assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ServiceAccount"}
    assert matches_user(objects, SERVICE_ACCOUNT_USER)
    assert "authentication.kubernetes.io/node-name" in str(policy["spec"]["variables"])
    assert policy["spec"]["failurePolicy"] == "Fail"
    # A refusal is 403 Forbidden, as docs/dra.md's troubleshooting says (the API server's
    # default for a policy is 422 Invalid, which the cluster showed).
    assert [v.get("reason") for v in policy["spec"]["validations"]] == ["Forbidden"] * 2
    policy_binding = the(objects, "ValidatingAdmissionPolicyBinding")
    assert policy_binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "paramRef": {
            "name": NAME,
            "namespace": NAMESPACE,
            "parameterNotFoundAction": "Allow",
        },
        "validationActions": ["Deny"],
    }


# The one form the policy's matchCondition takes: the user is the service account its
# binding names as its parameter (a test of its own, not a CEL interpreter: another form
# fails it).
EXACTLY_THE_PARAMETER = (
    "request.userInfo.username == 'system:serviceaccount:' + params.metadata.namespace + ':' "
    "+ params.metadata.name"
)


def matches_user(objects: list[Obj], username: str) -> bool:
    """Whether the policy applies to a request by `username`: its matchCondition with the
    parameter its binding names, which must be a ServiceAccount among `objects`."""
    (condition,) = the(objects, "ValidatingAdmissionPolicy")["spec"]["matchConditions"]
    assert " ".join(condition["expression"].split()) == EXACTLY_THE_PARAMETER
    reference = the(objects, "ValidatingAdmissionPolicyBinding")["spec"]["paramRef"]
    account = the(objects, "ServiceAccount", reference["name"])
    assert account["metadata"]["namespace"] == reference["namespace"]
    return username == f"system:serviceaccount:{reference['namespace']}:{reference['name']}"


def test_the_admission_policy_follows_the_service_account_to_another_namespace_and_name(
    tmp_path: Path,
) -> None:
    """A user's overlay that moves the driver to a namespace of their own and prefixes its
    names (kustomize's `namespace:` and `namePrefix:`) moves and renames its service account:
    the policy applies to that account exactly, and to no other, not one whose name holds
    the driver's (a pattern on the name would have caught it, or missed a renamed one)."""
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    overlay = tmp_path / "my-cluster"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "namespace: pcc-system\nnamePrefix: acme-\nresources:\n  - ../manifests/overlays/dra\n"
    )
    objects = render(str(overlay))
    account = the(objects, "ServiceAccount", f"acme-{NAME}")
    assert account["metadata"]["namespace"] == "pcc-system"
    assert the(objects, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": f"acme-{NAME}", "namespace": "pcc-system"}
    ]
    assert matches_user(objects, f"system:serviceaccount:pcc-system:acme-{NAME}")
    for other in ("system:serviceaccount:pcc-system:default", f"system:node:{NAME}",
                  f"system:serviceaccount:pcc-system:{NAME}",
                  f"system:serviceaccount:pcc-system:acme-{NAME}-helper",
                  f"system:serviceaccount:kube-system:acme-{NAME}"):  # fmt: skip
        assert not matches_user(objects, other), other


@pytest.mark.parametrize("directory", DRA)
def test_the_device_class_serves_the_extended_resource_pods_ask_for(directory: str) -> None:
    """Pods unchanged since the device plugin (resources.limits of the extended resource) get
    a share from the driver: the migration path."""
    device_class = the(render(directory), "DeviceClass")
    assert device_class["spec"]["extendedResourceName"] == RESOURCE
    (selector,) = device_class["spec"]["selectors"]
    assert selector["cel"]["expression"] == f'device.driver == "{DRIVER_NAME}"'
    app = the(render("manifests/examples/confidential-app"), "Pod")
    assert int(app["spec"]["containers"][0]["resources"]["limits"][RESOURCE]) == 1


def test_dra_app() -> None:
    objects = render("manifests/examples/dra-app")
    pod = the(objects, "Pod")
    template = the(objects, "ResourceClaimTemplate")
    assert "namespace" not in pod["metadata"], "applies to the namespace the user chooses"
    (claim,) = pod["spec"]["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": DRIVER_NAME}
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {"claims": [{"name": claim["name"]}]}
    assert not pod["spec"].get("volumes")
    assert not container.get("securityContext", {}).get("privileged", False)


# The example workload


def test_confidential_app() -> None:
    pod = the(render("manifests/examples/confidential-app"), "Pod", "confidential-app")
    spec = pod["spec"]
    assert "namespace" not in pod["metadata"], "applies to the namespace the user chooses"
    assert spec["nodeSelector"] == {NODE_LABEL: "true"}
    (container,) = spec["containers"]
    assert int(container["resources"]["limits"][RESOURCE]) == 1
    # The device and the PCC directory come from the plugin, not from the pod's own spec.
    assert not spec.get("volumes")
    assert not container.get("securityContext", {}).get("privileged", False)


# The Containerfile and its context


def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions = []
    logical = ""
    for line in CONTAINERFILE.read_text().splitlines():
        if not logical and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        logical += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, rest = logical.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            logical = ""
    return instructions


def test_runtime_lock_has_hashes() -> None:
    """The Containerfile installs requirements/runtime.txt with --require-hashes."""
    lines = (ROOT / "requirements" / "runtime.txt").read_text().splitlines()
    requirements = [i for i, line in enumerate(lines) if line[:1].isalnum()]
    assert requirements
    for index in requirements:
        following = lines[index + 1] if index + 1 < len(lines) else ""
        assert following.strip().startswith("--hash=sha256:"), (
            f"{lines[index]!r} has no hash: regenerate the lock with `nox -s lock`"
        )


def test_containerfile_base_image_contract() -> None:
    """One base for both stages: the build stage's for the building machine's platform; the
    image itself on an empty root.

    The build stage installs for the target platform (uv --python-platform from TARGETARCH)
    and reads the target's base through a bind mount (tools/runtime_root.py), so a cross-build
    emulates nothing but the image's check (and, on a base without python3, its install).
    BUILD_BASE_IMAGE exists so that a local build can name the same base's two platforms apart
    (tools/images.py).
    """
    instructions = containerfile_instructions()
    assert instructions[:2] == [
        ("ARG", "BASE_IMAGE=docker.io/library/debian:trixie-slim"),
        ("ARG", "BUILD_BASE_IMAGE=${BASE_IMAGE}"),
    ]
    stages = [args for keyword, args in instructions if keyword == "FROM"]
    assert stages == [
        "${BASE_IMAGE} AS debian",
        "--platform=$BUILDPLATFORM ${BUILD_BASE_IMAGE} AS build",
        "scratch",
    ]
    runs = [args for keyword, args in instructions if keyword == "RUN"]
    installs = [run for run in runs if "uv pip install" in run]
    assert len(installs) == 2
    assert all('--python-platform "$(cat /opt/build/target-platform)"' in i for i in installs)
    (root,) = [run for run in runs if "runtime_root.py" in run]
    assert root.startswith("--mount=type=bind,from=debian,target=/debian ")
    final = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    # No shell in the image: its one step is in exec form.
    assert [args for keyword, args in final if keyword == "RUN"] == [
        '["/opt/pcc-device-plugin/bin/pcc-device-plugin", "--help"]'
    ]


def test_containerfile_installs_the_lock_with_hashes_and_wheels_only() -> None:
    runs = [args for keyword, args in containerfile_instructions() if keyword == "RUN"]
    (install,) = [run for run in runs if "requirements/runtime.txt" in run]
    assert "--require-hashes" in install
    assert "--only-binary=:all:" in install
    # Every exception to "wheels only" names a locked package (docs/deploy.md says why).
    locked = (ROOT / "requirements" / "runtime.txt").read_text()
    for name in re.findall(r"--no-binary=(\S+)", install):
        assert re.search(rf"^{re.escape(name)}==", locked, re.M), f"{name} is not in the lock"


def test_containerfile_build_backend_satisfies_pyproject() -> None:
    with (ROOT / "pyproject.toml").open("rb") as file:
        requires = tomllib.load(file)["build-system"]["requires"]
    (setuptools_requirement,) = [r for r in requires if r.startswith("setuptools")]
    pins = re.findall(r"setuptools==([0-9.]+)", CONTAINERFILE.read_text())
    assert pins
    for pin in pins:
        assert Version(pin) in SpecifierSet(setuptools_requirement.removeprefix("setuptools"))


def test_containerfile_labels_and_entry_point() -> None:
    instructions = containerfile_instructions()
    final = instructions[max(i for i, (k, _) in enumerate(instructions) if k == "FROM") :]
    assert ("ARG", f"VERSION={project_version()}") in final
    labels = " ".join(args for keyword, args in final if keyword == "LABEL")
    for key in ("source", "version", "licenses", "title"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    with (ROOT / "pyproject.toml").open("rb") as file:
        assert "pcc-device-plugin" in tomllib.load(file)["project"]["scripts"]
    assert instructions[-1] == ("ENTRYPOINT", '["/opt/pcc-device-plugin/bin/pcc-device-plugin"]')
    users = [args for keyword, args in final if keyword == "USER"]
    assert users[-1] == "0"


def test_containerfile_says_why_it_runs_as_root() -> None:
    lines = CONTAINERFILE.read_text().splitlines()
    last_user = max(i for i, line in enumerate(lines) if line.startswith("USER "))
    comment = []
    for line in reversed(lines[:last_user]):
        if not line.startswith("#"):
            break
        comment.append(line)
    assert "kubelet" in " ".join(comment)


def test_every_hadolint_ignore_is_justified() -> None:
    lines = CONTAINERFILE.read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            before = lines[index - 1]
            why = f"line {index + 1}: say why in a comment beside the ignore"
            assert before.startswith("#"), why
            assert "hadolint" not in before, why


def test_containerignore_admits_only_what_the_containerfile_copies() -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".containerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "deny everything first: no tests, caches or VCS data"
    admitted = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied: set[str] = set()
    for keyword, args in containerfile_instructions():
        if keyword == "COPY" and not args.startswith("--from"):
            copied.update(source.rstrip("/") for source in args.split()[:-1])
    assert copied == admitted
    for source in copied:
        if source != "README.md":  # written by the lead; the build needs it (pyproject readme)
            assert (ROOT / source).exists(), source


# docs/deploy.md

NEEDS_MARKER = re.compile(r"^# \(needs [^)]+\)")
RUN_BY_THIS_FILE = re.compile(r"^kubectl kustomize \S+( \| .+)?$")
NOX = re.compile(r"^(?:nox|python3 tools/dev\.py) -s (?P<sessions>[a-z_ ]+)$")
# The overlay of the user's own that the install steps of README.md and this page write, from
# the clone's root, to name the image with kubectl alone. A block that writes it is run whole
# (test_the_users_overlay_builds_with_kubectl_alone), not command by command.
USER_OVERLAY = "my-cluster"
WRITES_USER_OVERLAY = f"cat > {USER_OVERLAY}/kustomization.yaml <<'EOF'"


def docs_text() -> str:
    if not DOCS.exists():
        pytest.fail("docs/deploy.md is missing")
    return DOCS.read_text()


def fenced_shell(text: str) -> list[str]:
    """The shell blocks of a Markdown text, each as a script (a list item's indent taken off)."""
    fenced = r"^[ \t]*```(?:sh|bash|console)\n(.*?)^[ \t]*```$"
    return [textwrap.dedent(block).strip("\n") for block in re.findall(fenced, text, re.M | re.S)]


def shell_blocks() -> list[list[str]]:
    return [
        [line.strip() for line in block.splitlines()]
        for block in fenced_shell(docs_text())
        if WRITES_USER_OVERLAY not in block
    ]


def commands(block: list[str]) -> list[str]:
    """Commands, with backslash-continued lines joined."""
    joined = "\n".join(line for line in block if not line.startswith("#"))
    return [line.strip() for line in joined.replace("\\\n", " ").splitlines() if line.strip()]


def test_docs_commands_are_run_here_or_marked() -> None:
    """A shell block is either all commands a test runs, or says in its first line what it needs."""
    unmarked = []
    for block in shell_blocks():
        if NEEDS_MARKER.match(block[0]):
            continue
        for command in commands(block):
            if not (RUN_BY_THIS_FILE.match(command) or NOX.match(command)):
                unmarked.append(command)
    assert not unmarked, "mark these blocks '# (needs ...)' or make a test run them:\n" + "\n".join(
        unmarked
    )


def test_docs_kustomize_commands_work() -> None:
    kubectl()
    ran = 0
    for block in shell_blocks():
        for command in commands(block):
            if RUN_BY_THIS_FILE.match(command):
                result = subprocess.run(
                    ["bash", "-o", "pipefail", "-c", command],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                assert result.returncode == 0, f"{command}\n{result.stderr}"
                assert result.stdout.strip(), command
                ran += 1
    assert ran


def test_docs_nox_sessions_are_run_by_ci() -> None:
    in_ci = {
        session
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if not line.lstrip().startswith("#")
        for sessions in re.findall(r"(?:nox|tools/dev\.py) -s ((?:[\w-]+ ?)+)", line)
        for session in sessions.split()
    }
    assert {"demo", "slow", "manifests", "image_bases", "image", "e2e", "cluster"} <= in_ci
    named = set()
    for block in shell_blocks():
        for command in commands(block):
            match = NOX.match(command)
            if match:
                assert set(match["sessions"].split()) <= in_ci, command
                named |= set(match["sessions"].split())
    assert {"manifests", "image"} <= named


def test_docs_paths_exist_and_kustomize_paths_render() -> None:
    text = docs_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:manifests|docs|tests|requirements)/[\w./-]*\w)", text))
    assert paths
    missing = [path for path in sorted(paths) if not (ROOT / path).exists()]
    assert not missing, missing
    for command in re.findall(r"kubectl (?:apply|delete) -k (\S+)", text):
        if command == USER_OVERLAY:
            continue  # written by the install step, and built by the test below
        assert command in kustomizations(), command
        assert render(command)


@pytest.mark.parametrize("document", ["README.md", "docs/deploy.md"])
def test_the_users_overlay_builds_with_kubectl_alone(document: str, tmp_path: Path) -> None:
    """The install step's overlay of the user's own names their image and changes nothing else,
    with no kustomize binary: the block runs as shown, in a copy of the clone's manifests."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "kubectl").symlink_to(kubectl())
    (block,) = [
        block
        for block in fenced_shell((ROOT / document).read_text())
        if WRITES_USER_OVERLAY in block
    ]
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{tools}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"{block}\n{result.stderr}"
    image = f"registry.example.com/pcc/pcc-device-plugin:{project_version()}"
    assert result.stdout.split() == ["image:", image]
    overlay = render(str(tmp_path / USER_OVERLAY))
    base = render("manifests/base")
    plugin_container(the(base, "DaemonSet"))["image"] = image
    assert overlay == base


def test_docs_state_the_validated_kubernetes_range() -> None:
    oldest = ".".join(map(str, OLDEST_KUBERNETES))
    newest = ".".join(map(str, NEWEST_KUBERNETES))
    assert f"Kubernetes {oldest} to {newest}" in docs_text()


# The fleet docs/deploy.md works out, and kube-controller-manager's default client limit
# (--kube-api-qps, v1.37.2), which paces the DaemonSet controller's pod creations and deletions.
FLEET = 5000
CONTROLLER_QPS = 20


def scaled(value: int | str, nodes: int) -> int:
    """A maxSurge or maxUnavailable for `nodes` nodes, as the DaemonSet controller rounds it."""
    if isinstance(value, int):
        return value
    return math.ceil(int(value.removesuffix("%")) * nodes / 100)


def test_docs_work_out_the_fleet_from_the_manifests() -> None:
    """docs/deploy.md's arithmetic for a 5,000-node pool follows the shipped strategies."""
    text = " ".join(docs_text().split())
    surge = daemonset("manifests/base")["spec"]["updateStrategy"]["rollingUpdate"]
    no_surge = daemonset("manifests/overlays/no-surge")["spec"]["updateStrategy"]["rollingUpdate"]
    assert (
        f"`maxSurge: {surge['maxSurge']}` and `maxUnavailable: {surge['maxUnavailable']}`" in text
    )
    assert f"`maxUnavailable: {no_surge['maxUnavailable']}`" in text
    assert f"(rounded up: {scaled(surge['maxSurge'], 3)} of 3)" in text
    nodes_a_second = CONTROLLER_QPS // 2  # a creation and a deletion each
    assert f"at most {nodes_a_second} nodes a second" in text
    assert f"takes {2 * FLEET:,} requests: {2 * FLEET // CONTROLLER_QPS} s at the least" in text
    in_flight = scaled(surge["maxSurge"], FLEET)
    assert f"new pods on {in_flight:,} of the {FLEET:,} nodes" in text
    assert f"more than {in_flight // nodes_a_second} s from creation to ready" in text
    gapped = scaled(no_surge["maxUnavailable"], FLEET)
    assert f"{gapped:,} of the {FLEET:,} nodes update at once" in text
    assert f"while a gap lasts less than {gapped // nodes_a_second} s" in text
    assert (
        f"one at a time in a pool of up to {100 // int(no_surge['maxUnavailable'][:-1])})" in text
    )


def test_docs_troubleshooting_names_the_real_log_lines() -> None:
    text = docs_text()
    ds = daemonset("manifests/base")
    host_root = flag(plugin_container(ds), "host-root", "")
    # The plugin logs the path as it sees it, under the host root.
    assert f"detect device {host_root}{DEVICE} failed" in text
    assert f"detect socket path {host_root}{PCC_DIR} failed" in text
    assert "Registered device plugin with Kubelet" in text


def test_docs_list_every_kustomization_and_component() -> None:
    text = docs_text()
    for directory in kustomizations() + components():
        assert f"`{directory}`" in text, f"docs/deploy.md does not mention {directory}"


def test_docs_state_the_probe_settings() -> None:
    container = plugin_container(daemonset("manifests/base"))
    live = container["livenessProbe"]
    ready = container["readinessProbe"]
    text = " ".join(docs_text().split())
    assert (
        f"`/livez` every {live['periodSeconds']} s, {live['timeoutSeconds']} s timeout, "
        f"a restart after {live['failureThreshold']} failures in a row"
    ) in text
    assert (
        f"`/readyz` every {ready['periodSeconds']} s, "
        f"not ready after {ready['failureThreshold']} failures"
    ) in text


def test_docs_quote_the_plugins_own_words() -> None:
    """Log lines and /readyz answers that docs/deploy.md quotes come from the plugin's source."""
    source = "\n".join(path.read_text() for path in sorted((ROOT / "pcc_plugin").glob("**/*.py")))
    text = docs_text()
    for words in (
        "kubelet's ListAndWatch stream ended; registering again",
        "another instance serves it",
        "registered, but kubelet's ListAndWatch stream is not open",
        "every device is Unhealthy: ",
        "Cannot write CDI spec ",
        "for /metrics, /livez and /readyz: ",
    ):
        assert words in source, f"the plugin no longer says {words!r}"
        assert words in text, f"docs/deploy.md does not quote {words!r}"


def test_the_docs_quote_one_idle_memory_figure_per_mode_the_bench_measured() -> None:
    """docs/deploy.md and docs/dra.md give the two idle figures of the `nox -s bench` run
    BENCHMARKS.md shows, rounded, and no other."""
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    section = benchmarks[benchmarks.index("## `nox -s bench`") :]
    section = section[: section.index("\n## ")]
    (run,) = re.findall(r"^```\n(pcc-device-plugin benchmark: .*?)^```$", section, re.M | re.S)

    def figure(label: str) -> int:
        found = re.findall(rf"^{re.escape(label)}  +([\d.]+) MiB", run, re.M)
        assert len(found) == 1, f"the run shows no one line {label!r}"
        return round(float(found[0]))

    plugin = figure("idle VmRSS after a scrape, dev venv")
    driver = figure("idle VmRSS after a scrape, the DRA driver (dev venv)")
    deploy = docs_text()
    dra = " ".join((ROOT / "docs" / "dra.md").read_text().split())
    assert set(re.findall(r"about (\d+) MiB idle", deploy)) == {str(plugin)}
    assert f"| memory (VmRSS, idle, measured below) | {plugin} MiB | {driver} MiB |" in dra
    assert f"the device plugin about {plugin} MiB, the DRA driver about {driver} MiB" in dra
