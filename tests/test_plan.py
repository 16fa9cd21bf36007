"""`longlive plan`: its arithmetic on crafted rates, and its refusal to guess a rate nobody measured."""
from __future__ import annotations

import pytest
import yaml

from longlive_core.config import ConfigError
from longlive_core.params_overlay import overlaid_params
from longlive_core.plan.capacity import Workload, estimate, plan
from longlive_core.plan.cli import STAGES, main
from longlive_core.plan.rates import Rate, find_rate, load_rates

from .conftest import REPO


def _rate(stage, device, value, unit, devices=1, variant=""):
    return Rate(stage, device, value, unit, devices, variant, source="row", machine="m", date="2026-01-01")


@pytest.fixture(scope="module")
def params():
    return overlaid_params(REPO / "params.yaml", REPO / "configs/production.yaml")


def test_arithmetic_on_crafted_rates(params):
    w = Workload(videos=3600, gpus=8, cpu_cores=4, video_seconds=60, shot_seconds=6)
    rates = [_rate("ingest", "cpu", 2.0, "files/s", devices=2),  # 1 file/s per core
             _rate("iqa_filter", "h200", 4.0, "frames/s"),
             _rate("encode_latents", "h200", 240.0, "frames/s", devices=4, variant="sp4"),
             _rate("encode_latents", "h200", 1e9, "frames/s", variant="sp1")]  # not production's sp: unused
    ingest = estimate("ingest", params, w, rates)
    assert ingest.device_hours == pytest.approx(1.0) and ingest.hours == pytest.approx(0.25)  # 3600 core-s / 4
    iqa = estimate("iqa_filter", params, w, rates)
    frames = 3600 * 60 / 6 * params["iqa_filter"]["frames_per_shot"]
    assert iqa.work == frames and iqa.device_hours == pytest.approx(frames / 4 / 3600)
    assert iqa.hours == pytest.approx(iqa.device_hours / 8)
    enc = estimate("encode_latents", params, w, rates)
    assert params["encode_latents"]["sp"] == 4 and enc.rate.variant == "sp4"
    assert enc.device_hours == pytest.approx(3600 * 60 * params["encode_latents"]["clip"]["fps"] / 60 / 3600)


def test_train_ar_counts_the_flops_the_benchmark_counts(params):
    from longlive_core.models.config import dit_config
    from longlive_core.train.flops import step_flops
    from longlive_core.train.layout import TeacherForcingLayout

    t = params["train_ar"]
    one = step_flops(dit_config(t["model"]), TeacherForcingLayout(96, 8, 880, 512), captions=1)
    ac = t["activation_checkpointing"]
    assert ac != "none"  # production's samples need it
    ac = f"compiler{t['ac_budget']:g}" if ac == "compiler" else ac  # the compiler's rate is per budget
    rates = [_rate("train_ar", "h200", 500.0, "TFLOP/s", variant=t["precision"]["recipe"]),  # not production's
             _rate("train_ar", "h200", 300.0, "TFLOP/s", variant=f"{t['precision']['recipe']}+{ac}-ac"),
             _rate("train_ar", "h200", 200.0, "TFLOP/s", variant=f"{t['precision']['recipe']}+compiler0.01-ac")]
    e = estimate("train_ar", params, Workload(videos=1, gpus=32), rates)
    samples = t["nnodes"] * t["nproc"] // t["sp"] * t["grad_accum"]
    assert samples == 16 and e.work == pytest.approx(t["steps"] * samples * one / 1e12)
    assert e.hours == pytest.approx(e.work / 300 / 3600 / 32)


def test_a_stage_without_a_measured_rate_is_never_estimated(params):
    rates = [Rate("shots", "cpu", None, "video-s/s", note="only detection was timed"),
             _rate("ingest", "cpu", 1.0, "files/s")]
    out = plan(params, Workload(videos=10, gpus=2, gpu="gb200"), rates, ["ingest", "shots", "train_ar"])
    ingest, shots, train = out
    assert ingest.hours is not None
    assert shots.hours is None and shots.missing == "no measured rate: only detection was timed"
    assert train.hours is None
    assert train.missing == "no measured rate: no train_ar rate measured on gb200 (nvfp4+compiler0.2-ac)"


def test_rates_file_needs_sources_and_the_committed_one_loads(tmp_path):
    bad = tmp_path / "rates.yaml"
    bad.write_text(yaml.safe_dump({"rates": [{"stage": "ingest", "device": "cpu", "value": 3.0, "unit": "files/s"}]}))
    with pytest.raises(ConfigError, match="needs a positive value and its source, machine and date"):
        load_rates(bad)
    rates = load_rates()
    assert find_rate(rates, "train_ar", "h200", "bf16").value == pytest.approx(0.521 * 989, rel=1e-3)
    assert find_rate(rates, "train_ar", "h200", "bf16+full-ac").value == pytest.approx(0.405 * 989, rel=1e-3)
    assert find_rate(rates, "merge_w4a4", "h200").value is None


def test_every_committed_rate_names_its_results_row():
    """A measured rate's ``source`` is the first cell of the bench/RESULTS.md row it was read from, exactly:
    a row renamed or dropped (a figure superseded) leaves no rate behind that cites nothing."""
    rows = {line.split(" | ")[0][2:] for line in (REPO / "bench/RESULTS.md").read_text().splitlines()
            if line.startswith("| ")}
    unsourced = [(r.stage, r.variant, r.source) for r in load_rates() if r.value is not None and r.source not in rows]
    assert not unsourced


def test_cli_prints_every_stage_and_what_the_total_leaves_out(capsys):
    assert main(["--videos", "120000", "--gpus", "32"]) == 0
    out = capsys.readouterr().out
    for stage in STAGES:
        assert f"\n{stage} " in out
    # production trains NVFP4 under the compiler's activation budget: the rate measured for that pair
    assert "TFLOP/s per GPU" in out.split("\ntrain_ar ")[1].splitlines()[0]
    assert "`compiler` with emulated NVFP4" in out.split("\ntrain_ar ")[1].splitlines()[0]
    assert "not in the total (no measured rate): merge_w4a4, package" in out
    assert "captions/s per GPU" in out.split("\ncaption ")[1].splitlines()[0]
    assert main(["--videos", "0", "--gpus", "32"]) == 2


def test_caption_is_planned_per_shot_at_the_rate_of_production_settings(params):
    """Every shot (and a subjects request per video) at the rate measured with production's batch, frames
    and token bound; a rate measured at other settings is not used; the committed one is production's."""
    c = params["caption"]
    variant = f"bs{c['batch_size']}-{c['max_frames']}f-{c['max_new_tokens']}tok"
    w = Workload(videos=1000, gpus=8, video_seconds=60, shot_seconds=6)
    e = estimate("caption", params, w, [_rate("caption", "h200", 9.0, "captions/s", variant="bs1-8f-64tok"),
                                        _rate("caption", "h200", 2.0, "captions/s", variant=variant)])
    assert (e.work, e.work_unit, e.rate.variant) == (10_000, "shots", variant)
    assert e.device_hours == pytest.approx((10_000 + 1000) / 2.0 / 3600)
    assert e.hours == pytest.approx(e.device_hours / 8)
    committed = find_rate(load_rates(), "caption", "h200", variant)
    assert committed is not None and committed.value > 0
    assert estimate("caption", params, w, load_rates()).hours == pytest.approx(11_000 / committed.value / 3600 / 8)


def test_the_budget_planner_has_no_stand_in_rate(params):
    """No other policy's rate is used for `activation_checkpointing: budget`: it is measured per memory limit."""
    t = {**params["train_ar"], "activation_checkpointing": "budget", "ac_memory_limit_gib": 47}
    rates = [_rate("train_ar", "h200", 446.0, "TFLOP/s", variant=f"{t['precision']['recipe']}+compiler0.2-ac"),
             _rate("train_ar", "h200", 300.0, "TFLOP/s", variant=f"{t['precision']['recipe']}+full-ac")]
    e = estimate("train_ar", {**params, "train_ar": t}, Workload(videos=1, gpus=32), rates)
    assert e.hours is None and f"({t['precision']['recipe']}+budget47GiB-ac)" in e.missing
    assert "bench/train_step.py --ac budget:<GiB>" in e.missing
    measured = _rate("train_ar", "h200", 480.0, "TFLOP/s", variant=f"{t['precision']['recipe']}+budget47GiB-ac")
    assert estimate("train_ar", {**params, "train_ar": t}, Workload(videos=1, gpus=32), [measured]).hours > 0
    t["ac_memory_limit_gib"] = None
    e = estimate("train_ar", {**params, "train_ar": t}, Workload(videos=1, gpus=32), rates)
    assert e.hours is None and "+budget0.9x-ac" in e.missing


def test_distillation_is_planned_at_the_rate_of_its_recipe_and_checkpointing(params):
    """Production's DMD rate (NVFP4 + LoRA, the planner at 0.9 of the GPU) and `full`'s are committed, the
    planner's faster; a limit with no measured rate has no stand-in."""
    w = Workload(videos=1, gpus=16)
    d = params["distill_dmd"]
    assert (d["activation_checkpointing"], d["ac_memory_limit_gib"]) == ("budget", None)
    planned = estimate("distill_dmd", params, w, load_rates()).hours
    full = estimate("distill_dmd", {**params, "distill_dmd": {**d, "activation_checkpointing": "full"}}, w,
                    load_rates()).hours
    assert 0 < planned < full
    d = {**d, "ac_memory_limit_gib": 47}
    e = estimate("distill_dmd", {**params, "distill_dmd": d}, w, load_rates())
    assert e.hours is None and "(nvfp4+budget47GiB-ac)" in e.missing and "bench/dmd_step.py --ac budget" in e.missing
