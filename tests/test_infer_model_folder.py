"""A W4A4 model folder rebuilt by the loader inference uses: the packed layers bit for bit, the same
outputs as the model it was saved from on the CPU (to float rounding), and runnable on the GPU (the emulated NVFP4 GEMMs
through Triton) with the CPU's outputs to rounding. And a folder of another format is refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from longlive_core.infer.model_folder import W4A4_WEIGHTS, load_model_folder
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.folder import write_config
from longlive_core.models.wan_dit import WanDiT
from longlive_core.models.weights import CheckpointError
from longlive_core.quant import convert_linears
from longlive_core.quant.w4a4 import packed_layers, w4a4_state_dict

from .helpers.ar_model import folder_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"]).eval()
    convert_linears(model, "nvfp4", packed=True, overrides={"backend": "torch"})
    root = tmp_path_factory.mktemp("w4a4")
    save_file(w4a4_state_dict(model, torch.float32), str(root / W4A4_WEIGHTS))
    write_config(folder_config(format="longlive-w4a4", stage="merge_w4a4", quantization_config={},
                               longlive_quantization={"weight_tile": [16, 16], "four_over_six": None}), root)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 48, 2, 4, 4, generator=g), torch.tensor([681.0]), torch.randn(1, 5, 32, generator=g))
    return root, model, inputs


def run(model, inputs, device):
    x, t, text = inputs
    with torch.no_grad():
        return model(x.to(device), t.to(device), text.to(device)).float().cpu()


def test_the_loader_rebuilds_the_packed_model_on_the_cpu(folder, tmp_path):
    root, model, inputs = folder
    loaded, config = load_model_folder(root)
    assert config.format == "longlive-w4a4"
    for name, layer in packed_layers(model).items():
        mine = dict(loaded.named_modules())[name]
        assert torch.equal(mine.weight_packed, layer.weight_packed)
        assert torch.equal(mine.weight_scale, layer.weight_scale)
    torch.testing.assert_close(run(loaded, inputs, "cpu"), run(model, inputs, "cpu"), rtol=1e-5, atol=1e-5)
    (tmp_path / "config.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a model folder this project runs"):
        load_model_folder(tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_loader_runs_the_w4a4_model_on_the_gpu(folder):
    root, _, inputs = folder
    cpu = run(load_model_folder(root)[0], inputs, "cpu")
    gpu = run(load_model_folder(root, device="cuda")[0], inputs, "cuda")
    assert torch.isfinite(gpu).all()
    assert float((gpu - cpu).norm() / cpu.norm()) < 1e-3  # Triton's emulation against torch's
