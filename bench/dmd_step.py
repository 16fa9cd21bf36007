"""One DMD iteration (a generator step and a critic step) at the real 5B block dimensions, by phase,
with the peak GPU memory of each way to hold the three roles.

    PYTHONPATH=. python bench/dmd_step.py [--blocks 8] [--frames 32] [--modes nvfp4-lora bf16-lora bf16-full]
                                          [--steps 2] [--ac full]

Modes: ``nvfp4-lora``, what ``distill_dmd`` runs in production: one frozen backbone whose linears are
held packed in NVFP4 (no master weight), with the generator's and the fake score's LoRA adapters
(rank 128) in BF16 on top; ``bf16-lora``: the same with a float32-master backbone computed in BF16;
``bf16-full``: self-forcing's full-weight distillation, three whole copies, the generator and the
fake score trained with AdamW. The iteration is ``DMDTrainer.train_step`` with ``generator_every``
1: the generator's rollout (chunks of 8 latent frames, the 4-step list, the exit step drawn, its
gradient through every chunk's exit step), the fake and the real (guided: two passes) scores over
the teacher-forcing layout of the 32 generated frames, backward and AdamW; then the critic's
rollout, fake-score flow loss, backward and AdamW. Latents 44x80 (880 tokens per frame), 512-token
captions; activation checkpointing ``--ac`` of every role's blocks (``budget:G``: ``activation_checkpointing:
budget`` with ``ac_memory_limit_gib: G``, its plans and profiles written to ``--out``/ac-plans, the
planner's numbers in the row). Each mode runs in its own
process (peak memory from a clean start); one warm-up iteration (compilation), then the mean of
``--steps`` timed ones. ``--memory-peak``: one more iteration with its allocations recorded, and what
was live at its peak, by line, written to ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from bench.gpu_setup import one_rank_group, random_dit_on_gpu
from bench.memory_peak import record_peak

H, W, TEXT_TOKENS = 44, 80, 512


def make_inputs(root: Path, frames: int, blocks: int) -> tuple[Path, Path]:
    """A latent cache of one train and one val sample, and a models/ar folder's config.json (the weights
    themselves are made on the GPU: see ``random_dit``)."""
    from longlive_core.latents.files import EMPTY_PROMPT
    from longlive_core.models.folder import (
        DiTFolder,
        Encoder,
        LatentGeometry,
        MultiShot,
        PrecisionRules,
        Sampling,
        VideoFormat,
        write_config,
    )
    from longlive_core.quant.recipe import DEFAULT_SKIP

    latents, ar = root / "latents", root / "ar"
    (latents / "shards").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    tensors, rows = {}, []
    for sid, split in (("s", "train"), ("v", "val")):
        tensors[f"{sid}/0/latents"] = torch.randn(48, frames, H, W, generator=g)
        tensors[f"{sid}/0/text"] = torch.randn(TEXT_TOKENS, 4096, generator=g)
        rows.append({"sample_id": sid, "shot": 0, "video_id": sid, "shot_index": 0, "shard": "shard-00000.safetensors",
                     "latents_key": f"{sid}/0/latents", "text_key": f"{sid}/0/text", "latent_shape": [48, frames, H, W],
                     "num_frames": 4 * frames - 3, "caption": "", "split": split, "encode_key": "", "fingerprint": ""})
    save_file(tensors, str(latents / "shards/shard-00000.safetensors"))
    save_file({"text": torch.randn(TEXT_TOKENS, 4096, generator=g)}, str(latents / EMPTY_PROMPT))
    pd.DataFrame(rows).to_parquet(latents / "index.parquet", index=False)
    ar.mkdir(parents=True, exist_ok=True)
    write_config(DiTFolder(format="longlive-dit", stage="train_ar", dit={"name": "bench"},
                           latent=LatentGeometry(48, 8, H, W), video=VideoFormat(24.0, H * 16, W * 16),
                           vae=Encoder("tiny"), text_encoder=Encoder("tiny", max_length=TEXT_TOKENS),
                           sampling=Sampling("flow-matching"), multi_shot=MultiShot(8),
                           precision=PrecisionRules("nvfp4", DEFAULT_SKIP)), ar)
    return ar, latents


def random_dit(path, cfg, dtype=None):
    """``load_dit``'s stand-in: random weights on the GPU (a CPU quantization of them would outlast the bench)."""
    return random_dit_on_gpu(cfg)


def one_mode(args) -> dict:
    from longlive_core.config import ConfigError
    from longlive_core.distill import trainer as trainer_module
    from longlive_core.distill.config import DistillDMDConfig, LoRASettings
    from longlive_core.distill.trainer import DistillInputs, DMDTrainer, PhaseTimes
    from longlive_core.distributed.config import ParallelConfig
    from longlive_core.models import config as model_configs
    from longlive_core.train.ac_planning import StepPeak

    model_configs.DIT_CONFIGS["bench"] = dataclasses.replace(model_configs.dit_config("wan2.2-ti2v-5b"),
                                                             num_layers=args.blocks)
    trainer_module.load_dit = random_dit
    one_rank_group()
    recipe = "nvfp4" if args.one.startswith("nvfp4") else "bf16"
    mode, _, limit = args.ac.partition(":")
    cfg = DistillDMDConfig(steps=10**6, generator_every=1, latent_frames=args.frames, grad_frames=args.frames,
                           lora=LoRASettings(128, 128.0), recipe=recipe, stats_every=0,
                           parallel=ParallelConfig(device="cuda"), activation_checkpointing=mode,
                           ac_memory_limit_gib=float(limit) if limit else None)
    row: dict = {"mode": args.one, "blocks": args.blocks, "frames": args.frames, "ac": args.ac}
    with tempfile.TemporaryDirectory() as tmp:
        ar, latents = make_inputs(Path(tmp), args.frames, args.blocks)
        try:
            trainer = DMDTrainer(cfg, DistillInputs(ar, latents, Path(tmp) / "ckpt", None,
                                                    Path(args.out) / "ac-plans"),  # the device keeps nothing
                                 full_weights=args.one == "bf16-full")
            row["state_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)  # weights and buffers before a step
            trainer.train_step(0)  # warm-up: compilation, optimizer state
            torch.cuda.synchronize()  # its last kernels finish before the timing starts
            trainer.phases = PhaseTimes(torch.device("cuda"))
            if trainer.planner is not None:  # the warm-up checked as the product checks every step; then the
                trainer.planner.check_peak(0)  # timed steps' peaks alone, each pass's apart (the planner's
                trainer.planner.peak = StepPeak(torch.device("cuda"))  # sections reset the allocator's counter)
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                trainer.train_step(step)
            torch.cuda.synchronize()
            row["iteration_s"] = round((time.perf_counter() - t0) / args.steps, 3)
            row["phases_s"] = {k: round(v / args.steps, 3) for k, v in sorted(trainer.phases.seconds.items())}
            if trainer.planner is not None:
                trainer.planner.check_peak(args.steps)  # the timed steps' pass peaks against their predictions
                row["peak_gib"] = round(trainer.planner.peak.local() / 2**30, 2)
                row.update({k: round(v, 3) for k, v in trainer.planner.summary().items()})
            else:
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if args.memory_peak:  # one more iteration with every allocation recorded: what its peak holds
                name = f"memory-peak-{args.one}-{args.ac.replace(':', '')}.json"
                peak = record_peak(functools.partial(trainer.train_step, args.steps + 1), Path(args.out) / name)
                row["recorded_peak_gib"] = round(peak, 2)
        except ConfigError as exc:  # a measured peak above the limit: the row says by how much
            row["error"] = str(exc)
        except torch.OutOfMemoryError as exc:
            import traceback

            where = [f"{f.name}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)
                     if "longlive_core" in f.filename or "bench" in f.filename]
            row["error"] = f"out of memory in {' <- '.join(reversed(where[-6:]))}: {str(exc)[:200]}"
    dist.destroy_process_group()
    return row


def stage_comparison(args) -> dict:
    from longlive_core.distill import trainer as trainer_module
    from longlive_core.distill.config import DistillDMDConfig, LoRASettings
    from longlive_core.distill.trainer import DistillInputs, memory_comparison
    from longlive_core.distributed.config import ParallelConfig
    from longlive_core.models import config as model_configs

    model_configs.DIT_CONFIGS["bench"] = dataclasses.replace(model_configs.dit_config("wan2.2-ti2v-5b"),
                                                             num_layers=args.blocks)
    trainer_module.load_dit = random_dit
    one_rank_group()
    mode, _, limit = args.ac.partition(":")
    cfg = DistillDMDConfig(latent_frames=args.frames, grad_frames=args.frames, lora=LoRASettings(128, 128.0),
                           parallel=ParallelConfig(device="cuda"), activation_checkpointing=mode,
                           ac_memory_limit_gib=float(limit) if limit else None)
    with tempfile.TemporaryDirectory() as tmp:
        ar, latents = make_inputs(Path(tmp), args.frames, args.blocks)
        out = memory_comparison(cfg, DistillInputs(ar, latents, Path(tmp) / "ckpt", None, Path(args.out) / "ac-plans"),
                                Path(tmp) / "scratch")
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["nvfp4-lora", "bf16-lora", "bf16-full"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ac", default="full", help="none | full | selective | budget[:GiB] (the step's peak limit)")
    ap.add_argument("--stage-comparison", action="store_true",
                    help="run distill_dmd's own memory_comparison at these dims instead (nvfp4-lora against bf16-full)")
    ap.add_argument("--memory-peak", action="store_true",
                    help="also record one iteration's allocations: what is live at its peak (bench/memory_peak.py)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode in this process
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.ac.partition(":")[0] not in ("none", "full", "selective", "budget"):
        ap.error(f"--ac must be none, full, selective or budget[:GiB]; got {args.ac!r}")
    if args.one:
        print("ROW " + json.dumps(one_mode(args)), flush=True)
        return
    if args.stage_comparison:
        print(json.dumps(stage_comparison(args)), flush=True)
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.blocks} blocks of wan2.2-ti2v-5b, "
          f"{args.frames} latent frames", flush=True)
    rows = []
    for mode in args.modes:
        proc = subprocess.run([sys.executable, __file__, "--one", mode, "--blocks", str(args.blocks), "--frames",
                               str(args.frames), "--steps", str(args.steps), "--ac", args.ac, "--out", args.out,
                               *(["--memory-peak"] if args.memory_peak else [])],
                              capture_output=True, text=True)
        found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[0]) if found else {"mode": mode, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "dmd_step.json").write_text(json.dumps(rows, indent=1))
    base = next((r for r in rows if r["mode"] == "bf16-full" and "peak_gib" in r), None)
    for r in rows:
        if "peak_gib" in r and base:
            print(f"{r['mode']}: peak {r['peak_gib']} GiB = {r['peak_gib'] / base['peak_gib']:.2f}x bf16-full; "
                  f"iteration {r['iteration_s']} s")


if __name__ == "__main__":
    main()
