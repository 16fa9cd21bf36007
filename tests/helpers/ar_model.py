"""A models/ar folder for distillation and merge tests: a tiny seeded DiT saved as train_ar saves it,
and the typed config.json of such folders."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from longlive_core.models.checkpoint import save_dit
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.folder import (
    DiTFolder,
    Encoder,
    LatentGeometry,
    MultiShot,
    PrecisionRules,
    Sampling,
    VideoFormat,
    as_json,
)
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.recipe import DEFAULT_SKIP


def folder_config(chunk_frames: int = 2, **changes) -> DiTFolder:
    """A tiny model folder's config (train_ar's fields; ``changes`` replaces any of them)."""
    config = DiTFolder(format="longlive-dit", stage="train_ar", dit={"name": "tiny"},
                       latent=LatentGeometry(48, chunk_frames, 4, 4), video=VideoFormat(24.0, 64, 64),
                       vae=Encoder("tiny", "tiny", 0), text_encoder=Encoder("tiny", "tiny", 0, max_length=16),
                       sampling=Sampling("flow-matching", None, 1000, 5.0), multi_shot=MultiShot(8),
                       precision=PrecisionRules("bf16", DEFAULT_SKIP), weights_dtype="float32")
    return dataclasses.replace(config, **changes)


def make_ar_model(root: Path, chunk_frames: int = 2, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = WanDiT(DIT_CONFIGS["tiny"])
    save_dit(model, root, config=as_json(folder_config(chunk_frames)))
    return root
