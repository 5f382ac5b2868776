"""``python -m e2e.sampler PID OUT``: how long process PID's threads ran and waited for a CPU,
every millisecond (``sampling`` on stdout once it has begun), until stdin closes (or PID is
gone, or two minutes pass); then the samples to OUT, one a line: ``epoch-seconds ran-seconds
waited-seconds`` (sums over the threads, from /proc/PID/task/*/schedstat).

It runs at real-time priority (SCHED_FIFO), so that it samples on time however busy the machine
is: the e2e reads from these samples how much of a leg of the plugin's was the machine's
(legs.Samples). Standard library only, and as little work per sample as it can.
"""

from __future__ import annotations

import os
import select
import sys
import time

INTERVAL = 0.001
LONGEST = 120.0
# Said on stdout once the first sample is taken.
SAMPLING = b"sampling\n"


def sample(tasks: str) -> tuple[float, int, int] | None:
    ran = waited = 0
    try:
        threads = os.listdir(tasks)
    except FileNotFoundError:
        return None
    for thread in threads:
        try:
            with open(f"{tasks}/{thread}/schedstat", "rb") as stat:
                fields = stat.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended
        ran += int(fields[0])
        waited += int(fields[1])
    return time.time(), ran, waited


def main(pid: int, out: str) -> int:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        print("e2e.sampler: no real-time priority; samples may come late", file=sys.stderr)
    tasks = f"/proc/{pid}/task"
    samples = []
    ends = time.monotonic() + LONGEST
    while time.monotonic() < ends:
        found = sample(tasks)
        if found is None:
            break
        samples.append(found)
        if len(samples) == 1:
            os.write(sys.stdout.fileno(), SAMPLING)
        # Readable stdin is its end (nothing is ever written to it): stop.
        if select.select([sys.stdin], [], [], INTERVAL)[0]:
            break
    with open(out, "w") as lines:
        lines.writelines(
            f"{at:.6f} {ran / 1e9:.9f} {waited / 1e9:.9f}\n" for at, ran, waited in samples
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
