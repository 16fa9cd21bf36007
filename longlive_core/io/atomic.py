"""Atomic file writes: a reader (or a rerun after a crash) sees the old file or the new one, never
half of one. Everything is written to a temporary file in the same directory, flushed to disk and
then renamed over the target."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

TMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yields a temporary path next to ``target``; renames it onto ``target`` if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + target.name + ".", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yields an empty staging folder beside ``target``, which takes ``target``'s place when the block
    succeeds: a reader sees the old folder or the new one, never a mix. A swap that died between its
    two renames left the old folder aside; it is put back first."""
    target = Path(target)
    staging = target.with_name(f"{TMP_PREFIX}{target.name}.saving")
    replaced = target.with_name(f"{TMP_PREFIX}{target.name}.replaced")
    if not target.exists() and replaced.is_dir():
        os.replace(replaced, target)
    for leftover in (staging, replaced):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if target.exists():
        os.replace(target, replaced)
    os.replace(staging, target)
    shutil.rmtree(replaced, ignore_errors=True)


def write_parquet(df: pd.DataFrame, target: str | Path) -> None:
    with atomic_path(target) as tmp:
        df.to_parquet(tmp, index=False)


def write_json(obj: Any, target: str | Path) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_bytes(data: bytes, target: str | Path) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def remove_stale_tmp(directory: str | Path) -> int:
    """Deletes temporaries a killed run left behind; returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    n = 0
    for p in directory.rglob(TMP_PREFIX + "*"):
        if p.is_file():
            p.unlink()
            n += 1
    return n


def remove_unreferenced(directory: str | Path, name: re.Pattern[str], referenced: set[str]) -> int:
    """Deletes the files in ``directory`` whose names match ``name`` and that nothing refers to (the
    shards of a stage whose every entry was redone or dropped); returns how many."""
    removed = 0
    for path in Path(directory).iterdir() if Path(directory).is_dir() else ():
        if name.fullmatch(path.name) and path.name not in referenced:
            path.unlink()
            removed += 1
    return removed
