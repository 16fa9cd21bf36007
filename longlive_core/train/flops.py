"""FLOPs of a teacher-forcing step, counted the way MFU is quoted: 2 per multiply-add of every
linear layer and of the attention's unmasked (query, key) pairs, times 3 for forward + backward.
Elementwise work, norms and the recomputation of activation checkpointing are not counted."""
from __future__ import annotations

import math

import torch

from longlive_core.models.config import DiTConfig
from longlive_core.train.layout import TeacherForcingLayout

# dense BF16 datasheet figures (TFLOP/s), the MFU denominator when params give none
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "GB200": 2500.0, "A100": 312.0}


def step_flops(cfg: DiTConfig, layout: TeacherForcingLayout, captions: int) -> float:
    """Forward + backward FLOPs of one sample of ``layout`` reading ``captions`` captions."""
    d, n = cfg.dim, 2 * layout.frames * layout.tokens_per_frame
    text = captions * layout.text_tokens
    per_block = (2 * n * d * d * 4  # self-attention q, k, v, o
                 + 2 * n * d * d * 2 + 2 * text * d * d * 2  # cross-attention q, o on video; k, v on text
                 + 2 * n * d * cfg.ffn_dim * 2  # FFN
                 + 4 * d * layout.attended_pairs()  # QK^T and PV over unmasked pairs
                 + 4 * d * n * layout.text_tokens)  # cross-attention: each token reads one caption
    embed = 2 * n * d * cfg.in_channels * math.prod(cfg.patch_size) + 2 * text * (cfg.text_dim * d + d * d)
    head = 2 * n * d * cfg.out_channels * math.prod(cfg.patch_size)
    return 3.0 * (cfg.num_layers * per_block + embed + head)


def peak_tflops(device: torch.device, configured: float | None) -> tuple[float | None, str]:
    """(denominator, what it is): the configured figure, else the GPU's datasheet figure, else none."""
    if configured:
        return configured, f"{configured:g} TFLOP/s (train_ar.peak_tflops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
            if key in name:
                return PEAK_BF16_TFLOPS[key], f"{PEAK_BF16_TFLOPS[key]:g} TFLOP/s dense BF16 datasheet ({name})"
        return None, f"unknown for {name}: set train_ar.peak_tflops"
    return None, "none on the CPU: set train_ar.peak_tflops"
