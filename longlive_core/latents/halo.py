"""Balanced-SP chunk-halo VAE encoding: each of P ranks encodes only its share of a shot.

A shot's latent frames are split into P contiguous chunks. The Wan VAE encodes the first raw frame
alone and then groups of 4 causally, so latent j >= 1 covers raw frames 4j-3 .. 4j. A rank whose
chunk is latents [L, E) encodes raw frames from 4 (L - h - 1) to 4 (E - 1) inclusive: the encoder
sees that sub-clip's first frame alone, then h "halo" latents of context, then its own latents,
which line up with the full encode's. It drops the first h + 1 latents it made. When the halo
would reach before the shot's start it encodes from frame 0 and drops L. Per-rank cost is
O(F / P + h) latent frames instead of O(F).

The halo a VAE needs is its causal receptive field in latent frames, counted from the encoder's
layers by ``receptive_field_latents``: every causal convolution with temporal kernel k adds k - 1
frames at the temporal resolution it runs at, and each temporal downsampling doubles that
resolution's step. For the Wan2.2 VAE that is 112 raw frames = 28 latents (the public code's halo).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from longlive_core.models.vae import TEMPORAL_STRIDE, encode_video


@dataclasses.dataclass(frozen=True)
class Chunk:
    rank: int
    latent_start: int  # the latents this rank keeps: [latent_start, latent_end)
    latent_end: int
    raw_start: int  # the raw frames it encodes: [raw_start, raw_end)
    raw_end: int
    drop: int  # leading latents of its encode that are halo

    @property
    def encoded_latents(self) -> int:
        return self.latent_end - self.latent_start + self.drop


def split_latents(num_latents: int, ranks: int) -> list[tuple[int, int]]:
    """P contiguous, balanced [start, end) ranges (the first ones one longer when uneven)."""
    if ranks < 1 or num_latents < ranks:
        raise ValueError(f"cannot split {num_latents} latent frames over {ranks} ranks")
    base, extra = divmod(num_latents, ranks)
    bounds = [0]
    for r in range(ranks):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def chunk_for(rank: int, start: int, end: int, halo: int) -> Chunk:
    """What encodes latents [start, end) of a shot: its raw frames with ``halo`` latents of context."""
    raw_end = TEMPORAL_STRIDE * (end - 1) + 1
    first_halo = start - halo
    if start == 0 or first_halo <= 0:
        return Chunk(rank, start, end, 0, raw_end, start)
    return Chunk(rank, start, end, TEMPORAL_STRIDE * (first_halo - 1), raw_end, halo + 1)


def plan_chunks(num_latents: int, ranks: int, halo: int) -> list[Chunk]:
    return [chunk_for(rank, start, end, halo) for rank, (start, end) in enumerate(split_latents(num_latents, ranks))]


def encode_chunk(vae, video: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The latents [latent_start, latent_end) of ``video`` (1, 3, T, H, W), from this chunk's frames only."""
    z = encode_video(vae, video[:, :, chunk.raw_start:chunk.raw_end])
    return z[:, chunk.drop:]


def encode_chunked(vae, video: torch.Tensor, ranks: int, halo: int) -> torch.Tensor:
    """What P ranks produce together, computed here one chunk after another."""
    num_latents = 1 + (video.shape[2] - 1) // TEMPORAL_STRIDE
    return torch.cat([encode_chunk(vae, video, c) for c in plan_chunks(num_latents, ranks, halo)], dim=1)


def receptive_field_latents(vae) -> int:
    """The encoder's causal receptive field in latent frames (see the module docstring)."""
    raw, step = 0, 1
    for _name, module in vae.encoder.named_modules():
        kernel = getattr(module, "kernel_size", None)
        if type(module).__name__ != "WanCausalConv3d" or kernel is None:
            continue
        raw += (kernel[0] - 1) * step
        if module.stride[0] > 1:
            step *= module.stride[0]
    return math.ceil(raw / TEMPORAL_STRIDE)
