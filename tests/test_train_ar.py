"""AR training under torchrun on the CPU (gloo): FSDP2 on 2 ranks equals 1 rank, exact resumption,
the checkpoint digest's refusal, the NaN guard, and the NVFP4 recipe end to end. Several runs share
one torchrun launch (tests/helpers/train_worker.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT

from .conftest import launch_worker
from .helpers.latent_cache import SMALL, make_cache

pytestmark = pytest.mark.slow

BASE = {"model": "tiny", "steps": 4, "grad_accum": 2, "chunk_frames": 2, "max_latent_frames": 8,
        "optimizer": {"lr": 1e-3}, "ema": {"decay": 0.9, "start_step": 1}, "val_every": 2, "val_samples": 2,
        "checkpoint_every": 2, "keep_checkpoints": 2, "device": "cpu"}


def launch(tmp_path: Path, runs: list[dict], nproc: int = 1) -> dict[str, dict]:
    """Each run: name, latents, and optionally train_ar overrides, checkpoints, digest, stop_after, grads.
    Returns {name: {"summary": ..., "out": folder}}."""
    specs = [{"checkpoints": str(tmp_path / f"ckpt-{r['name']}"), "digest": "d", **r,
              "train_ar": {**BASE, **r.get("train_ar", {}), "nproc": nproc}, "latents": str(r["latents"])}
             for r in runs]
    out = launch_worker("train_worker", tmp_path, specs, nproc)
    return {r["name"]: {"summary": json.loads((out / r["name"] / "summary.json").read_text()),
                        "out": out / r["name"]} for r in runs}


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("latents"), SMALL)


def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, latents):
    """The same two global slots: one rank x 2 micro-batches, or two ranks x 1: loss and every
    gradient agree within float32 tolerance (float32 compute, so only summation order differs)."""
    f32 = {"precision": {"param_dtype": "float32"}}
    # and a step with validation over one val sample: the rank without one must still join FSDP's gathers
    val = {**f32, "steps": 1, "val_every": 1, "val_samples": 1}
    ones = launch(tmp_path / "1", [{"name": "g", "latents": latents, "grads": True,
                                    "train_ar": {**f32, "grad_accum": 2}},
                                   {"name": "val", "latents": latents, "train_ar": {**val, "grad_accum": 2}}], 1)
    twos = launch(tmp_path / "2", [{"name": "g", "latents": latents, "grads": True,
                                    "train_ar": {**f32, "grad_accum": 1}},
                                   {"name": "val", "latents": latents, "train_ar": {**val, "grad_accum": 1}}], 2)
    one, two = ones["g"], twos["g"]
    assert ones["val"]["summary"]["final_val_loss"] == pytest.approx(twos["val"]["summary"]["final_val_loss"],
                                                                     rel=1e-4)
    assert one["summary"]["loss_sum"] == pytest.approx(two["summary"]["loss_sum"], rel=1e-5)
    g1, g2 = load_file(one["out"] / "grads.safetensors"), load_file(two["out"] / "grads.safetensors")
    assert g1.keys() == g2.keys() and len(g1) > 20
    for name in g1:  # rank grads are averaged by FSDP; accumulation divides each micro-batch by 2
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


def test_resume_redoes_the_lost_step_exactly_and_other_runs_are_set_aside(tmp_path, latents):
    """A run stopped after step 3 (its checkpoint is step 2's) and started again redoes step 3 from
    the checkpoint with the loss the first run had there from its live state, bit for bit (the
    end-to-end test kills a `dvc repro` and compares more steps). A checkpoint of another run
    digest (other params, data, weights or layout) is set aside, never resumed."""
    ckpt = str(tmp_path / "ckpt")
    runs = launch(tmp_path, [{"name": "first", "latents": latents, "checkpoints": ckpt, "stop_after": 3},
                             {"name": "second", "latents": latents, "checkpoints": ckpt},
                             {"name": "other", "latents": latents, "checkpoints": ckpt, "digest": "other",
                              "train_ar": {"steps": 1}}])
    first, second, other = (runs[n]["summary"] for n in ("first", "second", "other"))
    assert first["steps_run"] == 3 and second["start_step"] == 2  # step 3's work was lost with the stop
    before, after = first["logged"], second["logged"]
    assert [m["step"] for m in after] == [3, 4] and after[0]["loss"] == before[2]["loss"]
    assert after[0]["grad_norm"] == before[2]["grad_norm"]
    assert other["start_step"] == 0 and "set aside" in other["resume"]
    aside = Path(ckpt) / "set_aside" / "d"
    assert sorted(p.name for p in aside.iterdir()) == ["history.jsonl", "step-00000002", "step-00000004"]
    history = [json.loads(line) for line in (aside / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["loss"] for h in history] == [m["loss"] for m in before[:2] + after]


@pytest.fixture(scope="module")
def guarded_and_nvfp4(tmp_path_factory, latents):
    tmp = tmp_path_factory.mktemp("train")
    poisoned = make_cache(tmp / "poisoned", {"x": ("train", [4]), "v": ("val", [4])}, nan_in="x")
    return launch(tmp, [{"name": "nan", "latents": poisoned, "train_ar": {"steps": 2, "val_every": 0}},
                        {"name": "fp4", "latents": latents,
                         "train_ar": {"steps": 3, "precision": {"recipe": "nvfp4", "sqnr_every": 2,
                                                                "forward_bf16_from_step": 2}}}])


def test_non_finite_steps_are_skipped_and_never_touch_the_weights(guarded_and_nvfp4):
    result = guarded_and_nvfp4["nan"]
    assert result["summary"]["skipped_steps"] == 2
    assert all(m["skipped_steps"] == i + 1 for i, m in enumerate(result["summary"]["logged"]))
    torch.manual_seed(0)  # init tiny, init_seed 0: the EMA is still the starting weights
    init = WanDiT(DIT_CONFIGS["tiny"]).state_dict()
    ema = load_file(result["out"] / "ema.safetensors")
    assert all(torch.equal(ema[k], init[k].float()) for k in init)


def test_nvfp4_recipe_trains_the_tiny_model_and_logs_sqnr(guarded_and_nvfp4):
    s = guarded_and_nvfp4["fp4"]["summary"]
    assert s["conversion"].startswith("recipe nvfp4: ") and " 0 linear layers converted" not in s["conversion"]
    logged = s["logged"]
    assert all(math.isfinite(m["loss"]) for m in logged) and s["skipped_steps"] == 0
    sqnr = {k: v for k, v in logged[0].items() if k.startswith("sqnr/")}
    assert any(k.endswith("/weight") for k in sqnr) and any(k.endswith("/grad_output") for k in sqnr)
    assert all(math.isfinite(v) and v > 5 for v in sqnr.values())
    # step 3 (index 2) runs the forward GEMMs in BF16: its probe measures no quantized input
    assert not any(k.endswith("/input") for k in logged[2]) and any(k.endswith("/input") for k in logged[0])
