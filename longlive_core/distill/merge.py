"""The W4A4 merge: the generator's LoRA merged into the AR weights in float32, then every eligible
linear layer quantized to packed NVFP4 (no high-precision copy kept), and the fixed inputs on which
the result is compared with the BF16 merged model."""
from __future__ import annotations

from pathlib import Path

import torch

from longlive_core.config import ConfigError
from longlive_core.distill.lora import merge_adapter
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.folder import DiTFolder
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.data import LatentSamples, generator_for


def merged_model(ar_dir: Path, ar_config: DiTFolder, dmd_dir: Path) -> WanDiT:
    """The AR weights with the generator's adapter merged in, in float32."""
    base = load_dit(ar_dir, ar_config.dit_config, dtype=torch.float32)
    return merge_adapter(base, dmd_dir).eval()


ChunkInput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (latents (1, C, F_c, h, w), timestep (1,), text)


def chunk_inputs(latents: Path, chunk: int, shot_offset: int, steps: list[int], count: int, seed: int, purpose: str
                 ) -> list[ChunkInput]:
    """``count`` inputs of the kind generation feeds the model: a chunk of a val (else train) sample's
    latents noised to one of the sampling steps, with its caption; keyed by (seed, purpose, i)."""
    data = LatentSamples(latents, "val", chunk, shot_offset)
    if not len(data):
        data = LatentSamples(latents, "train", chunk, shot_offset)
    if not len(data):
        raise ConfigError(f"no sample in {latents} has a whole {chunk}-frame chunk to calibrate and compare on")
    out = []
    for i in range(count):
        sample = data.load(data.sample_ids[i % len(data)], chunk, None)
        g = generator_for(seed, purpose, i)
        t = float(steps[i % (len(steps) - 1)])  # the steps before the final 0
        x0 = sample.latents[None]
        x_t = (1 - t / 1000) * x0 + (t / 1000) * torch.randn(x0.shape, generator=g)
        out.append((x_t, torch.tensor([t]), sample.text[:1]))
    return out


@torch.no_grad()
def outputs(model: WanDiT, inputs: list[ChunkInput], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The model's predictions for ``inputs``, flattened and concatenated (float32, on the CPU)."""
    ys = [model(x.to(device, dtype), t.to(device), text.to(device, dtype)).float().cpu().flatten()
          for x, t, text in inputs]
    return torch.cat(ys)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y - reference).norm() / reference.norm().clamp_min(1e-30))
