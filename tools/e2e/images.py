"""The sandbox ("pause") image, built here because nothing can be pulled on the e2e node.

``pause/main.go`` is compiled statically and packed as the only file of a one-layer image, in the
docker-archive format that ``ctr images import`` reads (``manifest.json``, the image config and
the layer tarball), with fixed timestamps so the same source gives the same image. The archive
is cached in the cache directory under the hash of the source and the Go version.
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
from pathlib import Path

from .builds import CACHE

PAUSE_SOURCE = Path(__file__).resolve().parent / "pause"
PAUSE_REPOSITORY = "localhost/pcc-e2e/pause"


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


def pause_archive() -> tuple[Path, str]:
    """(docker-archive tarball, image reference) of the pause image; built when not cached."""
    go = shutil.which("go")
    if go is None:
        raise SystemExit("pause image: `go` is not on PATH; install Go (see docs/e2e.md)")
    digest = hashlib.sha256(_go_env(go, "GOVERSION").encode())
    for source in sorted(PAUSE_SOURCE.iterdir()):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    key = digest.hexdigest()[:12]
    reference = f"{PAUSE_REPOSITORY}:{key}"
    target = CACHE / "e2e" / f"pause-{key}.tar"
    if target.exists():
        return target, reference
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(
            [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(binary), "."],
            cwd=PAUSE_SOURCE, env=dict(os.environ, CGO_ENABLED="0"), check=True,
        )  # fmt: skip
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
    for stale in target.parent.glob("pause-*.tar"):
        if stale != target:
            stale.unlink()
    return target, reference
