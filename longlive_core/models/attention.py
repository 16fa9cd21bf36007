"""Attention behind one small interface, with one mask definition for every backend.

A mask is a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` written with tensor ops, so the
same function builds a FlexAttention block mask on CUDA and a dense boolean mask for SDPA on the
CPU (where FlexAttention has no backward in torch 2.14). A mask that is a union of whole rectangles
(the teacher-forcing layout's chunks) may also carry them as ``dense_rows``: then attention runs as
one unmasked SDPA call per query range, the fused dense kernels doing only the attended pairs.
``attend(q, k, v, mask_mod)`` takes (B, heads, L, head_dim) tensors and picks the backend.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q_start, q_end, ((kv_start, kv_end), ...)): the query rows [q_start, q_end) attend to every key of
# the key ranges and to no other; a mask's rows tile its queries in order
DenseRows = tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]


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
    import torch._dynamo  # here, not at the top: dynamo's import costs ~2 s in every process that attends without it
    with torch._dynamo.config.patch(recompile_limit=1024):
        return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device, _compile=True)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
    block_mask = None if mask_mod is None else block_mask_for(mask_mod, q.shape[2], k.shape[2], q.device)
    # chunk-by-chunk generation calls it with many (query, key) lengths, with and without a mask and a
    # gradient: past dynamo's default of 8 recompilations it would run flex eagerly, which materialises
    # every score (hundreds of GiB at 56K tokens)
    import torch._dynamo
    with torch._dynamo.config.patch(recompile_limit=1024):
        return _compiled_flex()(q, k, v, block_mask=block_mask)


def with_dense_rows(mask_mod: MaskMod, rows: DenseRows) -> MaskMod:
    """``mask_mod`` carrying the same mask as dense rectangles (``attend`` then runs it by rows)."""
    start = 0
    for q0, q1, ranges in rows:
        if q0 != start or q1 <= q0 or not ranges or any(b <= a for a, b in ranges):
            raise ValueError(f"dense rows must tile the queries in order with non-empty key ranges; got {rows}")
        start = q1
    mask_mod.dense_rows = rows
    return mask_mod


def _keys(x: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    parts = [x[:, :, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def rows_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: DenseRows) -> torch.Tensor:
    if not rows[-1][1] == q.shape[2] == k.shape[2]:
        raise ValueError(f"the mask's dense rows cover {rows[-1][1]} queries and keys; attention got "
                         f"{q.shape[2]} queries and {k.shape[2]} keys")
    return torch.cat([F.scaled_dot_product_attention(q[:, :, q0:q1], _keys(k, ranges), _keys(v, ranges))
                      for q0, q1, ranges in rows], dim=2)


def with_dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device) -> MaskMod:
    """``mask_mod`` carrying its (q_len, kv_len) boolean mask, made now: a compiled block reads it as an
    input (no guard on its values, no recompilation when it changes)."""
    mask_mod.dense = dense_mask(mask_mod, q_len, kv_len, device)
    return mask_mod


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
    mask = getattr(mask_mod, "dense", None)
    if mask is not None and mask.shape != (q.shape[2], k.shape[2]):
        raise ValueError(f"the mask was made for {tuple(mask.shape)} (queries, keys); attention got "
                         f"{q.shape[2]} queries and {k.shape[2]} keys")
    if mask is None and mask_mod is not None:
        mask = dense_mask(mask_mod, q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None = None,
           backend: str | None = None) -> torch.Tensor:
    """Attention of (B, heads, L, head_dim) tensors; ``backend`` "rows" (the default where the mask has
    dense rows), "sdpa" (a dense boolean mask: the default without a mask or with one made by
    ``with_dense_mask``, and on the CPU) or "flex" (the CUDA default for other masks)."""
    rows = getattr(mask_mod, "dense_rows", None)
    # SDPA without a mask or with one made beforehand: FlexAttention inside a checkpointed block under
    # torch.compile sends the whole block to eager (on the H200 every checkpointing mode ran at eager speed)
    made = mask_mod is None or getattr(mask_mod, "dense", None) is not None
    backend = backend or ("rows" if rows is not None else "flex" if q.is_cuda and not made else "sdpa")
    if backend == "rows":
        if rows is None:
            raise ValueError("attention backend 'rows' needs a mask_mod with dense rows (with_dense_rows)")
        return rows_attend(q, k, v, rows)
    if backend == "flex":
        return flex_attend(q, k, v, mask_mod)
    if backend == "sdpa":
        return sdpa_attend(q, k, v, mask_mod)
    raise ValueError(f"attention backend must be 'rows', 'flex' or 'sdpa'; got {backend!r}")
