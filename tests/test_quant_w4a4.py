"""The W4A4 file: compressed-tensors' nvfp4-pack-quantized layout, read back bit for bit, decompressed
by compressed-tensors itself to our dequantized weights exactly, 3.5x smaller than bf16 for the
quantized part."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant import RECIPES, convert_linears
from longlive_core.quant.packed import dequantize_packed
from longlive_core.quant.w4a4 import (
    calibrate,
    load_packed_layers,
    packed_layers,
    quantization_config,
    recipe_from_notes,
    w4a4_state_dict,
)


@pytest.fixture(scope="module")
def packed():
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"]).eval()
    convert_linears(model, "nvfp4", packed=True, overrides={"backend": "torch"})
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 48, 2, 4, 4, generator=g), torch.tensor([500.0]), torch.randn(1, 5, 32, generator=g))
    return model, inputs


def test_saved_and_loaded_bit_for_bit(packed, tmp_path):
    model, inputs = packed
    amax = calibrate(model, lambda: model(*inputs))
    assert set(amax) == set(packed_layers(model)) and all(float(a) > 0 for a in amax.values())
    state = w4a4_state_dict(model, torch.float32, amax)
    assert not any(k.endswith(".weight") and k.rpartition(".")[0] in packed_layers(model) for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    notes = quantization_config(model, RECIPES["nvfp4"])
    QuantizationConfig.model_validate(notes["quantization_config"])  # compressed-tensors reads its config
    assert notes["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert "head.head" in notes["quantization_config"]["ignore"]

    loaded = load_file(str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        fresh = WanDiT(DIT_CONFIGS["tiny"])
    recipe = recipe_from_notes(notes["longlive_quantization"])
    recipe = dataclasses.replace(recipe, backend="torch")
    assert load_packed_layers(fresh, loaded, recipe) == len(packed_layers(model))
    fresh.load_state_dict({k: v for k, v in loaded.items() if not k.endswith("input_global_scale")}, strict=True,
                          assign=True)
    fresh.eval()
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(fresh(*inputs), model(*inputs))


def test_a_w4a4_file_with_misread_tensors_is_refused_at_load_naming_the_layer(packed, tmp_path):
    """Scales that are not E4M3 (the decode reads their bytes) or a missing scale: the folder is refused when it
    loads, with the layer and the file, not at the first forward."""
    from longlive_core.infer.model_folder import load_w4a4
    from longlive_core.models.weights import CheckpointError

    model, _ = packed
    state = w4a4_state_dict(model, torch.float32, {name: torch.tensor(1.0) for name in packed_layers(model)})
    name = next(iter(packed_layers(model)))
    notes = quantization_config(model, RECIPES["nvfp4"])
    # what load_w4a4 reads of the folder's config.json
    config = SimpleNamespace(longlive_quantization=notes["longlive_quantization"], dit_config=DIT_CONFIGS["tiny"])
    for broken, why in ((lambda s: s[f"{name}.weight_scale"].to(torch.bfloat16), "float8_e4m3fn"),
                        (None, "weight_scale is missing")):
        bad = dict(state)
        if broken is None:
            del bad[f"{name}.weight_scale"]
        else:
            bad[f"{name}.weight_scale"] = broken(bad)
        save_file(bad, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=f"layer {name}: .*{why}.*merge_w4a4"):
            load_w4a4(tmp_path, config)


def test_compressed_tensors_decompresses_our_weights_exactly(packed):
    model, _ = packed
    scheme = QuantizationConfig.model_validate(
        quantization_config(model, RECIPES["nvfp4"])["quantization_config"]).config_groups["group_0"]
    for name, layer in packed_layers(model).items():
        theirs = NVFP4PackedCompressor.decompress({"weight_packed": layer.weight_packed,
                                                    "weight_scale": layer.weight_scale,
                                                    "weight_global_scale": layer.weight_global_scale}, scheme)
        ours = dequantize_packed(layer.weight_packed, layer.weight_scale, layer.weight_global_scale,
                                 (layer.out_features, layer.in_features), torch.bfloat16)
        assert theirs["weight"].dtype == torch.bfloat16 and torch.equal(theirs["weight"], ours), name


def test_the_quantized_part_is_three_and_a_half_times_smaller_than_bf16(packed):
    model, _ = packed
    layers = packed_layers(model).values()
    packed_bytes = sum(layer.packed_bytes() for layer in layers)
    bf16_bytes = sum(2 * layer.in_features * layer.out_features for layer in layers)
    assert 3.4 < bf16_bytes / packed_bytes < 3.6
