"""The quantized KV caches (NVFP4, FP8) against bf16: bytes per cached token, and attention's output
error with and without K-smoothing on keys that carry a per-channel offset (as real keys do), NVFP4's
with and without Four-Over-Six block scales.

    PYTHONPATH=. python bench/kv_cache_quant.py [--heads 24] [--dim 128] [--frames 32] [--offset 0 2 8]

At the 5B model's heads (24 x 128) and 880 tokens per latent frame: a cache of ``--frames`` frames
(written in chunks of 8 frames: NVFP4 one global scale each, FP8 a scale per token and head) read by
one 8-frame chunk of queries. Keys are N(0, 1) plus a per-channel offset of ``--offset`` times N(0, 1)
shared by every token; the smoothing mean comes from the first chunk written. The error is
||out - exact|| / ||exact|| of attention in float32 over the dequantized keys and values, against the
unquantized ones. Runs on the CPU (minutes: the exact attention over 28K keys is the cost).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from longlive_core.infer.kv_quant import KVQuantConfig, dequantize_all

TOKENS_PER_FRAME, CHUNK = 880, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--offset", type=float, nargs="+", default=[0.0, 2.0, 8.0])
    args = ap.parse_args()
    h, d = args.heads, args.dim
    g = torch.Generator().manual_seed(0)
    tokens, per_chunk = args.frames * TOKENS_PER_FRAME, CHUNK * TOKENS_PER_FRAME
    q = torch.randn(1, h, per_chunk, d, generator=g)
    v = torch.randn(1, h, tokens, d, generator=g)
    print(f"# heads {h} x {d}, cache of {args.frames} latent frames ({tokens} tokens), queries: one chunk")
    print("| key offset | format | bytes/token bf16 | bytes/token quantized | ratio | error plain | error smoothed |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    formats = [("nvfp4", KVQuantConfig(format="nvfp4")),
               ("nvfp4, four-over-six mse", KVQuantConfig(four_over_six="mse")),
               ("fp8", KVQuantConfig(format="fp8"))]
    for offset in args.offset:
        k = offset * torch.randn(1, h, 1, d, generator=g) + torch.randn(1, h, tokens, d, generator=g)
        exact = F.scaled_dot_product_attention(q, k, v)
        mean = k[:, :, :per_chunk].mean(dim=2, keepdim=True)
        for name, quant in formats:
            def stored(x, quant=quant):
                return [quant.chunk(x[:, :, i:i + per_chunk]) for i in range(0, tokens, per_chunk)]

            v_chunks = stored(v)
            v_back = dequantize_all(v_chunks, torch.float32)
            errors = []
            for keys in (k, k - mean):
                k_chunks = stored(keys)
                out = F.scaled_dot_product_attention(q, dequantize_all(k_chunks, torch.float32), v_back)
                errors.append(float((out - exact).norm() / exact.norm()))
            held = (sum(c.nbytes for c in k_chunks) + sum(c.nbytes for c in v_chunks)) / tokens
            bf16 = 2 * h * d * 2
            print(f"| {offset:g} | {name} | {bf16} | {held:.1f} | {bf16 / held:.3f} | {errors[0]:.4f} | "
                  f"{errors[1]:.4f} |", flush=True)

if __name__ == "__main__":
    main()
