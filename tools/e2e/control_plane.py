"""A one-node control plane for ``nox -s cluster``, in the node's namespaces (node.py).

etcd on the namespace's loopback as the API server's store; kube-apiserver on the node's address
(``192.0.2.1:443``); kube-controller-manager and kube-scheduler; each a :class:`node.Daemon`
with its log in the logs directory. What a real cluster has, and the sessions need:

- certificates and keys made now by ``openssl`` (EC P-256, valid for a day), one CA for all:
  the API server's serving certificate, a client certificate for each component (kubelet's as
  ``system:node:<node>`` in ``system:nodes``, which the Node authorizer and NodeRestriction
  need) and for the administrator (``system:masters``), and the service-account key pair;
- authorization ``Node,RBAC``; admission: the defaults (PodSecurity, Priority,
  ServiceAccount, ...) and NodeRestriction; PodSecurity enforces ``baseline`` in every
  namespace that does not say otherwise (admission.yaml), so the plugin's privileged pod is
  admitted only because kube-system is labelled ``privileged`` (cluster.py does that, as an
  administrator of such a cluster would);
- ``--allow-privileged``: the plugin's base pod is privileged;
- the ``kubernetes`` Service's address, where in-cluster clients (the DRA driver) find the API
  server: there is no kube-proxy, so the address (``SERVICE_IP``) is put on the node's loopback
  and the API server serves on the Service's port, 443, on every address: a pod's connection to
  ``KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT`` reaches it through the pods' bridge as
  kube-proxy's rule would send it.

The API server's own checks (``/readyz``, the components' ``/healthz``) tell when each is up.
"""

from __future__ import annotations

import functools
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import attrs
import trio

from bench.scale import audit

from .node import NODE_IP, NODE_NAME, Daemon
from .poll import Unavailable, wait_for

# The `kubernetes` Service's port: see the docstring.
API_PORT = 443
API_SERVER = f"https://{NODE_IP}:{API_PORT}"
ETCD = "http://127.0.0.1:2379"
SERVICE_CIDR = "10.96.0.0/16"
# The first address of SERVICE_CIDR: the `kubernetes` Service, in the serving certificate.
SERVICE_IP = "10.96.0.1"
CONTROLLER_MANAGER_PORT = 10257
SCHEDULER_PORT = 10259
DAYS = "1"

# What the DRA driver asks of the API server, recorded as the scale benchmark records its
# drivers' (bench/scale/audit.py): check 11 reads each node's start from it.
DRIVER_ACCOUNT = "system:serviceaccount:kube-system:pcc-device-plugin"
AUDIT_POLICY = audit.policy(users=[DRIVER_ACCOUNT])

ADMISSION = """\
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
  - name: PodSecurity
    configuration:
      apiVersion: pod-security.admission.config.k8s.io/v1
      kind: PodSecurityConfiguration
      defaults:
        enforce: baseline
        enforce-version: latest
      exemptions: {}
"""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@attrs.frozen
class Credential:
    certificate: Path
    key: Path


@attrs.define
class Pki:
    """The cluster's CA and what it signs, as files in `directory`."""

    directory: Path

    def __attrs_post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(self.ca.key), "-out", str(self.ca.certificate),
            "-days", DAYS, "-subj", "/CN=pcc-e2e-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        _openssl(
            "genpkey", "-algorithm", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-out", str(self.service_accounts.key),
        )  # fmt: skip
        _openssl(
            "pkey", "-in", str(self.service_accounts.key), "-pubout",
            "-out", str(self.service_accounts.certificate),
        )  # fmt: skip

    @property
    def ca(self) -> Credential:
        return Credential(self.directory / "ca.crt", self.directory / "ca.key")

    @property
    def service_accounts(self) -> Credential:
        """The key that signs service-account tokens; `certificate` is its public key."""
        return Credential(self.directory / "sa.pub", self.directory / "sa.key")

    def issue(self, name: str, subject: str, server_names: tuple[str, ...] = ()) -> Credential:
        """A certificate for `subject` (``/O=group/CN=user``), for a server when it has names."""
        issued = Credential(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        usage = "serverAuth" if server_names else "clientAuth"
        extensions = [
            "-addext", "basicConstraints=critical,CA:FALSE",
            "-addext", "keyUsage=critical,digitalSignature",
            "-addext", f"extendedKeyUsage={usage}",
        ]  # fmt: skip
        if server_names:
            names = ",".join(f"IP:{n}" if n[0].isdigit() else f"DNS:{n}" for n in server_names)
            extensions += ["-addext", f"subjectAltName={names}"]
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(issued.key), "-out", str(issued.certificate),
            "-days", DAYS, "-subj", subject, "-CA", str(self.ca.certificate),
            "-CAkey", str(self.ca.key), *extensions,
        )  # fmt: skip
        return issued

    def kubeconfig(self, name: str, user: Credential) -> Path:
        path = self.directory / f"{name}.kubeconfig"
        path.write_text(f"""\
apiVersion: v1
kind: Config
clusters:
  - name: pcc-e2e
    cluster:
      server: {API_SERVER}
      certificate-authority: {self.ca.certificate}
users:
  - name: {name}
    user:
      client-certificate: {user.certificate}
      client-key: {user.key}
contexts:
  - name: {name}
    context:
      cluster: pcc-e2e
      user: {name}
current-context: {name}
""")
        return path


def _https_get(url: str, ca: Path | None, user: Credential) -> int:
    """The status of a GET as `user`; without `ca`, the server's certificate is not checked."""
    context = ssl.create_default_context(cafile=None if ca is None else str(ca))
    if ca is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(str(user.certificate), str(user.key))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(url, timeout=5) as answer:
            status: int = answer.status
            return status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError) as error:
        raise Unavailable(f"GET {url}: {error}") from None


@attrs.define
class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler; started and stopped in
    order. Call inside the namespaces only."""

    state: Path
    logs: Path
    binaries: Path
    etcd_binary: Path
    pki: Pki = attrs.field(init=False)
    admin_credential: Credential = attrs.field(init=False)
    admin: Path = attrs.field(init=False)
    kubelet_kubeconfig: Path = attrs.field(init=False)
    daemons: list[Daemon] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        pki = self.pki = Pki(self.state / "pki")
        self.admin_credential = pki.issue("admin", "/O=system:masters/CN=pcc-e2e-admin")
        self.admin = pki.kubeconfig("admin", self.admin_credential)
        self.kubelet_kubeconfig = pki.kubeconfig(
            "kubelet", pki.issue("kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}")
        )
        serving = pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            (NODE_IP, SERVICE_IP, "127.0.0.1", "localhost", "kubernetes", "kubernetes.default",
             "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"),
        )  # fmt: skip
        # The API server's client for kubelet's API (logs, exec), as kubeadm made it.
        to_kubelet = pki.issue("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver")
        admission = self.state / "admission.yaml"
        admission.write_text(ADMISSION)
        audit_policy = self.state / "audit-policy.yaml"
        audit_policy.write_text(AUDIT_POLICY)
        kubeconfigs = {
            name: pki.kubeconfig(name, pki.issue(name, f"/CN=system:{name}"))
            for name in ("kube-controller-manager", "kube-scheduler")
        }
        self.daemons = [
            Daemon("etcd", [
                str(self.etcd_binary), "--name=pcc-e2e", f"--data-dir={self.state / 'etcd'}",
                f"--listen-client-urls={ETCD}", f"--advertise-client-urls={ETCD}",
                "--listen-peer-urls=http://127.0.0.1:2380",
                # In the state directory's tmpfs: nothing to make durable.
                "--unsafe-no-fsync",
            ], self.logs / "etcd.log"),
            Daemon("kube-apiserver", [
                str(self.binaries / "kube-apiserver"), f"--advertise-address={NODE_IP}",
                f"--secure-port={API_PORT}", f"--etcd-servers={ETCD}",
                f"--tls-cert-file={serving.certificate}", f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={pki.ca.certificate}",
                f"--kubelet-client-certificate={to_kubelet.certificate}",
                f"--kubelet-client-key={to_kubelet.key}",
                "--kubelet-preferred-address-types=InternalIP",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_accounts.certificate}",
                f"--service-account-signing-key-file={pki.service_accounts.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--admission-control-config-file={admission}",
                "--allow-privileged=true", "--profiling=false", "--v=1",
                f"--audit-policy-file={audit_policy}", f"--audit-log-path={self.audit_log}",
            ], self.logs / "kube-apiserver.log"),
            Daemon("kube-controller-manager", [
                str(self.binaries / "kube-controller-manager"),
                *self._client_flags(kubeconfigs["kube-controller-manager"]),
                f"--service-account-private-key-file={pki.service_accounts.key}",
                f"--root-ca-file={pki.ca.certificate}", "--use-service-account-credentials",
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1",
            ], self.logs / "kube-controller-manager.log"),
            Daemon("kube-scheduler", [
                str(self.binaries / "kube-scheduler"),
                *self._client_flags(kubeconfigs["kube-scheduler"]), "--v=1",
            ], self.logs / "kube-scheduler.log"),
        ]  # fmt: skip

    def node_kubeconfig(self, name: str) -> Path:
        """A kubeconfig for the kubelet of node `name` (its own ``system:node:<name>``)."""
        subject = f"/O=system:nodes/CN=system:node:{name}"
        return self.pki.kubeconfig(f"kubelet-{name}", self.pki.issue(f"kubelet-{name}", subject))

    @property
    def audit_log(self) -> Path:
        return self.logs / "kube-apiserver-audit.log"

    @staticmethod
    def _client_flags(kubeconfig: Path) -> list[str]:
        return [
            f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
            "--leader-elect=false", "--profiling=false",
        ]  # fmt: skip

    async def _answers(self, daemon: Daemon, url: str, ca: Path | None) -> bool | None:
        daemon.check_running()
        status = await trio.to_thread.run_sync(
            _https_get, url, ca, self.admin_credential, abandon_on_cancel=True
        )
        return True if status == 200 else None

    async def start(self) -> dict[str, float]:
        """Each component started and answering, in order; seconds each took."""
        etcd, apiserver, controller_manager, scheduler = self.daemons
        # The API server's readiness includes etcd's. The other two serve on certificates they
        # make themselves at start, which no CA vouches for.
        checks = {
            apiserver.name: (f"{API_SERVER}/readyz", self.pki.ca.certificate),
            controller_manager.name: (f"https://127.0.0.1:{CONTROLLER_MANAGER_PORT}/healthz", None),
            scheduler.name: (f"https://127.0.0.1:{SCHEDULER_PORT}/healthz", None),
        }
        took = {}
        await trio.run_process(["ip", "address", "add", f"{SERVICE_IP}/32", "dev", "lo"])
        await etcd.start()
        for daemon in self.daemons[1:]:
            await daemon.start()
            answers = functools.partial(self._answers, daemon, *checks[daemon.name])
            _, ready_at = await wait_for(f"{daemon.name} answers", answers, 120)
            took[daemon.name] = ready_at - daemon.started_at
        return took

    async def stop(self) -> None:
        for daemon in reversed(self.daemons):
            await daemon.stop()

    async def stop_api_server(self) -> None:
        """kube-apiserver alone stopped (an outage of the control plane's front door)."""
        await self.daemons[1].stop()

    async def start_api_server(self) -> float:
        """kube-apiserver started again and ready; when it was (CLOCK_BOOTTIME)."""
        apiserver = self.daemons[1]
        await apiserver.start()
        answers = functools.partial(
            self._answers, apiserver, f"{API_SERVER}/readyz", self.pki.ca.certificate
        )
        _, ready_at = await wait_for(f"{apiserver.name} answers again", answers, 120)
        return ready_at
