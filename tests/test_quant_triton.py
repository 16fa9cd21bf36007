"""The Triton quantize kernels equal the torch reference bit for bit (round-to-nearest) and round
stochastically without bias (checks in longlive_core.quant.selfcheck). On a CUDA machine they run
on the GPU; here on the CPU under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess since
the flag is read at import). No conftest import: the GPU image runs this file with --noconftest."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longlive_core.quant.selfcheck import check_cached_launch, check_emulated_linear, check_kernels, check_scaled_gemm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_triton_matches_torch_in_the_interpreter():
    from longlive_core.quant.triton_kernels import KERNELS

    def check(kernel: str) -> subprocess.CompletedProcess:
        code = f"from longlive_core.quant.selfcheck import check_kernels; check_kernels('cpu', kernels=({kernel!r},))"
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
                              capture_output=True, text=True, timeout=900)

    # a process per kernel, one per core: the interpreter is slow and single-threaded (OMP_NUM_THREADS: the
    # cores tests/conftest.py leaves a pytest-xdist worker; the GPU image runs this file without it)
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 2)) as pool:
        for kernel, proc in zip(KERNELS, pool.map(check, KERNELS)):
            assert proc.returncode == 0, (kernel, proc.stderr[-3000:])


def test_the_interpreters_configurations_meet_every_pair_of_choices():
    """The CPU interpreter checks half of the configurations the GPU checks: every tile, RHT and block-scale
    choice once, and still every pair of choices (input dtype included) together."""
    import itertools

    from longlive_core.quant.selfcheck import CONFIGS, INTERPRETER_CONFIGS

    assert len(INTERPRETER_CONFIGS) == len({c[1:] for c in INTERPRETER_CONFIGS}) == len(CONFIGS) // 2
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in INTERPRETER_CONFIGS} == {(c[i], c[j]) for c in CONFIGS}, (i, j)


TRACED = """
import torch
from longlive_core.quant.gemm import operand_amaxes, quantize_partial

def quantized(x):
    plain, rht = operand_amaxes(x, "triton")
    part, dec = quantize_partial(x, rht=True, stochastic=True, backend="triton", amax=rht)
    return part.float() * dec + plain

x = torch.randn(32, 64)
explained = torch._dynamo.explain(quantized)(x)
assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
assert any("triton_partial" in o for o in ops) and any("triton_amaxes" in o for o in ops), ops
"""


def test_the_triton_quantize_path_traces_as_operators():
    """Compiled code calls the Triton quantize launches as two operators (``longlive::triton_amaxes``,
    ``longlive::triton_partial``) in one graph: inline, a checkpointed NVFP4 block was not traced at
    all on the H200, and a block that is not one graph runs eagerly."""
    proc = subprocess.run([sys.executable, "-c", TRACED], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@pytest.fixture
def verified_launches(monkeypatch):
    from longlive_core.quant import triton_launch
    monkeypatch.setattr(triton_launch, "VERIFY", True)


@needs_cuda
def test_triton_matches_torch_on_the_gpu(verified_launches):
    check_kernels("cuda")
    check_kernels("cuda", m=1024, k=4096)


@needs_cuda
def test_cached_launch_picks_the_kernel_triton_picks_on_the_gpu(verified_launches):
    check_cached_launch("cuda")


@needs_cuda
def test_emulated_linear_is_the_same_on_both_backends_on_the_gpu(verified_launches):
    check_emulated_linear("cuda")


@needs_cuda
def test_device_alpha_gemm_agrees_with_the_float32_product_on_the_gpu():
    check_scaled_gemm("cuda")


def test_block_tile_narrows_to_the_row_and_keeps_its_blocks_per_program():
    from longlive_core.quant import triton_kernels
    for use, tile in triton_kernels.BLOCK_TILES.items():
        for k in (16, 160, 3072, 8192, 65536):
            got = triton_kernels._block_tile(use, k)
            assert got["BM"] * got["G"] == tile["BM"] * tile["G"] and got["num_warps"] == tile["num_warps"]
            assert got["G"] == tile["G"] or got["G"] // 2 < k // 16 <= got["G"], (use, k, got)


def test_16x16_codes_of_contiguous_rows_go_to_the_block_kernel_and_the_rest_to_row_tiles(monkeypatch):
    from longlive_core.quant import triton_kernels
    x = torch.zeros(32, 64)
    assert triton_kernels.pick_kernel(x, (16, 16), False, None, True) == "blocks"
    assert triton_kernels.pick_kernel(x.t(), (16, 16), False, None, True) == "rows"  # strided rows
    assert triton_kernels.pick_kernel(x, (16, 16), False, None, False) == "rows"  # the partial output
    assert triton_kernels.pick_kernel(x, (16, 16), False, "mse", True) == "rows"
    assert triton_kernels.pick_kernel(x, (16, 16), True, None, True) == "rows"
    for k in (16, 160, 3072, 65536):  # a program's rows never split a 16-row group
        assert triton_kernels._block_tile("codes_16x16", k)["BM"] % 16 == 0
    for forced, want in (("rows", "rows"), ("slices", "rows"), ("blocks", "blocks")):
        monkeypatch.setattr(triton_kernels, "FORCE_KERNEL", forced)
        assert triton_kernels.pick_kernel(x, (16, 16), False, None, True) == want, forced
