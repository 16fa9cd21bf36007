"""A LoRA adapter saved by peft and merged into the DiT in float32 gives peft's own unmerged forward;
quantized to packed W4A4 afterwards it stays close to it."""
from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from longlive_core.distill.lora import lora_config, merge_adapter
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant import convert_linears


def test_merged_adapter_equals_peft_forward_and_survives_w4a4(tmp_path):
    torch.manual_seed(0)
    peft_model = get_peft_model(WanDiT(DIT_CONFIGS["tiny"]), lora_config(rank=4, alpha=8))
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "dmd"))
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 48, 2, 4, 4, generator=g), torch.tensor([500.0]), torch.randn(1, 5, 32, generator=g))
    with torch.no_grad():
        expected = peft_model(*inputs)
        torch.manual_seed(0)  # the same base weights again
        merged = merge_adapter(WanDiT(DIT_CONFIGS["tiny"]), tmp_path / "dmd").eval()
        torch.testing.assert_close(merged(*inputs), expected, rtol=1e-5, atol=1e-5)
        torch.manual_seed(0)
        base = WanDiT(DIT_CONFIGS["tiny"])
        assert not torch.allclose(merged(*inputs), base(*inputs), atol=1e-3)  # the adapter changed something
        convert_linears(merged, "nvfp4", packed=True, overrides={"backend": "torch"})
        w4a4 = merged(*inputs)
    rel = float((w4a4 - expected).norm() / expected.norm())
    assert rel < 0.2, rel
    with pytest.raises(FileNotFoundError, match="run distill_dmd first"):
        merge_adapter(WanDiT(DIT_CONFIGS["tiny"]), tmp_path / "none")
