"""Distillation runs under torchrun, several in one launch (a launch costs more than a tiny run):

    torchrun --nproc_per_node=N -m tests.helpers.distill_worker SPEC.json OUT_DIR

SPEC.json holds {"runs": [{"name", "distill_dmd": {...}, "ar_model", "latents", "checkpoints",
"stop_after", "full_weights", "generated", "gradients", "eager_trials"}, ...]}, run in order. Rank 0
writes OUT_DIR/<name>/summary.json (with every metric logged) and the generator's adapter as peft saves
one (OUT_DIR/<name>/adapter/); a "generated" run also writes the generator's rollout of the first stats
prompt (generated.safetensors).
"""
from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from longlive_core.config import from_mapping
from longlive_core.distill import ac_planning as distill_planning
from longlive_core.distill.ac_planning import DistillPlanner
from longlive_core.distill.config import DistillDMDConfig
from longlive_core.distill.trainer import DistillInputs, DMDTrainer
from longlive_core.distributed.ac_eager import EagerTrials
from tests.helpers.worker import main_over_runs


def gradients(trainer: DMDTrainer, out: Path) -> None:
    """The first step's generator and critic gradients (the world's mean, whole), before any update."""
    prompt = trainer._prompt(trainer.prompts, ("prompt", 0, trainer.slot))
    key = (0, trainer.slot)
    loss, _ = trainer.generator_pass(prompt, key, 1)
    with trainer.roles.generator():
        loss.backward()
    trainer.critic_pass(prompt, key, 1).backward()
    grads = {}
    for role, params in (("generator", trainer.roles.generator_params()), ("critic", trainer.roles.critic_params())):
        flat = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                for p in params if p.grad is not None]
        grads[role] = torch.cat([g.float().flatten() for g in flat])
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(grads, str(out / "gradients.safetensors"))
        (out / "summary.json").write_text("{}")


def run_one(spec: dict, out: Path) -> None:
    """``eager_trials``: (full, plan, unchecked seconds, unchecked bytes) every block kind measures in
    every pass, injected (on the CPU the budget planner measures nothing: ``DistillPlanner.measures``)."""
    if "eager_trials" not in spec:
        return run_spec(spec, out)
    trials = EagerTrials(*spec["eager_trials"])
    with mock.patch.object(DistillPlanner, "measures", lambda self: True), \
            mock.patch.object(distill_planning, "eager_trials", lambda probes, args, plans, device:
                              dict.fromkeys(plans, trials)):
        return run_spec(spec, out)


def run_spec(spec: dict, out: Path) -> None:
    cfg = from_mapping(DistillDMDConfig, spec["distill_dmd"], "distill_dmd")
    inputs = DistillInputs(Path(spec["ar_model"]), Path(spec["latents"]), Path(spec["checkpoints"]),
                           {"run": spec.get("digest", "d")}, Path(spec["ac_plans"]) if "ac_plans" in spec else None)
    trainer = DMDTrainer(cfg, inputs, full_weights=spec.get("full_weights", False))
    if spec.get("gradients"):
        gradients(trainer, out)
        return
    rank0 = dist.get_rank() == 0
    logged: list[dict] = []
    summary = trainer.run(sink=lambda metrics, step: logged.append({"step": step, **metrics}),
                          stop_after=spec.get("stop_after"))
    summary["logged"] = logged
    adapter = summary.pop("adapter_state", {})
    generated = None
    if spec.get("generated"):
        data = trainer.stats_prompts
        prompt = trainer._prompt(data, ("stats", 0), data.sample_ids[0])
        with trainer.roles.generator() as generator, torch.no_grad():
            generated = trainer.generate(generator, prompt, ("stats", 0)).float().cpu()
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        if adapter:
            (out / "adapter").mkdir()
            save_file({k: v.contiguous() for k, v in adapter.items()},
                      str(out / "adapter" / "adapter_model.safetensors"))
            trainer.roles.lora_config.save_pretrained(str(out / "adapter"))
        if generated is not None:
            save_file({"x": generated, "noise": prompt.noise, "text": prompt.sample.text,
                       "shot_of_frame": prompt.sample.shot_of_frame, "positions": prompt.sample.positions},
                      str(out / "generated.safetensors"))
        (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main_over_runs(run_one)
