"""`nox -s e2e` and `nox -s cluster`: the shipped image on a real kubelet and containerd, as static
pods (e2e) and installed with kubectl on a one-node cluster (cluster).

Modules (run as ``PYTHONPATH=tools python -m e2e``, see ``__main__``):

``builds``
    Builds containerd, kubelet, the control plane and etcd from source, each at the version its
    Go module under this directory pins, through the Go module proxy, into a cache directory
    keyed on that version. Standard library only, so that CI can start it in the background
    before anything else is installed.
``images``
    The sandbox ("pause") image, built from ``pause/main.go`` into a docker-archive tarball, and
    the race's Go yardstick, a device plugin built from ``yardstick/main.go``.
``node``
    The node: private mount, PID and network namespaces with containerd and kubelet in them.
``control_plane``
    The cluster's etcd, kube-apiserver, kube-controller-manager and kube-scheduler, and the
    certificates they use.
``api``, ``kube``
    Kubelet's pod-resources gRPC API (our own client, ``podresources.proto``) and its HTTPS API;
    the API server's, with kubectl.
``pods``
    Pods rendered from the shipped kustomizations through the components in ``manifests/``.
``kubelet_log``
    Kubelet's own log, read for when its device manager did what.
``scenario``, ``cluster``
    The checks and the figures of each session; ``report`` prints them.

docs/e2e.md says how to run them, what they check and what they leave behind.
"""

# The cluster's stages, in order (harness.run_cluster; `python -m e2e cluster --only`).
CLUSTER_STAGES = ("node", "fleet", "dra", "fleet-dra")
