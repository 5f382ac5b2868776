"""The scale benchmark: N drivers against a real kube-apiserver (see __main__.py)."""
