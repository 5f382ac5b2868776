"""tools/dev.py, the quick start's bootstrap: several runs at once (CI starts two), and the
environment it gives uv."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import importlib.util
import io
import os
import platform
import subprocess
import sys
import threading
import tomllib
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

DEV = Path(__file__).resolve().parent.parent / "tools" / "dev.py"
RUNS = 6
# Large enough that the runs' writes of it overlap when nothing orders them.
PADDING = b"#" * (16 << 20)

# Loads tools/dev.py with the pin and the cache pointed at the test's, then runs it; pip
# fetches from the index that PIP_INDEX_URL names.
DRIVER = """
import importlib.util, platform, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("dev", sys.argv[1])
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)
dev.CACHE = Path(sys.argv[2])
dev.UV_WHEELS = {platform.machine(): (sys.argv[3], sys.argv[4])}
sys.argv = ["dev.py", "-s", "demo"]
dev.main()
"""


def pip_env(index: str) -> dict[str, str]:
    """This environment, with pip asking only `index`, and nothing of pip's cache."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PIP_")}
    quiet = {
        "PIP_NO_CACHE_DIR": "1",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return {**env, "PIP_INDEX_URL": index, **quiet}


def fake_uv_wheel(version: str) -> bytes:
    script = b'#!/bin/sh\necho ran "$@"\nexit 0\n' + PADDING + b"\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr(f"uv-{version}.data/scripts/uv", script)
        # What pip checks in a wheel it downloads.
        info = f"uv-{version}.dist-info"
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: uv\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return buffer.getvalue()


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """A package index serving the fake wheel once every run has asked for it."""
    version = "0.13.9"
    filename = f"uv-{version}-py3-none-any.whl"
    wheel = fake_uv_wheel(version)
    # Without the lock every run asks at once; with it only one does, served after the timeout.
    everyone_asked = threading.Barrier(RUNS, timeout=2)

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/uv/":
                content_type = "text/html"
                body = f'<a href="{base}/{filename}">{filename}</a>'.encode()
            else:
                with contextlib.suppress(threading.BrokenBarrierError):
                    everyone_asked.wait()
                content_type, body = "application/octet-stream", wheel
            self.send_response(200)
            self.send_header("Content-Type", content_type)
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
            [sys.executable, "-c", DRIVER, str(DEV), str(cache), filename, sha256],
            env=pip_env(url),
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
    # The uv in the cache is run as it is: the wheel is never asked for.
    unused = ("unused.whl", "0" * 64)
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, str(DEV), str(cache), *unused],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"UV_SYSTEM_CERTS={seen}\n"


def load_dev() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("dev", DEV)
    assert spec is not None
    assert spec.loader is not None
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


@pytest.mark.parametrize(
    ("version", "says"),
    [
        ((3, 11, 2), None),
        ((3, 15, 2), None),
        ((3, 10, 14), "needs Python 3.11 to 3.15 (what CI tests), this is 3.10.14 (/usr/bin/py); "
         "run it with one of those (e.g. python3.15 tools/dev.py)"),
        ((3, 16, 0), "needs Python 3.11 to 3.15 (what CI tests), this is 3.16.0 (/usr/bin/py); "
         "run it with one of those (e.g. python3.15 tools/dev.py)"),
    ],
)  # fmt: skip
def test_a_python_outside_the_tested_range_is_one_line(
    version: tuple[int, ...], says: str | None
) -> None:
    assert load_dev().python_problem(version, "/usr/bin/py") == says


def test_the_tested_range_is_what_pyproject_declares() -> None:
    """pip refuses another Python with requires-python; dev.py says the same range."""
    dev = load_dev()
    with (DEV.parent.parent / "pyproject.toml").open("rb") as file:
        declared = tomllib.load(file)["project"]["requires-python"]
    oldest, newest = dev.OLDEST, dev.NEWEST
    assert declared == f">={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"
