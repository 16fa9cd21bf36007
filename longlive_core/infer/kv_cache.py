"""The self-attention KV cache of chunk-by-chunk generation.

Generation runs the model on one chunk of latent frames at a time. Each block's self-attention
reads the keys and values of the clean chunks made before (the cache) and of the chunk itself, with
no mask: exactly what a noisy chunk sees in teacher-forcing training (itself and the clean chunks
before it), and what a clean chunk sees there (the clean chunks up to itself) when the finished
chunk is run once more at t = 0 to write its own keys and values. The cache keeps at most
``window`` latent frames (a rolling local window; None: everything), dropping the oldest frames;
optionally in NVFP4 (``kv_quant.py``).
"""
from __future__ import annotations

import torch

from longlive_core.infer.kv_quant import KVQuantConfig, QuantizedChunk, dequantize_all, keep_last
from longlive_core.models.attention import MaskMod, attend


class KVCache:
    def __init__(self, num_layers: int, tokens_per_frame: int, window: int | None = None,
                 quant: KVQuantConfig | None = None):
        """``quant``: hold the cached keys and values in NVFP4 (``infer/kv_quant.py``); None: as computed."""
        if window is not None and window < 1:
            raise ValueError(f"the cache window must be at least one latent frame; got {window}")
        self.num_layers, self.tokens_per_frame, self.window, self.quant = num_layers, tokens_per_frame, window, quant
        # per layer: a (B, H, T, D) tensor, or under ``quant`` the list of its written chunks
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers
        self.key_mean: list[torch.Tensor | None] = [None] * num_layers  # K-smoothing's, from the first chunk
        self.writing = False

    def _tokens(self, index: int) -> int:
        held = self.keys[index]
        if held is None:
            return 0
        return held.shape[2] if isinstance(held, torch.Tensor) else sum(c.tokens for c in held)

    @property
    def frames(self) -> int:
        """Latent frames held (the same in every layer once a write pass is complete)."""
        return self._tokens(0) // self.tokens_per_frame

    @property
    def nbytes(self) -> int:
        """Bytes the cached keys and values take, every layer."""
        total = 0
        for held in self.keys + self.values:
            if isinstance(held, torch.Tensor):
                total += held.numel() * held.element_size()
            elif held is not None:
                total += sum(c.nbytes for c in held)
        return total

    def for_layer(self, index: int) -> CachedAttention:
        return CachedAttention(self, index)

    def _append(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keep = None if self.window is None else self.window * self.tokens_per_frame
        k, v = k.detach(), v.detach()
        if self.quant is None:
            old_k, old_v = self.keys[index], self.values[index]
            k = k if old_k is None else torch.cat([old_k, k], dim=2)
            v = v if old_v is None else torch.cat([old_v, v], dim=2)
            self.keys[index], self.values[index] = (k, v) if keep is None else (k[:, :, -keep:], v[:, :, -keep:])
            return
        if self.quant.smooth_keys and self.key_mean[index] is None:
            self.key_mean[index] = k.float().mean(dim=(0, 2), keepdim=True)  # (1, H, 1, D)
        k = smoothed(k, self.key_mean[index])
        fos = self.quant.four_over_six
        keys = (self.keys[index] or []) + [QuantizedChunk.of(k, fos)]
        values = (self.values[index] or []) + [QuantizedChunk.of(v, fos)]
        self.keys[index], self.values[index] = ((keys, values) if keep is None else
                                                (keep_last(keys, keep), keep_last(values, keep)))


def smoothed(k: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    return k if mean is None else (k.float() - mean).to(k.dtype)


class CachedAttention:
    """Block ``index``'s ``attention_fn`` for one forward: attends over [cache; current] and, in a write
    pass, appends the current keys and values to the cache after using them. It holds the cache as it
    was when the forward began, so activation checkpointing, which calls it again in the backward
    after later chunks were written, recomputes what the forward computed."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index
        self.past_k, self.past_v, self.writing = cache.keys[index], cache.values[index], cache.writing
        self.key_mean = cache.key_mean[index]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
        if mask_mod is not None:
            raise ValueError("cached attention takes no mask: the cache holds exactly what the chunk may see")
        past_k, past_v = self.past_k, self.past_v
        if isinstance(past_k, list):  # NVFP4: dequantized on read; the chunk's own keys smoothed alike
            past_k, past_v = dequantize_all(past_k, k.dtype), dequantize_all(past_v, v.dtype)
        full_k = smoothed(k, self.key_mean)
        full_k = full_k if past_k is None else torch.cat([past_k.to(k.dtype), full_k], dim=2)
        full_v = v if past_v is None else torch.cat([past_v.to(v.dtype), v], dim=2)
        out = attend(q, full_k, full_v, None)
        if self.writing:
            self.cache._append(self.index, k, v)
        return out
