"""One forward of the teacher-forcing sequence: what training, and distillation's scores, run."""
from __future__ import annotations

import torch

from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.data import TrainSample
from longlive_core.train.flow import FlowMatching
from longlive_core.train.layout import TeacherForcingLayout


def layout_of(model: WanDiT, sample: TrainSample, chunk: int, sp: int = 1) -> TeacherForcingLayout:
    """The teacher-forcing layout of ``sample``'s whole window for ``model`` (split over ``sp`` ranks)."""
    _, _, h, w = sample.latents.shape
    _, ph, pw = model.cfg.patch_size
    return TeacherForcingLayout(sample.window_frames, chunk, (h // ph) * (w // pw), sample.text.shape[1], sp)


def teacher_forcing_velocity(model: WanDiT, layout: TeacherForcingLayout, clean: torch.Tensor, noisy: torch.Tensor,
                             chunk_sigma: torch.Tensor, text: torch.Tensor, shot_of_frame: torch.Tensor,
                             positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The velocity (float32) predicted for every noisy frame of [clean; noisy]: clean and noisy
    (B, C, f, h, w) on the model's device; chunk_sigma (B, chunks) the noise level of each noisy
    chunk; text (S, T, D) the captions, frame f reading caption ``shot_of_frame[f]``; positions (f,)."""
    device = clean.device
    text_in = text.reshape(1, -1, text.shape[-1]).to(device, dtype)
    # one caption: every frame reads it, no mask needed (and none to build)
    cross = layout.cross_mask(shot_of_frame[None].to(device), text.shape[0]) if text.shape[0] > 1 else None
    out = model(layout.sequence(clean, noisy).to(dtype), layout.timesteps(FlowMatching.timestep(chunk_sigma)), text_in,
                frame_positions=layout.frame_positions(positions.to(device)), mask_mod=layout.self_mask(),
                cross_mask_mod=cross)
    return layout.noisy_part(out).float()
