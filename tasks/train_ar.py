"""DVC stage `train_ar`: AR teacher-forcing training on data/latents/, written to models/ar/ (the EMA
weights as safetensors and config.json). The stage starts its ranks through torchrun
(train_ar.nnodes x train_ar.nproc; gloo on the CPU, NCCL on GPUs) and re-enters this module in each;
rank 0 logs to MLflow and writes reports/train_ar/. Checkpoints in checkpoints/train_ar/ (not a DVC output,
so DVC never deletes them) let a killed or extended run continue where it stopped."""
from __future__ import annotations

import dataclasses
from typing import Any

from longlive_core.config import ConfigError, stage_config
from longlive_core.devices import pick_device
from longlive_core.distributed.launch import under_torchrun
from longlive_core.latents.encode import EncodeLatentsConfig
from longlive_core.models.checkpoint import check_dit_weights, save_dit
from longlive_core.models.config import dit_config
from longlive_core.models.folder import (
    CONFIG,
    DiTFolder,
    Encoder,
    LatentGeometry,
    MultiShot,
    PrecisionRules,
    Sampling,
    VideoFormat,
    as_json,
)
from longlive_core.models.identity import write_identity
from longlive_core.models.vae import SPATIAL_STRIDE, TEMPORAL_STRIDE
from longlive_core.models.weights import CheckpointError, weights_identity
from longlive_core.tracking.lineage import CODE, code_digest, digest_file, digest_json, git_state, runtime_versions
from longlive_core.train.config import TrainARConfig
from longlive_core.train.data import sample_weights
from tasks.paths import (
    AR_CHECKPOINTS,
    AR_IDENTITY,
    AR_MODEL,
    CLIPS,
    LATENT_INDEX,
    LATENTS,
    SAMPLES,
    SHOTS,
    TRAIN_AR_HISTORY,
)
from tasks.stage import run_ranks

STAGE = "train_ar"


@dataclasses.dataclass(frozen=True)
class Prepared:
    train: TrainARConfig
    latents: EncodeLatentsConfig


def prepare(params: dict[str, Any]) -> Prepared:
    cfg = stage_config(TrainARConfig, STAGE, params)
    latents = stage_config(EncodeLatentsConfig, "encode_latents", params)
    if not under_torchrun():  # each rank checks its own GPU once started
        device = pick_device(cfg.parallel.device, f"{STAGE}.device")
        if cfg.activation_checkpointing == "budget":
            from longlive_core.distributed.ac_budget import require_limit

            require_limit(cfg.ac_memory_limit_gib, device, f"{STAGE}.ac_memory_limit_gib")
    if cfg.init != "tiny":
        try:
            check_dit_weights(cfg.init)
        except CheckpointError as exc:
            raise CheckpointError(f"{STAGE}.init: {exc} (or tiny, the demo's random model)") from exc
    if not LATENT_INDEX.is_file():
        raise ConfigError(f"{LATENT_INDEX} is missing: run encode_latents first (dvc repro encode_latents)")
    return Prepared(cfg, latents)


def digest_components(cfg: TrainARConfig) -> dict[str, str]:
    """What a checkpoint must match to be resumed, by name: the params that shape the math, the data
    drawn (the latent index and the sample weights), the starting weights, the world layout and the
    numeric code of training (its speed-only modules left out: tracking/lineage.py)."""
    return {"params": digest_json(cfg.resume_params()), "latent_index": digest_file(LATENT_INDEX),
            "sample_weights": digest_json(sorted(sample_weights(SAMPLES).items())),
            "init": weights_identity(cfg.init), "world": digest_json(cfg.parallel.world_layout()),
            CODE: code_digest("longlive_core.train.trainer")}


def model_config(p: Prepared, summary: dict) -> DiTFolder:
    """config.json of models/ar/: everything that rebuilds and runs the model without params.yaml."""
    t, c = p.train, p.latents.clip
    dit = dit_config(t.model)

    def encoder(path: str, **more) -> Encoder:
        return Encoder(path, weights_identity(path), 0 if path == "tiny" else None, **more)

    return DiTFolder(
        format="longlive-dit", stage=STAGE, dit={"name": t.model, **dataclasses.asdict(dit)},
        weights_dtype=t.export_dtype,
        latent=LatentGeometry(dit.in_channels, t.chunk_frames, c.height // SPATIAL_STRIDE, c.width // SPATIAL_STRIDE,
                              TEMPORAL_STRIDE, SPATIAL_STRIDE),
        video=VideoFormat(c.fps, c.height, c.width),
        vae=encoder(p.latents.vae), text_encoder=encoder(p.latents.text_encoder, max_length=p.latents.text_max_length),
        # not distilled: its own schedule; a chunk attends to at most the frames teacher forcing trained it on
        sampling=Sampling("flow-matching", None, t.num_train_timesteps, t.timestep_shift, window=t.max_latent_frames,
                          chunk_frames=t.chunk_frames, global_sink=0, shot_sink=0),
        multi_shot=MultiShot(t.shot_rope_offset, True),
        precision=PrecisionRules(t.precision.recipe, tuple(t.precision.skip), t.precision.keep_last_blocks),
        lineage={**git_state("."), "latent_index_sha256": digest_file(LATENT_INDEX), "init": t.init,
                 "init_sha256": weights_identity(t.init), "run_digest": summary["run_digest"],
                 "steps": summary["steps"], "step_ranges": summary["lineage"]})


def export(p: Prepared, summary: dict) -> None:
    import torch

    from longlive_core.models.wan_dit import WanDiT

    with torch.device("meta"):
        model = WanDiT(dit_config(p.train.model))
    dtype = getattr(torch, p.train.export_dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in summary.pop("ema_state").items()}, strict=True, assign=True)
    config = as_json(model_config(p, summary))
    save_dit(model, AR_MODEL, config=config)
    write_identity(AR_MODEL, config, AR_IDENTITY)


def body(p: Prepared, run) -> dict:
    import torch.distributed as dist

    from longlive_core.train.loop import report_history
    from longlive_core.train.online_latents import OnlineSource
    from longlive_core.train.trainer import TrainInputs, train  # torch.distributed's checkpointing: in the ranks only

    rank0 = dist.get_rank() == 0
    components = digest_components(p.train) if rank0 else None  # only rank 0 reads and writes checkpoint metadata
    online = OnlineSource(p.latents, SHOTS, CLIPS) if p.train.latent_source == "online" else None
    inputs = TrainInputs(LATENTS, SAMPLES, AR_CHECKPOINTS, components, online)
    digest = digest_json(components) if rank0 else ""
    run.set_tags({"input.latent_index.sha256": digest_file(LATENT_INDEX), "train_ar.run_digest": digest,
                  **{f"runtime.{k}": v for k, v in runtime_versions().items()}})
    summary = train(p.train, inputs, sink=lambda metrics, step: run.log_metrics(metrics, step=step))
    if not rank0:
        return summary
    summary["run_digest"] = digest
    export(p, summary)
    report_history(summary, TRAIN_AR_HISTORY)
    run.set_tags({"mfu_denominator": summary["mfu_denominator"]})
    run.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None})
    run.log_artifact(TRAIN_AR_HISTORY)
    run.log_artifact(AR_MODEL / CONFIG)
    return summary


def one_line(s) -> str:
    val = "" if s.get("final_val_loss") is None else f", val loss {s['final_val_loss']:.4f}"
    loss = "n/a" if s.get("final_loss") is None else f"{s['final_loss']:.4f}"
    return (f"{s['steps_run']} steps run to step {s['steps']} ({s['resume']}); loss {loss}{val}; "
            f"{s['skipped_steps']} skipped; {s['conversion']}")


def main() -> None:
    run_ranks(STAGE, prepare, body, one_line, lambda p: p.train.parallel)


if __name__ == "__main__":
    main()
