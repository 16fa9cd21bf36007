"""Few-step autoregressive rollout, chunk by chunk, with the self-attention KV cache.

For each chunk of ``chunk_frames`` latent frames: start from noise, and for each timestep t of
``steps`` (descending, ending at 0; the distilled [1000, 946, 854, 681, 0]) predict the velocity,
take x0 = x - sigma v (sigma = t / 1000, the schedule's shift already in the list), and renoise x0
to the next timestep with fresh noise, until the next one is 0. The finished chunk is then run
once at t = 0 to write its keys and values into the cache (not after the last chunk: nothing reads
them). Frame positions run on from chunk to chunk. Self-forcing distillation and the inference
engine both run this loop.
"""
from __future__ import annotations

import dataclasses

import torch

from longlive_core.infer.kv_cache import KVCache
from longlive_core.models.wan_dit import WanDiT


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    chunk_frames: int = 8
    steps: tuple[int, ...] = (1000, 946, 854, 681, 0)
    window: int | None = 32  # latent frames of keys a chunk reads besides its own; None: all before it

    def __post_init__(self) -> None:
        s = self.steps
        if len(s) < 2 or s[-1] != 0 or any(a <= b for a, b in zip(s, s[1:])) or s[0] > 1000:
            raise ValueError(f"steps must descend from at most 1000 to 0; got {list(s)}")


def denoise_chunk(model: WanDiT, x: torch.Tensor, text: torch.Tensor, positions: torch.Tensor,
                  steps: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """x (B, C, F_c, h, w) pure noise at steps[0] -> the chunk's x0, reading (not writing) the cache."""
    b = x.shape[0]
    for t, t_next in zip(steps[:-1], steps[1:]):
        sigma = t / 1000.0
        v = model(x, torch.full((b,), float(t), device=x.device), text, frame_positions=positions)
        x0 = x - sigma * v.to(x.dtype)
        if t_next == 0:
            return x0
        noise = torch.randn(x.shape, generator=generator, device=generator.device if generator else x.device)
        x = (1 - t_next / 1000.0) * x0 + (t_next / 1000.0) * noise.to(x.device, x.dtype)
    return x


@torch.no_grad()
def rollout(model: WanDiT, noise: torch.Tensor, text: torch.Tensor, cfg: RolloutConfig,
            generator: torch.Generator | None = None, start_position: int = 0) -> torch.Tensor:
    """noise (B, C, F, h, w), F a whole number of chunks -> the generated latents, chunk after chunk."""
    b, _, frames, h, w = noise.shape
    if frames % cfg.chunk_frames:
        raise ValueError(f"{frames} latent frames are not a whole number of {cfg.chunk_frames}-frame chunks")
    _, ph, pw = model.cfg.patch_size
    cache = KVCache(len(model.blocks), (h // ph) * (w // pw), cfg.window)
    saved, model.attention_fn = model.attention_fn, cache
    chunks = []
    try:
        n = frames // cfg.chunk_frames
        for c in range(n):
            lo = c * cfg.chunk_frames
            positions = torch.arange(start_position + lo, start_position + lo + cfg.chunk_frames, device=noise.device)
            x0 = denoise_chunk(model, noise[:, :, lo:lo + cfg.chunk_frames], text, positions, cfg.steps, generator)
            chunks.append(x0)
            if c + 1 < n:
                cache.writing = True
                model(x0, torch.zeros(b, device=noise.device), text, frame_positions=positions)
                cache.writing = False
    finally:
        model.attention_fn = saved
    return torch.cat(chunks, dim=2)
