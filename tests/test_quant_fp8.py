"""FP8 W8A8 layers: row-wise E4M3 numerics, the converted model, and the Triton quantizer (CUDA)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.fp8 import E4M3_MAX, FP8Linear, quantize_rows_torch
from longlive_core.quant.recipe import convert_linears_fp8


def test_row_scales_map_each_rows_amax_to_448_and_the_round_trip_is_close():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows six decades apart
    x[5] = 0
    codes, scale = quantize_rows_torch(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    assert torch.equal(codes.float().abs().amax(dim=1)[[0, 63]], torch.full((2,), E4M3_MAX))
    back = codes.float() * scale
    assert torch.equal(back[5], torch.zeros(256))
    rel = (back - x).norm(dim=1) / x.norm(dim=1).clamp(min=1e-30)
    assert float(rel[x.norm(dim=1) > 0].max()) < 0.04  # E4M3: 3 mantissa bits


def test_an_fp8_linear_tracks_the_bf16_one_and_holds_no_high_precision_weight():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128).to(torch.bfloat16)
    layer = FP8Linear.from_linear(linear)
    x = torch.randn(4, 10, 256, dtype=torch.bfloat16)
    ref = linear(x).float()
    assert float((layer(x).float() - ref).norm() / ref.norm()) < 0.05
    assert set(layer.state_dict()) == {"weight_fp8", "weight_scale", "bias"}
    assert layer.state_dict()["weight_fp8"].dtype == torch.float8_e4m3fn


def test_a_converted_dit_keeps_its_skip_list_and_stays_close():
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"]).eval()
    x, t, text = torch.randn(1, 48, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 5, 32)
    with torch.no_grad():
        ref = model(x, t, text)
        report = convert_linears_fp8(model)
        out = model(x, t, text)
    assert report.converted and all(".blocks." in f".{n}" for n in report.converted)
    assert "head.head" in report.kept and isinstance(model.blocks[0].ffn[0], FP8Linear)
    assert float((out - ref).norm() / ref.norm()) < 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton quantizer needs CUDA")
def test_the_triton_quantizer_gives_torchs_codes_and_scales():
    from longlive_core.quant.fp8_kernel import quantize_rows_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in ((7040, 3072), (33, 14336), (5, 100)):
        x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
        x[0] = 0
        q, s = quantize_rows_triton(x)
        q_ref, s_ref = quantize_rows_torch(x)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm's FP8 GEMM needs CUDA")
def test_the_cuda_layer_equals_the_cpu_products_to_bf16_rounding():
    torch.manual_seed(0)
    linear = nn.Linear(3072, 1024).to(torch.bfloat16)
    x = torch.randn(256, 3072, dtype=torch.bfloat16)
    cpu = FP8Linear.from_linear(linear)(x).float()
    gpu = FP8Linear.from_linear(linear.cuda())(x.cuda()).float().cpu()
    assert float((gpu - cpu).norm() / cpu.norm()) < 0.01  # accumulation order and bf16 rounding only
