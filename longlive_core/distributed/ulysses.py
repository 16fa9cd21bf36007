"""Balanced sequence parallelism: P ranks each hold the clean and the noisy copy of the same temporal
slice of a sample, and self-attention runs whole through a Ulysses all-to-all.

Before attention every rank holds all heads of its own tokens; the all-to-all hands each rank a
P-th of the heads for every token, concatenated rank by rank: [z0_clean, z0_noisy, ...,
z(P-1)_clean, z(P-1)_noisy]. The teacher-forcing mask is defined on that order directly
(``layout.balanced_roles``), so nothing is permuted; a second all-to-all gives every rank its own
tokens back with all heads. Cross-attention, the linears and the norms never leave the rank: the
text is replicated.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from longlive_core.models.attention import MaskMod, attend


@dataclasses.dataclass(frozen=True)
class SequenceShard:
    """Which slice of every sample this rank holds: ``rank`` of ``size`` ranks in ``group``."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


WHOLE = SequenceShard()  # one rank holds the whole sequence


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x (P, ...) -> (P, ...): part j goes to rank j; part j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The exchange is its own adjoint: the gradient of part j of the output goes back to rank j."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def tokens_to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """(S, B, H, L, D): S stacked tensors of local tokens with every head -> (S, B, H/P, P*L, D):
    every rank's tokens, rank by rank, with this rank's heads."""
    s, b, h, n, d = x.shape
    parts = x.view(s, b, size, h // size, n, d).movedim(2, 0)  # (P, S, B, H/P, L, D): head group j for rank j
    got = _AllToAll.apply(parts, group)  # part j: rank j's tokens, my heads
    return got.permute(1, 2, 3, 0, 4, 5).reshape(s, b, h // size, size * n, d)


def heads_to_tokens(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """The inverse of :func:`tokens_to_heads` for one tensor: (B, H/P, P*L, D) -> (B, H, L, D)."""
    b, hp, n, d = x.shape
    parts = x.view(b, hp, size, n // size, d).permute(2, 0, 1, 3, 4)  # part j: rank j's tokens
    got = _AllToAll.apply(parts, group)  # part j: my tokens, rank j's heads
    return got.transpose(0, 1).reshape(b, size * hp, n // size, d)


class UlyssesAttention:
    """An ``attention_fn`` for ``WanDiT``: q, k and v cross in one all-to-all, attention runs on the
    whole sequence for H/P heads, the output comes back in a second one. ``mask_mod`` addresses the
    post-exchange order."""

    def __init__(self, shard: SequenceShard, attention_fn=attend):
        self.shard, self.attention_fn = shard, attention_fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
        size, group = self.shard.size, self.shard.group
        if q.shape[1] % size:
            raise ValueError(f"{q.shape[1]} attention heads do not split over {size} sequence-parallel ranks")
        q, k, v = tokens_to_heads(torch.stack([q, k, v]), size, group).unbind(0)
        return heads_to_tokens(self.attention_fn(q, k, v, mask_mod), size, group)


# collectives over a shard's frames (inference's chunks and distillation's rollouts)
def gather_frames(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's frames (dim 2) of a chunk, in rank order, on every rank."""
    if shard.size == 1:
        return x
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
