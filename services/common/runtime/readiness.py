"""How a service tells whoever started it where it listens: files beside its `--ready-file`.

`<ready>` holds the main gRPC address and appears last, once the server listens (a launcher
that asked for port 0 learns the port from it); `<ready>.health`, `<ready>.metrics` and
`<ready>.http` hold the plaintext health port's, the metrics server's and the HTTP API's
addresses when those are on; `vmesh serve` writes `<ready>.mesh.json` (the mesh's
description) before its own `<ready>`. Each file is written whole or not at all, because its
reader polls for it."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path


class Announcement(Enum):
    """What a ready file announces, by the suffix it adds to the ready file's name."""
    ADDRESS = ""
    HEALTH = ".health"
    METRICS = ".metrics"
    HTTP = ".http"
    MESH_DESCRIPTION = ".mesh.json"


class ReadyFiles:
    """The ready file `path` and the files beside it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def file(self, announcement: Announcement = Announcement.ADDRESS) -> Path:
        return Path(f"{self.path}{announcement.value}")

    def write(self, announcement: Announcement, text: str) -> None:
        write_atomically(self.file(announcement), text)

    def read(self, announcement: Announcement = Announcement.ADDRESS) -> str | None:
        """The announced text, or None while (or when) nothing was announced."""
        try:
            return self.file(announcement).read_text()
        except FileNotFoundError:
            return None

    def written(self, announcement: Announcement = Announcement.ADDRESS) -> bool:
        return self.file(announcement).exists()

    def clear(self) -> None:
        """Remove every announcement (before a restarted service writes its own)."""
        for announcement in Announcement:
            path = self.file(announcement)
            path.unlink(missing_ok=True)
            _staging(path).unlink(missing_ok=True)  # left by a writer that died mid-way


def announce(ready_file: str | Path | None, announcement: Announcement, text: str) -> None:
    """Write one announcement when the service was given a ready file."""
    if ready_file:
        ReadyFiles(ready_file).write(announcement, text)


def write_atomically(path: Path, text: str) -> None:
    """Readers see the whole text or no file (a launcher polls for it)."""
    staging = _staging(path)
    staging.write_text(text)
    os.replace(staging, path)


def _staging(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")
