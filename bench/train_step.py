"""One AR teacher-forcing training step at the real 5B block dimensions: tokens/s, MFU, peak memory.

    PYTHONPATH=. python bench/train_step.py [--blocks 8] [--frames 8 16 24 32] [--recipes bf16 nvfp4]
                               [--ac none full selective compiler:0.5] [--compile 0 1] [--steps 4]
                               [--attention rows flex] [--memory-peak]

The whole step as `train_ar` runs it (``Trainer.train_step``): one sample's forward and backward
through the [clean; noisy] teacher-forcing sequence (8-frame chunks; self-attention by the mask's
dense rows, the default, or FlexAttention's block mask),
gradient clipping, AdamW and the EMA, on one GPU under FSDP2 (world 1), bf16 compute with float32
masters. Samples are 44x80 latents (704x1280 video: 880 tokens per latent frame) of one shot with
a 512-token caption, so F latent frames are 2 x 880 x F tokens. ``--blocks`` of the 30 are built
(the optimizer state of all 30 does not fit one GPU beside the activations); MFU counts the
linears and the unmasked attention pairs x 3 (``train/flops.py``) against the H200's 989 TFLOP/s
dense BF16 datasheet figure. Median of ``--steps`` timed steps after two warm-up steps.
``--ac compiler:B`` is ``train_ar.activation_checkpointing: compiler`` with ``ac_budget: B`` (it needs
``--compile 1``); ``--ac budget:G`` is ``activation_checkpointing: budget`` with ``ac_memory_limit_gib: G``
(``budget`` alone: 0.9 of the GPU's memory), each window length planned when it first runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from bench.gpu_setup import one_rank_group, random_dit_on_gpu
from bench.memory_peak import record_peak
from longlive_core.distributed.config import ParallelConfig
from longlive_core.models import config as model_configs
from longlive_core.train import trainer as trainer_module
from longlive_core.train.config import TrainARConfig
from longlive_core.train.flops import PEAK_BF16_TFLOPS
from longlive_core.train.trainer import Trainer, TrainInputs

H, W, TEXT_TOKENS = 44, 80, 512


def make_cache(root: Path, frames: int, text_dim: int) -> None:
    (root / "shards").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"s/0/latents": torch.randn(48, frames, H, W, generator=g),
               "s/0/text": torch.randn(TEXT_TOKENS, text_dim, generator=g)},
              str(root / "shards/shard-00000.safetensors"))
    pd.DataFrame([{"sample_id": "s", "shot": 0, "video_id": "s", "shot_index": 0, "shard": "shard-00000.safetensors",
                   "latents_key": "s/0/latents", "text_key": "s/0/text", "latent_shape": [48, frames, H, W],
                   "num_frames": 4 * frames - 3, "caption": "", "split": "train", "encode_key": "",
                   "fingerprint": ""}]).to_parquet(root / "index.parquet", index=False)
    pd.DataFrame([{"sample_id": "s", "sample_weight": 1.0}]).to_parquet(root / "samples.parquet", index=False)


def fast_random_model(cfg: TrainARConfig):
    return random_dit_on_gpu(model_configs.dit_config(cfg.model)).cpu()


def profile_step(trainer: Trainer, path: Path) -> None:
    """One step under torch.profiler: GPU time per op, the largest first (where the step's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(10**5)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    print(table[:6000], flush=True)


def run_config(args, cache: Path, recipe: str, ac: str, compiled: bool, attention: str, rows: list[dict]) -> None:
    mode, _, value = ac.partition(":")
    cfg = TrainARConfig(model="bench", init="tiny", steps=10**6, grad_accum=1, chunk_frames=8,
                        max_latent_frames=max(args.frames), activation_checkpointing=mode,
                        ac_budget=float(value) if mode == "compiler" and value else TrainARConfig.ac_budget,
                        ac_memory_limit_gib=float(value) if mode == "budget" and value else None, compile=compiled,
                        precision=dataclasses.replace(TrainARConfig().precision, recipe=recipe),
                        parallel=ParallelConfig(device="cuda"),
                        val_every=0, ema=dataclasses.replace(TrainARConfig().ema, start_step=0), attention=attention)
    # budget plans and the profiles they came from in --out: the device machine keeps nothing
    trainer = Trainer(cfg, TrainInputs(cache, cache / "samples.parquet", cache / "ckpt", None,
                                       ac_plans=Path(args.out) / "ac-plans"))
    for frames in args.frames:
        trainer.cfg = dataclasses.replace(cfg, max_latent_frames=frames)
        tokens = 2 * frames * H * W // 4
        row = {"recipe": recipe, "ac": ac, "compile": compiled, "attention": attention, "blocks": args.blocks,
               "frames": frames, "tokens": tokens}
        try:
            torch.cuda.empty_cache()
            # the peak from the first (compiling) step on: what the trainer's own check holds to the limit
            torch.cuda.reset_peak_memory_stats()
            times, flops = [], 0.0
            for i in range(args.steps + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step = trainer.train_step(i)
                loss, flops = step["loss"], step["flops"]
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            step_s = statistics.median(times)
            step_peak = torch.cuda.max_memory_allocated()
            fwd_bwd = []  # the forward and backward alone: what the optimizer, clipping and EMA add
            torch.cuda.reset_peak_memory_stats()
            for i in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                trainer.accumulate(i)
                torch.cuda.synchronize()
                fwd_bwd.append(time.perf_counter() - t0)
                trainer.optimizer.zero_grad(set_to_none=True)
            row["fwd_bwd_ms"] = round(min(fwd_bwd) * 1000, 1)
            # where the step's peak is: in the forward and backward, or in what follows them
            row["fwd_bwd_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if args.memory_peak:  # one more step with every allocation recorded: what its peak holds
                name = f"memory-peak-{recipe}-{ac.replace(':', '')}-{int(compiled)}-{frames}.json"
                peak = record_peak(functools.partial(trainer.train_step, 10**5 + 1), Path(args.out) / name)
                row["recorded_peak_gib"] = round(peak, 2)
            if args.profile:
                name = f"profile-{recipe}-{ac.replace(':', '')}-{int(compiled)}-{attention}-{frames}.txt"
                profile_step(trainer, Path(args.out) / name)
            row.update({"step_ms": round(step_s * 1000, 1), "tokens_per_s": round(tokens / step_s),
                        "tflops": round(flops / step_s / 1e12, 1),
                        "mfu": round(flops / step_s / 1e12 / PEAK_BF16_TFLOPS["H200"], 4),
                        "peak_gib": round(step_peak / 2**30, 1), "loss": round(loss, 4),
                        "spread_ms": round((max(times) - min(times)) * 1000, 1)})
            if trainer.planner is not None:  # the plan's prediction beside the measured peak
                row.update({k: round(v, 3) for k, v in trainer.planner.summary().items()
                            if k.endswith(f"_{frames}f") or k == "ac_limit_gib"})
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            trainer.optimizer.zero_grad(set_to_none=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    del trainer
    gc.collect()  # the trainer's cycles hold its GPU memory: the next config's planner would count it
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--frames", type=int, nargs="+", default=[8, 16, 24, 32])
    ap.add_argument("--recipes", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--ac", nargs="+", default=["none", "full"])
    ap.add_argument("--compile", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--attention", nargs="+", default=["rows"], help="train_ar.attention values: rows, flex")
    ap.add_argument("--profile", action="store_true", help="also profile one step of each size")
    ap.add_argument("--memory-peak", action="store_true",
                    help="also record one step's allocations: what is live at its peak, by line (bench/memory_peak.py)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the first report is written into it
    base = model_configs.dit_config("wan2.2-ti2v-5b")
    model_configs.DIT_CONFIGS["bench"] = dataclasses.replace(base, num_layers=args.blocks)
    trainer_module.build_model = fast_random_model
    one_rank_group()
    rows: list[dict] = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.blocks} blocks of wan2.2-ti2v-5b")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        make_cache(cache, max(args.frames), base.text_dim)
        for compiled in args.compile:
            for recipe in args.recipes:
                for ac in args.ac:
                    for attention in args.attention:
                        run_config(args, cache, recipe, ac, bool(compiled), attention, rows)
    (Path(args.out) / "train_step.json").write_text(json.dumps(rows, indent=1))
    print("recipe  ac           compile attn frames tokens  step_ms fwd_bwd  tok/s   TFLOP/s  MFU    peak GiB")
    for r in rows:
        head = f"{r['recipe']:7} {r['ac']:12} {r['compile']!s:7} {r['attention']:4} {r['frames']:6} {r['tokens']:6}"
        if "error" in r:
            print(f"{head}  {r['error']}")
        else:
            print(f"{head} {r['step_ms']:8} "
                  f"{r['fwd_bwd_ms']:7} {r['tokens_per_s']:7} {r['tflops']:8} {r['mfu']:.3f} {r['peak_gib']:8}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
