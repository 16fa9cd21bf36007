"""The Wan2.2 VAE (stride 4 x 16 x 16, 48 latent channels) through Diffusers' ``AutoencoderKLWan``.

``load_vae(path)`` reads a local Diffusers ``vae/`` folder (config.json + safetensors, nothing
fetched); ``build_vae(name)`` makes the architecture with random weights: ``wan2.2`` (the real
dimensions, for benchmarks) or ``tiny`` (the demo's). ``encode_video`` turns 8-bit RGB frames into
normalised latents, (z - latents_mean) / latents_std, as the DiT is trained on.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from longlive_core.models.weights import require_pretrained_dir

_WAN22 = dict(z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
              scale_factor_temporal=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True],
              latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
VAE_CONFIGS = {
    # Wan2.2's VAE: 160 channels at the top of the encoder, 256 in the decoder. Real weights come with their
    # own config.json (and the real latents_mean/std); this is the architecture for random-weight runs.
    "wan2.2": {**_WAN22, "base_dim": 160, "decoder_base_dim": 256},
    "tiny": {**_WAN22, "base_dim": 16},
}
TEMPORAL_STRIDE = 4
SPATIAL_STRIDE = 16


def build_vae(name: str):
    from diffusers import AutoencoderKLWan

    if name not in VAE_CONFIGS:
        raise ValueError(f"unknown VAE config {name!r}; known: {', '.join(VAE_CONFIGS)}")
    return AutoencoderKLWan(**VAE_CONFIGS[name]).eval()


def vae_architecture(path: str):
    """The VAE's modules without weights (on the meta device): what its shape says, e.g. the
    encoder's receptive field, without reading gigabytes. ``tiny`` or a local Diffusers folder."""
    from diffusers import AutoencoderKLWan

    config = VAE_CONFIGS["tiny"] if path == "tiny" else AutoencoderKLWan.load_config(Path(path))
    with torch.device("meta"):
        return AutoencoderKLWan.from_config(config)


def check_vae_dir(path: str | Path) -> None:
    """Raises CheckpointError, saying what to put there, unless ``path`` holds a VAE to load."""
    require_pretrained_dir(Path(path), "VAE", "put the Wan2.2 VAE there in the Diffusers layout (config.json and "
                           "diffusion_pytorch_model.safetensors, the vae/ folder of Wan-AI/Wan2.2-TI2V-5B-Diffusers)")


def load_vae(path: str | Path):
    from diffusers import AutoencoderKLWan

    check_vae_dir(path)
    return AutoencoderKLWan.from_pretrained(Path(path), use_safetensors=True, local_files_only=True).eval()


def vae_from(path: str, device: torch.device | str = "cpu"):
    """``tiny`` (random weights, the same on every rank and every run) or a local Diffusers folder."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = build_vae("tiny") if path == "tiny" else load_vae(path)
    return vae.to(device)


def frames_to_input(frames: np.ndarray, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (1, 3, T, H, W) in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).to(device=device)
    return (x.permute(3, 0, 1, 2)[None].to(dtype) / 127.5 - 1.0)


@torch.no_grad()
def encode_video(vae, video: torch.Tensor) -> torch.Tensor:
    """(1, 3, T, H, W) in [-1, 1], T = 1 + 4k -> normalised latents (z_dim, 1 + k, H / 16, W / 16)."""
    if (video.shape[2] - 1) % TEMPORAL_STRIDE:
        raise ValueError(f"{video.shape[2]} frames: the VAE takes 1 + {TEMPORAL_STRIDE}k")
    z = vae.encode(video).latent_dist.mode()[0]
    mean = torch.tensor(vae.config.latents_mean, dtype=z.dtype, device=z.device)[:, None, None, None]
    std = torch.tensor(vae.config.latents_std, dtype=z.dtype, device=z.device)[:, None, None, None]
    return (z - mean) / std
