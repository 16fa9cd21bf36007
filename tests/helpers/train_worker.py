"""Training runs under torchrun, for the multi-process tests, several in one launch (a launch costs
more than a tiny run):

    torchrun --nproc_per_node=N -m tests.helpers.train_worker SPEC.json OUT_DIR

SPEC.json holds {"runs": [{"name", "train_ar": {...}, "latents", "checkpoints", "digest",
"stop_after", "grads"}, ...]}, run in order. Rank 0 writes OUT_DIR/<name>/summary.json (with every
metric the run logged) and the EMA weights (ema.safetensors); a "grads" run writes the whole
gradients of step 0's micro-batches (grads.safetensors) and the loss sum, without an optimizer step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from longlive_core.config import from_mapping
from longlive_core.distributed.parallelize import clean_name
from longlive_core.train.config import TrainARConfig
from longlive_core.train.trainer import Trainer, TrainInputs
from tests.helpers.worker import main_over_runs


def run_one(spec: dict, out: Path) -> None:
    cfg = from_mapping(TrainARConfig, spec["train_ar"], "train_ar")
    latents = Path(spec["latents"])
    trainer = Trainer(cfg, TrainInputs(latents, latents / "samples.parquet", Path(spec["checkpoints"]),
                                       {"run": spec.get("digest", "d")}))
    rank0 = dist.get_rank() == 0
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
    if spec.get("grads"):
        loss_sum, _, _ = trainer.accumulate(0)
        total = torch.tensor([float(loss_sum)], dtype=torch.float64)
        dist.all_reduce(total)
        grads = {clean_name(n): p.grad.full_tensor().contiguous() for n, p in trainer.model.named_parameters()}
        if rank0:
            save_file(grads, str(out / "grads.safetensors"))
            (out / "summary.json").write_text(json.dumps({"loss_sum": float(total)}))
        return
    logged: list[dict] = []
    summary = trainer.run(sink=lambda metrics, step: logged.append({"step": step, **metrics}),
                          stop_after=spec.get("stop_after"))
    summary["logged"] = logged
    ema = summary.pop("ema_state")
    if rank0:
        save_file({k: v.contiguous() for k, v in ema.items()}, str(out / "ema.safetensors"))
        (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main_over_runs(run_one)
