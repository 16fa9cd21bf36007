"""AR training under torchrun on the CPU (gloo): FSDP2 on 2 ranks equals 1 rank, exact resumption,
the checkpoint digest's refusal, the NaN guard, and the NVFP4 recipe end to end."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, free_port, run
from .helpers.latent_cache import SMALL, make_cache

BASE = {"model": "tiny", "steps": 4, "grad_accum": 2, "chunk_frames": 2, "max_latent_frames": 8,
        "optimizer": {"lr": 1e-3}, "ema": {"decay": 0.9, "start_step": 1}, "val_every": 2, "val_samples": 2,
        "checkpoint_every": 2, "keep_checkpoints": 2, "device": "cpu"}


def torchrun(tmp_path: Path, name: str, train_ar: dict, latents: Path, nproc: int = 1, *extra: str,
             checkpoints: Path | None = None, digest: str = "d") -> dict:
    spec = {"train_ar": {**BASE, **train_ar, "nproc": nproc}, "latents": str(latents),
            "checkpoints": str(checkpoints or tmp_path / f"ckpt-{name}"), "digest": digest}
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(spec))
    out = tmp_path / f"out-{name}"
    run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         "-m", "tests.helpers.train_worker", str(config), str(out), *extra], cwd=REPO)
    return {"summary": json.loads((out / "summary.json").read_text()), "out": out}


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("latents"), SMALL)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, latents):
    """The same two global slots: one rank x 2 micro-batches, or two ranks x 1: loss and every
    gradient agree within float32 tolerance (float32 compute, so only summation order differs)."""
    f32 = {"precision": {"param_dtype": "float32"}}
    one = torchrun(tmp_path, "g1", {**f32, "grad_accum": 2}, latents, 1, "--grads")
    two = torchrun(tmp_path, "g2", {**f32, "grad_accum": 1}, latents, 2, "--grads")
    assert one["summary"]["loss_sum"] == pytest.approx(two["summary"]["loss_sum"], rel=1e-5)
    g1, g2 = load_file(one["out"] / "grads.safetensors"), load_file(two["out"] / "grads.safetensors")
    assert g1.keys() == g2.keys() and len(g1) > 20
    for name in g1:  # rank grads are averaged by FSDP; accumulation divides each micro-batch by 2
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)
    # and whole steps: the losses of 3 steps (bf16 compute, the demo's default)
    l1 = torchrun(tmp_path, "s1", {"steps": 3, "grad_accum": 2}, latents, 1)["summary"]["logged"]
    l2 = torchrun(tmp_path, "s2", {"steps": 3, "grad_accum": 1}, latents, 2)["summary"]["logged"]
    assert [m["loss"] for m in l1] == pytest.approx([m["loss"] for m in l2], rel=2e-3)


@pytest.mark.slow
def test_resume_gives_the_losses_of_an_uninterrupted_run_and_other_runs_are_set_aside(tmp_path, latents):
    straight = torchrun(tmp_path, "straight", {}, latents)
    ckpt = tmp_path / "ckpt-resumed"
    first = torchrun(tmp_path, "first", {}, latents, 1, "--stop-after", "3", checkpoints=ckpt)
    assert first["summary"]["steps_run"] == 3
    second = torchrun(tmp_path, "second", {}, latents, 1, checkpoints=ckpt)
    assert second["summary"]["start_step"] == 2  # the checkpoint of step 2; step 3's work was lost
    losses = {m["step"]: m["loss"] for m in first["summary"]["logged"] + second["summary"]["logged"]}
    assert [losses[s] for s in range(1, 5)] == [m["loss"] for m in straight["summary"]["logged"]]
    history = [json.loads(line) for line in (ckpt / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["loss"] for h in history] == [losses[s] for s in range(1, 5)]
    a, b = load_file(straight["out"] / "ema.safetensors"), load_file(second["out"] / "ema.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000004"]
    # another run digest (other params, data, weights or layout): set aside, never resumed
    other = torchrun(tmp_path, "other", {}, latents, 1, checkpoints=ckpt, digest="other")
    assert other["summary"]["start_step"] == 0 and "set aside" in other["summary"]["resume"]
    assert sorted(p.name for p in (ckpt / "set_aside" / "d").iterdir()) == [
        "history.jsonl", "step-00000002", "step-00000004"]


@pytest.mark.slow
def test_non_finite_steps_are_skipped_and_never_touch_the_weights(tmp_path):
    poisoned = make_cache(tmp_path / "latents", {"x": ("train", [4]), "v": ("val", [4])}, nan_in="x")
    result = torchrun(tmp_path, "nan", {"steps": 2, "val_every": 0}, poisoned)
    assert result["summary"]["skipped_steps"] == 2
    assert all(m["skipped_steps"] == i + 1 for i, m in enumerate(result["summary"]["logged"]))
    from longlive_core.models.config import DIT_CONFIGS
    from longlive_core.models.wan_dit import WanDiT

    torch.manual_seed(0)  # init tiny, init_seed 0: the EMA is still the starting weights
    init = WanDiT(DIT_CONFIGS["tiny"]).state_dict()
    ema = load_file(result["out"] / "ema.safetensors")
    assert all(torch.equal(ema[k], init[k].float()) for k in init)


@pytest.mark.slow
def test_nvfp4_recipe_trains_the_tiny_model_and_logs_sqnr(tmp_path, latents):
    result = torchrun(tmp_path, "fp4", {"steps": 3, "precision": {"recipe": "nvfp4", "sqnr_every": 2,
                                                                  "forward_bf16_from_step": 2}}, latents)
    s = result["summary"]
    assert s["conversion"].startswith("recipe nvfp4: ") and " 0 linear layers converted" not in s["conversion"]
    logged = s["logged"]
    assert all(math.isfinite(m["loss"]) for m in logged) and s["skipped_steps"] == 0
    sqnr = {k: v for k, v in logged[0].items() if k.startswith("sqnr/")}
    assert any(k.endswith("/weight") for k in sqnr) and any(k.endswith("/grad_output") for k in sqnr)
    assert all(math.isfinite(v) and v > 5 for v in sqnr.values())
    # step 3 (index 2) runs the forward GEMMs in BF16: its probe measures no quantized input
    assert not any(k.endswith("/input") for k in logged[2]) and any(k.endswith("/input") for k in logged[0])
