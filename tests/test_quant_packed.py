"""The packed frozen NVFP4 linear (W4A4): the same forward as the training layer on the weight it was
packed from, an input gradient through the NVFP4 dgrad, a quarter of BF16's bytes, peft's LoRA
training on top of a packed model, and the Triton decode of its weight bit for bit as torch's (on the
CPU under Triton's interpreter, on a GPU at the 5B's widest linear). No conftest import: the GPU image
runs this file with --noconftest."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant import RECIPES, NVFP4Linear, convert_linears
from longlive_core.quant.packed import PackedNVFP4Linear, weight_operand
from tests.test_infer_kv_attention import in_the_interpreter


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-4over6"])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_forward_equals_the_training_layer_and_gives_its_dgrad(recipe, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    rtn = dataclasses.replace(RECIPES[recipe], grad_stochastic=False, backend="torch")
    reference, packed = NVFP4Linear.from_linear(linear, rtn), PackedNVFP4Linear.from_linear(linear, rtn)
    x = torch.randn(3, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = packed(x), reference(x_ref)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert not any(p.requires_grad for p in packed.parameters())  # nothing of it trains
    # a quarter of bf16 and a little: 4-bit codes, one E4M3 scale per 16 values, one amax
    assert packed.packed_bytes() == 64 * 48 // 2 + 64 * 48 // 16 + 4
    torch.testing.assert_close(packed.weight, linear.weight, rtol=0.3, atol=0.05)


def test_lora_trains_on_a_packed_backbone():
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    report = convert_linears(model, "nvfp4", packed=True, overrides={"backend": "torch"})
    assert report.converted and all(isinstance(model.get_submodule(n), PackedNVFP4Linear) for n in report.converted)
    assert not any(isinstance(m, nn.Linear) and not isinstance(m, PackedNVFP4Linear) and n.startswith("blocks")
                   and n.endswith(("q", "k", "v", "o")) for n, m in model.named_modules())
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0,
                                            target_modules=["self_attn.q", "self_attn.k", "self_attn.v",
                                                            "self_attn.o", "ffn.0", "ffn.2"]))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    latents, text = torch.randn(1, 48, 2, 4, 4), torch.randn(1, 5, 32)
    out = lora(latents, torch.tensor([500.0]), text)
    out.square().mean().backward()
    grads = {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n or "lora_B" in n)


def test_compiled_inference_calls_the_packed_linear_as_one_operator():
    """Under torch.compile with dynamic shapes (a video's first chunk is shorter) the W4A4 product is
    the ``longlive::packed_nvfp4_linear`` operator: the same numbers as eager, whatever the length."""
    torch.manual_seed(0)
    packed = PackedNVFP4Linear.from_linear(nn.Linear(64, 32), dataclasses.replace(RECIPES["nvfp4"], backend="torch"))
    compiled = torch.compile(packed, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for tokens in (5, 17):
            x = torch.randn(2, tokens, 64)
            assert torch.equal(compiled(x), packed(x))
    graph = torch._dynamo.explain(packed)(x).graphs[0]
    assert any("packed_nvfp4_linear" in str(node.target) for node in graph.graph.nodes)


def decode_matches(device: str, rows: int = 37, cols: int = 784) -> bool:
    """The weight's partial operand from the Triton kernel against the torch path, bit for bit (signed
    zeros included): every code under every non-negative finite E4M3 scale byte (one block a byte; a
    block's scale is its amax over S_enc, never negative), then random codes and scales in a shape that
    is no multiple of the kernel's tile."""
    every_code = torch.tensor([(2 * i) | ((2 * i + 1) << 4) for i in range(8)], dtype=torch.uint8)  # codes 0..15
    finite = torch.arange(0x7F, dtype=torch.uint8)  # 0x7F is NaN; bit 7 the sign
    g = torch.Generator().manual_seed(0)
    random_scales = torch.randint(0, 0x7F, (rows, cols // 16), generator=g, dtype=torch.uint8)
    cases = [(every_code.repeat(len(finite), 1), finite[:, None]),
             (torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8), random_scales)]
    for packed, scale in cases:
        packed, scale = packed.to(device), scale.to(device).view(torch.float8_e4m3fn)
        shape, one = (packed.shape[0], 2 * packed.shape[1]), torch.ones(1, device=device)
        kernel, dec = weight_operand(packed, scale, one, shape, backend="triton")
        reference, ref_dec = weight_operand(packed, scale, one, shape, backend="torch")
        assert kernel.dtype == torch.bfloat16 and torch.equal(dec, ref_dec)
        if not torch.equal(kernel.view(torch.int16), reference.view(torch.int16)):
            return False
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel itself")
def test_the_weight_decode_kernel_is_torchs_bit_for_bit_in_the_interpreter():
    in_the_interpreter("from tests.test_quant_packed import decode_matches; assert decode_matches('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_weight_decode_kernel_is_torchs_bit_for_bit_on_the_gpu(monkeypatch):
    from longlive_core.quant import triton_launch

    monkeypatch.setattr(triton_launch, "VERIFY", True)  # the cached launch is Triton's own pick
    assert decode_matches("cuda", rows=14336, cols=3072)  # the FFN's first linear
