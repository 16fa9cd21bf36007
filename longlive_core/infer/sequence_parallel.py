"""Sequence parallelism in the chunked rollout (Ulysses over each chunk's tokens).

Each of P ranks runs the DiT on F_c / P of every chunk's latent frames, rank by rank in frame
order; every block's self-attention exchanges tokens for heads, so a rank attends, and caches, every
token of the chunk for its H / P heads. The same seed draws the same noise on every rank, each
keeping its frames, so the ranks together make what one process makes. Inference (``engine``) and
distillation's rollouts run this.
"""
from __future__ import annotations

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


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def from_first_rank(x: torch.Tensor | None, shard: SequenceShard, device: torch.device) -> torch.Tensor:
    """Rank 0's ``x`` (a 3-d tensor on ``device``; the other ranks pass None) on every rank of ``shard``:
    the prompts' embeddings, which one rank makes for all (umT5-XXL is 11 GB a rank otherwise)."""
    header = torch.zeros(4, dtype=torch.int64, device=device)
    if shard.rank == 0:
        header.copy_(torch.tensor([_DTYPES.index(x.dtype), *x.shape]))
    dist.broadcast(header, group=shard.group, group_src=0)
    if shard.rank != 0:
        code, *shape = header.tolist()
        x = torch.empty(shape, dtype=_DTYPES[code], device=device)
    x = x.contiguous()
    dist.broadcast(x, group=shard.group, group_src=0)
    return x
