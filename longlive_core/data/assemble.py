"""Multi-shot training samples from consecutive kept shots.

Within a video, kept shots that follow each other with no gap (no rejected shot between them)
form runs; each run is cut greedily into samples of at most ``max_shots`` shots and at most
``max_duration_s``; samples shorter than ``min_duration_s`` are dropped and counted. Each sample
falls in a duration bucket and gets a ``sample_weight`` so that weighted sampling draws every
bucket in its target share (the paper: a third each of 16-32 s, 32-64 s and >64 s). The
train/val split hashes the video_id, so no video is in both. Captions come from the caption stage
(data/captions/captions.parquet), each with its source (sidecar or model) carried into the samples.
"""
from __future__ import annotations

import dataclasses
import hashlib

import pandas as pd

from longlive_core.config import ConfigError

SAMPLE_COLUMNS = ["sample_id", "video_id", "path", "shot_indices", "num_shots", "start_frame", "end_frame",
                  "duration_s", "shot_durations_s", "captions", "caption_sources", "bucket", "sample_weight", "split"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    name: str
    min_s: float
    max_s: float | None = None  # None: no upper edge
    weight: float = 1.0  # target share of training draws (normalised over buckets)

    def holds(self, duration: float) -> bool:
        return duration >= self.min_s and (self.max_s is None or duration < self.max_s)


@dataclasses.dataclass(frozen=True)
class AssembleConfig:
    max_shots: int = 4
    min_duration_s: float = 16.0
    max_duration_s: float = 120.0
    buckets: list[Bucket] = dataclasses.field(default_factory=lambda: [
        Bucket("16-32s", 16, 32, 1.0), Bucket("32-64s", 32, 64, 1.0), Bucket(">64s", 64, None, 1.0)])
    missing_caption: str = "drop"  # drop (the shot) | empty (keep it with "") | fail (stop the stage)
    val_fraction: float = 0.05
    split_salt: str = "longlive"

    def validate(self, where: str) -> None:
        if self.max_shots < 1 or not 0 < self.min_duration_s <= self.max_duration_s:
            raise ConfigError(f"{where}: need max_shots >= 1 and 0 < min_duration_s <= max_duration_s")
        if self.missing_caption not in ("drop", "empty", "fail"):
            raise ConfigError(f"{where}.missing_caption must be drop, empty or fail")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"{where}.val_fraction must be in [0, 1)")
        if not self.buckets or any(b.weight <= 0 for b in self.buckets):
            raise ConfigError(f"{where}.buckets: at least one, each with weight > 0")
        edges = sorted(self.buckets, key=lambda b: b.min_s)
        for a, b in zip(edges, edges[1:]):
            if a.max_s is None or a.max_s > b.min_s:
                raise ConfigError(f"{where}.buckets {a.name} and {b.name} overlap")


def split_of(video_id: str, val_fraction: float, salt: str) -> str:
    h = int.from_bytes(hashlib.sha256(f"{salt}:{video_id}".encode()).digest()[:8], "big")
    return "val" if h / 2**64 < val_fraction else "train"


def bucket_of(duration: float, buckets: list[Bucket]) -> str | None:
    return next((b.name for b in buckets if b.holds(duration)), None)


@dataclasses.dataclass
class AssembleOutcome:
    samples: pd.DataFrame
    counts: dict[str, float]


def assemble_samples(scores: pd.DataFrame, captions: pd.DataFrame, cfg: AssembleConfig) -> AssembleOutcome:
    """``captions``: the caption stage's table (video_id, shot_index, caption or None, caption_source)."""
    kept = scores[scores["kept"]].sort_values(["video_id", "shot_index"]).reset_index(drop=True)
    kept = kept.merge(captions[["video_id", "shot_index", "caption", "caption_source"]], how="left",
                      on=["video_id", "shot_index"], validate="one_to_one", indicator=True)
    unknown = kept[kept["_merge"] == "left_only"]
    if len(unknown):
        first = unknown.iloc[0]
        raise ConfigError(f"{len(unknown)} kept shot(s) are not in the caption stage's table (e.g. "
                          f"{first['path']}#{first['shot_index']}): rerun the caption stage")
    kept = kept.drop(columns="_merge")
    kept["caption"] = [c if isinstance(c, str) else None for c in kept["caption"]]
    kept["caption_source"] = kept["caption_source"].fillna("")
    missing = kept["caption"].isna()
    if missing.any() and cfg.missing_caption == "fail":
        names = ", ".join(f"{r.path}#{r.shot_index}" for r in kept[missing].head(5).itertuples(index=False))
        raise ConfigError(f"{int(missing.sum())} kept shot(s) have no caption (e.g. {names}); add sidecars or set "
                          "assemble.missing_caption to drop or empty")
    if cfg.missing_caption == "drop":
        kept = kept[~missing]
    else:
        kept.loc[missing, "caption"] = ""
        kept.loc[missing, "caption_source"] = ""

    rows, too_short = [], 0

    def emit(run: list) -> None:
        nonlocal too_short
        duration = sum(s.duration_s for s in run)
        if duration < cfg.min_duration_s:
            too_short += 1
            return
        first, last = run[0], run[-1]
        rows.append({"sample_id": f"{first.video_id[:16]}-{first.shot_index:04d}-{last.shot_index:04d}",
                     "video_id": first.video_id, "path": first.path,
                     "shot_indices": [int(s.shot_index) for s in run], "num_shots": len(run),
                     "start_frame": int(first.start_frame), "end_frame": int(last.end_frame),
                     "duration_s": duration, "shot_durations_s": [float(s.duration_s) for s in run],
                     "captions": [s.caption for s in run], "caption_sources": [s.caption_source for s in run]})

    for _, shots in kept.groupby("video_id", sort=True):
        current: list = []
        for s in shots.itertuples(index=False):
            adjacent = current and s.start_frame == current[-1].end_frame
            fits = current and len(current) < cfg.max_shots and \
                sum(x.duration_s for x in current) + s.duration_s <= cfg.max_duration_s
            if current and not (adjacent and fits):
                emit(current)
                current = []
            if s.duration_s <= cfg.max_duration_s:
                current.append(s)
        if current:
            emit(current)

    samples = pd.DataFrame(rows, columns=SAMPLE_COLUMNS[:-3])
    samples["bucket"] = [bucket_of(d, cfg.buckets) for d in samples["duration_s"]]
    no_bucket = int(samples["bucket"].isna().sum())
    samples = samples[samples["bucket"].notna()].copy()
    samples["split"] = [split_of(v, cfg.val_fraction, cfg.split_salt) for v in samples["video_id"]]
    # weight so that drawing train samples proportionally to it gives each bucket its target share
    total = sum(b.weight for b in cfg.buckets)
    train_counts = samples[samples["split"] == "train"]["bucket"].value_counts()
    share = {b.name: b.weight / total for b in cfg.buckets}
    samples["sample_weight"] = [share[b] / train_counts.get(b, 1) for b in samples["bucket"]]
    samples = samples[SAMPLE_COLUMNS].sort_values("sample_id").reset_index(drop=True)
    counts = {"kept_shots": int(len(scores[scores["kept"]])), "missing_captions": int(missing.sum()),
              "samples": len(samples), "samples_too_short": too_short, "samples_without_bucket": no_bucket,
              "train": int((samples["split"] == "train").sum()), "val": int((samples["split"] == "val").sum()),
              "sample_s": float(samples["duration_s"].sum()),
              **{f"bucket_{b.name}": int((samples["bucket"] == b.name).sum()) for b in cfg.buckets}}
    return AssembleOutcome(samples, counts)
