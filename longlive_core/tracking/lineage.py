"""Lineage facts a run is tagged with: the code's git commit, whether the tree was dirty, and
content digests of what a stage read."""
from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def git_state(repo_root: str | Path = ".") -> dict[str, str]:
    """{'git.commit': sha or 'unknown', 'git.dirty': 'true'/'false'/'unknown'}; never raises."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo_root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    # Tracked files only (DVC keeps data out of git), and not dvc.lock: `dvc repro` rewrites it
    # after every stage, so it would mark every stage after the first as dirty.
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                 ":(exclude,glob)**/dvc.lock")
    return {"git.commit": commit.strip() if commit else "unknown",
            "git.dirty": "unknown" if status is None else str(bool(status.strip())).lower()}


def digest_lines(lines: Iterable[str]) -> str:
    """SHA-256 over newline-terminated lines: a content digest of a listing, order included."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()


def digest_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def digest_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()
