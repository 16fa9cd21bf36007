"""One training run under torchrun, for the multi-process tests:

    torchrun --nproc_per_node=N -m tests.helpers.train_worker CONFIG.json OUT_DIR [--stop-after K] [--grads]

CONFIG.json holds {"train_ar": {...}, "latents": dir, "checkpoints": dir}. Rank 0 writes
OUT_DIR/summary.json and the EMA weights (ema.safetensors); with --grads, the whole gradients of
step 0's micro-batches (grads.safetensors) and the loss sum, without an optimizer step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from longlive_core.config import from_mapping
from longlive_core.train.config import TrainARConfig
from longlive_core.train.parallelize import clean_name
from longlive_core.train.trainer import Trainer, TrainInputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--stop-after", type=int)
    ap.add_argument("--grads", action="store_true")
    args = ap.parse_args()
    spec = json.loads(Path(args.config).read_text())
    cfg = from_mapping(TrainARConfig, spec["train_ar"], "train_ar")
    latents = Path(spec["latents"])
    inputs = TrainInputs(latents, latents / "samples.parquet", Path(spec["checkpoints"]), spec.get("digest", "d"))
    dist.init_process_group("gloo")
    out = Path(args.out)
    try:
        trainer = Trainer(cfg, inputs)
        if args.grads:
            loss_sum, _, _ = trainer.accumulate(0)
            total = torch.tensor([loss_sum], dtype=torch.float64)
            dist.all_reduce(total)
            grads = {clean_name(n): p.grad.full_tensor().contiguous() for n, p in trainer.model.named_parameters()}
            if dist.get_rank() == 0:
                out.mkdir(parents=True, exist_ok=True)
                save_file(grads, str(out / "grads.safetensors"))
                (out / "summary.json").write_text(json.dumps({"loss_sum": float(total)}))
            return
        logged: list[dict] = []
        summary = trainer.run(sink=lambda metrics, step: logged.append({"step": step, **metrics}),
                              stop_after=args.stop_after)
        summary["logged"] = logged
        ema = summary.pop("ema_state")
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in ema.items()}, str(out / "ema.safetensors"))
            (out / "summary.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
