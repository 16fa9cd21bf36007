"""DVC stage `merge_w4a4`: models/ar/ + models/dmd/ -> models/w4a4/, the distilled model merged in float32
and held packed in NVFP4 in compressed-tensors' nvfp4-pack-quantized layout (model.safetensors and
config.json with its quantization_config), loaded back through the project's loader and compared with
the BF16 merged model on fixed inputs: reports/merge_w4a4/metrics.json."""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

from longlive_core.config import ConfigError, stage_config
from longlive_core.devices import pick_device
from longlive_core.distill.config import MergeW4A4Config
from longlive_core.io.atomic import atomic_dir, write_json
from longlive_core.models.folder import (
    CONFIG,
    AdapterFolder,
    DiTFolder,
    read_adapter_folder,
    read_dit_folder,
    write_config,
)
from longlive_core.models.identity import identity_digest, write_identity
from longlive_core.tracking.lineage import git_state
from tasks.paths import (
    AR_IDENTITY,
    AR_MODEL,
    DMD_IDENTITY,
    DMD_MODEL,
    LATENT_INDEX,
    LATENTS,
    MERGE_W4A4_METRICS,
    W4A4_IDENTITY,
    W4A4_MODEL,
)
from tasks.stage import main_for

STAGE = "merge_w4a4"


def prepare(params: dict[str, Any]) -> MergeW4A4Config:
    cfg = stage_config(MergeW4A4Config, STAGE, params)
    pick_device(cfg.device, f"{STAGE}.device")
    read_dit_folder(AR_MODEL, "train_ar")
    read_adapter_folder(DMD_MODEL, "distill_dmd")
    if not LATENT_INDEX.is_file():
        raise ConfigError(f"{LATENT_INDEX} is missing: run encode_latents first (dvc repro encode_latents)")
    return cfg


def w4a4_config(cfg: MergeW4A4Config, ar: DiTFolder, dmd: AdapterFolder, quantization: dict) -> DiTFolder:
    """config.json of models/w4a4/: the AR model's, made few-step by the adapter, and quantized."""
    return dataclasses.replace(
        ar, format="longlive-w4a4", stage=STAGE, weights_dtype=cfg.dtype, sampling=dmd.sampling,
        precision=dataclasses.replace(ar.precision, recipe=cfg.recipe), **quantization,
        lineage={**git_state("."), "ar_model": identity_digest(AR_IDENTITY),
                 "dmd_adapter": identity_digest(DMD_IDENTITY), "ar_lineage": ar.lineage, "dmd_lineage": dmd.lineage})


def body(cfg: MergeW4A4Config, run) -> dict:
    import torch
    from safetensors.torch import save_file

    from longlive_core.distill.merge import chunk_inputs, merged_model, outputs, relative_error
    from longlive_core.infer.model_folder import W4A4_WEIGHTS, load_w4a4
    from longlive_core.quant.recipe import RECIPES, convert_linears
    from longlive_core.quant.w4a4 import calibrate, packed_layers, quantization_config, w4a4_state_dict

    device = pick_device(cfg.device, f"{STAGE}.device")
    dtype = getattr(torch, cfg.dtype)
    ar, dmd = read_dit_folder(AR_MODEL, "train_ar"), read_adapter_folder(DMD_MODEL, "distill_dmd")
    chunk, steps = ar.latent.chunk_frames, list(dmd.sampling.steps)
    shot_offset = ar.multi_shot.shot_rope_offset
    calibration = chunk_inputs(LATENTS, chunk, shot_offset, steps, cfg.calibration_inputs, cfg.seed, "calibrate")
    evaluation = chunk_inputs(LATENTS, chunk, shot_offset, steps, cfg.eval_inputs, cfg.seed, "evaluate")

    model = merged_model(AR_MODEL, ar, DMD_MODEL).to(device)
    y_fp32 = outputs(model, evaluation, torch.float32, device)
    reference = copy.deepcopy(model).to(torch.bfloat16)  # the BF16 merged model
    y_bf16 = outputs(reference, evaluation, torch.bfloat16, device)
    bf16_bytes = sum(t.numel() * 2 for t in reference.state_dict().values())
    del reference
    report = convert_linears(model, cfg.recipe, skip=ar.precision.skip, keep_last_blocks=ar.precision.keep_last_blocks,
                             packed=True)
    layers = packed_layers(model)
    amax = calibrate(model, lambda: outputs(model, calibration, torch.float32, device))
    state = {k: v.cpu() for k, v in w4a4_state_dict(model, dtype, amax).items()}
    quantization = quantization_config(model, RECIPES[cfg.recipe])
    packed_bytes = sum(layer.packed_bytes() for layer in layers.values())
    packed_bf16_bytes = sum(layer.in_features * layer.out_features * 2 for layer in layers.values())
    with atomic_dir(W4A4_MODEL) as staging:
        save_file(state, os.fspath(staging / W4A4_WEIGHTS), metadata={"format": "pt"})
        config = write_config(w4a4_config(cfg, ar, dmd, quantization), staging)
    write_identity(W4A4_MODEL, config, W4A4_IDENTITY)
    loaded = load_w4a4(W4A4_MODEL, read_dit_folder(W4A4_MODEL, STAGE), device)  # what inference will load
    y_w4a4 = outputs(loaded, evaluation, dtype, device)
    metrics = {
        "disk_bytes": (W4A4_MODEL / W4A4_WEIGHTS).stat().st_size,
        "bf16_bytes": bf16_bytes,
        "size_ratio": round(bf16_bytes / (W4A4_MODEL / W4A4_WEIGHTS).stat().st_size, 4),
        "quantized_packed_bytes": packed_bytes,
        "quantized_bf16_bytes": packed_bf16_bytes,
        "quantized_size_ratio": round(packed_bf16_bytes / packed_bytes, 4),
        "packed_layers": len(layers),
        "kept_linears": len(report.kept),
        "rel_error_w4a4_vs_bf16": relative_error(y_w4a4, y_bf16),
        "rel_error_bf16_vs_fp32": relative_error(y_bf16, y_fp32),
        "eval_inputs": len(evaluation),
        "calibration_inputs": len(calibration),
    }
    write_json(metrics, MERGE_W4A4_METRICS)
    run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    run.log_artifact(MERGE_W4A4_METRICS)
    run.log_artifact(W4A4_MODEL / CONFIG)
    return {**metrics, "conversion": report.summary()}


def one_line(s) -> str:
    return (f"{s['packed_layers']} layers packed, {s['disk_bytes'] / 2**20:.2f} MiB on disk ({s['size_ratio']:.2f}x "
            f"smaller than bf16; {s['quantized_size_ratio']:.2f}x for the quantized part); output error against the "
            f"BF16 merged model {s['rel_error_w4a4_vs_bf16']:.4f}")


def main() -> None:
    main_for(STAGE, prepare, body, one_line)


if __name__ == "__main__":
    main()
