"""The emulated NVFP4 GEMM against BF16 ``F.linear``, same run, on a CUDA GPU.

    python bench/nvfp4_gemm.py [--tokens 16384 65536]

For the linear layer's three GEMMs at Wan2.2-5B shapes it times: BF16 ``F.linear`` (cuBLASLt,
bias in its epilogue); ``emulated_mm``, one cuBLASLt GEMM whose alpha (the two decode scales) is a
device scalar, bias in its epilogue too; and the float32 round trip it replaced (a float32-output GEMM,
then a scaling pass). It first checks the device-alpha GEMM against a float64 product of the same
operands and against the float32 round trip (one output rounding plus float32 accumulation in
another order apart, for every layout the layer uses).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from longlive_core.quant.gemm import emulated_mm, quantize_partial
from longlive_core.quant.selfcheck import check_scaled_gemm, gemm_error_ratio


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def round_trip(a, b, alpha, bias, out_dtype):
    out = torch.mm(a, b, out_dtype=torch.float32) * alpha
    if bias is not None:
        out = out + bias.to(out_dtype).float()
    return out.to(out_dtype)


def check(m: int, k: int, n: int) -> str:
    """check_scaled_gemm (asserts), then error figures at a real shape, for every layout the layer uses."""
    check_scaled_gemm("cuda")
    g = torch.Generator("cuda").manual_seed(0)
    xp, xd = quantize_partial(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
    wp, wd = quantize_partial(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g), (16, 16))
    bias = torch.randn(n, device="cuda", generator=g)
    col = lambda t: t.t().contiguous().t()  # noqa: E731
    lines = []
    for name, a, b, bb, out_dtype in (("fprop NT + bias", xp, wp.t(), bias, torch.bfloat16),
                                      ("dgrad NN", xp, wp.t().contiguous(), None, torch.bfloat16),
                                      ("wgrad TN -> fp32", col(xp), wp.t().contiguous(), None, torch.float32),
                                      ("TT", col(xp), wp.t(), None, torch.bfloat16)):
        got = emulated_mm(a, xd, b, wd, bb, out_dtype)
        ref64 = (a.double() @ b.double()) * (xd.double() * wd.double())
        if bb is not None:
            ref64 = ref64 + bb.to(out_dtype).double()
        rel = ((got.double() - ref64).norm() / ref64.norm()).item()
        same = (got == round_trip(a, b, xd * wd, bb, out_dtype)).float().mean().item()
        ratio = gemm_error_ratio(got, a, b, xd * wd, bb)
        assert ratio <= 1.0, (name, ratio)
        lines.append(f"| {name} | {rel:.2e} | {same:.4f} | {ratio:.2f} |")
    return "\n".join(lines)


def time_shape(k: int, n: int, t: int) -> None:
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dec = torch.full((), 0.5, device="cuda")
    cases = {  # name: (bf16 baseline, operands of the emulated GEMM, bias, out dtype)
        "fprop": (lambda: F.linear(x, w, bias), (x, w.t()), bias, torch.bfloat16),
        "dgrad": (lambda: gy @ w, (gy, w), None, torch.bfloat16),
        "wgrad": (lambda: gy.t() @ x, (gy.t(), x), None, torch.float32),
    }
    for name, (base, (a, b), bb, out_dtype) in cases.items():
        t_base = ms(base)
        t_new = ms(lambda a=a, b=b, bb=bb, o=out_dtype: emulated_mm(a, dec, b, dec, bb, o))
        t_old = ms(lambda a=a, b=b, bb=bb, o=out_dtype: round_trip(a, b, dec * dec, bb, o))
        print(f"| {k} -> {n} | {t} | {name} | {t_base:.3f} | {t_new:.3f} | {t_old:.3f} | "
              f"{t_new / t_base:.2f} | {t_old / t_base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| GEMM | rel err vs float64 | share equal to the fp32 round trip | worst error / allowed |")
    print("|---|---|---|---|")
    print(check(4096, 3072, 3072))
    print("| in -> out | tokens | GEMM | bf16 F.linear ms | device alpha ms | fp32 round trip ms | "
          "device alpha / bf16 | round trip / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for k, n in ((3072, 3072), (3072, 14336), (14336, 3072)):
        for t in args.tokens:
            time_shape(k, n, t)


if __name__ == "__main__":
    main()
