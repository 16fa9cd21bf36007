"""Experiment (session 8): the block kernel's RHT codes as a persistent loop whose loads Triton
pipelines through shared memory (cp.async, num_stages), against the launched-per-tile kernel.
Checks bits against the library kernel, then times CUDA graphs of each.

    PYTHONPATH=. python3 bench/tools/block_loop_exp.py
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nvfp4_quant import graph_ms  # noqa: E402

from longlive_core.quant import triton_kernels as tk  # noqa: E402


@triton.jit
def loop_kernel(x_ptr, sxm, M, K, amax_ptr, codes_ptr, scales_ptr, SCALE6: tl.constexpr, BM: tl.constexpr,
                G: tl.constexpr, RHT: tl.constexpr, STAGES: tl.constexpr):
    n_g = tl.cdiv(K // 16, G)
    s_enc = tk._encode_scale(amax_ptr, SCALE6)
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * n_g, tl.num_programs(0), num_stages=STAGES):
        rm = (t // n_g).to(tl.int64) * BM + tl.arange(0, BM)
        rg = (t % n_g).to(tl.int64) * G + tl.arange(0, G)
        mask = (rm[:, None] < M) & (rg[None, :] < K // 16)
        base = x_ptr + rm[:, None, None] * sxm + rg[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
        lo = tk._f32_pairs(tl.load(base, mask=mask[:, :, None], other=0.0))
        hi = tk._f32_pairs(tl.load(base + 8, mask=mask[:, :, None], other=0.0))
        x0, x1, x2, x3, x4, x5, x6, x7 = tk._split8(lo, BM, G)
        x8, x9, x10, x11, x12, x13, x14, x15 = tk._split8(hi, BM, G)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, bamax = tk._transform_and_amax(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, amax_ptr, amax_ptr, RHT,
            True, False, False)
        s_dec, enc = tk._block_scales(bamax, s_enc)
        words = codes_ptr + rm[:, None] * (K // 8) + rg[None, :] * 2
        tl.store(words, tk._word(x0, x1, x2, x3, x4, x5, x6, x7, enc), mask=mask)
        tl.store(words + 1, tk._word(x8, x9, x10, x11, x12, x13, x14, x15, enc), mask=mask)
        sbits = s_dec.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(scales_ptr + rm[:, None] * (K // 16) + rg[None, :], sbits, mask=mask)


def main() -> None:
    n = 8192
    torch.manual_seed(0)
    xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = 2 * n * n + n * n // 2 + n * n // 16
    codes = torch.empty((n, n // 2), dtype=torch.uint8, device="cuda")
    scales = torch.empty((n, n // 16), dtype=torch.uint8, device="cuda")
    print("| rht | variant | BM | G | warps | stages | programs/SM | graph ms | of 4.19 TB/s | bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rht in (True, False):
        amax = tk.global_amax(xs[0], rht)
        ref = tk.quantize(xs[0], rht=rht, amax=amax)
        t = graph_ms(lambda x, rht=rht, amax=amax: tk.quantize(x, rht=rht, amax=amax), xs)
        print(f"| {rht} | library | - | - | - | - | - | {t:.4f} | {nbytes / t / 1e9 / 4.19:.1%} | ref |")
        configs = [(1, 512, 8), (1, 256, 4), (1, 512, 4), (2, 256, 8)] if rht else [(1, 512, 4), (1, 512, 8)]
        for (bm, g, w), stages, per_sm in itertools.product(configs, (2, 3, 4), (1, 2, 4)):
            grid = (sms * per_sm,)

            def run(x, bm=bm, g=g, w=w, stages=stages, grid=grid, rht=rht, amax=amax):
                loop_kernel[grid](x, x.stride(0), n, n, amax, codes.view(torch.int32), scales, SCALE6=2688.0,
                                  BM=bm, G=g, RHT=rht, STAGES=stages, num_warps=w, enable_fp_fusion=False)
            try:
                codes.fill_(0xAA)
                scales.fill_(0xAA)
                run(xs[0])
                ok = torch.equal(codes, ref.codes) and torch.equal(scales, ref.scales.view(torch.uint8))
                t = graph_ms(run, xs)
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is a row
                print(f"| {rht} | loop | {bm} | {g} | {w} | {stages} | {per_sm} | failed: {type(e).__name__} | | |")
                continue
            print(f"| {rht} | loop | {bm} | {g} | {w} | {stages} | {per_sm} | {t:.4f} | "
                  f"{nbytes / t / 1e9 / 4.19:.1%} | {'same' if ok else 'DIFFER'} |")


if __name__ == "__main__":
    main()
