"""Wan2.2 VAE encode speed and the Balanced-SP per-rank law, on one GPU (or --tiny on the CPU).

    python bench/vae_sp_encode.py [--latents 97] [--height 704 --width 1280] [--tiny --device cpu]

1. Frames/s of the full encode of one clip (random weights, the real wan2.2 architecture, bf16).
2. Per-rank encode time for P = 1, 2, 4 with the default halo: each rank's chunk + halo encoded
   alone, as its rank would (simulated one after another on one device); the slowest rank against
   the full encode shows O(F/P + h) against O(F).
The H200 image has no diffusers: carry its wheel (`.whl/`) and `pip install --no-deps` it first.
"""
from __future__ import annotations

import argparse
import time

import torch

from longlive_core.latents.halo import plan_chunks, receptive_field_latents
from longlive_core.models.vae import build_vae, encode_video


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", type=int, default=97)
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    vae = build_vae("tiny" if args.tiny else "wan2.2").to(device=device, dtype=dtype)
    halo = receptive_field_latents(vae)
    frames = 1 + 4 * (args.latents - 1)
    video = (torch.rand(1, 3, frames, args.height, args.width, device=device) * 2 - 1).to(dtype)
    encode_video(vae, video[:, :, :9])  # warm-up (cuDNN autotuning, allocations)
    full_s = timed(lambda: encode_video(vae, video), device)
    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{'tiny' if args.tiny else 'wan2.2'} VAE, {frames} frames {args.height}x{args.width}, {dtype}")
    print(f"full encode: {full_s:.2f} s, {frames / full_s:.1f} frames/s; halo {halo} latent frames")
    print("| ranks | slowest rank s | latents it encodes | kept per rank | slowest / full |")
    print("|---|---|---|---|---|")
    for ranks in (1, 2, 4):
        times, sizes = [], []
        for c in plan_chunks(args.latents, ranks, halo):
            times.append(timed(lambda c=c: encode_video(vae, video[:, :, c.raw_start:c.raw_end]), device))
            sizes.append(c.encoded_latents)
        slowest = max(range(ranks), key=lambda r: times[r])
        print(f"| {ranks} | {times[slowest]:.2f} | {sizes[slowest]} | {args.latents / ranks:.1f} | "
              f"{times[slowest] / full_s:.2f} |")


if __name__ == "__main__":
    main()
