"""One chunk's attention over its window as ``longlive generate`` calls it, each kernel side by side in
one run: time, TFLOP/s and the error against float32 attention over the same (dequantized) inputs.

    python bench/attention_kernels.py [--frames 32] [--chunk 8] [--repeat 50] [--json F]
    TRITON_INTERPRET=1 python bench/attention_kernels.py --tiny   # the code path on the CPU

At the 5B's heads (24 x 128), 704x1280 (880 tokens per latent frame), the paper's window (32 latent
frames in all: ``--frames - --chunk`` cached, the chunk's own 8 appended): queries are one chunk, keys
N(0, 1) plus a per-channel offset (as real keys carry), random bf16 drawn on the GPU. Rows:

- ``bf16 cache`` what the BF16 cache runs (``kv_cache.PlainWindow``): the chunk's own keys copied into
  the room after the cached ones in the layer's buffer, then SDPA over the buffer's view;
- ``bf16 concatenated`` what it ran before: the cached chunks and the chunk's own keys concatenated,
  then SDPA;
- ``sdpa only`` the same SDPA on already concatenated keys (the kernel's own time);
- ``nvfp4 dequant`` the NVFP4 cache read by torch: every cached chunk dequantized to bf16, the chunk's
  own keys less the K-smoothing mean (``kv_attention.smoothed``), concatenated, SDPA;
- ``nvfp4 window kernel`` the same window as ``longlive generate`` reads it (``kv_attention.window``: on a
  GPU a Triton launch per chunk and one for the chunk's own smoothed keys, the same bits), then SDPA;
- ``nvfp4 fused`` infer/kv_attention.py's attention that dequantizes in registers;
- ``fp8 dequant`` / ``fp8 window kernel`` the FP8 cache's read (``kv: fp8``; E4M3 with a scale per token
  and head), the chunk's own keys smoothed as above: every cached chunk dequantized by torch and
  concatenated / written into the window by ``kv_attention.window`` (a Triton launch a chunk: the same
  bits), then SDPA;
- ``int8 qk + bf16 pv`` / ``int8 qk + fp8 pv`` infer/attention_8bit.py over the concatenated bf16 keys
  (its quantization of q, k, v included);
- ``cudnn fp8`` infer/attention_cudnn_fp8.py: cuDNN's fused FP8 SDPA over the same keys (its per-tensor
  quantization of q, k, v and the dequantization of its FP8 output included: ``attention_fp8_io``'s Triton
  launches); only where ``available()`` (the cuDNN frontend, a Hopper GPU), else a line says why it was
  skipped;
- ``cudnn fp8, torch passes`` the same with the inputs smoothed and quantized by torch
  (``attention_fp8_io``'s reference path, what ``attention_fp8`` ran before the Triton launches);
- ``cudnn fp8 kernel`` the same over inputs quantized beforehand (``attention_cudnn_fp8.quantized_inputs``):
  the fused kernel and its output's dequantization only, to tell the kernel's speed from the
  smoothing and quantization passes over the window's keys and values;
- ``cudnn fp8, kept window`` a chunk's later pass as ``longlive generate`` runs it (``attention_fp8_io.FP8Window``):
  the window in E4M3 from the first pass, the chunk's own K and V placed into it, Q quantized, the kernel.

FLOPs: 4 H M N D (Q K^T and P V). The error is ||out - ref|| / ||ref|| over two heads, ref = float32
attention over the inputs the kernel reads (the dequantized cache for the NVFP4 and FP8 rows).

A second table times each cache's read of K and V alone, without SDPA (``bf16 cache read``: the chunk's
own rows copied into the buffer's room; ``nvfp4 window`` / ``fp8 window``: ``kv_attention.window``),
as launched (``do_bench``) and replayed from a CUDA graph (``do_bench_cudagraph``: device time without
the host's launches), with the bytes each must move (codes, scales and the chunk's own rows read, the
window written) and the rate that gives: a read well under HBM speed in both timings is the kernel's,
one that the graph speeds up is launch gaps. A third table times the FFN's first matmul alone, then
with the NVFP4 window's read after it on one stream and beside it on a second (launched after the
matmul, and before it).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

TOKENS_PER_FRAME, HEADS, DIM = 880, 24, 128


def torch_quantized_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``attention_cudnn_fp8.quantized_inputs`` by torch's passes (the bench's comparison row)."""
    from longlive_core.infer.attention_cudnn_fp8 import FP8Inputs
    from longlive_core.infer.attention_fp8_io import smoothed_e4m3_torch

    (q8, dq, _), (k8, dk, _), (v8, dv, v_mean) = (smoothed_e4m3_torch(x, smooth) for x, smooth in
                                                  ((q, False), (k, True), (v, True)))
    return FP8Inputs(q8, k8, v8, dq, dk, dv, v_mean, q.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=32, help="the window in latent frames, the chunk included")
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=50, help="milliseconds of timed repeats (do_bench)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="the code path on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global TOKENS_PER_FRAME, HEADS, DIM
    if args.tiny:
        TOKENS_PER_FRAME, HEADS, DIM = 8, 2, 32

    import triton.testing

    from longlive_core.infer import attention_cudnn_fp8
    from longlive_core.infer.attention_8bit import attention_8bit
    from longlive_core.infer.attention_fp8_io import HEADROOM, FP8Window
    from longlive_core.infer.kv_attention import nvfp4_cache_attention, smoothed, window
    from longlive_core.infer.kv_cache import PlainWindow
    from longlive_core.infer.kv_quant import FP8Chunk, QuantizedChunk

    dev = torch.device("cpu" if args.tiny else "cuda")
    torch.manual_seed(0)
    m, per_chunk = args.chunk * TOKENS_PER_FRAME, args.chunk * TOKENS_PER_FRAME
    cached = (args.frames - args.chunk) // args.chunk

    def draw(tokens: int) -> torch.Tensor:
        return torch.randn(1, HEADS, tokens, DIM, device=dev, dtype=torch.bfloat16)

    offset = 2 * torch.randn(1, HEADS, 1, DIM, device=dev)
    q = draw(m)
    past_k = [(draw(per_chunk) + offset).to(torch.bfloat16) for _ in range(cached)]
    past_v = [draw(per_chunk) for _ in range(cached)]
    k, v = (draw(m) + offset).to(torch.bfloat16), draw(m)
    n = m + cached * per_chunk
    mean = past_k[0].float().mean(dim=2, keepdim=True)  # the first chunk's, as the cache takes it
    qk = [QuantizedChunk.of((c.float() - mean).to(torch.bfloat16)) for c in past_k]
    qv = [QuantizedChunk.of(c) for c in past_v]
    own_k = (k.float() - mean).to(torch.bfloat16)
    full_k, full_v = torch.cat(past_k + [k], dim=2), torch.cat(past_v + [v], dim=2)
    # the BF16 cache's buffers: the cached rows, room for the chunk's own after them
    room_k, room_v = PlainWindow(full_k.clone(), n - m), PlainWindow(full_v.clone(), n - m)
    deq_k = torch.cat([c.dequantize(torch.bfloat16) for c in qk] + [own_k], dim=2)
    deq_v = torch.cat([c.dequantize(torch.bfloat16) for c in qv] + [v], dim=2)
    fk = [FP8Chunk.of((c.float() - mean).to(torch.bfloat16)) for c in past_k]
    fv = [FP8Chunk.of(c) for c in past_v]
    fp8_k = torch.cat([c.dequantize(torch.bfloat16) for c in fk] + [own_k], dim=2)
    fp8_v = torch.cat([c.dequantize(torch.bfloat16) for c in fv] + [v], dim=2)

    rows = {
        "sdpa only": (lambda: F.scaled_dot_product_attention(q, full_k, full_v), full_k, full_v),
        "bf16 cache": (lambda: F.scaled_dot_product_attention(q, room_k.with_own(k), room_v.with_own(v)),
                       full_k, full_v),
        "bf16 concatenated": (lambda: F.scaled_dot_product_attention(q, torch.cat(past_k + [k], 2),
                                                                     torch.cat(past_v + [v], 2)), full_k, full_v),
        "nvfp4 dequant": (lambda: F.scaled_dot_product_attention(
            q, torch.cat([c.dequantize(torch.bfloat16) for c in qk] + [smoothed(k, mean)], 2),
            torch.cat([c.dequantize(torch.bfloat16) for c in qv] + [v], 2)), deq_k, deq_v),
        "nvfp4 window kernel": (lambda: F.scaled_dot_product_attention(
            q, window(qk, k, mean), window(qv, v)), deq_k, deq_v),
        "nvfp4 fused": (lambda: nvfp4_cache_attention(q, qk, qv, own_k, v), deq_k, deq_v),
        "fp8 dequant": (lambda: F.scaled_dot_product_attention(
            q, torch.cat([c.dequantize(torch.bfloat16) for c in fk] + [smoothed(k, mean)], 2),
            torch.cat([c.dequantize(torch.bfloat16) for c in fv] + [v], 2)), fp8_k, fp8_v),
        "fp8 window kernel": (lambda: F.scaled_dot_product_attention(
            q, window(fk, k, mean), window(fv, v)), fp8_k, fp8_v),
        "int8 qk + bf16 pv": (lambda: attention_8bit(q, full_k, full_v, pv="bf16"), full_k, full_v),
        "int8 qk + fp8 pv": (lambda: attention_8bit(q, full_k, full_v, pv="fp8"), full_k, full_v),
    }
    skipped = attention_cudnn_fp8.unavailable_reason(dev)
    if skipped is None:
        rows["cudnn fp8"] = (lambda: attention_cudnn_fp8.attention_fp8(q, full_k, full_v), full_k, full_v)
        rows["cudnn fp8, torch passes"] = (lambda: attention_cudnn_fp8.attention_fp8_quantized(
            torch_quantized_inputs(q, full_k, full_v)), full_k, full_v)
        prepared = attention_cudnn_fp8.quantized_inputs(q, full_k, full_v)
        rows["cudnn fp8 kernel"] = (lambda: attention_cudnn_fp8.attention_fp8_quantized(prepared), full_k, full_v)
        # a chunk's later pass as generate runs it: the window kept from its first pass, the own rows placed
        kept = FP8Window.of(full_k, full_v, own=m, headroom=HEADROOM)
        rows["cudnn fp8, kept window"] = (lambda: (kept.place(k, v), attention_cudnn_fp8.attention_fp8_window(
            q, kept))[1], full_k, full_v)
    flops = 4 * HEADS * m * n * DIM
    where = "cpu (interpreter)" if args.tiny else torch.cuda.get_device_name()
    print(f"# q {m} tokens, window {n} keys, {HEADS} x {DIM} heads, {where}, torch {torch.__version__}", flush=True)
    if skipped is not None:
        print(f"# cudnn fp8 skipped: {skipped}", flush=True)
    print("| kernel | ms | TFLOP/s | vs sdpa only | rel. error (2 heads) | peak extra GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    results, base = [], None
    for name, (fn, keys, values) in rows.items():
        out = fn()
        ref = F.scaled_dot_product_attention(q[:, :2].float(), keys[:, :2].float(), values[:, :2].float())
        err = float((out[:, :2].float() - ref).norm() / ref.norm())
        del out, ref
        if args.tiny:
            start = time.perf_counter()
            fn()
            ms, extra = (time.perf_counter() - start) * 1e3, 0.0
        else:
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = triton.testing.do_bench(fn, warmup=25, rep=args.repeat, return_mode="median")
            extra = (torch.cuda.max_memory_allocated() - before) / 2**30
        base = ms if name == "sdpa only" else base
        row = {"kernel": name, "ms": ms, "tflops": flops / ms / 1e9, "error": err, "peak_extra_gib": extra,
               "queries": m, "keys": n}
        results.append(row)
        rel = f"{base / ms:.2f}x" if base else ""
        print(f"| {name} | {ms:.3f} | {row['tflops']:.0f} | {rel} | {err:.4f} | {extra:.2f} |", flush=True)
        assert math.isfinite(err)
    results += time_reads(args, rows_of_reads(k, v, mean, room_k, room_v, qk, qv, fk, fv, m, n))
    if not args.tiny:
        results += time_overlap(args, lambda: (window(qk, k, mean), window(qv, v)), m)
    if args.json:
        with open(args.json, "a") as fh:
            for row in results:
                fh.write(json.dumps(row) + "\n")


def rows_of_reads(k, v, mean, room_k, room_v, qk, qv, fk, fv, m: int, n: int) -> dict:
    """Each cache's read of one layer's K and V for the chunk, and the bytes it must move: the chunk's own
    rows read, the cached codes and scales read, the window written (bf16: only the own rows are written)."""
    from longlive_core.infer.kv_attention import dequantized_window, window

    row = HEADS * DIM * 2  # a token's bf16 keys (or values), every head
    cached = n - m
    nvfp4_bytes = 2 * (m * row + cached * HEADS * (DIM // 2 + DIM // 16) + n * row)
    reads = {
        "bf16 cache read": (lambda: (room_k.with_own(k), room_v.with_own(v)), 2 * (2 * m * row)),
        "nvfp4 window": (lambda: (window(qk, k, mean), window(qv, v)), nvfp4_bytes),
    }
    for tokens in (128, 256):  # the product's launches take 64 tokens a program: larger tiles, fewer programs
        reads[f"nvfp4 window, {tokens} tokens a program"] = (
            lambda t=tokens: (dequantized_window(qk, k, t, mean), dequantized_window(qv, v, t)), nvfp4_bytes)
    return reads | {
        "fp8 window": (lambda: (window(fk, k, mean), window(fv, v)),
                       2 * (m * row + cached * HEADS * (DIM + 4) + n * row)),
    }


def time_reads(args, reads: dict) -> list[dict]:
    import triton.testing

    print("\n| read of K and V | ms | ms graphed | GB moved | TB/s | TB/s graphed |")
    print("|---|---:|---:|---:|---:|---:|")
    out = []
    for name, (fn, nbytes) in reads.items():
        if args.tiny:
            start = time.perf_counter()
            fn()
            ms = graphed = (time.perf_counter() - start) * 1e3
        else:
            ms = triton.testing.do_bench(fn, warmup=25, rep=args.repeat, return_mode="median")
            graphed = triton.testing.do_bench_cudagraph(fn, rep=args.repeat, return_mode="median")
        out.append({"read": name, "ms": ms, "ms_graphed": graphed, "bytes": nbytes})
        print(f"| {name} | {ms:.3f} | {graphed:.3f} | {nbytes / 1e9:.3f} | {nbytes / ms / 1e9:.2f} | "
              f"{nbytes / graphed / 1e9:.2f} |", flush=True)
    return out


def time_overlap(args, read, m: int) -> list[dict]:
    """Whether the NVFP4 window's read hides behind the block's compute-bound work: the FFN's first
    matmul of the chunk (m x 3072 by 3072 x 14336, bf16) alone, then followed by the read on the one
    stream, then beside it on a second stream (what reading the next layer's cached window ahead
    would overlap), launched after the matmul (as a read ahead would start while it runs) and before
    it (the read's programs take the SMs first)."""
    import triton.testing

    x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 14336, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def beside(read_first: bool):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        if not read_first:
            x @ w
        with torch.cuda.stream(side):
            read()  # its windows are made and freed on the side stream
        if read_first:
            x @ w
        main.wait_stream(side)

    rows = {"ffn matmul": lambda: x @ w, "ffn matmul, then the window": lambda: (x @ w, read()),
            "ffn matmul, the window beside it (two streams)": lambda: beside(False),
            "the window, the ffn matmul beside it (two streams)": lambda: beside(True)}
    print("\n| overlap | ms |")
    print("|---|---:|")
    out = []
    for name, fn in rows.items():
        ms = triton.testing.do_bench(fn, warmup=25, rep=args.repeat, return_mode="median")
        out.append({"overlap": name, "ms": ms})
        print(f"| {name} | {ms:.3f} |", flush=True)
    return out


if __name__ == "__main__":
    main()
