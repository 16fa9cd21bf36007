"""What a source lists: every file under its root, with where to read it and a fingerprint."""
from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path relative to the source root
    local_path: Path | None  # where to read the bytes; None when it must not be read
    size: int
    fingerprint: str  # changes whenever the content may have changed
    problem: str | None = None  # a reason to quarantine without reading


@dataclasses.dataclass
class Listing:
    files: list[SourceFile]
    skipped_dir_links: int = 0
    downloaded: int = 0
    download_bytes: int = 0
    cache_hits: int = 0
    removed_from_cache: int = 0
