"""DVC stage `merge_w4a4`: models/ar/ + models/dmd/ -> models/w4a4/, the distilled model merged in float32
and held packed in NVFP4 in compressed-tensors' nvfp4-pack-quantized layout (model.safetensors and
config.json with its quantization_config), loaded back through the project's loader and compared with
the BF16 merged model on fixed inputs (``distill/merge.py``: ``merge_w4a4``; over
``merge_w4a4.max_rel_error`` the stage fails and models/w4a4 stays as it was):
reports/merge_w4a4/metrics.json. The folder also holds prompt enhancement's example bank
(enhance_examples.*: ``latents/example_bank.py``), made here where the latent cache is an input, so
the bundle, a copy of the folder, carries it."""
from __future__ import annotations

import dataclasses
from typing import Any

from longlive_core.config import ConfigError, stage_config
from longlive_core.devices import pick_device
from longlive_core.distill.config import MergeW4A4Config
from longlive_core.io.atomic import write_json
from longlive_core.models.folder import CONFIG, AdapterFolder, DiTFolder, as_json, read_adapter_folder, read_dit_folder
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
    from longlive_core.distill.merge import merge_w4a4

    ar, dmd = read_dit_folder(AR_MODEL, "train_ar"), read_adapter_folder(DMD_MODEL, "distill_dmd")
    metrics = merge_w4a4(AR_MODEL, DMD_MODEL, LATENTS, cfg, W4A4_MODEL, lambda q: w4a4_config(cfg, ar, dmd, q),
                         pick_device(cfg.device, f"{STAGE}.device"))
    write_identity(W4A4_MODEL, as_json(read_dit_folder(W4A4_MODEL, STAGE)), W4A4_IDENTITY)
    write_json({k: v for k, v in metrics.items() if k != "conversion"}, MERGE_W4A4_METRICS)
    run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    run.log_artifact(MERGE_W4A4_METRICS)
    run.log_artifact(W4A4_MODEL / CONFIG)
    return metrics


def one_line(s) -> str:
    return (f"{s['packed_layers']} layers packed, {s['disk_bytes'] / 2**20:.2f} MiB on disk ({s['size_ratio']:.2f}x "
            f"smaller than bf16; {s['quantized_size_ratio']:.2f}x for the quantized part); output error against the "
            f"BF16 merged model {s['rel_error_w4a4_vs_bf16']:.4f} (at most {s['max_rel_error']}), against the "
            f"generator as distilled {s['rel_error_w4a4_vs_distilled']:.4f}; {s['inputs']}; "
            f"{s['example_captions']} train captions kept as prompt enhancement's examples")


def main() -> None:
    main_for(STAGE, prepare, body, one_line)


if __name__ == "__main__":
    main()
