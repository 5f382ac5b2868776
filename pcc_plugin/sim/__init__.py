"""A simulated kubelet on grpcio, a fake node and a daemon runner, for tests and the demo."""

from pcc_plugin.sim.blocking import run_blocking
from pcc_plugin.sim.daemon import Daemon, StartDaemon, unneeded_imports
from pcc_plugin.sim.kubelet import SimKubelet
from pcc_plugin.sim.node import FakeNode
from pcc_plugin.sim.state import NoPluginError, PluginOptions, Registration

__all__ = [
    "Daemon",
    "FakeNode",
    "NoPluginError",
    "PluginOptions",
    "Registration",
    "SimKubelet",
    "StartDaemon",
    "run_blocking",
    "unneeded_imports",
]
