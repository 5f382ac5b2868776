"""The daemon under test as a child process, its output teed into a log file and watched.

A reader thread copies the child's combined stdout and stderr into the log file and wakes the
waiters of :meth:`Daemon.wait_for_log` on each line, so tests wait on events, not on sleeps.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

# Never needed to register, each loaded only by the command or option that uses it: the
# doctor, the simulator, profiles and their YAML (--config), googleapis' status protos
# (grpclib's error details, which the plugin neither sends nor reads), and the DRA mode with
# its API client (--mode=dra).
NOT_NEEDED_TO_REGISTER = (
    "pcc_plugin.doctor",
    "pcc_plugin.sim",
    "pcc_plugin.profiles",
    "yaml",
    "google",
    "pcc_plugin.dra",
    "httpx",
)


def unneeded_imports(modules: Iterable[str]) -> list[str]:
    """The entries of NOT_NEEDED_TO_REGISTER among `modules`, or a submodule of them."""
    present = set(modules)
    return [
        name
        for name in NOT_NEEDED_TO_REGISTER
        if any(module == name or module.startswith(name + ".") for module in present)
    ]


class Daemon:
    """A process in its own session (and process group), so teardown can kill all of it."""

    def __init__(
        self, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.argv = list(argv)
        self._lines: list[str] = []
        self._output_ended = False
        self._changed = threading.Condition()
        self._log_file = log_path.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(
            target=self._tee, args=(self.proc.stdout,), name=f"daemon-{self.proc.pid}", daemon=True
        )
        self._reader.start()

    @classmethod
    def spawn_plugin(
        cls,
        args: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        wrapper: Sequence[str] = (),
    ) -> Daemon:
        """Run ``python -m pcc_plugin`` with ``args`` under this interpreter.

        ``wrapper`` comes first on the command line (``prlimit --nofile=64``, ``unshare -m``).
        """
        return cls([*wrapper, sys.executable, "-m", "pcc_plugin", *args], log_path, env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for_log(
        self, substring: str | re.Pattern[str], timeout: float = 10.0, *, count: int = 1
    ) -> str:
        """Block until ``count`` lines contain ``substring`` (or match the pattern anywhere);
        return the ``count``-th such line.

        Raises RuntimeError at once if the daemon's output ends first, TimeoutError after
        ``timeout`` seconds; both quote the end of the log.
        """

        def matching() -> list[str]:
            if isinstance(substring, re.Pattern):
                return [line for line in self._lines if substring.search(line)]
            return [line for line in self._lines if substring in line]

        with self._changed:
            self._changed.wait_for(lambda: len(matching()) >= count or self._output_ended, timeout)
            found = matching()
            output_ended = self._output_ended
            tail = "".join(self._lines[-20:])
        if len(found) >= count:
            return found[count - 1].rstrip("\n")
        progress = f"{len(found)} of {count} lines containing {substring!r}"
        if output_ended:
            # The output ends as the process exits, a moment before it can be reaped.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
            raise RuntimeError(
                f"the daemon's output ended (exit code {self.proc.returncode}) after {progress}; "
                f"log ends with:\n{tail}"
            )
        raise TimeoutError(f"{progress} after {timeout} s; log ends with:\n{tail}")

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Send ``sig`` to the daemon alone, then `exited`."""
        self.proc.send_signal(sig)
        return self.exited(timeout)

    def exited(self, timeout: float = 10.0) -> int:
        """Wait for the daemon to exit and return its exit code.

        Returns once the output is read to its end too, so the log is complete. Raises
        subprocess.TimeoutExpired if the daemon outlives ``timeout`` (teardown then kills it).
        """
        returncode = self.proc.wait(timeout)
        self._reader.join(timeout)
        return returncode

    def output_ended(self, timeout: float) -> bool:
        """Whether every process that held the daemon's output has let it go (read to its
        end), waiting up to `timeout` seconds for it."""
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        """Kill the whole process group unless the daemon was already reaped, then clean up."""
        if self.proc.returncode is None:
            # Not reaped yet, so the group ID cannot have been reused.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if not self.output_ended(5):
            raise RuntimeError(f"something in process group {self.proc.pid} still holds its output")
        self._log_file.close()

    def _tee(self, output: IO[bytes]) -> None:
        with output:
            for raw in output:
                line = raw.decode("utf-8", errors="replace")
                self._log_file.write(line)
                self._log_file.flush()
                with self._changed:
                    self._lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._output_ended = True
            self._changed.notify_all()


class StartDaemon(Protocol):
    """The ``start_daemon`` fixture: run ``[*wrapper] python -m pcc_plugin *args``, extra
    ``env`` merged in."""

    def __call__(
        self, *args: str, env: Mapping[str, str] | None = None, wrapper: Sequence[str] = ()
    ) -> Daemon: ...
