"""Where every stage reads and writes: the data layout of dvc.yaml, in one place."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from longlive_core.config import ConfigError
from longlive_core.data.roots import SourceError, local_root

INGEST = Path("data/ingest")
MANIFEST = INGEST / "manifest.parquet"
INGEST_STATE = INGEST / "state"

SHOTS_DIR = Path("data/shots")
SHOTS = SHOTS_DIR / "shots.parquet"
REJECTED = SHOTS_DIR / "rejected.parquet"
CLIPS = SHOTS_DIR / "clips"
SHOTS_STATE = SHOTS_DIR / "state"

IQA = Path("data/iqa")
SCORES = IQA / "scores.parquet"
IQA_STATE = IQA / "state"

CAPTION_DIR = Path("data/captions")
CAPTIONS = CAPTION_DIR / "captions.parquet"  # one row per kept shot: its caption (or none) and where it came from
SUBJECTS = CAPTION_DIR / "subjects.parquet"  # one row per video: its recurring subjects
CAPTION_STATE = CAPTION_DIR / "state"

SAMPLES = Path("data/samples/samples.parquet")
CURATION_REPORT = Path("reports/curation")

LATENTS = Path("data/latents")
LATENT_SHARDS = LATENTS / "shards"
LATENT_INDEX = LATENTS / "index.parquet"
LATENTS_FAILED = LATENTS / "failed.parquet"

AR_MODEL = Path("models/ar")  # train_ar's model folder (MISSION.md "Model folders")
AR_CHECKPOINTS = Path("checkpoints/train_ar")  # not a DVC output: DVC never deletes it, so a rerun resumes
TRAIN_AR_HISTORY = Path("reports/train_ar/history.jsonl")
AR_IDENTITY = Path("reports/train_ar/identity.json")  # its weights and how they run: what later stages key on

DMD_MODEL = Path("models/dmd")  # distill_dmd's: the generator's LoRA as a peft adapter
DMD_CHECKPOINTS = Path("checkpoints/distill_dmd")  # not a DVC output either: a killed distillation resumes
DISTILL_DMD_HISTORY = Path("reports/distill_dmd/history.jsonl")
DMD_IDENTITY = Path("reports/distill_dmd/identity.json")

W4A4_MODEL = Path("models/w4a4")  # merge_w4a4's: the merged model, packed NVFP4
MERGE_W4A4_METRICS = Path("reports/merge_w4a4/metrics.json")
W4A4_IDENTITY = Path("reports/merge_w4a4/identity.json")

EVALUATE = Path("reports/evaluate")
EVALUATE_VIDEOS = EVALUATE / "videos"  # each suite entry's prompt file, mp4 and sidecar
EVALUATE_SHEETS = EVALUATE / "sheets"  # a contact sheet per video
EVALUATE_SCORES = EVALUATE / "scores.json"

DIST = Path("dist")  # package's: the model bundle (VERSION and SHA256SUMS inside)

WEIGHTS = Path("data/weights")  # one file per stage that reads pretrained weights: their digests


def raw_root(params: dict[str, Any]) -> Path:
    """Where the ingested videos and sidecars are read from (ingest.source, or its S3 mirror)."""
    ingest = params.get("ingest") or {}
    if not isinstance(ingest.get("source"), str) or not isinstance(ingest.get("cache_dir"), str):
        raise ConfigError("params.yaml's ingest section must give source and cache_dir: the later stages read the "
                          "ingested files from there")
    root = local_root(ingest["source"], ingest["cache_dir"])
    if not root.is_dir():
        raise SourceError(f"{root} (ingest.source, or its S3 mirror) is not a directory: the ingested videos are "
                          "read from there; put them back, or run ingest on where they are now")
    return root
