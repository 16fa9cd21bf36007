"""Where an ingested source's files are read from, and paths from manifests kept inside their root."""
from __future__ import annotations

from pathlib import Path, PurePosixPath


class SourceError(RuntimeError):
    """The source cannot be listed or read as a whole, or changed under a later stage; the message
    says what to check."""


def safe_relpath(rel: str) -> str | None:
    """Returns the normalised POSIX relative path, or None if it is absolute or climbs out."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or any(part in ("", ".", "..") for part in parts):
        return None
    return PurePosixPath(rel).as_posix()


def resolve_inside(root: Path, relpath: str) -> Path:
    """Joins a manifest path onto its root, refusing anything that would leave the root."""
    safe = safe_relpath(relpath)
    root = root.resolve()
    path = (root / safe).resolve() if safe else None
    if path is None or not path.is_relative_to(root):
        raise ValueError(f"path {relpath!r} from a manifest is not inside its root {root}")
    return path


def local_root(source: str, cache_dir: str | Path) -> Path:
    """Where the files of an ingested source are read from: the directory, or the S3 mirror."""
    return Path(cache_dir) if source.startswith("s3://") else Path(source)
