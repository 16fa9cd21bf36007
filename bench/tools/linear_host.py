"""Host-side cost of the emulated NVFP4 linear, step by step: whether a step waits for the GPU
(a sync), recompiles a Triton kernel, or is simply slow to issue. For reading, not for RESULTS.

    PYTHONPATH=. python3 bench/tools/linear_host.py [--in 3072 --out 3072 --tokens 16384]

Before each timed piece the GPU gets a long sleep kernel, so a piece that returns quickly did not
wait for it, and one that takes about the sleep synchronized. Triton's per-kernel compile caches
are counted before and after, so a kernel compiled again on later steps shows. Then 20 steps run
back to back (one synchronization at the end, as a training loop runs them), alternately with
Triton's own launches and with the library's CachedLaunch. Single calls' host costs:
bench/tools/launch_cost.py.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from longlive_core.quant import NVFP4Linear, NVFP4Recipe, triton_kernels, triton_launch
from longlive_core.quant.gemm import emulated_mm, operand_amaxes, quantize_partial

SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU clock


def compiled_counts() -> dict[str, int]:
    counts = {}
    for name in ("_quant_kernel", "_slice_kernel", "_block_kernel", "_absmax_kernel"):
        fn = getattr(triton_kernels, name)
        counts[name] = sum(len(cache[0]) for cache in getattr(fn, "device_caches", {}).values())
    return counts


def host_ms(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t0) * 1000
    torch.cuda.synchronize()
    return dt


def layer_step():
    """(layer, x, dY, step) for the shape on the command line (--in, --out, --tokens): an NVFP4
    linear on the GPU and one eager forward + backward of it, as the benches time it. The host
    tools share it (linear_host_split.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--in", dest="k", type=int, default=3072)
    ap.add_argument("--out", dest="n", type=int, default=3072)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    layer = NVFP4Linear.from_linear(nn.Linear(args.k, args.n, device="cuda"), NVFP4Recipe())
    x = torch.randn(args.tokens, args.k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(args.tokens, args.n, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None
        layer(x).backward(gy)
    return layer, x, gy, step


def main() -> None:
    layer, x, gy, step = layer_step()
    g2, x2 = gy, x.detach()

    for _ in range(3):
        step()
    before = compiled_counts()
    steps = [host_ms(step) for _ in range(12)]
    print(f"compiled kernels before/after 12 steps: {before} -> {compiled_counts()}")
    print("host ms per step (sleep ahead of each):", " ".join(f"{s:.2f}" for s in steps))
    ga, gta = operand_amaxes(g2.t())
    _, xta = operand_amaxes(x2.t())
    wp, wd = quantize_partial(layer.weight.detach(), (16, 16))
    gp, alpha_d = quantize_partial(g2, stochastic=True, amax=ga, times=wd)  # as the layer: alpha from the kernel
    gt, gtd = quantize_partial(g2.t(), rht=True, stochastic=True, amax=gta)
    xt, alpha_w = quantize_partial(x2.t(), rht=True, amax=xta, times=gtd)
    pieces = {
        "forward": lambda: layer(x),
        "amaxes of dY (slices)": lambda: operand_amaxes(g2.t()),
        "dY row-wise SR": lambda: quantize_partial(g2, stochastic=True, amax=ga, times=wd),
        "dY^T RHT SR": lambda: quantize_partial(g2.t(), rht=True, stochastic=True, amax=gta),
        "x^T RHT": lambda: quantize_partial(x2.t(), rht=True, amax=xta, times=gtd),
        "dgrad GEMM": lambda: emulated_mm(gp, alpha_d, wp, None, out_dtype=torch.bfloat16),
        "wgrad GEMM": lambda: emulated_mm(gt, alpha_w, xt.t(), None, out_dtype=torch.float32),
        "bias grad": lambda: g2.sum(0, dtype=torch.float32),
        "forward + backward": lambda: layer(x).backward(gy),
    }
    torch.cuda.set_sync_debug_mode("warn")
    for name, fn in pieces.items():
        times = [host_ms(fn) for _ in range(3)]
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in times) + " |")
    torch.cuda.set_sync_debug_mode(0)
    for enabled in (False, True, False, True):  # side by side: Triton's own launch, then the cached one
        triton_launch.ENABLED = enabled
        print("CachedLaunch" if enabled else "Triton's fn[grid]", end=": ")
        back_to_back(step)


def back_to_back(step, steps: int = 20) -> None:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"{steps} steps back to back: {1000 * (issued - t0) / steps:.2f} ms per step to issue, "
          f"{1000 * (done - t0) / steps:.2f} ms per step in all")


if __name__ == "__main__":
    main()
