"""The benchmark: the real daemon against the simulated kubelet (``nox -s bench``)."""
