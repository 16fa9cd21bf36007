"""NVFP4 quantize kernel bandwidth on a CUDA GPU (figures go into bench/RESULTS.md).

    python bench/nvfp4_quant.py [--size 8192] [--sweep --best-out best.json] [--quick --fos-sweep]

Times the Triton kernel on a size x size bfloat16 tensor, with and without the RHT, with the amax
computed by the kernel's own pass (x read twice) and passed in (x read once), and the partial
(q * S_dec, bfloat16) output the emulated GEMM uses. Effective bandwidth counts the bytes the
kernel must move (x reads, codes + scales or the partial written) and is set against a
device-to-device copy measured in the same run the same way (a CUDA graph; bytes read + written)
and against the H200's copy bandwidth in ../shared/docs/REFERENCE.md, 4.19 TB/s, which the goal
names. Checks the bits against the torch reference first. --sweep times the kernel's tile shapes
and warp counts first and uses the fastest (writing it to --best-out for
bench/nvfp4_linear.py --tile-from). --fos-sweep: the Four-Over-Six row tile alone, at the NVFP4 KV
cache's write (bench/generate_product.py --quant-tiles runs the product with it).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from longlive_core.quant import triton_kernels
from longlive_core.quant.gemm import quantize_partial
from longlive_core.quant.nvfp4 import quantize_nvfp4, quantize_torch
from longlive_core.quant.selfcheck import same_bits

REFERENCE_COPY_TBS = 4.19  # ../shared/docs/REFERENCE.md section 7: the H200's device copy, read + write


def ms(fn, rep: int = 300) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def graph_ms(fn, xs, repeat: int = 1, rep: int = 300) -> float:
    """Device time of fn per call: ``repeat`` calls on each input captured in a CUDA graph, replays
    timed (for ``rep`` ms), so Python and launch overhead between kernels drop out."""
    for x in xs:
        fn(x)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for x in xs:
                fn(x)
    return ms(graph.replay, rep) / (repeat * len(xs))


def tile_sweep(label: str, tile: dict, candidates: list[dict], calls: list[tuple[str, object]], xs,
               scored: int | None = None) -> None:
    """Times ``calls`` (name, fn(x)) for each candidate tile (CUDA graphs over rotating inputs), prints a table and
    keeps in ``tile`` the candidate with the least total time of the first ``scored`` calls."""
    keys = list(candidates[0])
    print(f"| {label} " + " | ".join(keys) + " | " + " | ".join(f"{name} ms" for name, _ in calls) + " |")
    print("|---" * (len(keys) + len(calls)) + "|")
    best = None
    for candidate in candidates:
        tile.update(candidate)
        times = []
        for _, fn in calls:
            times.append(graph_ms(fn, xs))  # device time: launch overhead would hide tile differences
        score = sum(times[:scored])
        best = min(best, (score, candidate), key=lambda b: b[0]) if best else (score, candidate)
        print("| " + " | ".join(str(candidate[k]) for k in keys) + " | " + " | ".join(f"{t:.3f}" for t in times)
              + " |")
    tile.update(best[1])
    print(f"fastest {label} tile: {best[1]}")


def slice_sweep(xs) -> None:
    """The slice kernel's tiles on the two wgrad calls."""
    tile_sweep("slice", triton_kernels.SLICE_TILE,
               [dict(BM=bm, G=g, num_warps=w) for bm, g, w in ((32, 4, 4), (64, 2, 4), (64, 4, 4), (128, 2, 4),
                                                               (128, 4, 8), (256, 2, 8), (32, 8, 4))],
               [("transposed RHT", lambda x: quantize_partial(x.t(), rht=True)),
                ("transposed RHT SR", lambda x: quantize_partial(x.t(), rht=True, stochastic=True))], xs)


def block_sweep(xs, uses=("codes", "codes_rht", "codes_16x16", "amaxes")) -> None:
    """The register-block kernel's tile for each of its uses, then the plain amax pass's tiles."""
    amax = {r: triton_kernels.global_amax(xs[0], r) for r in (False, True)}
    shapes = {"codes": ((1, 256, 8), (1, 512, 8), (1, 512, 4), (2, 256, 4), (2, 512, 8), (4, 128, 4)),
              # 4 blocks per thread (1x512x4, 2x512x8, 2x256x4): 22.7 SASS instructions per element
              # against 24.0 at 2 (bench/tools/kernel_asm.py), but 96 registers against 64, and no
              # faster on the H200 (RESULTS, iteration 7); 4x256x4 (8 blocks, 255 registers) slower. Since
              # iteration 9's kernel changes (64-bit code stores, one convert per rounded value, rcp.rn) the
              # RHT codes run fastest at 4 blocks per thread: 1x512x4 and 1x256x2 0.059 ms, 1x512x8 0.060
              # (iteration 10's kernel: 1x512x4, 1x256x2 and 1x128x1 0.056, 1x512x8 0.058)
              "codes_rht": ((1, 512, 8), (1, 512, 4), (1, 256, 2), (1, 128, 1), (1, 1024, 8), (2, 512, 8),
                            (2, 256, 4), (4, 256, 4), (2, 256, 8), (4, 128, 8)),
              "codes_16x16": ((16, 32, 4), (16, 16, 2), (16, 64, 8), (32, 16, 4), (32, 32, 8), (64, 8, 4)),
              "amaxes": ((4, 128, 4), (8, 128, 4), (4, 128, 8), (8, 64, 4), (2, 256, 4), (8, 128, 8), (16, 64, 8),
                         (4, 256, 8))}
    calls = {"codes": lambda x: triton_kernels.quantize(x, amax=amax[False]),
             "codes_rht": lambda x: triton_kernels.quantize(x, rht=True, amax=amax[True]),
             "codes_16x16": lambda x: triton_kernels.quantize(x, tile=(16, 16), amax=amax[False]),
             "amaxes": lambda x: triton_kernels.amaxes(x)}
    for use in (u for u in uses if u in shapes):
        tile_sweep(f"block {use}", triton_kernels.BLOCK_TILES[use],
                   [dict(BM=bm, G=g, num_warps=w) for bm, g, w in shapes[use]], [(use, calls[use])], xs)
    if "plain" not in uses:
        return
    tile_sweep("amax", triton_kernels.AMAX_TILE,
               [dict(BLOCK_SIZE=b, ITERS=i, num_warps=w) for b, i, w in ((4096, 8, 8), (8192, 4, 8), (2048, 16, 4),
                                                                         (4096, 16, 8), (8192, 8, 16))],
               [("plain amax pass", lambda x: triton_kernels.global_amax(x, False))], xs)


def sweep(xs) -> None:
    """The row-tile kernel's tiles: quantize (1x16, amax given) and the RHT partial of a transposed view."""
    amax = triton_kernels.global_amax(xs[0], False)
    tile_sweep("row", triton_kernels.TILE,
               [dict(BM=bm, BK=bk, num_warps=w) for bm in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)
                if bm * bk <= 8192],
               [("quantize", lambda x: triton_kernels.quantize(x, amax=amax)),
                ("RHT partial (transposed)", lambda x: quantize_partial(x.t(), rht=True))], xs)


# the KV cache's write at 704x1280: a chunk's K (or V), 7,040 tokens x 24 heads, quantized as rows of the head dim
KV_WRITE_SHAPE = (7040 * 24, 128)
FOS_CANDIDATES = ((32, 128, 4), (16, 128, 4), (32, 128, 8), (16, 128, 8), (64, 128, 8), (16, 64, 4), (16, 64, 2),
                  (32, 64, 8))


def fos_sweep(xs) -> None:
    """The row kernel's Four-Over-Six tile (FOS_TILE): the KV cache's write (its amax pass included, as
    QuantizedChunk.of calls it) at the 5B model's chunk shape, scored, and a square operand's 4/6 codes
    (the nvfp4-4over6 recipe's), each candidate's bits checked against the torch reference first."""
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = [torch.randn(*KV_WRITE_SHAPE, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    amax = triton_kernels.global_amax(xs[0], False)
    candidates = [dict(BM=bm, BK=bk, num_warps=w) for bm, bk, w in FOS_CANDIDATES]
    for candidate in candidates:
        triton_kernels.FOS_TILE.update(candidate)
        for x in (kv[0], xs[0][:512]):
            for tile in ((1, 16), (16, 16)):
                assert same_bits(quantize_torch(x, tile, four_over_six="mse"),
                                 triton_kernels.quantize(x, tile, four_over_six="mse")), (candidate, tile)
    tile_sweep("4/6 row, square operand", triton_kernels.FOS_TILE, candidates,
               [("4/6 codes, amax given", lambda x: triton_kernels.quantize(x, four_over_six="mse", amax=amax))], xs)
    tile_sweep("4/6 row", triton_kernels.FOS_TILE, candidates,  # kept: the KV write is production's 4/6 call
               [("KV write (amax pass + 4/6 codes)", lambda x: quantize_nvfp4(x, four_over_six="mse"))], kv)


def load_tiles(path: str) -> None:
    """The kernels' tiles from a --best-out file (older files lack the later tiles)."""
    with open(path) as f:
        tiles = json.load(f)
    triton_kernels.TILE.update(tiles["TILE"])
    triton_kernels.SLICE_TILE.update(tiles["SLICE_TILE"])
    triton_kernels.FOS_TILE.update(tiles.get("FOS_TILE", {}))
    for use, tile in tiles.get("BLOCK_TILES", {}).items():
        triton_kernels.BLOCK_TILES[use].update(tile)
    triton_kernels.AMAX_TILE.update(tiles.get("AMAX_TILE", {}))


def compare_kernels(xs) -> None:
    """The three kernels side by side on the calls the linear layer makes and on the codes output."""
    amax = triton_kernels.global_amax(xs[0], False)
    amax_rht = triton_kernels.global_amax(xs[0], True)
    # (name, call, transposed, stochastic, codes only)
    cases = [
        ("codes 1x16, amax given", lambda x: triton_kernels.quantize(x, amax=amax), False, False, True),
        ("codes 1x16 RHT, amax given (rows)", lambda x: triton_kernels.quantize(x, rht=True, amax=amax_rht),
         False, False, True),
        ("partial 1x16 (fprop x)", lambda x: quantize_partial(x), False, False, False),
        ("partial 1x16 SR (dgrad dy)", lambda x: quantize_partial(x, stochastic=True), False, True, False),
        ("partial transposed RHT (wgrad x)", lambda x: quantize_partial(x.t(), rht=True), True, False, False),
        ("partial transposed RHT SR (wgrad dy)", lambda x: quantize_partial(x.t(), rht=True, stochastic=True),
         True, True, False),
    ]
    print("| call | " + " | ".join(f"{k} ms" for k in triton_kernels.KERNELS) + " | default picks |")
    print("|---|" + "---|" * len(triton_kernels.KERNELS) + "---|")
    for name, fn, transposed, sr, codes_only in cases:
        x = xs[0].t() if transposed else xs[0]
        cells = []
        for kernel in triton_kernels.KERNELS:
            triton_kernels.FORCE_KERNEL = kernel
            if triton_kernels.pick_kernel(x, (1, 16), sr, None, codes_only) != kernel:
                cells.append("-")
                continue
            j = iter(range(10**9))
            cells.append(f"{ms(lambda j=j, fn=fn: fn(xs[next(j) % 3])):.3f}")
        triton_kernels.FORCE_KERNEL = None
        picks = triton_kernels.pick_kernel(x, (1, 16), sr, None, codes_only)
        print(f"| {name} | " + " | ".join(cells) + f" | {picks} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--fos-sweep", action="store_true", help="the Four-Over-Six row tile (the KV cache's writes)")
    ap.add_argument("--best-out")
    ap.add_argument("--quick", action="store_true", help="the bit check and the bandwidth table only")
    ap.add_argument("--block-sweep", nargs="*", help="with --quick: the block kernel's tiles too, for these uses "
                    "(codes codes_rht codes_16x16 amaxes plain; none named: all)")
    args = ap.parse_args()
    n = args.size
    torch.manual_seed(0)
    xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]  # rotate: no cache reuse
    x = xs[0]
    if args.sweep:
        sweep(xs)
        slice_sweep(xs)
    if args.sweep or args.fos_sweep:
        fos_sweep(xs)
    if not args.quick or args.block_sweep is not None:
        block_sweep(xs, args.block_sweep or ("codes", "codes_rht", "codes_16x16", "amaxes", "plain"))
    if args.best_out:
        with open(args.best_out, "w") as f:
            json.dump({"TILE": triton_kernels.TILE, "SLICE_TILE": triton_kernels.SLICE_TILE,
                       "FOS_TILE": triton_kernels.FOS_TILE, "BLOCK_TILES": triton_kernels.BLOCK_TILES,
                       "AMAX_TILE": triton_kernels.AMAX_TILE}, f)
    if not args.quick:
        compare_kernels(xs)
    for rht in (False, True):
        for tile in ((1, 16), (16, 16)):
            ref, got = quantize_torch(x, tile, rht), triton_kernels.quantize(x, tile, rht)
            assert torch.equal(ref.codes, got.codes) and torch.equal(ref.scales.view(torch.uint8),
                                                                       got.scales.view(torch.uint8))
    print(f"bit-exact vs torch at {n}x{n} bf16: ok")
    elems = n * n
    xbytes, codes_scales = 2 * elems, elems // 2 + elems // 16
    dst = torch.empty_like(x)
    i = iter(range(10**9))
    copy_bw = 2 * xbytes / graph_ms(lambda x: dst.copy_(x), xs) / 1e9  # timed as the kernels are
    amax = {r: triton_kernels.global_amax(x, r) for r in (False, True)}
    calls = [("device copy (read + write)", lambda x: dst.copy_(x), 2 * xbytes)]
    calls.append(("amax pass only, no RHT, torch vector_norm", lambda x: torch.linalg.vector_norm(x, float("inf")),
                  xbytes))
    for rht in (False, True):
        tag = "RHT" if rht else "no RHT"
        calls += [
            (f"quantize 1x16, {tag}, amax pass included", lambda x, r=rht: triton_kernels.quantize(x, rht=r),
             2 * xbytes + codes_scales),
            (f"quantize 1x16, {tag}, amax given", lambda x, r=rht: triton_kernels.quantize(x, rht=r, amax=amax[r]),
             xbytes + codes_scales),
            (f"amax pass only, {tag}", lambda x, r=rht: triton_kernels.global_amax(x, r), xbytes)]
    calls += [
        ("quantize 16x16, no RHT, amax given", lambda x: triton_kernels.quantize(x, tile=(16, 16), amax=amax[False]),
         xbytes + codes_scales),
        ("partial (bf16 out), 1x16, amax pass included", lambda x: quantize_partial(x), 3 * xbytes),
        ("partial (bf16 out), transposed view, RHT", lambda x: quantize_partial(x.t(), rht=True), 3 * xbytes)]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {n}x{n} bf16")
    print(f"# copy bandwidth in this run {copy_bw:.2f} TB/s (graph-timed); 'graph' times replay a CUDA graph of the"
          f" call (device time only); the goal is 70% of {REFERENCE_COPY_TBS} TB/s")
    print(f"| what | ms | graph ms | GB moved | TB/s (graph) | of this run's copy | of {REFERENCE_COPY_TBS} TB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, fn, nbytes in calls:
        t = ms(lambda fn=fn: fn(xs[next(i) % 3]))
        tg = graph_ms(fn, xs)
        bw = nbytes / tg / 1e9
        print(f"| {name} | {t:.3f} | {tg:.3f} | {nbytes / 1e9:.3f} | {bw:.2f} | {bw / copy_bw:.0%} | "
              f"{bw / REFERENCE_COPY_TBS:.0%} |")


if __name__ == "__main__":
    main()
