"""The claims this driver prepared on this node, on the host's disk: read and written here only.

`<state dir>/checkpoint.json`, replaced whole (a temporary file, fsync, rename, fsync of the
directory) before kubelet hears of a change, so a driver started again (a restart, a
rollout, a reboot) knows what it prepared. Version 1, the first:

    {"version": 1, "driver": "<driver>", "claims": {"<claim UID>": {
        "namespace": "...", "name": "...",
        "devices": [{"requests": ["..."], "pool": "...", "device": "..."}]}}}

A file that is not that (another version, a torn write by hand) is moved aside to
`checkpoint.json.unreadable`, said, and the claims are taken from what else records them
(`salvage`: the claims' CDI specs, claims.py). One call at a time, across instances too
(either pod of a rolling update may be asked): `locked` holds a trio lock and an flock of
`serialize.lock` beside the file, as upstream's kubeletplugin helper names it, and gives up
(`LockBusy`) when it cannot have them in the time its caller has.

The file is read and written (two fsyncs) in a worker thread: a slow disk holds up the call
that waits for it, not the event loop (kubelet's other calls, the health streams, probes).
The flock is waited for in a thread too, of a limiter of its own with one place: a wait that
its caller gave up on keeps that place until the lock comes, so the next call waits for it
there, and never more than one thread waits however many calls give up (trio's default
limiter, shared with every other thread, would be used up).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

log = logging.getLogger(__name__)

VERSION = 1
FILE = "checkpoint.json"
LOCK = "serialize.lock"


@attrs.frozen
class PreparedDevice:
    """One device of a prepared claim, and the requests of the claim it serves."""

    requests: tuple[str, ...]
    pool: str
    device: str


@attrs.frozen
class PreparedClaim:
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


Claims = dict[str, PreparedClaim]


class LockBusy(Exception):
    """The lock was not free within the time given: another call (of this instance or of
    another one) holds it."""


class Checkpoint:
    """The prepared claims of `driver`, by claim UID, in `directory`."""

    def __init__(self, directory: Path, driver: str, salvage: Callable[[], Claims] = dict) -> None:
        self.directory = directory
        self.driver = driver
        self.salvage = salvage
        self._lock = trio.Lock()
        self._flock_waiter = trio.CapacityLimiter(1)

    def peek(self) -> Claims:
        """The claims as the file has them now, without the lock (it is replaced whole, so
        never seen half written) and without moving an unreadable one aside (that is `read`'s,
        under the lock)."""
        try:
            return _claims(json.loads((self.directory / FILE).read_bytes()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}

    def read(self) -> Claims:
        path = self.directory / FILE
        try:
            return _claims(json.loads(path.read_bytes()))
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # Kept aside, not lost: an operator can see what was prepared.
            aside = path.with_name(f"{FILE}.unreadable")
            os.replace(path, aside)
            salvaged = self.salvage()
            self.write(salvaged)
            # Said once it is true on disk: whoever reads the line may read the file.
            log.error("Checkpoint %s was unreadable (%s), moved to %s; %d prepared claims "
                      "taken from their CDI specs", path, exc, aside, len(salvaged))  # fmt: skip
            return salvaged

    def write(self, claims: Claims) -> None:
        document = {
            "version": VERSION,
            "driver": self.driver,
            "claims": {uid: attrs.asdict(claim) for uid, claim in claims.items()},
        }
        with tempfile.NamedTemporaryFile(
            "w", dir=self.directory, prefix=".checkpoint-", delete=False
        ) as temporary:
            json.dump(document, temporary, indent=1, sort_keys=True)
            temporary.flush()
            os.fsync(temporary.fileno())
        try:
            os.replace(temporary.name, self.directory / FILE)
        except OSError:
            Path(temporary.name).unlink(missing_ok=True)
            raise
        directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    @contextlib.asynccontextmanager
    async def locked(self, within: float = math.inf) -> AsyncIterator[Claims]:
        """The claims, read under the lock and written back as the block leaves them, if it
        changed them (and did not raise); LockBusy if the lock is not free within `within`
        seconds, OSError if they cannot be read or written."""
        async with contextlib.AsyncExitStack() as held:
            try:
                with trio.fail_after(within):
                    await self._lock.acquire()
                    held.callback(self._lock.release)
                    descriptor = os.open(
                        self.directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
                    )
                    held.callback(os.close, descriptor)
                    # Another instance holds it while it writes a few files. A thread waits for
                    # it, abandoned if the wait ends first: the descriptor is closed then, so a
                    # lock the thread takes later goes with it.
                    await trio.to_thread.run_sync(
                        fcntl.flock, descriptor, fcntl.LOCK_EX, abandon_on_cancel=True,
                        limiter=self._flock_waiter,
                    )  # fmt: skip
            except trio.TooSlowError:
                raise LockBusy(
                    f"another call held {self.directory / LOCK} for {within:.0f} s (another "
                    "instance of the driver, or a slow disk); kubelet tries again"
                ) from None
            claims = await trio.to_thread.run_sync(self.read)
            before = dict(claims)
            yield claims
            if claims != before:
                await trio.to_thread.run_sync(self.write, claims)


def _claims(document: Any) -> Claims:
    """Version 1's claims, typed; ValueError (or a lookup's error) for anything else."""
    if document.get("version") != VERSION:
        raise ValueError(f"version {document.get('version')!r}, not {VERSION}")
    return claims_of(document["claims"])


def claims_of(entries: Any) -> Claims:
    """Claims by UID, typed from their JSON form (a lookup's error if one is not that)."""
    return {
        str(uid): PreparedClaim(
            entry["namespace"],
            entry["name"],
            tuple(
                PreparedDevice(tuple(device["requests"]), device["pool"], device["device"])
                for device in entry["devices"]
            ),
        )
        for uid, entry in entries.items()
    }
