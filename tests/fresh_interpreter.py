"""Python source run in a fresh interpreter: for what imports do, which this one has done."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def output_of(source: str, *args: str, options: Sequence[str] = ()) -> str:
    """What `source` prints, run with `args` as its sys.argv[1:], the interpreter's `options`."""
    return subprocess.run(
        [sys.executable, *options, "-c", source, *args],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip


def json_of(source: str, *args: str, options: Sequence[str] = ()) -> Any:
    """What `source` prints, one JSON document."""
    return json.loads(output_of(source, *args, options=options))
