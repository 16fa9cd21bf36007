"""8-bit attention (infer/attention_8bit.py): INT8 Q K^T after K-smoothing, P V in E4M3 or bfloat16,
against float64 attention on N(0, 1) heads with a per-channel key offset. Measured in the
interpreter (relative L2 error of the output): bf16 SDPA 0.2%; P V in bfloat16 0.9-1.6%; in E4M3
3.1-3.6% (the probabilities' 3-bit mantissa). On the CPU under Triton's interpreter (TRITON_INTERPRET=1,
in a subprocess since the flag is read at import); on a GPU at the 5B's heads and window. No conftest
import: the GPU image runs this file with --noconftest."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.attention import float64_attention

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = {"bf16": 0.025, "fp8": 0.06}  # relative L2 error of the output, about 1.6x the worst measured


def check(device: str, heads: int = 2, dim: int = 64, queries: int = 40, keys: int = 300,
          blocks: tuple[tuple[int, int], ...] = ((128, 64), (16, 16)), seed: int = 0) -> dict:
    from longlive_core.infer.attention_8bit import attention_8bit, int8_rows, int8_rows_torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(70, dim, generator=g) * 3).to(device, torch.bfloat16)
    codes, scales = int8_rows(x)
    want_codes, want_scales = int8_rows_torch(x)
    assert torch.equal(codes, want_codes)
    # torch on CUDA divides by a scalar as a product with its reciprocal: an ulp from div_rn (H200)
    torch.testing.assert_close(scales, want_scales, rtol=2**-22, atol=0)
    errors = {}
    for sharpness in (1.0, 3.0):
        q = (torch.randn(1, heads, queries, dim, generator=g) * sharpness).to(device, torch.bfloat16)
        offset = torch.randn(1, heads, 1, dim, generator=g) * 2
        k = (torch.randn(1, heads, keys, dim, generator=g) + offset).to(device, torch.bfloat16)
        v = torch.randn(1, heads, keys, dim, generator=g).to(device, torch.bfloat16)
        reference = float64_attention(q, k, v)
        for pv, tolerance in TOLERANCE.items():
            for block_m, block_n in blocks:
                out = attention_8bit(q, k, v, pv, block_m, block_n)
                assert out.shape == q.shape and out.dtype == torch.bfloat16
                error = ((out.double() - reference).norm() / reference.norm()).item()
                assert error <= tolerance, f"P V in {pv}, sharpness {sharpness}, {block_m}x{block_n}: {error:.4f}"
                errors[(pv, sharpness, block_m)] = round(error, 4)
    return errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel itself (and the GPU "
                    "image's Triton has another interpreter)")
def test_8bit_attention_is_within_its_tolerance_in_the_interpreter():
    code = "from tests.test_infer_attention_8bit import check; print(check('cpu'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_8bit_attention_is_within_its_tolerance_on_the_gpu():
    # the 5B's 24 heads of 128 over a window of 32 latent frames (28,160 keys) for one chunk's queries
    print(check("cuda", heads=24, dim=128, queries=7040, keys=28160, blocks=((128, 64),)))
