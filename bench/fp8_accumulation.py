"""Why cuDNN's FP8 attention is far off BF16 past the DiT's first layer: Hopper's FP8 tensor cores add
each product into the float32 accumulator at limited precision, and a P V over a window of 28,160 keys
adds up a sum that outgrows every term when V's channels carry an offset shared by the keys.

    PYTHONPATH=. python bench/fp8_accumulation.py DUMP.safetensors [MORE.safetensors ...]

Reads what ``bench/fp8_attention_layers.py --dump`` wrote for one head of one layer (its q, k, v, the
BF16 and FP8 outputs, the per-tensor amaxes; the tensors may be split over several files) and computes
on the CPU, in float64:

- P V with every E4M3 rounding the kernel makes (Q, smoothed K, P x 448, V, O) and exact sums;
- the same with the accumulation modelled as a fixed-point adder: at each step of ``--k`` keys, the
  accumulator and the step's products aligned to the largest exponent among them, ``--bits`` bits kept
  below it, the rest truncated toward zero;
- both again with V smoothed: its mean over the keys, per channel, taken out before the E4M3 rounding
  and added back to the output (exact: each row of softmax's P sums to 1).

Each against float64 attention and against the kernel's own output. Where the accumulator model matches
the kernel and the exact sums do not, the accumulation is the error, and smoothing V is the fix to try.
"""
from __future__ import annotations

import argparse
import math

import torch
from safetensors.torch import load_file

from longlive_core.infer.attention_cudnn_fp8 import O_HEADROOM, P_SCALE
from longlive_core.quant.fp8 import E4M3_MAX


def e4m3(x: torch.Tensor, amax: float) -> torch.Tensor:
    """x rounded to E4M3 under the per-tensor scale amax / 448, back in x's units (float64)."""
    descale = amax / E4M3_MAX
    return (x / descale).float().to(torch.float8_e4m3fn).double() * descale


def truncating_matmul(p: torch.Tensor, v: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """p (queries, keys) @ v (keys, dim) in steps of ``k`` keys: at each step the running sum and the
    step's products are cut to multiples of 2^(e - bits), e the largest exponent among them, toward zero."""
    acc = torch.zeros(p.shape[0], v.shape[1], dtype=torch.float64)
    for start in range(0, p.shape[1], k):
        products = p[:, start:start + k, None] * v[None, start:start + k]  # (queries, k, dim)
        top = torch.maximum(acc.abs(), products.abs().amax(1)).clamp_min(1e-300)
        ulp = torch.exp2(torch.floor(torch.log2(top)) - bits)
        acc = torch.trunc(acc / ulp) * ulp + (torch.trunc(products / ulp[:, None]) * ulp[:, None]).sum(1)
    return acc


def modelled(q, k, v, amaxes: tuple[float, float, float], smooth_v: bool, bits: int | None, step: int
             ) -> torch.Tensor:
    """One head's FP8 attention (queries, dim) as the kernel rounds it, in float64: the per-tensor scales
    from ``amaxes`` (Q, smoothed K, V over every head); a smoothed V's from this head alone."""
    amax_q, amax_k, amax_v = amaxes
    smoothed = k - k.mean(0, keepdim=True)
    offset = v.mean(0, keepdim=True) if smooth_v else torch.zeros_like(v[:1])
    shifted = v - offset
    if smooth_v:
        amax_v = float(shifted.abs().amax())
    q8, k8, v8 = e4m3(q, amax_q), e4m3(smoothed, amax_k), e4m3(shifted, amax_v)
    s = q8 @ k8.T / math.sqrt(q.shape[-1])
    p = torch.exp(s - s.amax(-1, keepdim=True))
    row_sum = p.sum(-1, keepdim=True)
    p8 = (p * P_SCALE).float().to(torch.float8_e4m3fn).double()
    pv = p8 @ v8 if bits is None else truncating_matmul(p8, v8, bits, step)
    out = pv / P_SCALE / row_sum
    o_scale = O_HEADROOM * E4M3_MAX / amax_v
    return (out * o_scale).float().to(torch.float8_e4m3fn).double() / o_scale + offset


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--queries", type=int, default=64, help="rows modelled (the products are queries x keys x dim)")
    ap.add_argument("--bits", type=int, nargs="+", default=[12, 13, 14])
    ap.add_argument("--k", type=int, default=32, help="keys an MMA step adds at once")
    args = ap.parse_args()
    d: dict[str, torch.Tensor] = {}
    for path in args.dumps:
        d.update(load_file(path))
    q, k, v = (d[n][0, 0].double() for n in ("q", "k", "v"))
    rows = torch.linspace(0, q.shape[0] - 1, args.queries).long()
    q = q[rows]
    kernel, bf16 = d["fp8"][0, 0, rows].double(), d["bf16"][0, 0, rows].double()
    amaxes = tuple(float(x) for x in d["amax"])  # over every head: the per-tensor scales the kernel had
    ref = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), -1) @ v
    print(f"# one head: {q.shape[0]} of the dump's queries over {k.shape[0]} keys; BF16 against float64: "
          f"{relative(bf16, ref):.4f}, the kernel against float64: {relative(kernel, ref):.4f}")
    print("| model | V smoothed | against float64 | against the kernel |")
    print("|---|---|---:|---:|")
    for bits in [None, *args.bits]:
        for smooth in (False, True):
            out = modelled(q, k, v, amaxes, smooth, bits, args.k)
            name = "exact sums" if bits is None else f"{bits}-bit accumulator, {args.k} keys a step"
            print(f"| {name} | {'yes' if smooth else 'no'} | {relative(out, ref):.4f} | "
                  f"{'' if smooth else f'{relative(out, kernel):.4f}'} |", flush=True)


if __name__ == "__main__":
    main()
