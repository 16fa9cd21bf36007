"""Where the time of one emulated NVFP4 linear forward + backward goes, kernel by kernel (torch.profiler),
next to BF16 F.linear at the same shape. For reading, not for RESULTS ratios (bench/nvfp4_linear.py).

    PYTHONPATH=. python3 bench/tools/linear_profile.py [--in 3072 --out 3072 --tokens 16384]
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from longlive_core.quant import NVFP4Linear, NVFP4Recipe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--in", dest="k", type=int, default=3072)
    ap.add_argument("--out", dest="n", type=int, default=3072)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    base = nn.Linear(args.k, args.n, device="cuda")
    bf16 = nn.Linear(args.k, args.n, device="cuda", dtype=torch.bfloat16)
    layers = {"bf16": bf16, "nvfp4": NVFP4Linear.from_linear(base, NVFP4Recipe())}
    x = torch.randn(args.tokens, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(args.tokens, args.n, device="cuda", dtype=torch.bfloat16)
    def step(layer):
        x.grad = layer.weight.grad = layer.bias.grad = None  # as bench/nvfp4_linear.py: no accumulation
        layer(x).backward(gy)

    for name, layer in layers.items():
        for _ in range(5):
            step(layer)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step(layer)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events) / args.steps / 1000
        print(f"\n## {name}: {args.k} -> {args.n}, {args.tokens} tokens; GPU time per step {total:.3f} ms")
        print("| kernel | calls/step | ms/step |")
        print("|---|---|---|")
        for e in events[:14]:
            print(f"| {e.key[:90]} | {e.count / args.steps:.0f} | {e.self_device_time_total / args.steps / 1000:.3f} |")


if __name__ == "__main__":
    main()
