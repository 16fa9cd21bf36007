"""Few-step autoregressive rollout, chunk by chunk, with the self-attention KV cache.

For each chunk of ``chunk_frames`` latent frames: start from noise, and for each timestep t of
``steps`` (descending, ending at 0; the distilled [1000, 946, 854, 681, 0]) predict the velocity,
take x0 = x - sigma v (sigma = t / 1000, the schedule's shift already in the list), and renoise x0
to the next timestep with fresh noise, until the next one is 0. The finished chunk is then run
once at t = 0 to write its keys and values into the cache (not after the last chunk: nothing reads
them). Frame positions run on from chunk to chunk. Self-forcing distillation stops each chunk at a
drawn exit step and backpropagates through that step only. Self-forcing distillation and the inference
engine both run this loop.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from longlive_core.distributed.ulysses import WHOLE, SequenceShard, chunk_part
from longlive_core.infer.config import RolloutConfig
from longlive_core.infer.kv_cache import KVCache, SinkConfig
from longlive_core.infer.sequence_parallel import ShardedCache
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.flow import FlowMatching


def teacher_schedule(steps: int, shift: float, num_train_timesteps: int = 1000) -> tuple[int, ...]:
    """``steps`` timesteps of a flow-matching model's own shifted schedule (the AR model's many-step
    sampler), descending from ``num_train_timesteps``, then 0 (repeats after rounding merged)."""
    if not 1 <= steps <= num_train_timesteps:
        raise ValueError(f"schedule has {num_train_timesteps} timesteps: ask for 1 to {num_train_timesteps} steps, "
                         f"not {steps}")
    flow = FlowMatching(num_train_timesteps, shift)
    ts = flow.timestep(flow.sigmas(torch.arange(steps) * (num_train_timesteps // steps))).round().int().tolist()
    return (*sorted(set(ts), reverse=True), 0)


def denoise_chunk(model: WanDiT, x: torch.Tensor, text: torch.Tensor, positions: torch.Tensor,
                  steps: tuple[int, ...], generator: torch.Generator | None, exit_index: int | None = None,
                  grad: bool = False, dtype: torch.dtype | None = None,
                  part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x (B, C, F_c, h, w) pure noise at steps[0] -> the chunk's x0, reading (not writing) the cache:
    the x0 predicted at step ``exit_index`` (default the last, steps[-2]); with ``grad`` that one
    prediction carries the gradient, every step before it runs without. The model reads x in
    ``dtype`` (default x's); the chunk's running state stays in x's. ``part`` (lo, hi, F): x is frames
    lo:hi of an F-frame chunk (a sequence-parallel rank's share): fresh noise is drawn for all F frames
    and cut, so the ranks together draw what one process would."""
    b = x.shape[0]
    last = len(steps) - 2 if exit_index is None else exit_index
    for i, (t, t_next) in enumerate(zip(steps[:-1], steps[1:])):
        with torch.set_grad_enabled(grad and i == last):
            t_in = torch.full((b,), float(t), device=x.device)
            v = model(x.to(dtype or x.dtype), t_in, text, frame_positions=positions)
            x0 = x - (t / 1000.0) * v.to(x.dtype)
        if i == last:
            return x0
        shape = x.shape if part is None else (*x.shape[:2], part[2], *x.shape[3:])
        noise = torch.randn(shape, generator=generator, device=generator.device if generator else x.device)
        if part is not None:
            noise = noise[:, :, part[0]:part[1]]
        x = (1 - t_next / 1000.0) * x0 + (t_next / 1000.0) * noise.to(x.device, x.dtype)
    raise ValueError(f"exit_index {exit_index} is not a step of {list(steps)}")


def rollout(model: WanDiT, noise: torch.Tensor, text: torch.Tensor | Sequence[torch.Tensor], cfg: RolloutConfig,
            generator: torch.Generator | None = None, positions: torch.Tensor | None = None,
            exit_index: int | None = None, grad_from_chunk: int | None = None, dtype: torch.dtype | None = None,
            shard: SequenceShard = WHOLE, shots: Sequence[int] | None = None) -> torch.Tensor:
    """noise (B, C, F, h, w), F a whole number of chunks -> the generated latents, chunk after chunk,
    with the inference KV cache (``cfg``'s window and sinks). ``text``: (B, T, D) for every chunk, or
    one such tensor per chunk (a multi-shot video's chunks read their own shot's caption); ``shots``:
    each chunk's shot index (default: one shot), a change starts a shot in the cache as inference
    does; ``positions`` (F,) RoPE frame positions (default 0..F-1, shot offsets are the caller's).
    Self-forcing: every chunk exits at step ``exit_index``, and the chunks from ``grad_from_chunk``
    on carry the gradient of that step (None: no gradient anywhere). Under sequence parallelism
    (``shard``, every rank given the same noise and generator) the result is this rank's frames of
    every chunk (``infer.sequence_parallel.gather_video`` joins them)."""
    _, _, frames, h, w = noise.shape
    if frames % cfg.chunk_frames:
        raise ValueError(f"{frames} latent frames are not a whole number of {cfg.chunk_frames}-frame chunks")
    n = frames // cfg.chunk_frames
    texts = [text] * n if isinstance(text, torch.Tensor) else list(text)
    shots = [0] * n if shots is None else list(shots)
    if len(texts) != n or len(shots) != n:
        raise ValueError(f"{len(texts)} texts and {len(shots)} shot indices for {n} chunks")
    if positions is None:
        positions = torch.arange(frames, device=noise.device)
    _, ph, pw = model.cfg.patch_size
    cache = KVCache(len(model.blocks), (h // ph) * (w // pw), cfg.window,
                    sink=SinkConfig(cfg.global_sink, cfg.shot_sink))
    lo, hi = chunk_part(cfg.chunk_frames, shard)
    saved, model.attention_fn = model.attention_fn, (cache if shard.size == 1 else ShardedCache(cache, shard))
    chunks = []
    try:
        for c in range(n):
            if c and shots[c] != shots[c - 1]:
                cache.start_shot()
            part = slice(c * cfg.chunk_frames + lo, c * cfg.chunk_frames + hi)
            grad = grad_from_chunk is not None and c >= grad_from_chunk
            x0 = denoise_chunk(model, noise[:, :, part], texts[c], positions[part], cfg.steps, generator,
                               exit_index, grad, dtype, part=(lo, hi, cfg.chunk_frames))
            chunks.append(x0)
            if c + 1 < n:
                write_chunk(model, cache, x0, texts[c], positions[part], dtype, frames=cfg.chunk_frames)
    finally:
        model.attention_fn = saved
    return torch.cat(chunks, dim=2)


@torch.no_grad()
def write_chunk(model: WanDiT, cache: KVCache, x0: torch.Tensor, text: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype | None = None, frames: int | None = None) -> None:
    """The finished chunk once more at t = 0: its clean keys and values go into the cache. ``frames``:
    the whole chunk's latent frames where x0 is one sequence-parallel rank's share of them (the
    exchange before attention gives every rank's cache every frame, for its share of the heads)."""
    with cache.write(frames or x0.shape[2]):
        model(x0.detach().to(dtype or x0.dtype), torch.zeros(x0.shape[0], device=x0.device), text,
              frame_positions=positions)
