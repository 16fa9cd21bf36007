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
        HEADROOM,
        dequantized_output_torch,
        per_tensor_e4m3_torch,
        placed_e4m3_torch,
        triton_dequantized_output,
        triton_placed_e4m3,
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
    # a kept window (FP8Window): its scale with headroom, then a later pass's own rows quantized after the
    # cached ones, some past the headroom (they saturate, never NaN)
    codes, descale, mean = triton_smoothed_e4m3(k, True, HEADROOM)
    ref_codes, ref_descale = per_tensor_e4m3_torch(k, mean, HEADROOM)
    assert torch.equal(descale, ref_descale) and torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    own = made(queries, 8.0) * 3
    placed, ref = codes.clone(), codes.clone()
    triton_placed_e4m3(own, mean, descale, placed, keys - queries)
    placed_e4m3_torch(own, mean, descale, ref, keys - queries)
    assert torch.equal(placed.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(placed[:, :, :keys - queries].view(torch.uint8), codes[:, :, :keys - queries].view(torch.uint8))
    assert placed.float().isfinite().all() and placed.float().abs().max() == 448
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


def test_a_kept_window_takes_a_later_passs_own_rows_after_its_cached_ones():
    # a chunk's passes share the cached rows' E4M3 codes; each later pass writes only its own rows, with the
    # first pass's means and descales (the torch path here; passes_match checks the Triton launch's bits)
    from longlive_core.infer.attention_fp8_io import HEADROOM, FP8Window
    from longlive_core.quant.fp8 import e4m3_codes_torch

    g = torch.Generator().manual_seed(1)
    cached, own, heads, dim = 40, 8, 2, 16
    k = (torch.randn(1, heads, cached + own, dim, generator=g) + 4).to(torch.bfloat16)
    v = torch.randn(1, heads, cached + own, dim, generator=g).to(torch.bfloat16)
    window = FP8Window.of(k, v, own)
    assert window.cached == cached and window.k8.shape == k.shape == window.v8.shape
    shifted = k.float() - k.float().mean(dim=2, keepdim=True)
    assert torch.equal(window.descale_k.flatten(), shifted.abs().amax().reshape(1) / 448 * HEADROOM)
    first = window.k8.clone()
    k2 = (torch.randn(1, heads, own, dim, generator=g) + 4).to(torch.bfloat16)
    v2 = torch.randn(1, heads, own, dim, generator=g).to(torch.bfloat16)
    assert window.fits(k2, v2) and not window.fits(k2[:, :, :-1], v2[:, :, :-1])
    window.place(k2, v2)
    assert torch.equal(window.k8[:, :, :cached].view(torch.uint8), first[:, :, :cached].view(torch.uint8))
    expected = e4m3_codes_torch(k2.float() - window.k_mean, window.descale_k)
    assert torch.equal(window.k8[:, :, cached:].view(torch.uint8), expected.view(torch.uint8))
    # what the kernel reads is [cached; k2] to E4M3's precision (the headroom's binade included)
    for codes, descale, mean, x in ((window.k8, window.descale_k, window.k_mean, torch.cat([k[:, :, :cached], k2], 2)),
                                    (window.v8, window.descale_v, window.v_mean, torch.cat([v[:, :, :cached], v2], 2))):
        back = codes.float() * descale + mean
        assert float((back - x.float()).norm() / (x.float() - mean).norm()) < 0.05
