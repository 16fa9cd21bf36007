"""The W4A4 model on disk, in compressed-tensors' ``nvfp4-pack-quantized`` layout, and back.

Every packed layer (:class:`~longlive_core.quant.packed.PackedNVFP4Linear`) is stored as its
buffers, which carry compressed-tensors' names: ``<layer>.weight_packed`` (uint8, element 2i in
the low nibble), ``<layer>.weight_scale`` (float8_e4m3fn, out x in/16; a 16x16 tile's scale
repeated over its 16 rows), ``<layer>.weight_global_scale`` (float32 [1]: the encode scale
448 * 6 / amax, or 256 * 6 / amax under Four-Over-Six; ModelOpt stores the reciprocal). No high-
precision copy of a quantized weight is kept; every other tensor (the skip list: embeddings, the
head, norms, modulation) is stored in ``dtype``. ``config.json``'s ``quantization_config`` is made
by compressed-tensors' own ``QuantizationConfig``: weights FP4 in groups of 16 with a tensor-wide
global scale, activations FP4 in groups of 16 quantized at run time. ``input_global_scale`` holds
the encode scale of each layer's input amax calibrated over the inputs given to :func:`calibrate`
(runtimes that want a static one read it; this project's layers compute the amax of every call).
What that config cannot say (16x16 weight tiles, Four-Over-Six) is in ``longlive_quantization``.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from longlive_core.quant.linear import NVFP4Recipe
from longlive_core.quant.nvfp4 import E4M3_MAX, global_encode_scale
from longlive_core.quant.packed import PackedNVFP4Linear

FORMAT = "nvfp4-pack-quantized"
PACKED_KEYS = ("weight_packed", "weight_scale", "weight_global_scale")


def packed_layers(model: nn.Module) -> dict[str, PackedNVFP4Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, PackedNVFP4Linear)}


def calibrate(model: nn.Module, run) -> dict[str, torch.Tensor]:
    """Each packed layer's input amax over what ``run()`` feeds the model (float32 scalars)."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, layer in packed_layers(model).items():
        def record(_module, args, name=name):
            value = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], value) if name in amax else value
        hooks.append(layer.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return amax


def w4a4_state_dict(model: nn.Module, dtype: torch.dtype, input_amax: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors of the W4A4 file: packed layers as they are held, the rest in ``dtype``."""
    layers = packed_layers(model)
    state = {}
    for key, value in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner in layers and leaf in PACKED_KEYS:
            state[key] = value.contiguous()
        else:
            state[key] = value.to(dtype).contiguous() if value.is_floating_point() else value.contiguous()
    for name, amax in (input_amax or {}).items():
        state[f"{name}.input_global_scale"] = global_encode_scale(amax, E4M3_MAX).reshape(1).float()
    return state


def quantization_config(model: nn.Module, recipe: NVFP4Recipe) -> dict:
    """``config.json``'s ``quantization_config`` (compressed-tensors' schema) and our own notes."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    def fp4(dynamic) -> QuantizationArgs:
        return QuantizationArgs(num_bits=4, type="float", symmetric=True, group_size=16, strategy="tensor_group",
                                dynamic=dynamic, scale_dtype=torch.float8_e4m3fn)

    layers = packed_layers(model)
    kept = sorted(name for name, m in model.named_modules()
                  if isinstance(m, nn.Linear) and not isinstance(m, PackedNVFP4Linear))
    scheme = QuantizationScheme(targets=["Linear"], weights=fp4(False), input_activations=fp4("local"))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=FORMAT, quantization_status="compressed",
                                ignore=kept)
    return {"quantization_config": config.model_dump(mode="json"),
            "longlive_quantization": {"weight_tile": list(recipe.weight_tile), "four_over_six": recipe.four_over_six,
                                      "activations": "1x16 blocks, global amax of every call (dynamic)",
                                      "input_global_scale": "calibrated encode scale (448 * 6 / amax) per layer",
                                      "packed_layers": sorted(layers)}}


def load_packed_layers(model: nn.Module, state: dict[str, torch.Tensor], recipe: NVFP4Recipe) -> int:
    """Replaces every ``nn.Linear`` of ``model`` whose packed tensors are in ``state`` by a packed layer
    holding them (bit for bit); returns how many. The rest of ``state`` loads as usual."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{name}.weight_packed" not in state:
            continue
        bias = state.get(f"{name}.bias")
        try:
            layer = PackedNVFP4Linear.from_packed(module.in_features, module.out_features,
                                                  state[f"{name}.weight_packed"], state[f"{name}.weight_scale"],
                                                  state[f"{name}.weight_global_scale"],
                                                  None if bias is None else bias.float(), recipe)
        except KeyError as e:
            raise ValueError(f"layer {name}: {e.args[0]} is missing beside its weight_packed") from None
        except ValueError as e:
            raise ValueError(f"layer {name}: {e}") from None
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        count += 1
    return count


def recipe_from_notes(notes: dict) -> NVFP4Recipe:
    return dataclasses.replace(NVFP4Recipe(), weight_tile=tuple(notes["weight_tile"]),
                               four_over_six=notes["four_over_six"])

