"""etcd and kube-apiserver on 127.0.0.1 (free high ports, no root), with an audit log of the
drivers' requests, each driver a user of its own.

The API server is the cluster session's build (bench/scale/builds.py), started much as
tools/e2e/control_plane.py starts it, with what this benchmark needs instead of what a node
needs: static bearer tokens (``--token-auth-file``: one user per node, ``scale:<node>``, in the
group ``scale:drivers``, and an administrator in ``system:masters``), authorization RBAC only
(the drivers' ClusterRole is the one manifests/overlays/dra ships, bound to the group), no
endpoint reconciler (its address is loopback), and the audit log (level Metadata for the
drivers' group, nobody else). The certificates come from the e2e's `Pki` (openssl).

Administrator requests go over one kept HTTPS connection (http.client), so that the benchmark
itself opens no connection per request while connections are counted.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import secrets
import signal
import socket
import ssl
import subprocess
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import yaml
from e2e.control_plane import SERVICE_CIDR, Pki

from bench.scale import audit
from bench.scale.audit import GROUP, USER_PREFIX

ROOT = Path(__file__).resolve().parent.parent.parent
RBAC = ROOT / "manifests" / "overlays" / "dra" / "rbac.yaml"
READY_WITHIN = 180.0
STOP_WITHIN = 30.0
# kube-apiserver 1.37 stops listening at once on SIGTERM, then may not exit for 30 s and more
# while watches are open: after this long it is killed (its clients see the same either way:
# nobody listening, their connections reset).
APISERVER_EXIT_GRACE = 2.0
CALL_TIMEOUT = 30.0

AUDIT_POLICY = audit.policy(groups=[GROUP])

Obj = dict[str, Any]


class Failed(Exception):
    """The control plane did not do what the benchmark needs; the message says what."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@attrs.define
class Daemon:
    """A process of ours, in a session of its own, its output in `log`."""

    argv: list[str]
    log: Path
    grace: float = STOP_WITHIN
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def check(self, what: str) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise Failed(f"{what} exited ({code}); {self.log}:\n{_tail(self.log)}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop(process, self.grace)


def stop(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited after `grace` seconds."""
    if process.poll() is None:
        process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace)
    if process.poll() is None:
        process.kill()
        process.wait()


@attrs.define
class ControlPlane:
    """etcd and kube-apiserver in `directory`, for `nodes`; `start()` them, `stop()` them."""

    directory: Path
    apiserver_binary: Path
    etcd_binary: Path
    nodes: list[str]
    port: int = attrs.field(factory=free_port)
    tokens: dict[str, str] = attrs.field(init=False)
    admin_token: str = attrs.field(init=False)
    pki: Pki = attrs.field(init=False)
    etcd: Daemon = attrs.field(init=False)
    apiserver: Daemon = attrs.field(init=False)
    _connection: http.client.HTTPSConnection | None = None
    _context: ssl.SSLContext = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pki = Pki(self.directory / "pki")
        serving = self.pki.issue("apiserver", "/CN=kube-apiserver", ("127.0.0.1", "localhost"))
        self.tokens = {node: secrets.token_hex(16) for node in self.nodes}
        self.admin_token = secrets.token_hex(16)
        lines = [f'{self.admin_token},scale-admin,scale-admin,"system:masters"']
        lines += [
            f'{token},{USER_PREFIX}{node},{USER_PREFIX}{node},"{GROUP}"'
            for node, token in self.tokens.items()
        ]
        token_file = self.directory / "tokens.csv"
        token_file.write_text("\n".join(lines) + "\n")
        token_file.chmod(0o600)
        policy = self.directory / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        etcd_client, etcd_peer = free_port(), free_port()
        etcd_url, peer_url = f"http://127.0.0.1:{etcd_client}", f"http://127.0.0.1:{etcd_peer}"
        self.etcd = Daemon([
            str(self.etcd_binary), "--name=scale", f"--data-dir={self.directory / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=scale={peer_url}",
            # A benchmark's store: nothing to make durable.
            "--unsafe-no-fsync",
        ], self.directory / "etcd.log")  # fmt: skip
        self.apiserver = Daemon([
            str(self.apiserver_binary), "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--etcd-servers={etcd_url}",
            f"--tls-cert-file={serving.certificate}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.pki.ca.certificate}", f"--token-auth-file={token_file}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.pki.service_accounts.certificate}",
            f"--service-account-signing-key-file={self.pki.service_accounts.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The `kubernetes` Service's endpoint would be this loopback address: none.
            "--endpoint-reconciler-type=none",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
            # One file however long the run (no rotation while it is read).
            "--audit-log-maxsize=100000",
            "--profiling=false", "--v=1",
        ], self.directory / "kube-apiserver.log", APISERVER_EXIT_GRACE)  # fmt: skip
        self._context = ssl.create_default_context(cafile=str(self.pki.ca.certificate))

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def audit_log(self) -> Path:
        return self.directory / "audit.log"

    def kubeconfig(self, node: str, path: Path) -> Path:
        """A kubeconfig for the driver of `node`: its own token."""
        path.write_text(
            yaml.safe_dump({
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "scale", "cluster": {
                    "server": self.server,
                    "certificate-authority": str(self.pki.ca.certificate),
                }}],
                "users": [{"name": node, "user": {"token": self.tokens[node]}}],
                "contexts": [{"name": "scale", "context": {"cluster": "scale", "user": node}}],
                "current-context": "scale",
            })
        )  # fmt: skip
        return path

    def start(self) -> float:
        """etcd and the API server started, the API server ready; seconds the latter took."""
        self.etcd.start()
        return self.start_apiserver()

    def start_apiserver(self) -> float:
        """The API server started and ready (its /readyz); the seconds that took."""
        started = time.monotonic()
        self.apiserver.start()
        deadline = started + READY_WITHIN
        last = "no answer"
        while time.monotonic() < deadline:
            self.etcd.check("etcd")
            self.apiserver.check("kube-apiserver")
            try:
                status, body = self.call("GET", "/readyz")
            except (OSError, http.client.HTTPException) as error:
                last = str(error)
            else:
                if status == 200:
                    return time.monotonic() - started
                last = f"{status} {body[:200]!r}"
            time.sleep(0.1)
        raise Failed(f"kube-apiserver not ready within {READY_WITHIN:.0f} s ({last})")

    def listening(self) -> bool:
        with socket.socket() as probe:
            probe.settimeout(0.5)
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop_apiserver(self) -> float:
        """The API server stopped (SIGTERM, as for an upgrade); when it stopped listening
        (time.time())."""
        self._disconnect()
        process = self.apiserver.process
        assert process is not None
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WITHIN
        while process.poll() is None and self.listening() and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped = time.time()
        self.apiserver.stop()
        return stopped

    def stop(self) -> None:
        self._disconnect()
        self.apiserver.stop()
        self.etcd.stop()

    def _disconnect(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def call(self, method: str, path: str, body: Obj | None = None) -> tuple[int, bytes]:
        """One request as the administrator, on the kept connection (made again if it broke)."""
        for attempt in (1, 2):
            if self._connection is None:
                self._connection = http.client.HTTPSConnection(
                    "127.0.0.1", self.port, context=self._context, timeout=CALL_TIMEOUT
                )
            headers = {"Authorization": f"Bearer {self.admin_token}", "Accept": "application/json"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            try:
                self._connection.request(method, path, body=data, headers=headers)
                answer = self._connection.getresponse()
                return answer.status, answer.read()
            except (OSError, http.client.HTTPException):
                self._disconnect()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def ok(self, method: str, path: str, body: Obj | None = None) -> Obj:
        status, data = self.call(method, path, body)
        if not 200 <= status < 300:
            raise Failed(f"{method} {path}: {status} {data[:300]!r}")
        answer: Obj = json.loads(data) if data else {}
        return answer

    def prepare(self) -> None:
        """The drivers' ClusterRole (manifests/overlays/dra's), bound to their group, and one
        Node per driver."""
        for document in yaml.safe_load_all(RBAC.read_text()):
            if document["kind"] == "ClusterRole":
                rules = document["rules"]
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "scale-driver"},
            "rules": rules,
        }
        self.ok("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
        self.ok("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "scale-driver"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "scale-driver"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                          "name": GROUP}],
        })  # fmt: skip
        for node in self.nodes:
            self.ok("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                              "metadata": {"name": node}})  # fmt: skip

    def slices(self, driver: str, node: str | None = None) -> list[Obj]:
        fields = [f"spec.driver={driver}"] + ([f"spec.nodeName={node}"] if node else [])
        query = urllib.parse.urlencode({"fieldSelector": ",".join(fields)})
        items: list[Obj] = self.ok("GET", f"/apis/resource.k8s.io/v1/resourceslices?{query}")[
            "items"
        ]
        return items

    def delete_slices(self, names: Iterable[str]) -> None:
        for name in names:
            status, data = self.call("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}")
            if status not in (200, 404):
                raise Failed(f"DELETE resourceslice {name}: {status} {data[:300]!r}")

    def metrics(self) -> str:
        status, data = self.call("GET", "/metrics")
        if status != 200:
            raise Failed(f"GET /metrics: {status}")
        return data.decode()


def go_heap(metrics: str) -> int:
    """The API server's Go heap in use, in KiB (go_memstats_heap_inuse_bytes): its live
    memory, without what its garbage collector has not yet given back."""
    for line in metrics.splitlines():
        if line.startswith("go_memstats_heap_inuse_bytes "):
            return round(float(line.split()[1]) / 1024)
    raise Failed("no go_memstats_heap_inuse_bytes in kube-apiserver's /metrics")


def open_watches(metrics: str, resource: str) -> int:
    """Watches the API server holds open on `resource`, from its /metrics
    (apiserver_longrunning_requests)."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith("apiserver_longrunning_requests{"):
            continue
        labels, _, value = line.rpartition(" ")
        if f'resource="{resource}"' in labels and 'verb="WATCH"' in labels:
            total += float(value)
    return round(total)
