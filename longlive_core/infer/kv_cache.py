"""The self-attention KV cache of chunk-by-chunk generation.

Generation runs the model on one chunk of latent frames at a time. Each block's self-attention
reads the keys and values of the clean chunks made before (the cache) and of the chunk itself, with
no mask: exactly what a noisy chunk sees in teacher-forcing training (itself and the clean chunks
before it), and what a clean chunk sees there (the clean chunks up to itself) when the finished
chunk is run once more at t = 0 to write its own keys and values. The cache keeps at most
``window`` latent frames (a rolling local window; None: everything), dropping the oldest frames.
"""
from __future__ import annotations

import torch

from longlive_core.models.attention import MaskMod, attend


class KVCache:
    def __init__(self, num_layers: int, tokens_per_frame: int, window: int | None = None):
        if window is not None and window < 1:
            raise ValueError(f"the cache window must be at least one latent frame; got {window}")
        self.num_layers, self.tokens_per_frame, self.window = num_layers, tokens_per_frame, window
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.writing = False

    @property
    def frames(self) -> int:
        """Latent frames held (the same in every layer once a write pass is complete)."""
        k = self.keys[0]
        return 0 if k is None else k.shape[2] // self.tokens_per_frame

    def for_layer(self, index: int) -> CachedAttention:
        return CachedAttention(self, index)

    def _append(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self.keys[index], self.values[index]
        k = k if old_k is None else torch.cat([old_k, k], dim=2)
        v = v if old_v is None else torch.cat([old_v, v], dim=2)
        if self.window is not None:
            keep = self.window * self.tokens_per_frame
            k, v = k[:, :, -keep:], v[:, :, -keep:]
        self.keys[index], self.values[index] = k.detach(), v.detach()


class CachedAttention:
    """Block ``index``'s ``attention_fn`` for one forward: attends over [cache; current] and, in a write
    pass, appends the current keys and values to the cache after using them. It holds the cache as it
    was when the forward began, so activation checkpointing, which calls it again in the backward
    after later chunks were written, recomputes what the forward computed."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index
        self.past_k, self.past_v, self.writing = cache.keys[index], cache.values[index], cache.writing

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
        if mask_mod is not None:
            raise ValueError("cached attention takes no mask: the cache holds exactly what the chunk may see")
        past_k, past_v = self.past_k, self.past_v
        full_k = k if past_k is None else torch.cat([past_k.to(k.dtype), k], dim=2)
        full_v = v if past_v is None else torch.cat([past_v.to(v.dtype), v], dim=2)
        out = attend(q, full_k, full_v, None)
        if self.writing:
            self.cache._append(self.index, k, v)
        return out
