"""Emulated NVFP4 linear forward + backward against BF16 F.linear, same run, on a CUDA GPU.

    python bench/nvfp4_linear.py [--tokens 16384 32768 65536] [--tile-from best.json]

Wan2.2-5B shapes: 3072->3072 (attention projections), 3072->14336 and 14336->3072 (FFN). Median
time of forward + backward (input, weight and bias gradients) for each, BF16 and NVFP4 timed in
alternation over several rounds (the ratio is the median of the per-round ratios); the goal is at
most 1.5x BF16. Weights are float32 masters (as in training); the BF16 baseline casts them per call the way
autocast would.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton.testing
from torch import nn

from longlive_core.quant import NVFP4Linear, NVFP4Recipe, triton_kernels

SHAPES = ((3072, 3072), (3072, 14336), (14336, 3072))


def fwd_bwd(layer, x, gy):
    def run():
        x.grad = None
        layer.weight.grad = None
        layer.bias.grad = None
        layer(x).backward(gy)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--tile-from")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.tile_from:
        with open(args.tile_from) as f:
            tiles = json.load(f)
        triton_kernels.TILE.update(tiles["TILE"])
        triton_kernels.SLICE_TILE.update(tiles["SLICE_TILE"])
    torch.manual_seed(0)
    tiles = f"{triton_kernels.TILE} {triton_kernels.SLICE_TILE}"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, tiles {tiles}")
    print(f"# {args.rounds} interleaved rounds; ratio = median of the per-round ratios, then their range")
    print("| in -> out | tokens | bf16 ms | nvfp4 ms | ratio | ratio range | nvfp4 fwd ms | bf16 fwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        base = nn.Linear(k, n, device="cuda")
        bf16 = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        bf16.load_state_dict(base.state_dict())
        fp4 = NVFP4Linear.from_linear(base, NVFP4Recipe())
        for t in args.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            gy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            times = {name: [] for name in ("bf16", "nvfp4", "bf16_fwd", "nvfp4_fwd")}
            for _ in range(args.rounds):  # A, B, A, B ...: clock and thermal drift hit both alike
                for name, layer in (("bf16", bf16), ("nvfp4", fp4)):
                    times[name].append(triton.testing.do_bench(fwd_bwd(layer, x, gy), warmup=10, rep=60,
                                                               return_mode="median"))
                    with torch.no_grad():
                        fwd = lambda layer=layer, x=x: layer(x)  # noqa: E731
                        times[name + "_fwd"].append(triton.testing.do_bench(fwd, warmup=10, rep=30,
                                                                            return_mode="median"))
            ratios = [a / b for a, b in zip(times["nvfp4"], times["bf16"])]
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"| {k} -> {n} | {t} | {med['bf16']:.2f} | {med['nvfp4']:.2f} | {statistics.median(ratios):.2f} | "
                  f"{min(ratios):.2f}-{max(ratios):.2f} | {med['nvfp4_fwd']:.2f} | {med['bf16_fwd']:.2f} |")
            del x, gy
        del base, bf16, fp4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
