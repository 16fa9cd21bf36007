"""A models/ar folder for distillation and merge tests: a tiny seeded DiT saved as train_ar saves it."""
from __future__ import annotations

from pathlib import Path

import torch

from longlive_core.models.checkpoint import save_dit
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.recipe import DEFAULT_SKIP


def make_ar_model(root: Path, chunk_frames: int = 2, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = WanDiT(DIT_CONFIGS["tiny"])
    config = {"format": "longlive-dit", "stage": "train_ar", "dit": {"name": "tiny"},
              "latent": {"channels": 48, "chunk_frames": chunk_frames, "height": 4, "width": 4, "temporal_stride": 4,
                         "spatial_stride": 16},
              "video": {"fps": 24.0, "height": 64, "width": 64},
              "text_encoder": {"path": "tiny", "max_length": 16, "seed": 0}, "vae": {"path": "tiny", "seed": 0},
              "multi_shot": {"shot_rope_offset": 8, "scene_transition_prefix": True},
              "sampling": {"kind": "flow-matching", "num_train_timesteps": 1000, "timestep_shift": 5.0, "steps": None},
              "precision": {"recipe": "bf16", "skip": list(DEFAULT_SKIP), "keep_last_blocks": 0}}
    save_dit(model, root, config=config)
    return root
