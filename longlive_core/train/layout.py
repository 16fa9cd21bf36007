"""The teacher-forcing sequence: where every token sits, which tokens it may attend to, which
caption each frame reads. The one place that defines the layout, the mask and the per-frame inputs;
sequence parallelism gives a different token order through ``roles`` and keeps the rest.

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

from longlive_core.models.attention import MaskMod

# token index -> (chunk index within the sample, is-noisy), as tensors; the order of tokens in the sequence
Roles = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def clean_then_noisy(frames: int, chunk: int, tokens_per_frame: int) -> Roles:
    """The single-rank order: every clean frame, then every noisy frame."""
    def roles(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frame = idx // tokens_per_frame
        noisy = frame >= frames
        return (frame - noisy.long() * frames) // chunk, noisy

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


@functools.lru_cache(maxsize=64)
def _self_mask(frames: int, chunk: int, tokens_per_frame: int) -> MaskMod:
    return teacher_forcing_mask(clean_then_noisy(frames, chunk, tokens_per_frame))


@dataclasses.dataclass(frozen=True)
class TeacherForcingLayout:
    frames: int  # F latent frames of the sample (a whole number of chunks)
    chunk: int
    tokens_per_frame: int
    text_tokens: int  # tokens of one caption

    def __post_init__(self) -> None:
        if self.frames % self.chunk:
            raise ValueError(f"{self.frames} latent frames are not a whole number of {self.chunk}-frame chunks")

    @property
    def chunks(self) -> int:
        return self.frames // self.chunk

    def sequence(self, clean: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
        """(B, C, 2F, H, W) from two (B, C, F, H, W) latents."""
        return torch.cat([clean, noisy], dim=2)

    def noisy_part(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, :, self.frames:]

    def timesteps(self, chunk_timesteps: torch.Tensor) -> torch.Tensor:
        """(B, 2F): 0 for clean frames, chunk i's timestep for noisy chunk i's frames."""
        noisy = chunk_timesteps.repeat_interleave(self.chunk, dim=1)
        return torch.cat([torch.zeros_like(noisy), noisy], dim=1)

    def frame_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.cat([positions, positions])

    def self_mask(self) -> MaskMod:
        """One mask object per layout shape, so attention's block-mask cache serves every step of it."""
        return _self_mask(self.frames, self.chunk, self.tokens_per_frame)

    def cross_mask(self, shot_of_frame: torch.Tensor) -> MaskMod:
        """shot_of_frame (B, F): the caption each latent frame reads; both copies of a frame read it."""
        return per_frame_text_mask(torch.cat([shot_of_frame, shot_of_frame], dim=1), self.tokens_per_frame,
                                   self.text_tokens)

    def attended_pairs(self) -> int:
        """Unmasked (query, key) token pairs of the self-attention, for FLOP counting."""
        c, n = self.chunks, self.tokens_per_frame * self.chunk
        clean = c * (c + 1) // 2  # clean chunk i sees i + 1 clean chunks
        noisy = c + c * (c - 1) // 2  # itself, and i clean chunks
        return (clean + noisy) * n * n
