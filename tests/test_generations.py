"""The shared skeleton's decisions, on trio's MockClock: a resource failing leaves the others
be; faults back to back wait and are forgotten once the resource is ready for a while."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from pcc_plugin.errors import FatalError
from pcc_plugin.generations import (
    STABLE_AFTER,
    Backoff,
    Generation,
    ServeGeneration,
    forget_faults_when_stable,
    serve_generations,
    supervise_resource,
)
from pcc_plugin.state import ResourceState


@attrs.define
class FakeMode:
    """A mode whose serving fails as told: `running` with `bug` the first `failures` times,
    `serve_generation` with `fault` (an OSError) the first `faults` times."""

    state: ResourceState
    directory: Path
    failures: int = 0
    bug: Exception = attrs.Factory(lambda: RuntimeError("boom"))
    faults: int = 0
    fault: OSError = attrs.Factory(lambda: PermissionError(13, "Permission denied"))
    server: str = "the fake server"
    directory_flags: str = "--fake-path"
    served: list[float] = attrs.Factory(list)
    generations: list[tuple[float, str]] = attrs.Factory(list)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ServeGeneration]:
        self.served.append(trio.current_time())
        if len(self.served) <= self.failures:
            raise self.bug
        yield self.serve_generation

    async def serve_generation(self, generation: Generation) -> None:
        self.generations.append((trio.current_time(), generation.cause))
        if len(self.generations) <= self.faults:
            raise self.fault
        generation.nursery.start_soon(trio.sleep_forever)


async def test_a_failing_resource_is_restarted_alone(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    broken = FakeMode(ResourceState("example.com/broken"), tmp_path, failures=2)
    healthy = FakeMode(ResourceState("example.com/healthy"), tmp_path)
    with trio.move_on_after(600):
        async with trio.open_nursery() as nursery:
            for mode in (broken, healthy):
                nursery.start_soon(supervise_resource, mode)
    first, second, third = broken.served
    assert 0.5 <= second - first <= 1.0  # backoff: 1 s with jitter
    assert 1.0 <= third - second <= 2.0
    assert len(healthy.served) == 1  # never disturbed
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert errors[0].startswith("example.com/broken failed; restarting it in")


async def test_a_fatal_error_in_a_resource_stops_the_daemon(tmp_path: Path) -> None:
    mode = FakeMode(ResourceState("x"), tmp_path, failures=1, bug=FatalError("no socket"))
    with pytest.raises(FatalError):
        await supervise_resource(mode)


async def test_faults_back_to_back_wait_and_are_said_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """An isolated fault is acted on at once; then 20 ms doubling; one error line for all."""
    caplog.set_level(logging.INFO)
    mode = FakeMode(ResourceState("x"), tmp_path, faults=6)
    with trio.move_on_after(60):
        await serve_generations(mode, mode.serve_generation, Backoff())
    times = [at for at, _ in mode.generations]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps[0] == 0
    for gap, ceiling in zip(gaps[1:], (0.02, 0.04, 0.08, 0.16, 0.32), strict=True):
        assert ceiling / 2 <= gap <= ceiling
    problem = f"cannot serve in {tmp_path}: [Errno 13] Permission denied"
    assert mode.generations[-1][1] == problem
    assert mode.state.backoff_seconds == pytest.approx(sum(gaps))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{problem}; retrying; fix: run the daemon as UID 0 with kubelet's directory mounted "
        "read-write (the DaemonSet as shipped; with SELinux, the directory needs the "
        "container_device_plugin_t type, docs/deploy.md); not on a node, give --fake-path a "
        "directory you can write"
    ]
    assert f"Serving in {tmp_path} again, after: {problem}" in caplog.text


async def test_faults_are_forgotten_once_the_resource_has_been_ready_a_while(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = ResourceState("x", needs_stream=False)
    backoff = Backoff(immediate_first=True)
    for _ in range(3):
        backoff.next_delay()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(forget_faults_when_stable, state, backoff)
        await trio.sleep(STABLE_AFTER * 2)
        state.registered_with_kubelet("start")
        # Ready, but not for long enough: nothing is forgotten.
        await trio.sleep(STABLE_AFTER / 2)
        state.kubelet_awaited(Path("/kubelet.sock"), "does not exist")
        await trio.sleep(STABLE_AFTER * 2)
        assert backoff.attempt == 3
        state.registered_with_kubelet("start")
        await trio.sleep(STABLE_AFTER + 1)
        assert backoff.attempt == 0


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(first=0.1, cap=2.0, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(10)]
    ceilings = [min(2.0, 0.1 * 2**n) for n in range(10)]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)


def test_backoff_acts_at_once_on_an_isolated_fault_and_forgets_on_reset() -> None:
    backoff = Backoff(first=0.02, cap=5.0, immediate_first=True, rng=random.Random(3))
    assert backoff.next_delay() == 0
    assert 0.01 <= backoff.next_delay() <= 0.02
    assert 0.02 <= backoff.next_delay() <= 0.04
    for _ in range(20):
        assert backoff.next_delay() <= 5.0
    backoff.reset()
    assert backoff.next_delay() == 0


@pytest.mark.parametrize("times", [1, 3])
async def test_a_file_vanishing_under_a_generation_is_an_error_only_if_it_happens_again(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    times: int,
) -> None:
    """Kubelet deletes every file in its directory when it starts, now and then the socket
    being renamed into place: a line at --v=1, served again at once; an error only when it
    happens back to back."""
    staged = tmp_path / ".0123abcd.new.sock"
    vanished = FileNotFoundError(2, "No such file or directory", str(staged), "pcc-1.sock")
    mode = FakeMode(ResourceState("x"), tmp_path, faults=times, fault=vanished)
    with trio.move_on_after(60):
        await serve_generations(mode, mode.serve_generation, Backoff())
    assert len(mode.generations) == times + 1
    assert mode.generations[1][0] == 0  # the first time, at once
    problem = f"cannot serve in {tmp_path}: [Errno 2] No such file or directory"
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if times == 1:
        assert loud == []
    else:
        assert loud == [
            f"{problem}; retrying; fix: check the directory on the node; not on a node, "
            "give --fake-path a directory you can write"
        ]


@attrs.define
class WipedAgainAndAgain(FakeMode):
    """Kubelet restarting every second, its wipe catching the socket being renamed into place
    every other time: one generation in two fails with `fault`, the others are restarted a
    second after they served."""

    async def serve_generation(self, generation: Generation) -> None:
        self.generations.append((trio.current_time(), generation.cause))
        if len(self.generations) % 2:
            raise self.fault

        async def kubelet_restarts() -> None:
            await trio.sleep(1)
            generation.restart("kubelet restarted")

        generation.nursery.start_soon(kubelet_restarts)


async def test_a_file_vanishing_now_and_then_is_never_waited_for(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each wipe that catches the socket is kubelet's restart, not a fault of the plugin's:
    served again at once each time, however many come within STABLE_AFTER."""
    staged = tmp_path / ".0123abcd.new.sock"
    vanished = FileNotFoundError(2, "No such file or directory", str(staged), "pcc-1.sock")
    mode = WipedAgainAndAgain(ResourceState("x"), tmp_path, fault=vanished)
    with trio.move_on_after(STABLE_AFTER):
        await serve_generations(mode, mode.serve_generation, Backoff())
    starts = [at for at, _ in mode.generations]
    assert len(starts) > 10
    assert all(later - earlier in (0, 1) for earlier, later in itertools.pairwise(starts))
    assert mode.state.backoff_seconds == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
