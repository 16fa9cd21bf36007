"""3-D rotary position embedding: a head's dimensions split into time, height and width parts, each
rotated by its own position (Wan's split: height and width get 2 * (head_dim // 6) each)."""
from __future__ import annotations

import torch


def _angles(dim: int, positions: torch.Tensor, theta: float) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    return torch.outer(positions.to(torch.float64), freqs)  # (n, dim/2)


def rope_cos_sin(dims: tuple[int, int, int], frame_positions: torch.Tensor, height: int, width: int,
                 theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (F * height * width, head_dim / 2) float32, tokens in (frame, row, column)
    order. ``frame_positions`` (F,) are the frames' time positions: consecutive for one clip, offset
    for a later chunk or a new shot."""
    t_dim, h_dim, w_dim = dims
    device = frame_positions.device
    f = _angles(t_dim, frame_positions, theta)
    h = _angles(h_dim, torch.arange(height, device=device), theta)
    w = _angles(w_dim, torch.arange(width, device=device), theta)
    n_f = f.shape[0]
    grid = torch.cat([f[:, None, None].expand(n_f, height, width, -1),
                      h[None, :, None].expand(n_f, height, width, -1),
                      w[None, None, :].expand(n_f, height, width, -1)], dim=-1).reshape(n_f * height * width, -1)
    return grid.cos().float(), grid.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates (x[2i], x[2i+1]) pairs of x (B, L, heads, head_dim) by the angles of (L, head_dim/2)."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)
