"""Caption sidecars: a JSON file beside each video with the same stem.

Two forms:
  {"caption": "..."}                                  one caption for the whole video
  {"shots": [{"start_s": 0.0, "end_s": 4.1, "caption": "..."}, ...]}   captions per interval
A shot gets the caption whose interval overlaps it most (ties: the earlier interval).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pandas as pd

from longlive_core.data.roots import SourceError, resolve_inside


class CaptionError(ValueError):
    """The sidecar is malformed; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class CaptionInterval:
    start_s: float
    end_s: float
    caption: str


@dataclasses.dataclass(frozen=True)
class Sidecar:
    intervals: tuple[CaptionInterval, ...]  # one interval spanning all time for the whole-video form

    def caption_for(self, start_s: float, end_s: float) -> str | None:
        best, best_overlap = None, 0.0
        for iv in self.intervals:
            overlap = min(end_s, iv.end_s) - max(start_s, iv.start_s)
            if overlap > best_overlap:
                best, best_overlap = iv.caption, overlap
        return best


def sidecar_path(video_path: str | Path) -> Path:
    return Path(video_path).with_suffix(".json")


def parse_sidecar(data: object, where: str = "sidecar") -> Sidecar:
    if not isinstance(data, dict):
        raise CaptionError(f"{where}: expected a JSON object with 'caption' or 'shots'")
    if "caption" in data and "shots" not in data:
        cap = data["caption"]
        if not isinstance(cap, str) or not cap.strip():
            raise CaptionError(f"{where}: 'caption' must be a non-empty string")
        return Sidecar((CaptionInterval(0.0, math.inf, cap.strip()),))
    if "shots" in data and "caption" not in data:
        shots = data["shots"]
        if not isinstance(shots, list) or not shots:
            raise CaptionError(f"{where}: 'shots' must be a non-empty list")
        out = []
        for i, s in enumerate(shots):
            if not isinstance(s, dict) or not {"start_s", "end_s", "caption"} <= set(s):
                raise CaptionError(f"{where}: shots[{i}] needs start_s, end_s and caption")
            start, end, cap = s["start_s"], s["end_s"], s["caption"]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, end)):
                raise CaptionError(f"{where}: shots[{i}] start_s and end_s must be numbers")
            if not end > start >= 0:
                raise CaptionError(f"{where}: shots[{i}] needs 0 <= start_s < end_s, got {start}..{end}")
            if not isinstance(cap, str) or not cap.strip():
                raise CaptionError(f"{where}: shots[{i}].caption must be a non-empty string")
            out.append(CaptionInterval(float(start), float(end), cap.strip()))
        return Sidecar(tuple(out))
    raise CaptionError(f"{where}: expected exactly one of 'caption' or 'shots'")


def read_sidecar(path: str | Path) -> tuple[Sidecar, str]:
    """The parsed sidecar and the SHA-256 of its bytes (what the manifest records, so an edit is seen)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CaptionError(f"{path.name}: not readable JSON ({exc})") from exc
    return parse_sidecar(data, path.name), hashlib.sha256(raw).hexdigest()


def shot_captions(shots: pd.DataFrame, manifest: pd.DataFrame, root: Path) -> list[str | None]:
    """The caption whose sidecar interval overlaps each shot most (None: no caption). Each sidecar
    must still be the one ingest read (its digest is in the manifest): an edit made since is an
    error that says to rerun ingest, never a caption the manifest does not account for."""
    # a content's path with status ok stands for it: byte-identical copies are marked duplicate
    info = manifest[manifest["status"] == "ok"].set_index("video_id")
    sidecars: dict[str, object] = {}
    out: list[str | None] = []
    for r in shots.itertuples(index=False):
        if r.video_id not in sidecars:
            sidecar = None
            row = info.loc[r.video_id]
            if row["caption_status"] == "ok" and isinstance(row["caption_path"], str):
                try:
                    sidecar, digest = read_sidecar(resolve_inside(root, row["caption_path"]))
                except CaptionError as exc:
                    digest = f"unreadable ({exc})"
                if digest != row["caption_sha256"]:
                    raise SourceError(f"{row['caption_path']} changed after ingest read it: rerun ingest "
                                      "(`dvc repro` does) so the manifest records this version")
            sidecars[r.video_id] = sidecar
        sc = sidecars[r.video_id]
        out.append(sc.caption_for(r.start_s, r.end_s) if sc else None)
    return out
