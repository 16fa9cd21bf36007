"""The Wan2.2-TI2V-5B diffusion transformer, with a timestep per latent frame.

Module names follow the original Wan checkpoints (``self_attn.q``, ``norm3`` = the cross-attention
norm, ``head.modulation`` ...), so those load as they are; ``checkpoint.py`` renames the Diffusers
layout. One timestep per latent frame lets clean (t = 0) and noisy frames share a sequence, as
teacher forcing needs. What is not here, on purpose: attention masks and sequence parallelism (the
``attention_fn`` and ``mask_mod`` a caller passes), quantization (``longlive_core.quant`` converts
the linear layers from outside), checkpointing and sharding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from longlive_core.models.attention import MaskMod, attend
from longlive_core.models.config import DiTConfig
from longlive_core.models.rope import apply_rope, rope_cos_sin

# Kept in high precision when the linear layers are quantized (the paper's choice): embeddings,
# the timestep projection and the output head. Globs for quant.convert_linears(skip=...).
HIGH_PRECISION_MODULES = ("patch_embedding", "text_embedding.*", "time_embedding.*", "time_projection.*", "head.*")


def timestep_sinusoids(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(..., dim) float32: [cos, sin] of t times 10000^(-i / (dim/2)), i < dim/2."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[..., None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, F, S, dim) float32 with per-frame shift/scale (B, F, dim)."""
    return x * (1 + scale[:, :, None]) + shift[:, :, None]


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm in float32 whatever the dtype of its input and parameters (a bf16 model keeps
    float32 normalisation, as Wan does); returns float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, rope=None,
                mask_mod: MaskMod | None = None, attention_fn=attend) -> torch.Tensor:
        src = x if context is None else context
        b = x.shape[0]
        q = self.norm_q(self.q(x)).view(b, x.shape[1], self.num_heads, -1)
        k = self.norm_k(self.k(src)).view(b, src.shape[1], self.num_heads, -1)
        v = self.v(src).view(b, src.shape[1], self.num_heads, -1)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask_mod)
        return self.o(out.transpose(1, 2).flatten(2).type_as(x))


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        d = cfg.dim
        self.norm1 = FP32LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.self_attn = Attention(d, cfg.num_heads, cfg.eps)
        self.norm3 = FP32LayerNorm(d, eps=cfg.eps)  # before cross-attention (Wan's naming)
        self.cross_attn = Attention(d, cfg.num_heads, cfg.eps)
        self.norm2 = FP32LayerNorm(d, eps=cfg.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(self, x, context, t_mod, frames: int, rope, mask_mod, attention_fn, cross_mask_mod=None):
        """x (B, L, dim); t_mod (B, F or 1, 6, dim) float32 per-frame modulation. Only self-attention
        goes through ``attention_fn`` (sequence parallelism swaps it); cross-attention reads the
        text, which every rank holds whole, locally."""
        b, n, d = x.shape
        shift, scale, gate, c_shift, c_scale, c_gate = (self.modulation[:, None] + t_mod).unbind(2)

        def per_frame(h):
            return h.float().view(b, frames, n // frames, d)

        h = modulate(per_frame(self.norm1(x)), shift, scale).view(b, n, d).type_as(x)
        h = self.self_attn(h, rope=rope, mask_mod=mask_mod, attention_fn=attention_fn)
        x = (per_frame(x) + per_frame(h) * gate[:, :, None]).view(b, n, d).type_as(x)
        x = x + self.cross_attn(self.norm3(x).type_as(x), context, mask_mod=cross_mask_mod)
        h = modulate(per_frame(self.norm2(x)), c_shift, c_scale).view(b, n, d).type_as(x)
        h = self.ffn(h)
        return (per_frame(x) + per_frame(h) * c_gate[:, :, None]).view(b, n, d).type_as(x)


class Head(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm = FP32LayerNorm(cfg.dim, eps=cfg.eps, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, frames: int) -> torch.Tensor:
        b, n, d = x.shape
        shift, scale = (self.modulation[:, None] + t_emb[:, :, None]).unbind(2)
        h = modulate(self.norm(x).view(b, frames, n // frames, d), shift, scale)
        return self.head(h.view(b, n, d).type_as(x))


class WanDiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.attention_fn = attend  # sequence parallelism swaps this for an all-to-all wrapper

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                frame_positions: torch.Tensor | None = None, mask_mod: MaskMod | None = None,
                cross_mask_mod: MaskMod | None = None) -> torch.Tensor:
        """latents (B, C, F, H, W); timesteps (B,) or one per latent frame (B, F); text (B, T, text_dim);
        frame_positions (F,) for RoPE (default 0..F-1); mask_mod over the token sequence (frame-major);
        cross_mask_mod over (video token, text token) pairs: per-shot captions are several texts
        concatenated along T, each frame reading its own (``longlive_core.train.layout``)."""
        cfg = self.cfg
        b, _, f, hgt, wid = latents.shape
        pt, ph, pw = cfg.patch_size
        fp, hp, wp = f // pt, hgt // ph, wid // pw
        if timesteps.dim() == 1:
            timesteps = timesteps[:, None]  # one timestep for every frame
        if timesteps.shape not in ((b, 1), (b, fp)):
            raise ValueError(f"timesteps must be (B,) or (B, F) = ({b}, {fp}); got {tuple(timesteps.shape)}")
        if frame_positions is not None and frame_positions.shape != (fp,):
            raise ValueError(f"frame_positions must be ({fp},), one per latent frame; "
                             f"got {tuple(frame_positions.shape)}")
        positions = torch.arange(fp, device=latents.device) if frame_positions is None else frame_positions
        rope = rope_cos_sin(cfg.rope_dims, positions, hp, wp, cfg.rope_theta)

        x = self.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()  # (B, L, dim), frame-major
        t_emb = self.time_embedding(timestep_sinusoids(timesteps, cfg.freq_dim).to(self.time_embedding[0].weight.dtype))
        t_mod = self.time_projection(t_emb).float().unflatten(-1, (6, cfg.dim))  # (B, F|1, 6, dim)
        t_emb = t_emb.float()
        frames = t_mod.shape[1]
        context = self.text_embedding(text)
        # an attention_fn with a per-block form (the inference KV cache) gives each block its own
        per_layer = getattr(self.attention_fn, "for_layer", None)
        for i, block in enumerate(self.blocks):
            fn = per_layer(i) if per_layer is not None else self.attention_fn
            x = block(x, context, t_mod, frames, rope, mask_mod, fn, cross_mask_mod)
        out = self.head(x, t_emb, frames)  # (B, L, pt*ph*pw*C)
        out = out.view(b, fp, hp, wp, pt, ph, pw, cfg.out_channels).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.reshape(b, cfg.out_channels, fp * pt, hp * ph, wp * pw)
