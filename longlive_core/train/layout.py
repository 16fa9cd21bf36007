"""The teacher-forcing sequence: where every token sits, which tokens it may attend to, which
caption each frame reads. The one place that defines the layout, the mask and the per-frame inputs;
sequence parallelism splits it over ranks through ``sp`` and ``balanced_roles``.

A sample of F latent frames in chunks of ``chunk`` frames becomes the 2F-frame sequence
[z_clean; z_noisy]. Clean and noisy copies of a frame share its RoPE position and its caption; clean
frames have timestep 0, noisy chunk i its own. Clean chunk i attends to clean chunks 0..i; noisy
chunk i to itself and to clean chunks 0..i-1. So one forward supervises every noisy chunk, each
conditioned on the clean past only, as autoregressive generation will see it.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from longlive_core.models.attention import DenseRows, MaskMod, with_dense_mask, with_dense_rows

# token index -> (chunk index within the sample, is-noisy), as tensors; the order of tokens in the sequence
Roles = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def balanced_roles(frames: int, chunk: int, tokens_per_frame: int, sp: int = 1) -> Roles:
    """The token order after Balanced SP's all-to-all over ``sp`` ranks: rank r's clean frames, then
    its noisy frames, rank after rank ([z0_clean, z0_noisy, ..., z(P-1)_clean, z(P-1)_noisy]), rank r
    holding frames r*F/P .. (r+1)*F/P - 1. With one rank: every clean frame, then every noisy one."""
    local = frames // sp
    per_rank = 2 * local * tokens_per_frame

    def roles(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rank = idx // per_rank
        frame = (idx % per_rank) // tokens_per_frame
        noisy = frame >= local
        return (rank * local + frame - noisy.long() * local) // chunk, noisy

    return roles


def teacher_forcing_mask(roles: Roles) -> MaskMod:
    def mask_mod(b, h, q_idx, kv_idx):
        q_chunk, q_noisy = roles(q_idx)
        kv_chunk, kv_noisy = roles(kv_idx)
        clean_q = ~q_noisy & ~kv_noisy & (kv_chunk <= q_chunk)
        noisy_q = q_noisy & ((kv_noisy & (kv_chunk == q_chunk)) | (~kv_noisy & (kv_chunk < q_chunk)))
        return clean_q | noisy_q

    return mask_mod


def per_frame_text_mask(text_segment: torch.Tensor, tokens_per_frame: int, text_tokens: int) -> MaskMod:
    """Cross-attention mask: a video token of frame f reads only the ``text_tokens`` tokens of caption
    ``text_segment[b, f]`` in the captions concatenated along the text axis."""
    def mask_mod(b, h, q_idx, kv_idx):
        return text_segment[b, q_idx // tokens_per_frame] == kv_idx // text_tokens

    return mask_mod


def teacher_forcing_rows(frames: int, chunk: int, tokens_per_frame: int, sp: int = 1) -> DenseRows:
    """``teacher_forcing_mask(balanced_roles(...))`` as dense rectangles: each chunk's clean and noisy
    queries with their key ranges, in ``balanced_roles``' token order."""
    local, n = frames // sp, chunk * tokens_per_frame
    per_rank, local_chunks = 2 * local * tokens_per_frame, local // chunk

    def start(c: int, noisy: bool) -> int:
        return c // local_chunks * per_rank + noisy * local * tokens_per_frame + c % local_chunks * n

    def merged(chunks: list[tuple[int, bool]]) -> tuple[tuple[int, int], ...]:
        ranges: list[list[int]] = []
        for a in sorted(start(c, noisy) for c, noisy in chunks):
            if ranges and ranges[-1][1] == a:
                ranges[-1][1] = a + n
            else:
                ranges.append([a, a + n])
        return tuple((a, b) for a, b in ranges)

    rows = [(start(c, False), merged([(j, False) for j in range(c + 1)])) for c in range(frames // chunk)]
    rows += [(start(c, True), merged([(j, False) for j in range(c)] + [(c, True)])) for c in range(frames // chunk)]
    return tuple((q0, q0 + n, ranges) for q0, ranges in sorted(rows))


@functools.lru_cache(maxsize=64)
def _self_mask(frames: int, chunk: int, tokens_per_frame: int, sp: int) -> MaskMod:
    return with_dense_rows(teacher_forcing_mask(balanced_roles(frames, chunk, tokens_per_frame, sp)),
                           teacher_forcing_rows(frames, chunk, tokens_per_frame, sp))


@dataclasses.dataclass(frozen=True)
class TeacherForcingLayout:
    frames: int  # F latent frames of the sample (a whole number of chunks)
    chunk: int
    tokens_per_frame: int
    text_tokens: int  # tokens of one caption
    sp: int = 1  # sequence-parallel ranks: each holds F/sp frames (a whole number of chunks), clean and noisy

    def __post_init__(self) -> None:
        if self.frames % (self.chunk * self.sp):
            raise ValueError(f"{self.frames} latent frames are not a whole number of {self.chunk}-frame chunks "
                             f"on each of {self.sp} sequence-parallel ranks")

    @property
    def chunks(self) -> int:
        return self.frames // self.chunk

    @property
    def local_frames(self) -> int:
        return self.frames // self.sp

    def frame_range(self, rank: int) -> tuple[int, int]:
        """The frames sequence-parallel rank ``rank`` holds (both copies of)."""
        return rank * self.local_frames, (rank + 1) * self.local_frames

    def sequence(self, clean: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """(B, C, 2f, H, W) from two (B, C, f, H, W) latents: the whole sample (f = F) or, under
        sequence parallelism, this rank's slice (f = F/sp); the same for the methods below."""
        return torch.cat([clean, noisy], dim=2)

    def noisy_part(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, :, out.shape[2] // 2:]

    def timesteps(self, chunk_timesteps: torch.Tensor) -> torch.Tensor:
        """(B, 2f): 0 for clean frames, chunk i's timestep for noisy chunk i's frames."""
        noisy = chunk_timesteps.repeat_interleave(self.chunk, dim=1)
        return torch.cat([torch.zeros_like(noisy), noisy], dim=1)

    def frame_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.cat([positions, positions])

    def self_mask(self) -> MaskMod:
        """One mask object per layout shape, so attention's block-mask cache serves every step of it."""
        return _self_mask(self.frames, self.chunk, self.tokens_per_frame, self.sp)

    def cross_mask(self, shot_of_frame: torch.Tensor, captions: int) -> MaskMod:
        """shot_of_frame (B, F): the caption each latent frame reads (of ``captions``); both copies of a
        frame read it. For one sample the boolean mask is made here (SDPA reads it: a compiled,
        checkpointed block traces that, where FlexAttention's block mask sends the block to eager)."""
        segment = torch.cat([shot_of_frame, shot_of_frame], dim=1)
        mask = per_frame_text_mask(segment, self.tokens_per_frame, self.text_tokens)
        if segment.shape[0] == 1:
            mask = with_dense_mask(mask, segment.shape[1] * self.tokens_per_frame, captions * self.text_tokens,
                                   segment.device)
        return mask

    def attended_pairs(self) -> int:
        """Unmasked (query, key) token pairs of the whole sample's self-attention, for FLOP counting."""
        c, n = self.chunks, self.tokens_per_frame * self.chunk
        clean = c * (c + 1) // 2  # clean chunk i sees i + 1 clean chunks
        noisy = c + c * (c - 1) // 2  # itself, and i clean chunks
        return (clean + noisy) * n * n
