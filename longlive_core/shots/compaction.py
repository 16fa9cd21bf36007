"""Clip shards that lost most of their clips are rewritten with the ones still in use.

A video gone from the manifest, or split again, leaves its old clips in shards that other videos'
clips keep in use. Each such shard whose live clips hold less than ``shots.shard_min_live`` of its
bytes is rewritten: the live clips go to new shards, closed before any row refers to them, and
the rows that move are handed back for the state; the old shard, no longer referred to, is deleted
with the other unreferenced shards. A kill at any point leaves rows whose shards are on disk.
Downstream stages key clips by ``clip_sha256``, so a moved clip is not scored or encoded again.
"""
from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from longlive_core.shots.clips import ShardWriter


def _open(clips_dir: Path, shard: str) -> tarfile.TarFile:
    if "/" in shard or "\\" in shard or shard.startswith("."):  # a name from the state stays in clips_dir
        raise ValueError(f"bad shard name {shard!r}")
    return tarfile.open(clips_dir / shard, "r")


def shard_members(clips_dir: Path, shard: str) -> dict[str, int]:
    """Each member's name and size (bytes), from the shard's headers alone."""
    with _open(clips_dir, shard) as tar:
        return {m.name: m.size for m in tar.getmembers() if m.isfile()}


def read_members(clips_dir: Path, shard: str, names: set[str]) -> Iterator[tuple[str, bytes]]:
    """The named members, in the shard's order, in one pass over it."""
    with _open(clips_dir, shard) as tar:
        for m in tar:
            if m.isfile() and m.name in names:
                yield m.name, tar.extractfile(m).read()  # type: ignore[union-attr]


def compact_shards(live: pd.DataFrame, touched: set[str], clips_dir: Path, min_live: float,
                   shard_max_bytes: int) -> tuple[list[dict], int, int]:
    """``live``: the state rows of the videos still in the manifest; ``touched``: the shards that lost
    clips in this run. Returns (the rows of every video with a moved clip, now naming its new
    shard; shards rewritten; dead clips left in touched shards still in use)."""
    used = live[live["clip_shard"].notna()]
    live_members = used.groupby("clip_shard")["clip_member"].agg(set).to_dict()
    to_rewrite, orphaned = {}, 0
    for shard in sorted(touched & set(live_members)):
        sizes = shard_members(clips_dir, shard)
        members = live_members[shard]
        if not members <= sizes.keys():
            raise ValueError(f"{shard} lacks {sorted(members - sizes.keys())[:3]} that the shots state refers to: "
                             "the state and the clips disagree; delete data/shots/state to split every video again")
        if sum(sizes[m] for m in members) < min_live * sum(sizes.values()):
            to_rewrite[shard] = members
        else:
            orphaned += len(sizes) - len(members)
    if not to_rewrite:
        return [], 0, orphaned
    writer = ShardWriter(clips_dir, shard_max_bytes)
    moved: dict[tuple[str, str], str] = {}
    try:
        for shard, members in to_rewrite.items():
            for member, data in read_members(clips_dir, shard, members):
                moved[(shard, member)] = writer.add(member, data)
                if writer.full:
                    writer.close()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    rows = live[live["video_id"].isin(used.loc[used["clip_shard"].isin(to_rewrite), "video_id"])].copy()
    rows["clip_shard"] = [moved.get((s, m), s) for s, m in zip(rows["clip_shard"], rows["clip_member"])]
    return rows.to_dict("records"), len(to_rewrite), orphaned
