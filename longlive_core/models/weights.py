"""Pretrained weights on local paths: their identity by content, and clear errors when missing.

Nothing is downloaded: every weight comes from a path in params.yaml, and a missing one is an
error that says what to put there. The identity is a digest of the bytes (file by file, with their
names), so weights replaced at the same path are seen whatever their sizes and modification times
say. Reading tens of gigabytes on every run would cost minutes, so each file's digest is memoised
under its size, modification time, inode and inode change time: the last changes whenever the
file's bytes are written, and no copy tool sets it, so a replaced file is always read again.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from longlive_core.io.atomic import write_json
from longlive_core.tracking.lineage import digest_file, digest_lines

MEMO = Path("data/.weights_sha256.json")  # a cache only: deleting it costs one more read of the weights


class CheckpointError(RuntimeError):
    """Weights are missing or do not fit; the message says what to put where."""


def require_pretrained_dir(path: Path, what: str, how: str) -> None:
    """A from_pretrained folder must hold config.json and safetensors weights; else say what to put there."""
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise CheckpointError(f"no {what} at {path}: {how}, or point its path in params.yaml at where it is")


def _file_digest(path: Path, memo: dict[str, list]) -> str:
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    key = str(path.resolve())
    if key in memo and memo[key][:4] == stamp:
        return memo[key][4]
    digest = digest_file(path)
    memo[key] = [*stamp, digest]
    return digest


def weights_identity(path: str | Path, memo_path: Path | None = MEMO) -> str:
    """"tiny" for the built-in random models, else a short digest of the file's (or the folder's files')
    names and bytes; ``memo_path`` (None: no memo) spares reading unchanged files again."""
    if str(path) == "tiny":
        return "tiny"
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise CheckpointError(f"no weights at {path}: point its path in params.yaml at the model's folder")
    memo: dict[str, list] = {}
    if memo_path is not None and memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            memo = {}  # a damaged memo is only a slower run
    before = dict(memo)
    lines = [f"{f.relative_to(path) if f != path else f.name}\t{_file_digest(f, memo)}" for f in files]
    if memo_path is not None and memo != before:
        os.makedirs(memo_path.parent, exist_ok=True)
        write_json(memo, memo_path)
    return digest_lines(lines)[:16]
