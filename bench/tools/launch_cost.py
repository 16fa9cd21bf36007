"""Host cost of one Triton launch of the block kernel, layer by layer: the library's quantize call,
Triton's own ``fn[grid](...)`` (binder, cache key, launch metadata, hooks, launcher), the
library's CachedLaunch of the same kernel, the CompiledKernel's launcher called directly, and torch
calls for scale. For reading; RESULTS quotes what it prints.

    PYTHONPATH=. python3 bench/tools/launch_cost.py [--profile]

The tensor is small (256 x 3072) so the GPU finishes each kernel before the host issues the next:
what is timed is the host. --profile adds cProfile's top functions of the quantize call and of an
emulated NVFP4 linear step at 3072 -> 3072, 16K tokens.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch import nn

from longlive_core.quant import NVFP4Linear, NVFP4Recipe
from longlive_core.quant import triton_kernels as tk

CALLS = 2000


def us_per_call(fn, calls: int = CALLS) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    x = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)
    m, k = x.shape
    amax = tk.global_amax(x, False)
    codes = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, k // 16), dtype=torch.uint8, device=x.device)
    tile = tk._block_tile("codes", k)
    grid = (tk._cdiv(m, tile["BM"]), tk._cdiv(k // tk.BLOCK, tile["G"]), 1)
    kernel_args = (x, x.stride(0), m, k, amax, codes.view(torch.int64), scales, amax, amax)
    constexprs = dict(SCALE6=448.0 * 6, BM=tile["BM"], G=tile["G"], RHT=False, IS_BF16=True, AMAX_ONLY=False,
                      TILE2D=False)
    options = dict(num_warps=tile["num_warps"], enable_fp_fusion=False)

    def jit_launch():
        tk._block_kernel[grid](*kernel_args, **constexprs, **options)

    _, (compiled, trailing) = tk._block_launcher.kernel_for(kernel_args, {**constexprs, **options})
    all_args = (*kernel_args, *trailing)  # every parameter in order, as Triton passes them
    runner = compiled[grid]

    def compiled_launch():
        runner(*all_args)

    def cached_launch():
        tk._block_launcher[grid](*kernel_args, **constexprs, **options)

    stream = torch.cuda.current_stream().cuda_stream
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata

    def raw_launch():
        run(grid[0], grid[1], 1, stream, function, packed, None, None, None, *all_args)

    rows = {
        "torch.empty": lambda: torch.empty(16, device="cuda"),
        "torch add": lambda: amax + 1,
        "torch.zeros(2, int32)": lambda: torch.zeros(2, dtype=torch.int32, device="cuda"),
        "torch.empty(2, int32).zero_()": lambda: torch.empty(2, dtype=torch.int32, device="cuda").zero_(),
        "stochastic-rounding seed": lambda: tk._device_seed(None, x.device),
        "quantize(x, amax=amax)": lambda: tk.quantize(x, amax=amax),
        "fn[grid](...)": jit_launch,
        "CachedLaunch[grid](...)": cached_launch,
        "CompiledKernel[grid](*args)": compiled_launch,
        "CompiledKernel.run(...) raw": raw_launch,
        "global_amax(x)": lambda: tk.global_amax(x, False),
        "amaxes(x)": lambda: tk.amaxes(x),
    }
    rows.update(gemm_rows())
    for name, fn in rows.items():
        print(f"{name:32s} {us_per_call(fn):8.1f} us/call")
    if args.profile:
        profile("quantize(x, amax=amax), 500 calls", lambda: tk.quantize(x, amax=amax), 500)
        layer = NVFP4Linear.from_linear(nn.Linear(3072, 3072, device="cuda"), NVFP4Recipe())
        xs = torch.randn(16384, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(16384, 3072, device="cuda", dtype=torch.bfloat16)

        def step():
            xs.grad = layer.weight.grad = layer.bias.grad = None
            layer(xs).backward(gy)
        for _ in range(3):
            step()
        profile("NVFP4 linear step 3072 -> 3072, 16K tokens, 50 steps", step, 50)


def gemm_rows() -> dict:
    """The device-alpha GEMM's host cost against torch.mm's, and its pieces (small shapes: host-bound)."""
    import ctypes

    from longlive_core.quant import cublas
    from longlive_core.quant.gemm import emulated_mm
    a = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3072, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda")
    bias16 = bias.bfloat16()
    alpha = torch.ones((), device="cuda")
    out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    cublas.scaled_mm_unchecked(a, b, alpha, torch.bfloat16)  # makes (or refreshes) the plan: the most recent one
    plan = next(reversed(cublas._plans().values()))
    lib, handle = cublas._library(), cublas._handle(a.device)
    beta = cublas._constant(a.device, 0.0)
    stream = torch.cuda.current_stream().cuda_stream
    workspace = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device="cuda")

    def matmul():  # the bare cuBLASLt call on a cached plan
        lib.cublasLtMatmul(handle, plan.desc, alpha.data_ptr(), b.data_ptr(), plan.layout_b, a.data_ptr(),
                           plan.layout_a, beta.data_ptr(), out.data_ptr(), plan.layout_out, out.data_ptr(),
                           plan.layout_out, ctypes.byref(plan.algo), workspace.data_ptr(), plan.workspace, stream)
    return {
        "cublasLtMatmul alone (ctypes)": matmul,
        "torch.mm bf16": lambda: torch.mm(a, b),
        "F.linear bf16 + bias": lambda: torch.nn.functional.linear(a, b.t(), bias16),
        "cublas.scaled_mm": lambda: cublas.scaled_mm(a, b, alpha, torch.bfloat16),
        "cublas.scaled_mm_unchecked": lambda: cublas.scaled_mm_unchecked(a, b, alpha, torch.bfloat16),
        "cublas.scaled_mm_unchecked + bias": lambda: cublas.scaled_mm_unchecked(a, b, alpha, torch.bfloat16, bias16),
        "emulated_mm with bias": lambda: emulated_mm(a, alpha, b, alpha, bias, torch.bfloat16),
        "  current_stream().cuda_stream": lambda: torch.cuda.current_stream(a.device).cuda_stream,
        "  _cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(a.device.index),
        "  cublas.supported": lambda: cublas.supported(a, b, torch.bfloat16),
    }


def profile(title: str, fn, calls: int) -> None:
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"--- {title}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
