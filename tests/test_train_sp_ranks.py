"""Balanced sequence parallelism on the CPU (gloo; one rank in this process, more under torchrun),
on the 6-head test model: SP=2 and SP=3 give SP=1's loss and gradients, SP with FSDP2 over 2 x 2
ranks too, NVFP4's round-to-nearest forward matches once amaxes are reduced over the SP group,
and error recycling gives the same losses, buffer fill and injections on 2 ranks as on 1 and
resumes its buffers from checkpoints."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from .helpers.latent_cache import make_cache
from .test_train_ar import launch

pytestmark = pytest.mark.slow

# every sample has at least 12 latent frames in whole 2-frame chunks: its window is the same 12 frames
# whether it is split over 1, 2 or 3 ranks
SP_CACHE = {"a": ("train", [7, 6]), "b": ("train", [14]), "c": ("train", [4, 6, 4]), "v1": ("val", [6, 6])}
SP = {"model": "tiny-6h", "max_latent_frames": 12, "precision": {"param_dtype": "float32"}}
ER = {**SP, "steps": 4, "val_every": 2, "val_samples": 1, "checkpoint_every": 2,
      "error_recycling": {"enabled": True, "timestep_buckets": 4, "position_buckets": 4, "entries_per_bucket": 3,
                          "warmup_steps": 2, "clean_prob": 0.2, "context_prob": 0.9, "latent_prob": 0.9,
                          "noise_prob": 0.5, "store_dtype": "float32"}}
FP4 = {**SP, "precision": {"recipe": "nvfp4", "param_dtype": "float32"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo_world):
    tmp = tmp_path_factory.mktemp("sp")
    latents = make_cache(tmp / "latents", SP_CACHE)

    def grads(name, extra=None, accum=1, base=SP):
        return {"name": name, "latents": latents, "grads": True,
                "train_ar": {**base, **(extra or {}), "grad_accum": accum}}

    resume = str(tmp / "ckpt-resume")
    out = {1: launch(tmp / "1", [grads("g"), grads("g2", accum=2), grads("fp4", base=FP4),
                                 {"name": "er", "latents": latents, "train_ar": ER}], 1)}
    out[2] = launch(tmp / "2", [grads("g", {"sp": 2}), grads("fp4", {"sp": 2}, base=FP4),
                                {"name": "er", "latents": latents, "train_ar": {**ER, "sp": 2}},
                                {"name": "stop", "latents": latents, "train_ar": {**ER, "sp": 2},
                                 "checkpoints": resume, "stop_after": 3},
                                {"name": "resume", "latents": latents, "train_ar": {**ER, "sp": 2},
                                 "checkpoints": resume},
                                {"name": "er_dp", "latents": latents, "train_ar": {**ER, "grad_accum": 1}}], 2)
    out[3] = launch(tmp / "3", [grads("g", {"sp": 3})], 3)
    # 2 data-parallel groups of 2 SP ranks
    out[4] = launch(tmp / "4", [grads("g", {"sp": 2}),
                                {"name": "er_dp", "latents": latents, "train_ar": {**ER, "sp": 2, "grad_accum": 1}}], 4)
    return out


def assert_same_grads(a, b):
    ga, gb = load_file(a["out"] / "grads.safetensors"), load_file(b["out"] / "grads.safetensors")
    assert ga.keys() == gb.keys() and len(ga) > 20
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_sp_equals_one_rank(runs, world):
    one, split = runs[1]["g"], runs[world]["g"]
    assert split["summary"]["loss_sum"] == pytest.approx(one["summary"]["loss_sum"], rel=1e-5)
    assert_same_grads(one, split)


def test_sp_with_fsdp_over_two_by_two_ranks_equals_one_rank_accumulating(runs):
    one, split = runs[1]["g2"], runs[4]["g"]
    assert split["summary"]["loss_sum"] == pytest.approx(one["summary"]["loss_sum"], rel=1e-5)
    assert_same_grads(one, split)


def test_nvfp4_forward_matches_with_amaxes_reduced_over_the_sp_group(runs):
    """Round-to-nearest forward GEMMs: the loss equals one rank's (the backward's stochastic rounding
    differs by design, so gradients are not compared). Each rank's GEMMs run other token counts, so
    float32 sums may round apart and flip a value lying on an FP4 boundary to its neighbour on one
    machine and not another: 1e-5, a tenth of how far the float model's loss is from NVFP4's."""
    one, split = runs[1]["fp4"]["summary"]["loss_sum"], runs[2]["fp4"]["summary"]["loss_sum"]
    assert split == pytest.approx(one, rel=1e-5)
    assert abs(split - runs[2]["g"]["summary"]["loss_sum"]) > 1e-4 * split  # and it is not the float model's


def test_error_recycling_does_not_depend_on_sp_and_resumes_its_buffers(runs):
    one, two = runs[1]["er"]["summary"]["logged"], runs[2]["er"]["summary"]["logged"]
    keys = ("loss", "error_buffer_fill", "injected_context", "injected_latent", "injected_noise")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-4)
    assert one[-1]["error_buffer_fill"] > 0 and sum(m["injected_context"] + m["injected_latent"] for m in one) > 0
    # stopped after step 3 (checkpoint at 2), resumed: step 3 and 4 redone with the restored buffers
    resumed = runs[2]["resume"]["summary"]
    assert resumed["start_step"] == 2
    assert [m["loss"] for m in resumed["logged"]] == [m["loss"] for m in two[2:]]
    assert [m["injected_latent"] for m in resumed["logged"]] == [m["injected_latent"] for m in two[2:]]


def test_error_warm_up_pools_over_the_ranks_that_hold_the_same_buckets(runs):
    """Two data-parallel ranks, each its own buffers, pooling errors during warm-up: split over 2 SP
    ranks each (4 ranks, the pool is the data-parallel group of an SP rank) as on 1."""
    one, two = runs[2]["er_dp"]["summary"]["logged"], runs[4]["er_dp"]["summary"]["logged"]
    keys = ("loss", "error_buffer_fill", "injected_context", "injected_latent", "injected_noise")
    for a, b in zip(one, two, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-4)
    # in warm-up each data-parallel rank stores both ranks' errors: the fill of one rank drawing both
    # samples (accumulation 2); keeping only its own would halve it
    alone = runs[1]["er"]["summary"]["logged"]
    assert one[1]["error_buffer_fill"] == pytest.approx(alone[1]["error_buffer_fill"])
    assert one[1]["error_buffer_fill"] > 0
