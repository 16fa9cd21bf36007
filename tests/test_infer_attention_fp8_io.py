"""The Triton passes around cuDNN's FP8 attention (infer/attention_fp8_io.py) against the torch path: the
means within float32 summation order, and given those means the codes, the scales and the dequantized
output bit for bit. Here under Triton's interpreter (a subprocess: TRITON_INTERPRET is read when Triton
is imported); on the H200 at the paper's window (``generate_round.sh gpu_tests``)."""
from __future__ import annotations

import pytest
import torch

from tests.test_infer_kv_attention import in_the_interpreter


def passes_match(device: str, heads: int = 3, dim: int = 48, queries: int = 37, keys: int = 601) -> str:
    """Raises AssertionError where the Triton passes differ from torch's; returns a line of what matched.
    The keys and values come as the model makes them, (B, L, H, D) transposed, with a per-channel offset
    (and one channel constant, one all-zero head), lengths no multiple of the tiles, a head size no power
    of two."""
    from longlive_core.infer.attention_fp8_io import (
        dequantized_output_torch,
        per_tensor_e4m3_torch,
        triton_dequantized_output,
        triton_smoothed_e4m3,
    )

    g = torch.Generator().manual_seed(0)

    def made(length: int, offset: float) -> torch.Tensor:
        x = torch.randn(1, length, heads, dim, generator=g) + offset * torch.randn(1, 1, heads, dim, generator=g)
        x[..., 0, 5] = 3.0
        if offset == 0:  # q: values that round to a negative zero, whose sign torch keeps (0x80)
            x[0, :16, heads - 1, 7] = -1e-9
        return x.to(device, torch.bfloat16).transpose(1, 2)

    q, k, v = made(queries, 0.0), made(keys, 8.0), made(keys, 2.0)
    v[:, 1] = 0
    for x, smooth in ((q, False), (k, True), (v, True)):
        codes, descale, mean = triton_smoothed_e4m3(x, smooth)
        if smooth:
            torch.testing.assert_close(mean, x.float().mean(dim=2, keepdim=True), rtol=1e-5, atol=1e-6)
        ref_codes, ref_descale = per_tensor_e4m3_torch(x, mean)
        assert codes.is_contiguous() and codes.shape == x.shape
        assert torch.equal(descale, ref_descale), (descale, ref_descale)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    # finite codes, as attention's output is: a cast beyond E4M3's 448 may give NaN (never equal to itself)
    o8 = (torch.randn(1, heads, queries, dim, generator=g) * 100).clamp(-448, 448).to(device).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.0173], device=device)
    offset = torch.randn(1, heads, 1, dim, generator=g).to(device)
    for dtype in (torch.bfloat16, torch.float32):
        out = triton_dequantized_output(o8, scale, offset, dtype)
        ref = dequantized_output_torch(o8, scale, offset, dtype)
        differ = (out != ref).nonzero()
        assert not len(differ), (f"{dtype}: {len(differ)} outputs differ, the first at {differ[0].tolist()}: "
                                 f"{out[tuple(differ[0])].item()!r} against {ref[tuple(differ[0])].item()!r}")
    return f"codes, scales and output as torch's for q {tuple(q.shape)}, k and v {tuple(k.shape)}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernels themselves")
def test_the_fp8_attention_passes_are_torchs_in_the_interpreter():
    in_the_interpreter("from tests.test_infer_attention_fp8_io import passes_match; print(passes_match('cpu'))")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_fp8_attention_passes_are_torchs_on_the_gpu():
    # the 5B's 24 heads of 128: one chunk's 7,040 queries over a 28,160-key window
    print(passes_match("cuda", heads=24, dim=128, queries=7040, keys=28160))


def test_without_a_gpu_the_passes_are_the_torch_path():
    from longlive_core.infer.attention_fp8_io import dequantized_output, per_tensor_e4m3_torch, smoothed_e4m3

    x = torch.randn(1, 2, 10, 16).to(torch.bfloat16)
    codes, descale, mean = smoothed_e4m3(x, smooth=True)
    ref_codes, ref_descale = per_tensor_e4m3_torch(x, x.float().mean(dim=2, keepdim=True))
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(descale, ref_descale)
    assert smoothed_e4m3(x, smooth=False)[2] is None
    out = dequantized_output(codes, descale, mean, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and float((out.float() - x.float()).norm() / x.float().norm()) < 0.05
