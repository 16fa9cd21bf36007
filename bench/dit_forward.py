"""WanDiT forward time per latent frame at the real dimensions, against REFERENCE.md §7's floor.

    python bench/dit_forward.py [--frames 8] [--tiny --device cpu]

One chunk of 8 latent frames at 704x1280 (44x80 latents -> 880 tokens per frame, 7,040 tokens),
512 text tokens, full attention over the chunk, bf16, random weights, median of 10 forwards.
The floor (measured on the H200 in plain PyTorch, one Wan2.2-5B-sized block with 8 frames of
keys): 4.6 ms per block, so 30 blocks = 138 ms per 8-frame forward (17 ms per latent frame); it
is printed for --frames 8 only, since attention cost grows with the square of the frames.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from longlive_core.models.config import dit_config
from longlive_core.models.wan_dit import WanDiT

FLOOR_MS_PER_BLOCK = 4.6  # REFERENCE.md §7, 8 frames of keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = dit_config("tiny" if args.tiny else "wan2.2-ti2v-5b")
    h, w = (44, 80) if not args.tiny else (8, 16)
    torch.manual_seed(0)
    with torch.device(device):
        model = WanDiT(cfg).to(dtype).eval()
    latents = torch.randn(1, cfg.in_channels, args.frames, h, w, device=device, dtype=dtype)
    text = torch.randn(1, 512 if not args.tiny else 16, cfg.text_dim, device=device, dtype=dtype)
    t = torch.full((1, args.frames), 500.0, device=device)
    times = []
    with torch.no_grad():
        for i in range(args.repeats + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(latents, t, text)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:  # warm-up: FlexAttention compiles on the first call
                times.append((time.perf_counter() - start) * 1000)
    ms = statistics.median(times)
    tokens = args.frames * (h // 2) * (w // 2)
    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{'tiny' if args.tiny else 'wan2.2-ti2v-5b'}, {args.frames} latent frames, {tokens} tokens, {dtype}")
    print(f"forward {ms:.1f} ms (median of {len(times)}), {ms / args.frames:.2f} ms per latent frame")
    if args.frames == 8 and not args.tiny:  # §7's floor was measured for this chunk only
        floor = FLOOR_MS_PER_BLOCK * cfg.num_layers
        print(f"floor {floor:.0f} ms -> {ms / floor:.2f}x the plain-PyTorch block floor")


if __name__ == "__main__":
    main()
