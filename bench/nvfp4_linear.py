"""Emulated NVFP4 linear forward + backward against BF16 F.linear, same run, on a CUDA GPU.

    python bench/nvfp4_linear.py [--tokens 16384 32768 65536] [--tile-from best.json]

Wan2.2-5B shapes: 3072->3072 (attention projections), 3072->14336 and 14336->3072 (FFN). Median
time of forward + backward (input, weight and bias gradients) for each, BF16 and NVFP4 timed in
alternation over several rounds (the ratio is the median of the per-round ratios); the goal is at
most 1.5x BF16. Each is timed eagerly (Python issuing every launch, as a plain training loop does)
and as a replayed CUDA graph of the whole step (device time, as torch.compile's "reduce-overhead"
or a graphed training step gives): at 16K tokens of 3072 the eager NVFP4 step is bound by the
host's launch rate, not by the GPU. The NVFP4 layer keeps float32 master weights (as in training;
its bias is cast to bfloat16 per call, as autocast does); the BF16 baseline is a bfloat16 layer.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing
from nvfp4_quant import load_tiles  # bench/, the script's own folder
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


def graphed(layer, x, gy):
    """A CUDA graph of one forward + backward (launch overhead gone: device time only). The
    stochastic-rounding seed is drawn on the device, so each replay rounds with fresh draws."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture wants
        for _ in range(3):
            fwd_bwd(layer, x, gy)()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = layer.weight.grad = layer.bias.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x).backward(gy)
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--tile-from")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.tile_from:
        load_tiles(args.tile_from)
    torch.manual_seed(0)
    tiles = f"{triton_kernels.TILE} {triton_kernels.SLICE_TILE}"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, tiles {tiles}")
    print(f"# {args.rounds} interleaved rounds; ratio = median of the per-round ratios, then their range")
    print("| in -> out | tokens | bf16 ms | nvfp4 ms | ratio | ratio range | nvfp4 fwd ms | bf16 fwd ms | "
          "graphed bf16 ms | graphed nvfp4 ms | graphed ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        base = nn.Linear(k, n, device="cuda")
        bf16 = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        bf16.load_state_dict(base.state_dict())
        fp4 = NVFP4Linear.from_linear(base, NVFP4Recipe())
        for t in args.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            gy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            times = {name: [] for name in ("bf16", "nvfp4", "bf16_fwd", "nvfp4_fwd", "bf16_graph", "nvfp4_graph")}
            graphs = {"bf16": graphed(bf16, x, gy), "nvfp4": graphed(fp4, x, gy)}
            for _ in range(args.rounds):  # A, B, A, B ...: clock and thermal drift hit both alike
                for name, layer in (("bf16", bf16), ("nvfp4", fp4)):
                    times[name].append(triton.testing.do_bench(fwd_bwd(layer, x, gy), warmup=10, rep=60,
                                                               return_mode="median"))
                    with torch.no_grad():
                        fwd = lambda layer=layer, x=x: layer(x)  # noqa: E731
                        times[name + "_fwd"].append(triton.testing.do_bench(fwd, warmup=10, rep=30,
                                                                            return_mode="median"))
                    times[name + "_graph"].append(triton.testing.do_bench(graphs[name].replay, warmup=10, rep=60,
                                                                          return_mode="median"))
            ratios = [a / b for a, b in zip(times["nvfp4"], times["bf16"])]
            graph_ratios = [a / b for a, b in zip(times["nvfp4_graph"], times["bf16_graph"])]
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"| {k} -> {n} | {t} | {med['bf16']:.2f} | {med['nvfp4']:.2f} | {statistics.median(ratios):.2f} | "
                  f"{min(ratios):.2f}-{max(ratios):.2f} | {med['nvfp4_fwd']:.2f} | {med['bf16_fwd']:.2f} | "
                  f"{med['bf16_graph']:.2f} | {med['nvfp4_graph']:.2f} | {statistics.median(graph_ratios):.2f} "
                  f"({min(graph_ratios):.2f}-{max(graph_ratios):.2f}) |")
            del x, gy, graphs
        del base, bf16, fp4
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
