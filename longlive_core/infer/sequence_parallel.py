"""Sequence parallelism in the chunked rollout (Ulysses over each chunk's tokens).

Each of P ranks runs the DiT on F_c / P of every chunk's latent frames, rank by rank in frame
order; every block's self-attention exchanges tokens for heads, so a rank attends, and caches, every
token of the chunk for its H / P heads. The same seed draws the same noise on every rank, each
keeping its frames, so the ranks together make what one process makes. Inference (``engine``) and
distillation's rollouts run this.
"""
from __future__ import annotations

import torch

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
