"""Images and binaries built here, because nothing can be pulled on the e2e node.

The sandbox ("pause") image: ``pause/main.go`` is compiled statically and packed as the only file
of a one-layer image, in the docker-archive format that ``ctr images import`` reads
(``manifest.json``, the image config and the layer tarball), with fixed timestamps so the same
source gives the same image. The yardstick (``yardstick/main.go``, a Go device plugin for the
race's figures; docs/e2e.md) is a static binary that its pod runs from a hostPath. Both are
cached in the cache directory under the hash of their source and the Go version. Another clone
on the same machine (CI's beside a contributor's) may be running from another entry right now:
an entry is removed only once no run has used it for `STALE_AFTER`. The consumers' image stands
in for the examples' busybox: this machine's static busybox (Debian's busybox-static) and a link
for each of its applets, one layer, cached under the binary's hash.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from .builds import CACHE

HERE = Path(__file__).resolve().parent
PAUSE_SOURCE = HERE / "pause"
YARDSTICK_SOURCE = HERE / "yardstick"
PAUSE_REPOSITORY = "localhost/pcc-e2e/pause"
CONSUMER_REPOSITORY = "localhost/pcc-e2e/consumer"
BUSYBOX = Path("/bin/busybox")
STALE_AFTER = 7 * 86400


def _go_env(go: str, name: str) -> str:
    return subprocess.run(
        [go, "env", name], capture_output=True, text=True, check=True
    ).stdout.strip()


def _add(archive: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    archive.addfile(info, io.BytesIO(data))


def _tar(files: list[tuple[str, bytes, int]], links: Sequence[tuple[str, str]] = ()) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data, mode in files:
            _add(archive, name, data, mode)
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, 0
            archive.addfile(info)
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


def _write_image(
    target: Path, reference: str, arch: str, layer: bytes, config: Mapping[str, object]
) -> None:
    """A one-layer image named `reference`, as a docker-archive tarball at `target`."""
    layer_id = hashlib.sha256(layer).hexdigest()
    config_json = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
            "history": [{"created_by": "tools/e2e/images.py", "created": "1970-01-01T00:00:00Z"}],
            "created": "1970-01-01T00:00:00Z",
        },
        sort_keys=True,
    ).encode()
    config_name = f"{hashlib.sha256(config_json).hexdigest()}.json"
    layers = [f"{layer_id}/layer.tar"]
    manifest = [{"Config": config_name, "RepoTags": [reference], "Layers": layers}]
    partial = target.with_suffix(".partial")
    partial.write_bytes(
        _tar(
            [
                (f"{layer_id}/layer.tar", layer, 0o644),
                (config_name, config_json, 0o644),
                ("manifest.json", json.dumps(manifest).encode(), 0o644),
            ]
        )
    )
    os.replace(partial, target)


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
        config = {"Entrypoint": ["/pause"], "User": "65535:65535"}
        _write_image(target, reference, _go_env(go, "GOARCH"), layer, config)
    _remove_stale(target, "pause-*.tar")
    return target, reference


def busybox_problem() -> str | None:
    """Why this machine's busybox cannot be the consumers' image, None if it can."""
    if not BUSYBOX.is_file():
        return f"no {BUSYBOX} for the consumers' image (Debian: busybox-static)"
    with BUSYBOX.open("rb") as f:
        header = f.read(64)
        order: Literal["little", "big"] = "little" if header[5] == 1 else "big"
        phoff = int.from_bytes(header[32:40], order)
        size, count = int.from_bytes(header[54:56], order), int.from_bytes(header[56:58], order)
        f.seek(phoff)
        table = f.read(size * count)
    if any(int.from_bytes(table[i : i + 4], order) == 3 for i in range(0, len(table), size)):
        return f"{BUSYBOX} is linked dynamically: the consumers' image needs busybox-static's"
    return None


def consumer_archive() -> tuple[Path, str]:
    """(docker-archive tarball, image reference) of the consumers' busybox image; built when
    not cached. The examples' consumers run sh, ls and sleep; the e2e's checks stat, cat,
    touch and echo in them: all busybox applets, as in docker.io/library/busybox."""
    problem = busybox_problem()
    if problem:
        raise SystemExit(f"the e2e's consumer image: {problem}")
    binary = BUSYBOX.read_bytes()
    key = hashlib.sha256(binary).hexdigest()[:12]
    reference = f"{CONSUMER_REPOSITORY}:{key}"
    target = CACHE / "e2e" / f"consumer-{key}.tar"
    if target.exists():
        return target, reference
    target.parent.mkdir(parents=True, exist_ok=True)
    applets = subprocess.run(
        [str(BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    layer = _tar(
        [("bin/busybox", binary, 0o755)],
        [(f"bin/{applet}", "busybox") for applet in applets if applet != "busybox"],
    )
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    _write_image(target, reference, arch, layer, {"Cmd": ["sh"], "Env": ["PATH=/bin"]})
    _remove_stale(target, "consumer-*.tar")
    return target, reference
