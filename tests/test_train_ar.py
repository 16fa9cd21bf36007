"""AR training on the CPU: FSDP2 on 2 ranks equals 1 rank (under torchrun, gloo; several runs share
one launch, tests/helpers/train_worker.py); in this process as one rank: exact resumption, checkpoints
per run digest, a lowered step target, resumption across scheduling changes, the NaN guard, and the
NVFP4 recipe end to end."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longlive_core.config import from_mapping
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.checkpointing import read_history
from longlive_core.train.config import TrainARConfig
from longlive_core.train.trainer import Trainer, TrainInputs

from .conftest import launch_worker, run_worker_here
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
    out = (launch_worker("train_worker", tmp_path, specs, nproc) if nproc > 1 else
           run_worker_here("train_worker", tmp_path, specs))
    return {r["name"]: {"summary": json.loads((out / r["name"] / "summary.json").read_text()),
                        "out": out / r["name"]} for r in runs}


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("latents"), SMALL)


def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, latents, gloo_world):
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


def trainer(latents: Path, checkpoints: Path, overrides: dict | None = None, run: str = "d") -> Trainer:
    """A trainer of this pytest process (one gloo rank), as one rank of a torchrun job builds it."""
    cfg = from_mapping(TrainARConfig, {**BASE, **(overrides or {})}, "train_ar")
    return Trainer(cfg, TrainInputs(latents, latents / "samples.parquet", checkpoints, {"run": run, "code": "c"}))


def train(latents: Path, checkpoints: Path, overrides: dict | None = None, stop_after: int | None = None,
          run: str = "d") -> dict:
    """A run's summary, with every metric it logged under "logged"."""
    logged: list[dict] = []
    summary = trainer(latents, checkpoints, overrides, run).run(
        sink=lambda metrics, step: logged.append({"step": step, **metrics}), stop_after=stop_after)
    return {**summary, "logged": logged}


def test_resume_redoes_the_lost_step_exactly_from_the_run_digests_folder(tmp_path, latents, gloo_world):
    """A run stopped after step 3 (its checkpoint is step 2's) and started again redoes step 3 from
    the checkpoint with the loss the first run had there from its live state, bit for bit (the
    end-to-end test kills a `dvc repro` and compares more steps). Another run digest (other params,
    data, weights, layout or code) starts fresh beside it, and the first run's checkpoints are still
    found when it comes back."""
    ckpt = tmp_path / "ckpt"
    first = train(latents, ckpt, stop_after=3)
    second = train(latents, ckpt)
    assert first["steps_run"] == 3 and second["start_step"] == 2  # step 3's work was lost with the stop
    before, after = first["logged"], second["logged"]
    assert [m["step"] for m in after] == [3, 4] and after[0]["loss"] == before[2]["loss"]
    assert after[0]["grad_norm"] == before[2]["grad_norm"]
    other = train(latents, ckpt, {"steps": 1}, run="other")
    assert other["start_step"] == 0 and other["resume"] == "no checkpoint: starting fresh"
    back = train(latents, ckpt)
    assert back["start_step"] == 4 and back["steps_run"] == 0
    run_dir = Path(back["checkpoints"])
    assert sorted(p.name for p in run_dir.iterdir()) == ["history.jsonl", "run.json", "step-00000002", "step-00000004"]
    history = read_history(run_dir / "history.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["loss"] for h in history] == [m["loss"] for m in before[:2] + after]


def test_a_lowered_step_target_exports_what_a_fresh_run_of_that_many_steps_exports(tmp_path, latents, gloo_world):
    """steps 4 -> 2: the run resumes from its step-2 checkpoint, not the newer step 4, and exports the
    2-step EMA; with no checkpoint at or before the target it starts fresh."""
    ckpt = tmp_path / "ckpt"
    train(latents, ckpt)
    lowered = trainer(latents, ckpt, {"steps": 2})
    summary = lowered.run()
    assert (summary["start_step"], summary["steps_run"], summary["steps"]) == (2, 0, 2)
    fresh = trainer(latents, tmp_path / "fresh", {"steps": 2}).run()
    assert summary["ema_state"].keys() == fresh["ema_state"].keys()
    assert all(torch.equal(summary["ema_state"][k], fresh["ema_state"][k]) for k in fresh["ema_state"])
    one = train(latents, ckpt, {"steps": 1})
    assert one["start_step"] == 0 and one["steps_run"] == 1 and "the newest is step 4" in one["resume"]


def test_scheduling_changes_resume_and_the_lineage_records_each_range(tmp_path, latents, gloo_world):
    """Activation checkpointing, compile and the SQNR logging cadence change no number a checkpoint
    holds: a run resumes across them; the lineage lists which ran over which steps."""
    cfg = from_mapping(TrainARConfig, BASE, "train_ar")
    for change in ({"activation_checkpointing": "full"}, {"compile": True}, {"attention": "flex"},
                   {"activation_checkpointing": "compiler", "ac_budget": 0.2, "compile": True},
                   {"checkpoint_every": 1, "keep_runs": 3}, {"precision": {"sqnr_every": 7}}):
        assert from_mapping(TrainARConfig, {**BASE, **change}, "train_ar").resume_params() == cfg.resume_params()
    for change in ({"seed": 1}, {"optimizer": {"lr": 2e-3}}, {"precision": {"recipe": "nvfp4"}}):
        assert from_mapping(TrainARConfig, {**BASE, **change}, "train_ar").resume_params() != cfg.resume_params()
    ckpt = tmp_path / "ckpt"
    train(latents, ckpt, {"steps": 2})
    resumed = train(latents, ckpt, {"activation_checkpointing": "full"})
    assert resumed["start_step"] == 2 and resumed["steps_run"] == 2
    ranges = [(r["from_step"], r["to_step"], r["activation_checkpointing"]) for r in resumed["lineage"]]
    assert ranges == [(0, 2, "none"), (2, 4, "full")]
    assert all(r["torch"] == torch.__version__ and "git.commit" in r for r in resumed["lineage"])


@pytest.fixture(scope="module")
def guarded_and_nvfp4(tmp_path_factory, latents, gloo_world):
    tmp = tmp_path_factory.mktemp("train")
    poisoned = make_cache(tmp / "poisoned", {"x": ("train", [4]), "v": ("val", [4])}, nan_in="x")
    nan = trainer(poisoned, tmp / "nan", {"steps": 2, "val_every": 0}).run()
    fp4 = train(latents, tmp / "fp4", {"steps": 3, "precision": {"recipe": "nvfp4", "sqnr_every": 2,
                                                                  "forward_bf16_from_step": 2}})
    return {"nan": nan, "fp4": fp4}


def test_non_finite_steps_are_skipped_and_never_touch_the_weights(guarded_and_nvfp4):
    summary = guarded_and_nvfp4["nan"]
    assert summary["skipped_steps"] == 2
    history = read_history(Path(summary["checkpoints"]) / "history.jsonl")
    assert [m["skipped_steps"] for m in history] == [1, 2]
    torch.manual_seed(0)  # init tiny, init_seed 0: the EMA is still the starting weights
    init = WanDiT(DIT_CONFIGS["tiny"]).state_dict()
    ema = summary["ema_state"]
    assert all(torch.equal(ema[k], init[k].float()) for k in init)


def test_nvfp4_recipe_trains_the_tiny_model_and_logs_sqnr(guarded_and_nvfp4):
    s = guarded_and_nvfp4["fp4"]
    assert s["conversion"].startswith("recipe nvfp4: ") and " 0 linear layers converted" not in s["conversion"]
    logged = s["logged"]
    assert all(math.isfinite(m["loss"]) for m in logged) and s["skipped_steps"] == 0
    sqnr = {k: v for k, v in logged[0].items() if k.startswith("sqnr/")}
    assert any(k.endswith("/weight") for k in sqnr) and any(k.endswith("/grad_output") for k in sqnr)
    assert all(math.isfinite(v) and v > 5 for v in sqnr.values())
    # step 3 (index 2) runs the forward GEMMs in BF16: its probe measures no quantized input
    assert not any(k.endswith("/input") for k in logged[2]) and any(k.endswith("/input") for k in logged[0])
    history = read_history(Path(s["checkpoints"]) / "history.jsonl")
    assert not any("/" in k for h in history for k in h)  # per-layer detail in MLflow only
