"""DVC stage `distill_dmd`: DMD distillation of models/ar/ into a few-step generator, written to
models/dmd/ as a peft LoRA adapter (adapter_model.safetensors, adapter_config.json) with config.json.
The stage starts its ranks through torchrun (distill_dmd.nnodes x nproc), as train_ar does; rank 0
logs to MLflow and writes reports/distill_dmd/. Checkpoints in checkpoints/distill_dmd/ (kept by DVC
between runs) let a killed run continue from its last one."""
from __future__ import annotations

import os
from typing import Any

from longlive_core.config import ConfigError, stage_config
from longlive_core.devices import pick_device
from longlive_core.distill.config import DistillDMDConfig
from longlive_core.distill.lora import LORA_TARGETS
from longlive_core.distributed.launch import under_torchrun
from longlive_core.io.atomic import atomic_dir
from longlive_core.models.folder import (
    ADAPTER_FORMAT,
    CONFIG,
    AdapterFolder,
    AdapterSettings,
    Sampling,
    read_dit_folder,
    write_config,
)
from longlive_core.models.identity import identity_digest, write_identity
from longlive_core.tracking.lineage import CODE, code_digest, digest_file, digest_json, git_state, runtime_versions
from tasks.paths import (
    AR_IDENTITY,
    AR_MODEL,
    DISTILL_DMD_HISTORY,
    DMD_CHECKPOINTS,
    DMD_IDENTITY,
    DMD_MODEL,
    LATENT_INDEX,
    LATENTS,
)
from tasks.stage import run_ranks

STAGE = "distill_dmd"


def prepare(params: dict[str, Any]) -> DistillDMDConfig:
    cfg = stage_config(DistillDMDConfig, STAGE, params)
    if not under_torchrun():  # each rank checks its own GPU once started
        device = pick_device(cfg.parallel.device, f"{STAGE}.device")
        if cfg.activation_checkpointing == "budget":
            from longlive_core.distributed.ac_budget import require_limit

            require_limit(cfg.ac_memory_limit_gib, device, f"{STAGE}.ac_memory_limit_gib")
    cfg.check_chunk(read_dit_folder(AR_MODEL, "train_ar").latent.chunk_frames)
    if not LATENT_INDEX.is_file():
        raise ConfigError(f"{LATENT_INDEX} is missing: run encode_latents first (dvc repro encode_latents)")
    return cfg


def digest_components(cfg: DistillDMDConfig) -> dict[str, str]:
    """What a checkpoint must match to be resumed, by name: the params that shape distillation, the AR
    model, the prompts (the latent index), the world layout and the numeric code of distillation."""
    return {"params": digest_json(cfg.resume_params()), "ar_model": identity_digest(AR_IDENTITY),
            "latent_index": digest_file(LATENT_INDEX), "world": digest_json(cfg.parallel.world_layout()),
            CODE: code_digest("longlive_core.distill.trainer")}


def model_config(cfg: DistillDMDConfig, summary: dict) -> AdapterFolder:
    """config.json of models/dmd/: what the adapter is, what it was distilled from and for."""
    ar = read_dit_folder(AR_MODEL, "train_ar")
    return AdapterFolder(
        format=ADAPTER_FORMAT, stage=STAGE, base_model=str(AR_MODEL),
        base_model_identity=identity_digest(AR_IDENTITY),  # the adapter means something on these weights alone
        adapter=AdapterSettings(cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, tuple(LORA_TARGETS), "default"),
        sampling=Sampling("few-step", tuple(cfg.denoising_steps), window=cfg.window,
                          chunk_frames=ar.latent.chunk_frames, global_sink=cfg.global_sink, shot_sink=cfg.shot_sink),
        distillation={"recipe": cfg.recipe, "real_guidance": cfg.real_guidance, "fake_guidance": cfg.fake_guidance,
                      "steps": cfg.steps},
        lineage={**git_state("."), "latent_index_sha256": digest_file(LATENT_INDEX),
                 "run_digest": summary["run_digest"], "steps": summary["steps"], "step_ranges": summary["lineage"]})


def export(cfg: DistillDMDConfig, adapter: dict, lora_config, summary: dict) -> None:
    from safetensors.torch import save_file

    with atomic_dir(DMD_MODEL) as staging:
        save_file({k: v.contiguous() for k, v in adapter.items()}, os.fspath(staging / "adapter_model.safetensors"))
        lora_config.save_pretrained(os.fspath(staging))  # adapter_config.json, as peft reads it
        config = write_config(model_config(cfg, summary), staging)
    write_identity(DMD_MODEL, config, DMD_IDENTITY)


def body(cfg: DistillDMDConfig, run) -> dict:
    import torch.distributed as dist

    # torch.distributed's checkpointing: in the ranks only
    from longlive_core.distill.trainer import DistillInputs, DMDTrainer, memory_comparison
    from longlive_core.train.loop import report_history

    rank0 = dist.get_rank() == 0
    components = digest_components(cfg) if rank0 else None  # only rank 0 reads and writes checkpoint metadata
    inputs = DistillInputs(AR_MODEL, LATENTS, DMD_CHECKPOINTS, components)
    trainer = DMDTrainer(cfg, inputs)
    digest = digest_json(components) if rank0 else ""
    run.set_tags({"input.ar_model": components["ar_model"] if rank0 else "", "distill_dmd.run_digest": digest,
                  **{f"runtime.{k}": v for k, v in runtime_versions().items()}})
    summary = trainer.run(sink=lambda metrics, step: run.log_metrics(metrics, step=step))
    summary["run_digest"] = digest
    adapter, lora_config = summary.pop("adapter_state"), trainer.roles.lora_config
    if rank0:
        export(cfg, adapter, lora_config, summary)
    if cfg.memory_comparison:
        del trainer  # each mode is measured from a clean start
        summary["memory_comparison"] = memory_comparison(cfg, inputs, DMD_CHECKPOINTS / "memory_comparison")
    if not rank0:
        return summary
    report_history(summary, DISTILL_DMD_HISTORY)
    run.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None})
    memory = summary.get("memory_comparison", {})
    if memory.get("measured"):
        run.log_metrics({"peak_memory_vs_bf16_full_weights": memory["ratio"]})
    run.log_artifact(DISTILL_DMD_HISTORY)
    run.log_artifact(DMD_MODEL / "adapter_config.json")
    run.log_artifact(DMD_MODEL / CONFIG)
    return summary


def one_line(s) -> str:
    critic = ("" if "critic_eval_loss_first" not in s else
              f"; critic loss at fixed timesteps {s['critic_eval_loss_first']:.4f} -> {s['critic_eval_loss_last']:.4f}")
    memory = s.get("memory_comparison", {})
    # the comparison's own peaks: under budget the run's peak is its plan's, not the comparison's
    against = (f"; one iteration with {memory['activation_checkpointing']} checkpointing {memory['peak_mb']:.0f} MiB, "
               f"{memory['ratio']:.2f}x BF16 full-weight distillation's {memory['bf16_full_weights_peak_mb']:.0f} MiB"
               if memory.get("measured") else "")
    return (f"{s['steps_run']} steps run to step {s['steps']} ({s['resume']}){critic}; {s['skipped_steps']} skipped; "
            f"peak memory {s['peak_memory_mb']:.0f} MiB{against}; {s['conversion']}")


def main() -> None:
    run_ranks(STAGE, prepare, body, one_line, lambda cfg: cfg.parallel)


if __name__ == "__main__":
    main()
