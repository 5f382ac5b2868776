"""Python source run in a fresh interpreter: for what imports do, which this one has done."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def output_of(source: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def json_of(source: str) -> Any:
    """What `source` prints, one JSON document."""
    return json.loads(output_of(source))
