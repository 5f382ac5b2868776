"""Protobuf classes for the simulated kubelet (generated)."""
