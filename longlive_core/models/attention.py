"""Attention behind one small interface, with one mask definition for every backend.

A mask is a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` written with tensor ops, so the
same function builds a FlexAttention block mask on CUDA and a dense boolean mask for SDPA on the
CPU (where FlexAttention has no backward in torch 2.14). ``attend(q, k, v, mask_mod)`` takes
(B, heads, L, head_dim) tensors and picks the backend from the device.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch._dynamo
import torch.nn.functional as F

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The (q_len, kv_len) boolean mask a mask_mod describes (True = attend)."""
    q = torch.arange(q_len, device=device)[:, None]
    kv = torch.arange(kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(zero, zero, q, kv).expand(q_len, kv_len)


def block_causal(tokens_per_frame: int, frames_per_block: int) -> MaskMod:
    """Each token sees every token of its own block of frames and of the blocks before it."""
    block = tokens_per_frame * frames_per_block

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx // block <= q_idx // block

    return mask_mod


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    # default dynamism: the first new sequence length recompiles once with symbolic lengths instead
    # of once per length (which would hit the recompile limit and fall back to eager flex)
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=16)
def block_mask_for(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device):
    """The FlexAttention block mask of a mask_mod at these lengths, built once and shared by every
    layer and call that uses the same mask_mod object. So a mask_mod must be a pure function of its
    indices: one that reads a tensor changed in place later would get its old mask."""
    from torch.nn.attention.flex_attention import create_block_mask
    if device.type != "cuda":
        return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)
    # compiled on GPUs: the eager construction evaluates mask_mod on all q_len x kv_len index pairs at
    # once (about 100 GiB of int64 temporaries at 110K tokens); the compiled one goes block by block.
    # Every new mask_mod (another layout) recompiles it: past dynamo's default limit of 8 it would fall
    # back to the eager construction without a word, so the limit is raised for this call
    with torch._dynamo.config.patch(recompile_limit=1024):
        return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device, _compile=True)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
    block_mask = None if mask_mod is None else block_mask_for(mask_mod, q.shape[2], k.shape[2], q.device)
    # chunk-by-chunk generation calls it with many (query, key) lengths, with and without a mask and a
    # gradient: past dynamo's default of 8 recompilations it would run flex eagerly, which materialises
    # every score (hundreds of GiB at 56K tokens)
    with torch._dynamo.config.patch(recompile_limit=1024):
        return _compiled_flex()(q, k, v, block_mask=block_mask)


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
    mask = None if mask_mod is None else dense_mask(mask_mod, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None = None,
           backend: str | None = None) -> torch.Tensor:
    """Attention of (B, heads, L, head_dim) tensors; ``backend`` "flex" (CUDA default) or "sdpa"."""
    backend = backend or ("flex" if q.is_cuda else "sdpa")
    if backend == "flex":
        return flex_attend(q, k, v, mask_mod)
    if backend == "sdpa":
        return sdpa_attend(q, k, v, mask_mod)
    raise ValueError(f"attention backend must be 'flex' or 'sdpa'; got {backend!r}")
