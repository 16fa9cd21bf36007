"""Any model folder the chain makes (MISSION.md "Model folders") as a runnable ``WanDiT``: train_ar's
``longlive-dit`` folders and merge_w4a4's ``longlive-w4a4`` ones (the linear layers held packed in
NVFP4, activations quantized in 1x16 blocks at run time, emulated where the GPU has no FP4 GEMM)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from longlive_core.models.checkpoint import load_dit, load_safetensors
from longlive_core.models.folder import DiTFolder, read_dit_folder
from longlive_core.models.wan_dit import WanDiT
from longlive_core.models.weights import CheckpointError
from longlive_core.quant.w4a4 import load_packed_layers, recipe_from_notes

W4A4_WEIGHTS = "model.safetensors"


def load_w4a4(directory: str | Path, config: DiTFolder, device: str | torch.device = "cpu",
              backend: str | None = None) -> WanDiT:
    """The W4A4 model of ``directory``: packed layers bit for bit as stored, the rest in the stored
    dtype; ``backend`` overrides the recipe's GEMM emulation (None: Triton on CUDA, torch elsewhere)."""
    path = Path(directory) / W4A4_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: run merge_w4a4 (dvc repro merge_w4a4)")
    state = load_safetensors(path)
    recipe = dataclasses.replace(recipe_from_notes(config.longlive_quantization), backend=backend)
    with torch.device("meta"):
        model = WanDiT(config.dit_config)
    try:
        load_packed_layers(model, state, recipe)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; it is not a W4A4 file merge_w4a4 wrote: make it again (dvc repro "
                              f"merge_w4a4)") from None
    model.load_state_dict({k: v for k, v in state.items() if not k.endswith(".input_global_scale")}, strict=True,
                          assign=True)
    return model.to(device).eval()


def load_model_folder(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
                      ) -> tuple[WanDiT, DiTFolder]:
    """(the model, its config.json); ``dtype`` casts a longlive-dit folder's weights (a W4A4 folder
    keeps what it holds)."""
    config = read_dit_folder(directory)
    if config.format == "longlive-w4a4":
        return load_w4a4(directory, config, device), config
    return load_dit(directory, config.dit_config, dtype, device).eval(), config
