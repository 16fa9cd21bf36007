"""FP8 W8A8 linear (``quant/fp8.py``) against BF16 at the 5B DiT's linear shapes — H200.

    python bench/fp8_linear.py

For 7,040 tokens (one 8-latent-frame chunk at 704x1280) and 16,384, and the block's three linear
shapes (q/k/v/o 3072->3072, FFN up 3072->14336, FFN down 14336->3072): BF16 ``F.linear``, the FP8
GEMM alone (``torch._scaled_mm``, row-wise scales, codes made beforehand), the Triton activation
quantizer alone, and the whole ``FP8Linear`` (quantize + GEMM), by ``triton.testing.do_bench``
(median), side by side in one run. The goal (issue 20): the whole layer at least 1.3x BF16.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longlive_core.quant.fp8 import FP8Linear, quantize_rows  # noqa: E402

SHAPES = [(3072, 3072), (3072, 14336), (14336, 3072)]


def row(tokens: int, k: int, n: int) -> str:
    linear = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    layer = FP8Linear.from_linear(linear)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    codes, scale = quantize_rows(x)

    def gemm():
        return torch._scaled_mm(codes, layer.weight_fp8.t(), scale_a=scale, scale_b=layer.weight_scale.t(),
                                bias=layer.bias, out_dtype=torch.bfloat16, use_fast_accum=True)

    with torch.no_grad():
        ref = linear(x).float()
        err = float((layer(x).float() - ref).norm() / ref.norm())
        t_bf16 = triton.testing.do_bench(lambda: F.linear(x, linear.weight, linear.bias))
        t_gemm = triton.testing.do_bench(gemm)
        t_quant = triton.testing.do_bench(lambda: quantize_rows(x))
        t_layer = triton.testing.do_bench(lambda: layer(x))
    return (f"| {tokens} | {k} -> {n} | {t_bf16:.3f} | {t_gemm:.3f} | {t_quant:.3f} | {t_layer:.3f} | "
            f"{t_bf16 / t_gemm:.2f}x | {t_bf16 / t_layer:.2f}x | {err:.4f} |")


def main() -> None:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, median ms (do_bench)")
    print("| tokens | in -> out | bf16 | fp8 GEMM | quantize | FP8Linear | GEMM x | layer x | rel. error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens in (7040, 16384):
        for k, n in SHAPES:
            print(row(tokens, k, n))


if __name__ == "__main__":
    main()
