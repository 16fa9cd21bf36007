"""The ingest stage's logic: list a source, hash, probe, quarantine, de-duplicate, build the manifest.

What is a video is decided by its content: every file with a video extension, or with none, is
probed, and one that is not a video is quarantined with the reason.

Work is remembered across runs in a small state directory, so a rerun only does what is new:
  hashes.parquet  SHA-256 per (path, fingerprint): a file is re-hashed only when it changed
  probes.parquet  probe outcome per content hash and probe key (the probe's code and settings):
                  identical bytes are probed once, until the probe itself changes
  canonical.parquet  which path stands for each content: an earlier file keeps status ok when
                   a copy of it arrives later, whatever the copy's name
Every ``checkpoint_every`` items the rows added since the last checkpoint go to a new part file of
their table (``hashes-000003.parquet``; atomic writes), so a checkpoint costs its own rows, not the
table's (120K rows rewritten every 500 files would grow quadratically), and a run killed halfway
keeps what it finished: the rerun redoes only the rest. The end of a run folds each table into one
file, forgetting files that are gone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd

from longlive_core.config import ConfigError
from longlive_core.data.captions import CaptionError, read_sidecar, sidecar_path
from longlive_core.data.listing import Listing, SourceFile
from longlive_core.data.s3_mirror import S3Config
from longlive_core.io.atomic import write_parquet
from longlive_core.io.parts import PartTable
from longlive_core.progress import Progress
from longlive_core.tracking.lineage import code_digest, digest_file, digest_json
from longlive_core.video.probe import PROBE_COLUMNS, ProbeError, probe_video

log = logging.getLogger(__name__)

MANIFEST_COLUMNS = ["video_id", "path", "status", "reason", "size_bytes", *PROBE_COLUMNS,
                    "caption_path", "caption_status", "caption_sha256", "source"]
STATUSES = ("ok", "quarantined", "duplicate")

# The containers real collections hold; files with no extension are probed too.
VIDEO_EXTENSIONS = [".mp4", ".m4v", ".mov", ".qt", ".mkv", ".webm", ".avi", ".divx", ".mpg", ".mpeg", ".m2v",
                    ".vob", ".ts", ".m2ts", ".mts", ".mod", ".tod", ".flv", ".f4v", ".wmv", ".asf", ".3gp",
                    ".3g2", ".ogv", ".mxf", ".dv"]


def is_video_candidate(relpath: str, extensions: set[str]) -> bool:
    """A file ingest probes: a video extension, or no extension at all (hidden files aside)."""
    name = PurePosixPath(relpath).name
    suffix = PurePosixPath(relpath).suffix.lower()
    return suffix in extensions or (suffix == "" and not name.startswith("."))


@dataclasses.dataclass(frozen=True)
class IngestConfig:
    source: str
    cache_dir: str = "data/ingest/s3_cache"
    min_duration_s: float = 1.0
    decode_check_frames: int = 8
    extensions: list[str] = dataclasses.field(default_factory=lambda: list(VIDEO_EXTENSIONS))
    workers: int = 2
    checkpoint_every: int = 25
    s3: S3Config = dataclasses.field(default_factory=S3Config)

    def validate(self, where: str) -> None:
        if not self.source:
            raise ConfigError(f"{where}.source must name a directory or an s3://bucket/prefix URI")
        for key in ("workers", "checkpoint_every", "decode_check_frames"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be >= 1, got {getattr(self, key)}")
        if self.min_duration_s < 0:
            raise ConfigError(f"{where}.min_duration_s must be >= 0")
        bad = [e for e in self.extensions if not e.startswith(".")]
        if bad:
            raise ConfigError(f"{where}.extensions must start with a dot, got {bad}")


HASH_STATE_COLUMNS = ["path", "fingerprint", "video_id"]


class IngestState:
    """Per-item results that survive across runs (see the module docstring)."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self._hash_table = PartTable(self.dir, "hashes", HASH_STATE_COLUMNS)
        self._probe_table = PartTable(self.dir, "probes", ["video_id", "probe_key", "error", *PROBE_COLUMNS])
        self._new_hashes: list[tuple[str, str]] = []  # keys added since the last checkpoint
        self._new_probes: list[tuple[str, str]] = []
        self.canonical: dict[str, str] = {}
        cp = self.dir / "canonical.parquet"
        if cp.is_file():
            self.canonical = dict(pd.read_parquet(cp).itertuples(index=False))
        # a part's row supersedes the folded file's for the same key (PartTable.read groups by any key)
        self.hashes: dict[tuple[str, str], str] = {
            (r.path, r.fingerprint): r.video_id
            for r in self._hash_table.read(latest_by=["path", "fingerprint"]).itertuples(index=False)}
        self.probes: dict[tuple[str, str], dict[str, Any]] = {}  # (video_id, probe key) -> outcome
        probes = self._probe_table.read(latest_by=["video_id", "probe_key"])
        for rec in probes.astype(object).to_dict("records"):
            rec = {k: (None if pd.isna(v) else v) for k, v in rec.items()}
            if rec["probe_key"] is not None:  # a state from before probe keys: everything is probed again
                self.probes[(rec.pop("video_id"), rec.pop("probe_key"))] = rec

    def add_hash(self, key: tuple[str, str], video_id: str) -> None:
        self.hashes[key] = video_id
        self._new_hashes.append(key)

    def add_probe(self, key: tuple[str, str], outcome: dict[str, Any]) -> None:
        self.probes[key] = outcome
        self._new_probes.append(key)

    def _hash_rows(self, keys) -> pd.DataFrame:
        return pd.DataFrame([{"path": p, "fingerprint": f, "video_id": self.hashes[(p, f)]} for p, f in keys],
                            columns=HASH_STATE_COLUMNS)

    def _probe_rows(self, keys) -> pd.DataFrame:
        return pd.DataFrame([{"video_id": vid, "probe_key": key, **self.probes[(vid, key)]} for vid, key in keys],
                            columns=self._probe_table.columns)

    def checkpoint(self) -> None:
        """What was added since the last checkpoint, as one part file per table."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._hash_table.append(self._hash_rows(self._new_hashes))
        self._probe_table.append(self._probe_rows(self._new_probes))
        self._new_hashes, self._new_probes = [], []

    def save(self) -> None:
        """Every table as one file holding exactly the entries kept now."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._hash_table.compact(self._hash_rows(sorted(self.hashes)))
        self._probe_table.compact(self._probe_rows(sorted(self.probes)))
        self._new_hashes, self._new_probes = [], []
        canonical = pd.DataFrame(sorted(self.canonical.items()), columns=["video_id", "path"])
        write_parquet(canonical, self.dir / "canonical.parquet")


@dataclasses.dataclass
class IngestOutcome:
    manifest: pd.DataFrame
    counts: dict[str, int | float]


def probe_key(cfg: IngestConfig) -> str:
    """What a probe outcome depends on besides the bytes: the probe's code and its setting."""
    return digest_json([code_digest("longlive_core.video.probe"), cfg.decode_check_frames])[:16]


def _probe_record(path: Path, decode_frames: int) -> dict[str, Any]:
    try:
        result = probe_video(path, decode_frames)
    except ProbeError as exc:
        return {"error": str(exc), **{c: None for c in PROBE_COLUMNS}}
    return {"error": None, **result.as_row()}


def _run_parallel(items: list, fn, workers: int, label: str, state: IngestState, every: int, on_done) -> None:
    if not items:
        return
    progress = Progress(log, label, len(items), "files")
    pending = 0
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(fn, item): item for item in items}
            for fut in as_completed(futures):
                on_done(futures[fut], fut.result())
                progress.advance()
                pending += 1
                if pending >= every:
                    state.checkpoint()
                    pending = 0
    finally:
        state.checkpoint()


def _caption(listing_paths: dict[str, SourceFile], video: SourceFile) -> tuple[str | None, str, str | None]:
    """(sidecar path, caption status, SHA-256 of the sidecar) for a video."""
    rel = sidecar_path(video.relpath).as_posix()
    side = listing_paths.get(rel)
    if side is None or side.local_path is None:
        return None, "missing", None
    try:
        _, digest = read_sidecar(side.local_path)
    except CaptionError as exc:
        return rel, f"invalid: {exc}", None
    return rel, "ok", digest


def ingest(listing: Listing, cfg: IngestConfig, state: IngestState, source_uri: str) -> IngestOutcome:
    exts = {e.lower() for e in cfg.extensions}
    by_path = {f.relpath: f for f in listing.files}
    videos = [f for f in listing.files if is_video_candidate(f.relpath, exts)]
    video_paths = {v.relpath for v in videos}
    sidecar_paths = {sidecar_path(p).as_posix() for p in video_paths}
    known = sidecar_paths | video_paths
    other = [f.relpath for f in listing.files if f.relpath not in known]
    if other:
        log.info("%d file(s) are neither videos (ingest.extensions, or no extension) nor caption sidecars, "
                 "not ingested: %s%s", len(other), ", ".join(other[:5]), " ..." if len(other) > 5 else "")

    # 1. hash what is new or changed
    hash_errors: dict[str, str] = {}
    to_hash = [v for v in videos if v.problem is None and v.size > 0
               and (v.relpath, v.fingerprint) not in state.hashes]

    def do_hash(v: SourceFile) -> tuple[str | None, str | None]:
        try:
            return digest_file(v.local_path), None
        except OSError as exc:
            return None, f"unreadable: {exc.strerror or exc}"

    def hashed(v: SourceFile, res: tuple[str | None, str | None]) -> None:
        digest, err = res
        if err:
            hash_errors[v.relpath] = err
        else:
            state.add_hash((v.relpath, v.fingerprint), digest)

    _run_parallel(to_hash, do_hash, cfg.workers, "ingest: hashing", state, cfg.checkpoint_every, hashed)
    empty_id = hashlib.sha256(b"").hexdigest()
    ids = {}
    for v in videos:
        if v.size == 0 and v.problem is None:
            ids[v.relpath] = empty_id
        elif (v.relpath, v.fingerprint) in state.hashes:
            ids[v.relpath] = state.hashes[(v.relpath, v.fingerprint)]

    # 2. probe each content once; one path stands for its copies: the one that did last run,
    #    if it is still there with that content, else the first in sorted order
    first_path: dict[str, str] = {}
    for v in videos:
        vid = ids.get(v.relpath)
        if vid and v.size > 0 and vid not in first_path:
            first_path[vid] = v.relpath
    for vid in first_path:
        previous = state.canonical.get(vid)
        if previous is not None and ids.get(previous) == vid:
            first_path[vid] = previous
    state.canonical = dict(first_path)
    key = probe_key(cfg)
    to_probe = [by_path[p] for vid, p in first_path.items() if (vid, key) not in state.probes]

    def probed(v: SourceFile, rec: dict) -> None:
        state.add_probe((ids[v.relpath], key), rec)

    _run_parallel(to_probe, lambda v: _probe_record(v.local_path, cfg.decode_check_frames), cfg.workers,
                  "ingest: probing", state, cfg.checkpoint_every, probed)

    # 3. one manifest row per video file
    rows = []
    for v in videos:
        vid = ids.get(v.relpath)
        row: dict[str, Any] = {"video_id": vid, "path": v.relpath, "size_bytes": v.size,
                               "source": source_uri, **{c: None for c in PROBE_COLUMNS}}
        row["caption_path"], row["caption_status"], row["caption_sha256"] = _caption(by_path, v)
        if v.problem:
            status, reason = "quarantined", v.problem
        elif v.size == 0:
            status, reason = "quarantined", "empty file (0 bytes)"
        elif v.relpath in hash_errors:
            status, reason = "quarantined", hash_errors[v.relpath]
        else:
            rec = state.probes[(vid, key)]
            row.update({c: rec[c] for c in PROBE_COLUMNS})
            canonical = first_path[vid]
            if rec["error"]:
                status, reason = "quarantined", rec["error"]
                if canonical != v.relpath:
                    reason += f" (same content as {canonical})"
            elif rec["duration_s"] < cfg.min_duration_s:
                status = "quarantined"
                reason = f"too short: {rec['duration_s']:.2f} s < ingest.min_duration_s {cfg.min_duration_s} s"
            elif canonical != v.relpath:
                status, reason = "duplicate", f"duplicate of {canonical}"
            else:
                status, reason = "ok", ""
        row["status"], row["reason"] = status, reason
        rows.append(row)
    # forget files that are gone, so the state does not grow without bound
    current = {(v.relpath, v.fingerprint) for v in videos}
    state.hashes = {k: h for k, h in state.hashes.items() if k in current}
    live = set(ids.values())
    state.probes = {k: r for k, r in state.probes.items() if k[0] in live and k[1] == key}
    state.save()
    manifest = pd.DataFrame(rows, columns=MANIFEST_COLUMNS)
    manifest = manifest.astype({"size_bytes": "int64", "duration_s": "float64", "fps": "float64",
                                "width": "Int64", "height": "Int64", "rotation": "Int64",
                                "num_frames": "Int64", "bit_rate": "Int64",
                                "variable_frame_rate": "boolean", "has_audio": "boolean"})
    counts: dict[str, int | float] = {
        "files_listed": len(listing.files),
        "videos": len(videos),
        "other_files": len(other),
        "hashed": len(to_hash),
        "probed": len(to_probe),
        "reused": sum(1 for v in videos if v.problem is None and v.size > 0) - len(to_hash),
        **{f"status_{s}": int((manifest["status"] == s).sum()) for s in STATUSES},
        "ok_duration_s": float(manifest.loc[manifest["status"] == "ok", "duration_s"].sum()),
        "ok_frames": int(manifest.loc[manifest["status"] == "ok", "num_frames"].sum()),
        "bytes_hashed": int(sum(v.size for v in to_hash)),
        "skipped_dir_links": listing.skipped_dir_links,
        "s3_downloaded": listing.downloaded,
        "s3_download_bytes": listing.download_bytes,
        "s3_cache_hits": listing.cache_hits,
        "s3_removed_from_cache": listing.removed_from_cache,
    }
    return IngestOutcome(manifest=manifest, counts=counts)
