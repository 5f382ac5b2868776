from __future__ import annotations

import logging
import os
import re

from pcc_plugin.klog import V1, KlogFormatter


def test_lines_have_klogs_layout() -> None:
    record = logging.LogRecord(
        "x", logging.INFO, "/a/b/supervisor.py", 123, "hi %s", ("you",), None
    )
    line = KlogFormatter().format(record)
    assert re.fullmatch(
        rf"I\d{{4}} \d\d:\d\d:\d\d\.\d{{6}} {os.getpid():>7} supervisor\.py:123\] hi you", line
    ), line


def test_severity_letters() -> None:
    def letter(level: int) -> str:
        record = logging.LogRecord("x", level, "f.py", 1, "m", (), None)
        return KlogFormatter().format(record)[0]

    assert [letter(level) for level in (logging.DEBUG, V1, logging.INFO)] == ["I", "I", "I"]
    assert [letter(level) for level in (logging.WARNING, logging.ERROR)] == ["W", "E"]
