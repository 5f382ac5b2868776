"""Images and binaries built here from our own Go sources, because nothing can be pulled on the
e2e node.

The sandbox ("pause") image: ``pause/main.go`` is compiled statically and packed as the only file
of a one-layer image, in the docker-archive format that ``ctr images import`` reads
(``manifest.json``, the image config and the layer tarball), with fixed timestamps so the same
source gives the same image. The yardstick (``yardstick/main.go``, a Go device plugin for the
race's figures; docs/e2e.md) is a static binary that its pod runs from a hostPath. Both are
cached in the cache directory under the hash of their source and the Go version. Another clone
on the same machine (CI's beside a contributor's) may be running from another entry right now:
an entry is removed only once no run has used it for `STALE_AFTER`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from .builds import CACHE

HERE = Path(__file__).resolve().parent
PAUSE_SOURCE = HERE / "pause"
YARDSTICK_SOURCE = HERE / "yardstick"
PAUSE_REPOSITORY = "localhost/pcc-e2e/pause"
STALE_AFTER = 7 * 86400


def _go_env(go: str, name: str) -> str:
    return subprocess.run(
        [go, "env", name], capture_output=True, text=True, check=True
    ).stdout.strip()


def _add(archive: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    archive.addfile(info, io.BytesIO(data))


def _tar(files: list[tuple[str, bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data, mode in files:
            _add(archive, name, data, mode)
    return buffer.getvalue()


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise SystemExit("the e2e's Go programs: `go` is not on PATH; install Go (see docs/e2e.md)")
    return go


def _source_key(go: str, source: Path) -> str:
    digest = hashlib.sha256(_go_env(go, "GOVERSION").encode())
    for path in sorted(source.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def go_build(go: str, source: Path, binary: Path) -> None:
    """A static binary of the main package in `source`; modules through GOPROXY, as go.sum says."""
    subprocess.run(
        [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(binary), "."],
        cwd=source, env=dict(os.environ, CGO_ENABLED="0"), check=True,
    )  # fmt: skip


def _remove_stale(kept: Path, pattern: str) -> None:
    """Mark `kept` used now; remove the other entries no run has used for STALE_AFTER."""
    os.utime(kept)
    for stale in kept.parent.glob(pattern):
        if stale != kept and time.time() - stale.stat().st_mtime > STALE_AFTER:
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()


def yardstick_binary() -> Path:
    """The yardstick's binary, alone in its directory; built when not cached."""
    go = _go()
    directory = CACHE / "e2e" / f"yardstick-{_source_key(go, YARDSTICK_SOURCE)}"
    binary = directory / "yardstick"
    if not binary.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory.parent) as tmp:
            go_build(go, YARDSTICK_SOURCE, Path(tmp) / "yardstick")
            os.replace(Path(tmp) / "yardstick", binary)
    _remove_stale(directory, "yardstick-*")
    return binary


def pause_archive() -> tuple[Path, str]:
    """(docker-archive tarball, image reference) of the pause image; built when not cached."""
    go = _go()
    key = _source_key(go, PAUSE_SOURCE)
    reference = f"{PAUSE_REPOSITORY}:{key}"
    target = CACHE / "e2e" / f"pause-{key}.tar"
    if target.exists():
        _remove_stale(target, "pause-*.tar")
        return target, reference
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        binary = Path(tmp) / "pause"
        go_build(go, PAUSE_SOURCE, binary)
        layer = _tar([("pause", binary.read_bytes(), 0o755)])
        layer_id = hashlib.sha256(layer).hexdigest()
        config = json.dumps(
            {
                "architecture": _go_env(go, "GOARCH"),
                "os": "linux",
                "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
                "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
                "history": [
                    {"created_by": "tools/e2e/images.py", "created": "1970-01-01T00:00:00Z"}
                ],
                "created": "1970-01-01T00:00:00Z",
            },
            sort_keys=True,
        ).encode()
        config_name = f"{hashlib.sha256(config).hexdigest()}.json"
        manifest = [
            {"Config": config_name, "RepoTags": [reference], "Layers": [f"{layer_id}/layer.tar"]}
        ]
        partial = Path(tmp) / "pause.tar"
        partial.write_bytes(
            _tar(
                [
                    (f"{layer_id}/layer.tar", layer, 0o644),
                    (config_name, config, 0o644),
                    ("manifest.json", json.dumps(manifest).encode(), 0o644),
                ]
            )
        )
        os.replace(partial, target)
    _remove_stale(target, "pause-*.tar")
    return target, reference
