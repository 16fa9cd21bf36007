"""Chunk-halo VAE encoding: error of the chunked latents against the full per-shot encode as a
function of the halo h, for P = 2, 3, 4 ranks (tiny Wan2.2 VAE, random weights, on this CPU).

    .venv/bin/python bench/vae_halo.py [--latents 45]
"""
from __future__ import annotations

import argparse
import time

import torch

from longlive_core.latents.halo import encode_chunked, plan_chunks, receptive_field_latents
from longlive_core.models.vae import build_vae, encode_video


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", type=int, default=45)
    n = ap.parse_args().latents
    torch.manual_seed(0)
    vae = build_vae("tiny")
    with torch.device("meta"):
        real = build_vae("wan2.2")
    print(f"derived halo (receptive field): tiny {receptive_field_latents(vae)}, "
          f"wan2.2 {receptive_field_latents(real)} latent frames")
    video = torch.rand(1, 3, 4 * (n - 1) + 1, 32, 32) * 2 - 1
    t = time.perf_counter()
    full = encode_video(vae, video)
    full_s = time.perf_counter() - t
    halos = (0, 2, 4, 8, 12, 16, 20, 24, 28)
    print(f"{n} latent frames; max |chunked - full| / max |full|; full encode {full_s:.2f} s")
    print("| ranks | " + " | ".join(f"h={h}" for h in halos) + " | largest chunk, latents encoded (h=28) |")
    print("|---|" + "---|" * (len(halos) + 1))
    for ranks in (2, 3, 4):
        errs = []
        for h in halos:
            z = encode_chunked(vae, video, ranks, h)
            errs.append(((z - full).abs().max() / full.abs().max()).item())
        biggest = max(c.encoded_latents for c in plan_chunks(n, ranks, 28))
        print(f"| {ranks} | " + " | ".join(f"{e:.1e}" for e in errs) + f" | {biggest} of {n} |")


if __name__ == "__main__":
    main()
