"""`nox -s e2e`: the shipped image as static pods on a real kubelet and containerd.

Modules (run as ``PYTHONPATH=tools python -m e2e``, see ``__main__``):

``kubelet_build``
    Builds kubelet from source at the version pinned in ``kubelet/go.mod``, through the Go module
    proxy, into a cache directory keyed on that version. Standard library only, so that CI can
    start it in the background before anything else is installed.
``images``
    The sandbox ("pause") image, built from ``pause/main.go`` into a docker-archive tarball.
``node``
    The node: a private mount, PID and network namespace with containerd and kubelet in it.
``api``
    Kubelet's pod-resources gRPC API (our own client, ``podresources.proto``) and its HTTPS API.
``pods``
    Static pods rendered from the shipped kustomizations through the overlays in ``manifests/``.
``scenario``
    The checks and the figures.

docs/e2e.md says how to run it, what it checks and what it leaves behind.
"""
