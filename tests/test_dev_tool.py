"""tools/dev.py, the quick start's bootstrap: several runs at once (CI starts two), and the
environment it gives uv."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import os
import platform
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parent.parent / "tools" / "dev.py"
RUNS = 6
# Large enough that the runs' writes of it overlap when nothing orders them.
PADDING = b"#" * (16 << 20)

# Loads tools/dev.py with the index, the pin and the cache pointed at the test's, then runs it.
DRIVER = """
import importlib.util, platform, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("dev", sys.argv[1])
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)
dev.INDEX, dev.CACHE = sys.argv[2], Path(sys.argv[3])
dev.UV_WHEELS = {platform.machine(): (sys.argv[4], sys.argv[5])}
sys.argv = ["dev.py", "-s", "demo"]
dev.main()
"""


def fake_uv_wheel(version: str) -> bytes:
    script = b'#!/bin/sh\necho ran "$@"\nexit 0\n' + PADDING + b"\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr(f"uv-{version}.data/scripts/uv", script)
    return buffer.getvalue()


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """A package index serving the fake wheel once every run has asked for it."""
    version = "0.13.9"
    filename = f"uv-{version}-fake.whl"
    wheel = fake_uv_wheel(version)
    # Without the lock every run asks at once; with it only one does, served after the timeout.
    everyone_asked = threading.Barrier(RUNS, timeout=2)

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/uv/":
                url = f"{base}/{filename}"
                body = json.dumps({"files": [{"filename": filename, "url": url}]}).encode()
            else:
                with contextlib.suppress(threading.BrokenBarrierError):
                    everyone_asked.wait()
                body = wheel
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    base = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield base, filename, hashlib.sha256(wheel).hexdigest()
    finally:
        server.shutdown()
        server.server_close()
        everyone_asked.abort()


@pytest.mark.skipif(platform.system() != "Linux", reason="dev.py pins uv for Linux only")
def test_runs_started_together_all_get_a_runnable_uv(
    index: tuple[str, str, str], tmp_path: Path
) -> None:
    url, filename, sha256 = index
    cache = tmp_path / "cache"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(DEV), url, str(cache), filename, sha256],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(RUNS)
    ]
    outcomes = [run.communicate(timeout=60) for run in runs]
    for run, (out, err) in zip(runs, outcomes, strict=True):
        assert run.returncode == 0, err.decode()[-800:]
        assert out.decode().startswith("ran tool run"), out.decode()
    assert sorted(path.name for path in cache.iterdir()) == ["fetch.lock", "uv"]


# A uv that says which certificate store it was told to trust.
CERTS_UV = '#!/bin/sh\necho "UV_SYSTEM_CERTS=${UV_SYSTEM_CERTS-unset}"\n'


@pytest.mark.parametrize(("given", "seen"), [(None, "true"), ("false", "false")])
def test_uv_trusts_the_system_certificate_store_unless_told_otherwise(
    tmp_path: Path, given: str | None, seen: str
) -> None:
    """As Python and pip do: behind a TLS-intercepting proxy, its root is in that store."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "uv").write_text(CERTS_UV)
    (cache / "uv").chmod(0o755)
    env = {name: value for name, value in os.environ.items() if name != "UV_SYSTEM_CERTS"}
    if given is not None:
        env["UV_SYSTEM_CERTS"] = given
    # The uv in the cache is run as it is: the index and the wheel are never asked for.
    unused = ("http://127.0.0.1:9", "unused.whl", "0" * 64)
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, str(DEV), unused[0], str(cache), *unused[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"UV_SYSTEM_CERTS={seen}\n"
