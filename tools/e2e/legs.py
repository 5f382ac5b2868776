"""A kubelet restart as the plugin and kubelet lived it, from the plugin's log and kubelet's.

When kubelet restarts, the plugin has two legs of its own to run, and kubelet the rest:

    kubelet  registration server starting, kubelet.sock created ─┐
    plugin   Register sent                     ← the register leg ┘
    kubelet  Register read, its dial-back, GetDevicePluginOptions
    plugin   "Kubelet dialled in" (options answered)
    kubelet  options received: "Connected to new client", ─┐
             ListAndWatch opened                            │ the list leg
    plugin   its first device list sent on kubelet's stream ←┘
    kubelet  device list processed: the devices are allocatable

A pod kubelet admits before the last line fails for good (issue 26). The checks judge the
plugin's two legs against bounds set from measurements (docs/e2e.md, "The race"); the pods
admitted or refused are figures, each refused one attributed to the plugin or to kubelet.

Instants (epoch seconds, see kubelet_log) and what marks each:

- kubelet.sock created: the later of kubelet's "Starting device plugin registration server"
  (logged just before it clears the directory and listens) and kubelet.sock's inode change time
  (the kernel's, at bind; its coarse clock may lag by a few milliseconds). Both are at or before
  the true instant, so the register leg is never shorter than it was;
- a kubelet line marks when kubelet went on past it: its stamp, or, when kubelet wrote it after
  lines stamped later (its goroutine held up in the log call on a busy machine), the latest of
  those;
- Register sent: the plugin's first "Registering <resource> at" from then on (earlier ones went
  to the old kubelet.sock and were refused; a later one is the one kubelet took when it refused
  the first, still starting). The plugin logs it as it starts the call: the connection and the
  write after it are not in its log;
- the list leg's start: the later of the plugin's "Kubelet dialled in" (as it answers kubelet's
  GetDevicePluginOptions) and kubelet's "Connected to new client" (it has the answer and goes
  on to open ListAndWatch): what kubelet does in between is kubelet's;
- list sent: the plugin's "ListAndWatch stream opened on ... (kubelet's)", as it starts sending
  the list. Kubelet opens the stream on a goroutine of its own after its line, which on a busy
  kubelet runs tens of milliseconds later and logs nothing: until the plugin first runs after
  kubelet's line (it has nothing to do before kubelet's request comes), the leg is not its own.

A leg is judged less the time the plugin was runnable but waiting for a CPU in it (and the list
leg less its idle start, above): that is the machine's (a busy two-core machine kept the
plugin, in a pod that requests 100m, waiting up to 200 ms). The waits come from the plugin's
threads' schedstat, sampled every millisecond by e2e.sampler at real-time priority (Samples).
The yardstick (yardstick/main.go) logs the same words at the same steps, and is judged (as
figures) the same way.
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from . import kubelet_log, sampler
from .kubelet_log import Line
from .node import PLUGIN_DIR, Daemon
from .poll import wait_for

REGISTERING = "Registering {resource} at"
DIALLED_IN = "Kubelet dialled in"
STREAM_OPENED = "ListAndWatch stream opened on"
KUBELETS = "(kubelet's)"
POD_LOGS = Path("/var/log/pods")
TOOLS = Path(__file__).resolve().parents[1]
# Bounds on the plugin's own part of each leg in a round (one in ten may be above them, see
# allowed_over): about three times the p99 and twice the largest measured over 148 rounds on a
# busy two-core machine (docs/e2e.md).
REGISTER_BOUND = 0.020
LIST_BOUND = 0.015


@attrs.frozen
class Restart:
    """One start of kubelet, the plugin's and kubelet's steps in it (None: not in the logs)."""

    server: float
    created: float
    register_sent: float | None
    register_taken: float | None
    register_read: float | None
    dialled_in: float | None
    connected: float | None
    list_sent: float | None
    processed: float | None
    # The plugin's threads, sampled (Samples): time runnable but waiting for a CPU (the
    # machine's) in each leg, and from kubelet.sock's creation to the devices processed, with
    # the time on a CPU.
    register_wait: float | None = None
    list_wait: float | None = None
    # ... and between kubelet's read of the Register and the plugin's dial-in (not a leg: that
    # is kubelet's dial-back and the plugin's accept, together).
    dial_wait: float | None = None
    # How long into the list leg the plugin stayed idle, neither running nor waiting to: it
    # had nothing to do before kubelet's request reached it (Samples.woke).
    list_idle: float | None = None
    cpu_wait: float | None = None
    cpu_used: float | None = None

    @classmethod
    def read(
        cls,
        kubelet: list[Line],
        plugin: list[Line],
        resource: str,
        healthy: int,
        socket_changed: float | None,
    ) -> Restart:
        """From kubelet's lines of one start, the plugin's log, and kubelet.sock's inode change
        time (None if unknown)."""
        server = kubelet_log.first(kubelet, kubelet_log.REGISTRATION_SERVER)
        assert server is not None, f"kubelet's log: no {kubelet_log.REGISTRATION_SERVER!r}"
        read = kubelet_log.first(
            kubelet, kubelet_log.REGISTRATION_REQUEST, resource, after=server.seconds
        )
        # Kubelet goes on to listen once it has written its line (`past`).
        created = server.past
        # Changed later than kubelet read a Register through it: not the bind's time.
        if socket_changed is not None and (read is None or socket_changed <= read.seconds):
            created = max(created, socket_changed)
        registering = REGISTERING.format(resource=resource)
        taken = read and kubelet_log.last(plugin, registering, before=read.seconds)
        # The plugin's first Register to this kubelet.sock; kubelet may have refused it and
        # taken a later one (`taken`).
        sent = taken and kubelet_log.first(plugin, registering, after=created)
        if sent is not None and taken is not None and sent.seconds > taken.seconds:
            sent = taken
        dialled = taken and kubelet_log.first(plugin, DIALLED_IN, after=taken.seconds)
        connected = read and kubelet_log.first(
            kubelet, kubelet_log.CONNECTED, resource, after=read.seconds
        )
        opened = dialled and kubelet_log.first(
            plugin, STREAM_OPENED, KUBELETS, after=dialled.seconds
        )
        processed = read and kubelet_log.first(
            kubelet, kubelet_log.DEVICE_UPDATES, resource, f"healthyCount={healthy}",
            after=read.seconds,
        )  # fmt: skip

        def at(line: Line | None) -> float | None:
            return None if line is None else line.seconds

        return cls(
            server=server.seconds,
            created=created,
            register_sent=at(sent),
            register_taken=at(taken),
            register_read=at(read),
            dialled_in=at(dialled),
            # Kubelet opens ListAndWatch once it has written its line.
            connected=None if connected is None else connected.past,
            list_sent=at(opened),
            processed=at(processed),
        )

    @staticmethod
    def _between(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    @property
    def register_leg(self) -> float | None:
        """The plugin's: kubelet.sock created → Register sent."""
        return self._between(self.created, self.register_sent)

    @property
    def list_leg(self) -> float | None:
        """The plugin's: kubelet's dial-in → its first device list sent, less kubelet's own
        turn in between (from the plugin's answer to GetDevicePluginOptions to kubelet's
        "Connected to new client", when it goes on to open ListAndWatch)."""
        return self._between(self.list_start, self.list_sent)

    @property
    def list_start(self) -> float | None:
        if self.dialled_in is None or self.connected is None:
            return None
        return max(self.dialled_in, self.connected)

    def own(self, attribute: str) -> float | None:
        """A leg less the time the plugin waited for a CPU in it and, for the list leg, the time
        it was idle before kubelet's request came: what is left is its own (its CPU time, its
        own waits). None when the leg or the plugin's samples are missing."""
        leg: float | None = getattr(self, attribute)
        wait: float | None = getattr(self, WAITS[attribute])
        if leg is None or wait is None:
            return None
        idle = (self.list_idle or 0.0) if attribute == "list_leg" else 0.0
        return max(0.0, leg - wait - idle)

    @property
    def kubelet_read(self) -> float | None:
        """Kubelet's: Register sent → kubelet read it (refusing any before it)."""
        return self._between(self.register_sent, self.register_read)

    @property
    def kubelet_dial(self) -> float | None:
        """Kubelet's and the plugin's: Register read → the plugin answers GetDevicePluginOptions
        (kubelet's dial-back, the plugin's accept and handshake)."""
        return self._between(self.register_read, self.dialled_in)

    @property
    def kubelet_turn(self) -> float | None:
        """Kubelet's, inside the list leg: the plugin's dial-in → kubelet has the options and
        opens ListAndWatch."""
        return self._between(self.dialled_in, self.connected)

    @property
    def kubelet_processed(self) -> float | None:
        """Kubelet's: the plugin's first list sent → kubelet processed it."""
        return self._between(self.list_sent, self.processed)

    def missing(self) -> list[str]:
        """The plugin's steps its log does not show, in order."""
        steps = {
            "Register sent (kubelet read none)" if self.register_read is None
            else f"a {REGISTERING.format(resource='<resource>')!r} line": self.register_sent,
            f"{DIALLED_IN!r}": self.dialled_in,
            f"{STREAM_OPENED!r} ... {KUBELETS!r}": self.list_sent,
        }  # fmt: skip
        return [name for name, instant in steps.items() if instant is None]


# The plugin's legs: attribute, name, what it spans, bound.
LEGS = (
    ("register_leg", "register leg", "kubelet.sock created → Register sent", REGISTER_BOUND),
    ("list_leg", "list leg", "kubelet's dial-in → first device list sent", LIST_BOUND),
)
WAITS = {"register_leg": "register_wait", "list_leg": "list_wait"}
KUBELET_LEGS = {
    "kubelet_read": "kubelet: Register sent → read",
    "kubelet_dial": "kubelet: Register read → its dial-back answered",
    "kubelet_turn": "kubelet: options answered → ListAndWatch opened",
    "kubelet_processed": "kubelet: first list sent → processed",
}


def p99(values: list[float]) -> float:
    """The 99th percentile, interpolated between the two nearest values (the largest of fewer
    than 100 lies above it)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[98]


def judged(restarts: list[Restart], attribute: str) -> list[float]:
    """A leg of each restart that has it, less the plugin's wait for a CPU."""
    return [v for r in restarts if (v := r.own(attribute)) is not None]


def allowed_over(rounds: int) -> int:
    """How many of `rounds` restarts may see a leg's own part above its bound: one in ten, and
    one in a run of fewer. The samples see a wait for a CPU, not every stall the machine makes
    (a read the kernel does for a page fault puts the thread to sleep): once in a run, a stall
    cannot be told from the machine's; again and again, it is the plugin's (docs/e2e.md)."""
    return max(1, rounds // 10)


def within_bounds(restarts: list[Restart]) -> str:
    """The legs of a run that passed, as a check's line says them."""
    parts = []
    for attribute, name, _, bound in LEGS:
        values = judged(restarts, attribute)
        over = sum(value > bound for value in values)
        parts.append(
            f"the plugin's {name}, its own part, median {statistics.median(values) * 1000:.1f} "
            f"ms, slowest {max(values) * 1000:.1f} ms, above {bound * 1000:.0f} ms in {over} of "
            f"{len(values)}"
        )
    return "; ".join(parts)


def over_bounds(restarts: list[Restart]) -> list[str]:
    """What the plugin did wrong over a run's restarts: a leg whose own part is above its bound
    in more of them than allowed (allowed_over), or a restart after which it never registered
    or its log lacks a step."""
    problems = [
        f"restart {number}: the plugin's log shows no {', no '.join(missing)}"
        for number, restart in enumerate(restarts, 1)
        if (missing := restart.missing())
    ]
    # A check that cannot tell the machine's share from the plugin's judges nothing: say so.
    problems += [
        f"restart {number}: the plugin's CPU was not sampled over it (e2e.sampler): its legs "
        "cannot be judged"
        for number, restart in enumerate(restarts, 1)
        if not restart.missing() and restart.register_wait is None
    ]
    for attribute, name, span, bound in LEGS:
        values = judged(restarts, attribute)
        over = [value for value in values if value > bound]
        if len(over) > allowed_over(len(values)):
            problems.append(
                f"the plugin's {name} ({span}), its own part: above its bound of "
                f"{bound * 1000:.0f} ms in {len(over)} of {len(values)} restarts "
                f"({', '.join(f'{value * 1000:.1f}' for value in sorted(over, reverse=True))} ms; "
                f"median {statistics.median(values) * 1000:.1f} ms), more than "
                f"{allowed_over(len(values))} allowed"
            )
    return problems


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def why_refused(restart: Restart, pod_added: float | None) -> str:
    """Whose a refused pod is: the plugin's (a leg over its bound), kubelet's before it read the
    Register, or kubelet's after."""
    late = [
        f"{name}, its own part, {ms(value)} > {bound * 1000:.0f} ms"
        for attribute, name, _, bound in LEGS
        if (value := restart.own(attribute)) is not None and value > bound
    ]
    if late or restart.missing():
        return "plugin late: " + "; ".join(late + [f"no {m}" for m in restart.missing()])
    taken = ms(restart._between(restart.created, pod_added))
    sent = ms(restart.register_leg)
    if restart.register_wait:
        sent += f", {ms(restart.register_wait)} of it waiting for a CPU"
    if pod_added is None or restart.register_read is None or pod_added < restart.register_read:
        when = (
            f"kubelet took the pod {taken} after kubelet.sock appeared, before the plugin's "
            f"Register ({sent})" if pod_added is not None and restart.register_sent is not None
            and pod_added < restart.register_sent
            else f"the plugin's Register sent at {sent}, kubelet took the pod at {taken} and read "
            f"the Register at {ms(restart._between(restart.created, restart.register_read))}"
        )  # fmt: skip
        return f"kubelet admitted the pod before its own server could read the request: {when}"
    return (
        f"kubelet late: it read the Register at "
        f"{ms(restart._between(restart.created, restart.register_read))} and took the pod at "
        f"{taken}, but its own steps after (dial-back {ms(restart.kubelet_dial)}, the plugin "
        f"waiting {ms(restart.dial_wait)} of it for a CPU; turn {ms(restart.kubelet_turn)}; "
        f"processing {ms(restart.kubelet_processed)}) ended after it"
    )


def container_log(namespace: str, pod: str, uid: str, container: str, restarts: int) -> Path:
    """Where kubelet keeps a container's log (on the node, in the namespace's /var/log)."""
    return POD_LOGS / f"{namespace}_{pod}_{uid}" / container / f"{restarts}.log"


def socket_changed() -> float | None:
    """kubelet.sock's inode change time, None if it is not there."""
    try:
        return os.stat(PLUGIN_DIR / "kubelet.sock").st_ctime_ns / 1e9
    except FileNotFoundError:
        return None


@attrs.frozen
class Samples:
    """The plugin's threads every millisecond over one restart (e2e.sampler): epoch time, and
    the seconds they ran and waited for a CPU so far, summed."""

    rows: list[tuple[float, float, float]]

    @classmethod
    def parse(cls, text: str) -> Samples:
        rows = [line.split() for line in text.splitlines()]
        return cls([(float(at), float(ran), float(waited)) for at, ran, waited in rows])

    def waited(self, start: float | None, end: float | None) -> float | None:
        """How long the plugin waited for a CPU between `start` and `end` (epoch).

        The kernel adds a wait to a thread's count when it ends (the thread gets a CPU): a wait
        counted between two samples is taken to have ended at the later one and to have lasted
        back from there, and what of it lies between `start` and `end` is counted. Samples
        after `end` count too, for a wait still going on at `end`. None without samples from
        before `start` to after `end`."""
        rows = self.rows
        if start is None or end is None or not rows or rows[0][0] > start or rows[-1][0] < end:
            return None
        total = 0.0
        for (_, _, before), (at, _, after) in itertools.pairwise(rows):
            if after > before:
                total += max(0.0, min(at, end) - max(at - (after - before), start))
        return total

    def idle(self, start: float | None, end: float | None) -> float | None:
        """How long from `start` the plugin neither ran nor waited to (its threads blocked),
        until it first did, by `end` at the latest. Dated early: from the sample before the
        first one that counted a run or a wait, less the wait it counted."""
        rows = self.rows
        if start is None or end is None or not rows or rows[0][0] > start or rows[-1][0] < end:
            return None
        for (before, ran, waited), (at, ran_then, waited_then) in itertools.pairwise(rows):
            if at <= start:
                continue
            if ran_then > ran or waited_then > waited:
                return max(0.0, min(end, before - (waited_then - waited)) - start)
            if at >= end:
                break
        return end - start

    def ran(self, start: float, end: float) -> float | None:
        """About how long the plugin ran between `start` and `end` (to the nearest samples)."""
        inside = [row for row in self.rows if start <= row[0] <= end]
        return inside[-1][1] - inside[0][1] if inside else None


@attrs.define
class Sampler:
    """e2e.sampler on process `pid`, at real-time priority, from `start` to `stop`."""

    pid: int
    process: trio.Process | None = None
    out: Path | None = None

    async def start(self) -> None:
        descriptor, name = tempfile.mkstemp(prefix="pcc-e2e-samples-")
        os.close(descriptor)
        self.out = Path(name)
        self.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "e2e.sampler", str(self.pid), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=str(TOOLS)),
        )
        # Its first sample taken: a busy machine can take a second to start Python.
        assert self.process.stdout is not None
        with trio.fail_after(60):
            said = await self.process.stdout.receive_some(64)
        if said != sampler.SAMPLING:
            raise AssertionError(f"e2e.sampler on {self.pid} did not start: {said!r}")

    async def stop(self) -> Samples | None:
        """The samples; None if it did not run or failed."""
        process, out = self.process, self.out
        if process is None or out is None:
            return None
        assert process.stdin is not None
        await process.stdin.aclose()
        with trio.fail_after(30):
            code = await process.wait()
        text = await trio.Path(out).read_text()
        out.unlink()
        return Samples.parse(text) if code == 0 else None


async def read_restart(
    kubelet: Daemon,
    plugin_log: Callable[[], Awaitable[Path]],
    resource: str,
    healthy: int,
    samples: Samples | None = None,
) -> Restart:
    """Kubelet's current start as its log and the plugin's (at `plugin_log()`) tell it, with
    the plugin's waits for a CPU from `samples`; read once the plugin's log has every step
    (containerd may still be copying its last lines), or after a few seconds with what it has."""
    changed = await trio.to_thread.run_sync(socket_changed)

    async def read() -> Restart:
        path = await plugin_log()
        try:
            plugin = await trio.to_thread.run_sync(kubelet_log.container_lines, path)
        except FileNotFoundError:
            raise AssertionError(f"no plugin log where kubelet keeps it: {path}") from None
        lines = kubelet_log.lines_of_start(kubelet.log, kubelet.starts)
        restart = Restart.read(lines, plugin, resource, healthy, changed)
        if samples is None:
            return restart
        return attrs.evolve(
            restart,
            register_wait=samples.waited(restart.created, restart.register_sent),
            list_wait=samples.waited(restart.list_start, restart.list_sent),
            list_idle=samples.idle(restart.list_start, restart.list_sent),
            dial_wait=samples.waited(restart.register_read, restart.dialled_in),
            cpu_wait=samples.waited(restart.created, restart.processed),
            cpu_used=None
            if restart.processed is None
            else samples.ran(restart.created, restart.processed),
        )

    async def complete() -> Restart | None:
        restart = await read()
        return None if restart.missing() else restart

    try:
        found, _ = await wait_for("the plugin's log of this restart", complete, 5)
    except AssertionError:
        return await read()
    return found
