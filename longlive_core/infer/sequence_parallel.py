"""Sequence parallelism in the chunked rollout (Ulysses over each chunk's tokens).

Each of P ranks runs the DiT on F_c / P of every chunk's latent frames, rank by rank in frame
order; every block's self-attention exchanges tokens for heads, so a rank attends, and caches, every
token of the chunk for its H / P heads. The same seed draws the same noise on every rank, each
keeping its frames, so the ranks together make what one process makes. Inference (``engine``) and
distillation's rollouts run this.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from longlive_core.distributed.ulysses import SequenceShard, UlyssesAttention
from longlive_core.infer.kv_cache import KVCache


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


def from_first_rank(make: Callable[[], torch.Tensor], shard: SequenceShard, device: torch.device) -> torch.Tensor:
    """``make()``, run by rank 0 of ``shard`` alone, on every rank: a float32 (n, length, dim) tensor on
    ``device`` (the prompts' embeddings, which one rank makes for all: umT5-XXL is 11 GB a rank
    otherwise). Where ``make`` fails on rank 0 the other ranks are told, and raise, instead of waiting
    for the tensor until the process group times out."""
    header = torch.full((3,), -1, dtype=torch.int64, device=device)  # the shape, or -1s: rank 0 failed
    if shard.rank == 0:
        try:
            x = make()
            if x.dtype != torch.float32 or x.dim() != 3:
                raise ValueError(f"from_first_rank sends a float32 (n, length, dim) tensor, not {x.dtype} "
                                 f"{tuple(x.shape)}")
            x = x.contiguous()
            header.copy_(torch.tensor(x.shape))
        finally:
            dist.broadcast(header, group=shard.group, group_src=0)
    else:
        dist.broadcast(header, group=shard.group, group_src=0)
        shape = header.tolist()
        if shape[0] < 0:
            raise RuntimeError(f"rank {shard.rank}: rank 0 failed to embed the prompt file for the other ranks; its "
                               "error (in rank 0's output) says what to fix")
        x = torch.empty(shape, dtype=torch.float32, device=device)
    dist.broadcast(x, group=shard.group, group_src=0)
    return x
