"""Distribution matching distillation: the generator's samples are pulled toward the real score's
distribution and away from the fake score's, which a critic keeps fitting to the generator.

For a generated latent x (no gradient into the scores), draw a timestep t, noise x to x_t and ask
both scores for x0. The real score is the frozen AR model with classifier-free guidance against the
empty prompt: real = cond + g (cond - uncond) (g = 3 in production; the public code's convention,
in which g = 0 is the conditional prediction alone); the fake score runs unguided. The DMD gradient
is fake - real, divided per chunk of latent frames by mean |x - real| over that chunk (so every
chunk moves by a comparable step whatever its error); the generator's loss is
0.5 * MSE(x, stop_grad(x - grad)), whose gradient in x is grad / numel. Timesteps are uniform in
[0, 1000), put through the schedule's shift and clamped to [20, 980]. The critic learns the flow
loss on detached generator samples; the generator steps once every ``generator_every`` critic
steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dmd_timesteps(u: torch.Tensor, shift: float = 5.0, low: float = 20.0, high: float = 980.0) -> torch.Tensor:
    """u uniform in [0, 1) -> timesteps (sigma x 1000) on the shifted schedule, clamped to [low, high]."""
    s = u.double()
    sigma = shift * s / (1 + (shift - 1) * s)
    return (sigma * 1000).clamp(low, high).float()


def guided(cond: torch.Tensor, uncond: torch.Tensor, guidance: float) -> torch.Tensor:
    """Classifier-free guidance of two x0 predictions: cond + g (cond - uncond) (g = 0: cond alone)."""
    return cond + guidance * (cond - uncond)


def dmd_gradient(x: torch.Tensor, fake_x0: torch.Tensor, real_x0: torch.Tensor, chunk_frames: int) -> torch.Tensor:
    """(fake - real) / mean |x - real|, the mean taken per sample and chunk of ``chunk_frames`` latent
    frames; x (B, C, F, h, w), F a whole number of chunks. Computed in float64, no gradient."""
    b, c, f, h, w = x.shape
    if f % chunk_frames:
        raise ValueError(f"{f} latent frames are not a whole number of {chunk_frames}-frame chunks")
    with torch.no_grad():
        x, fake_x0, real_x0 = x.double(), fake_x0.double(), real_x0.double()
        per_chunk = (x - real_x0).abs().view(b, c, f // chunk_frames, chunk_frames, h, w)
        normalizer = per_chunk.mean(dim=(1, 3, 4, 5), keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
        grad = (fake_x0 - real_x0).view_as(per_chunk) / normalizer
        return torch.nan_to_num(grad.view(b, c, f, h, w))


def generator_loss(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """0.5 * MSE(x, stop_grad(x - grad)): its gradient in x is grad / x.numel()."""
    return 0.5 * F.mse_loss(x.double(), (x.double() - grad).detach())


def critic_loss(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The fake score's flow-matching loss on a generated (detached) sample."""
    return F.mse_loss(velocity.float(), (noise - x0.detach()).float())


def is_generator_step(step: int, generator_every: int) -> bool:
    """The generator updates after every ``generator_every``-th critic step (steps counted from 0)."""
    return (step + 1) % generator_every == 0
