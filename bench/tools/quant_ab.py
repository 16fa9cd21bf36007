"""Side-by-side timing of the block kernel's calls for two trees of the library, in fresh processes.

    mkdir -p ab/old && git archive <rev> longlive_core | tar -x -C ab/old   # here; untracked, it travels
    for r in 1 2 3; do                                      # on the device, alternating
        PYTHONPATH=ab/old python bench/tools/quant_ab.py old
        PYTHONPATH=. python bench/tools/quant_ab.py new
    done

Prints one line per run: microseconds per call (median of CUDA-graph replays, 12 calls per graph over
three rotating 8192x8192 bfloat16 inputs, each call with outputs of its own), after a bit check
against the torch reference. The calls: codes with and without the RHT (amax given), the RHT codes
with an amax large enough (1e6 in the tensor) to take the kernel's path for small S_enc, the RHT
codes with their amax pass, and three calls of other kernels as controls (the transposed RHT
partial, both amaxes of x and of x.t()). A finer clock than bench/nvfp4_quant.py's table (whose
graph holds 3 calls and prints milliseconds to 3 places); the goal's figures come from that bench.
Delete ab/ afterwards: the lint test would check it, and it is not for committing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from longlive_core.quant import triton_kernels as tk
from longlive_core.quant.gemm import quantize_partial
from longlive_core.quant.nvfp4 import quantize_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for its timing helper
from nvfp4_quant import graph_ms  # noqa: E402

N = 8192


def graph_us(fn, xs) -> float:
    return 1e3 * graph_ms(fn, xs, repeat=4, rep=1000)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "tree"
    torch.manual_seed(0)
    xs = [torch.randn(N, N, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    big = xs[0].clone()
    big[0, 0] = 1e6  # S_enc below 2^-6, also after the RHT
    for x in (xs[0], big):
        for rht in (False, True):
            ref, got = quantize_torch(x, rht=rht), tk.quantize(x, rht=rht)
            assert torch.equal(ref.codes, got.codes), (label, rht)
            assert torch.equal(ref.scales.view(torch.uint8), got.scales.view(torch.uint8)), (label, rht)
    amax = {r: tk.global_amax(xs[0], r) for r in (False, True)}
    amax_big = tk.global_amax(big, True)
    calls = [("rht_codes", lambda x: tk.quantize(x, rht=True, amax=amax[True])),
             ("codes", lambda x: tk.quantize(x, amax=amax[False])),
             ("rht_codes_small_s_enc", lambda x: tk.quantize(x, rht=True, amax=amax_big)),
             ("rht_codes_amax_pass", lambda x: tk.quantize(x, rht=True)),
             ("partial_t_rht", lambda x: quantize_partial(x.t(), rht=True)),
             ("amaxes", lambda x: tk.amaxes(x)),
             ("amaxes_t", lambda x: tk.amaxes(x.t()))]
    print(label, " ".join(f"{name}={graph_us(fn, xs):.2f}" for name, fn in calls), flush=True)


if __name__ == "__main__":
    main()
