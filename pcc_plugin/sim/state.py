"""What the simulators share, and what the simulated kubelet keeps: its clients of plugins,
resources and registrations."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Any, Protocol, Self

import attrs


class Simulator(abc.ABC):
    """Started and stopped, also as a context manager; `wait_for` is woken by each change."""

    def __init__(self) -> None:
        # Reentrant so that wait_for predicates may call the observation methods.
        self._changed = threading.Condition(threading.RLock())

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def _describe(self) -> str:
        """The state in one line, for timeouts; the caller holds the lock."""

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Block until ``predicate()`` holds; raise TimeoutError describing the state otherwise."""
        with self._changed:
            if not self._changed.wait_for(predicate, timeout):
                raise TimeoutError(
                    f"{getattr(predicate, '__qualname__', predicate)} still false after "
                    f"{timeout} s; {self._describe()}"
                )


class NoPluginError(LookupError):
    """No connected device plugin serves the resource."""


class Message(Protocol):
    def SerializeToString(self) -> bytes: ...


@attrs.frozen
class PluginOptions:
    pre_start_required: bool
    get_preferred_allocation_available: bool


@attrs.frozen
class Registration:
    """One answered Register call, as the simulator saw it."""

    version: str
    endpoint: str
    resource_name: str
    accepted: bool
    # Why Register failed.
    error: str | None
    # Read back from the plugin with GetDevicePluginOptions; None if that failed.
    options: PluginOptions | None
    # Instants by time.monotonic(). Register received, and its answer decided (after the dial).
    received_at: float
    answered_at: float = 0.0
    # Kubelet's dial of the plugin's socket begun, GetDevicePluginOptions answered, the first
    # ListAndWatch list received; None if the dial failed (the first list: until it comes).
    dialled_at: float | None = None
    options_at: float | None = None
    first_list_at: float | None = None


@attrs.define(eq=False)
class PluginClient:
    """Kubelet's connection to one registered plugin socket."""

    resource: str
    endpoint: str
    channel: Any
    # When kubelet began dialling the plugin and when its options came back.
    dialled_at: float
    options_at: float
    # The index of its Registration in the simulator's list, once attached.
    registration: int = -1
    list_and_watch: Any = None
    thread: threading.Thread | None = None
    streaming: bool = False
    # The latest device list this client sent, for promotion (current kubelets).
    devices: dict[str, str] = attrs.Factory(dict)
    connected: bool = True
    # Set when the simulated kubelet itself goes down: the stream's end is then not "unexpected".
    kubelet_stopping: bool = False


@attrs.define
class KubeletResource:
    devices: dict[str, str] = attrs.Factory(dict)
    messages: int = 0
    active: PluginClient | None = None


class DialError(Exception):
    pass


def serialize(message: Message) -> bytes:
    return message.SerializeToString()
