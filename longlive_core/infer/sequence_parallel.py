"""Sequence parallelism in the chunked rollout (Ulysses over each chunk's tokens).

Each of P ranks runs the DiT on F_c / P of every chunk's latent frames, rank by rank in frame
order; every block's self-attention exchanges tokens for heads, so a rank attends, and caches, every
token of the chunk for its H / P heads. The same seed draws the same noise on every rank, each
keeping its frames, so the ranks together make what one process makes. Inference (``engine``) and
distillation's rollouts run this.
"""
from __future__ import annotations

import torch

from longlive_core.infer.kv_cache import KVCache
from longlive_core.train.sequence_parallel import SequenceShard, UlyssesAttention


class _ShardedLayer(UlyssesAttention):
    @torch.compiler.disable  # the exchange and the cache stay out of a compiled block's graph
    def __call__(self, q, k, v, mask_mod):
        return super().__call__(q, k, v, mask_mod)


class ShardedCache:
    """The KV cache under sequence parallelism (Ulysses over the chunk's tokens): every block's q, k
    and v cross in an all-to-all, so this rank attends, and caches, every token of the chunk for its
    H/P heads; the cache is a P-th of one process's."""

    def __init__(self, cache: KVCache, shard: SequenceShard):
        self.cache, self.shard = cache, shard

    def for_layer(self, index: int) -> _ShardedLayer:
        return _ShardedLayer(self.shard, self.cache.for_layer(index))


def gather_frames(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's frames (dim 2) of a chunk, in rank order, on every rank."""
    if shard.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return torch.cat(parts, dim=2)


def chunk_part(chunk: int, shard: SequenceShard) -> tuple[int, int]:
    """This rank's frames [lo, hi) of every ``chunk``-frame chunk."""
    if chunk % shard.size:
        raise ValueError(f"{chunk}-frame chunks do not split over {shard.size} sequence-parallel ranks")
    return shard.rank * chunk // shard.size, (shard.rank + 1) * chunk // shard.size


def gather_video(x: torch.Tensor, shard: SequenceShard, chunk: int) -> torch.Tensor:
    """(B, C, n F_c/P, h, w): this rank's frames of n chunks -> (B, C, n F_c, h, w), every rank's, in
    frame order, on every rank (no gradient crosses)."""
    if shard.size == 1:
        return x
    import torch.distributed as dist

    b, c, f, h, w = x.shape
    k = chunk // shard.size
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.detach().contiguous(), group=shard.group)
    every = torch.stack(parts).view(shard.size, b, c, f // k, k, h, w)  # (P, B, C, n, k, h, w)
    return every.permute(1, 2, 3, 0, 4, 5, 6).reshape(b, c, f * shard.size, h, w)


def rank_frames(x: torch.Tensor, shard: SequenceShard, chunk: int) -> torch.Tensor:
    """The inverse of ``gather_video``: this rank's frames of every chunk of a whole video."""
    if shard.size == 1:
        return x
    b, c, f, h, w = x.shape
    n, k = f // chunk, chunk // shard.size
    return x.view(b, c, n, shard.size, k, h, w)[:, :, :, shard.rank].reshape(b, c, n * k, h, w)
