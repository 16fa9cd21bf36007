"""Hours and device-hours per stage: the work each stage does for a run (from params and the
workload), divided by a measured rate. A stage without a measured rate is reported as such, never
estimated: its hours are None and the totals say what they leave out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longlive_core.plan.rates import Rate, find_rate

CPU_STAGES = ("ingest", "shots", "package")


@dataclass(frozen=True)
class Workload:
    videos: int
    gpus: int
    gpu: str = "h200"
    cpu_cores: int = 64
    video_seconds: float = 56.0  # mean raw video length
    shot_seconds: float = 6.0  # mean usable shot length


@dataclass(frozen=True)
class StageEstimate:
    stage: str
    device: str
    work: float
    work_unit: str
    rate: Rate | None
    device_hours: float | None  # GPU-hours, or CPU core-hours
    hours: float | None
    missing: str = ""  # why there is no estimate


def _frames_per_second(params: dict[str, Any]) -> float:
    return float(params["encode_latents"]["clip"]["fps"])


def _train_tflop(params: dict[str, Any]) -> float:
    """TFLOPs of all of train_ar's steps, counted as the train-step benchmark counts them."""
    from longlive_core.models.config import dit_config
    from longlive_core.models.vae import SPATIAL_STRIDE
    from longlive_core.train.flops import step_flops
    from longlive_core.train.layout import TeacherForcingLayout

    t = params["train_ar"]
    cfg = dit_config(t["model"])
    clip = params["encode_latents"]["clip"]
    stride, patch = SPATIAL_STRIDE, cfg.patch_size
    tokens = (clip["height"] // stride // patch[1]) * (clip["width"] // stride // patch[2])
    layout = TeacherForcingLayout(frames=t["max_latent_frames"], chunk=t["chunk_frames"], tokens_per_frame=tokens,
                                  text_tokens=params["encode_latents"]["text_max_length"])
    samples_per_step = t["nnodes"] * t["nproc"] // t.get("sp", 1) * t["grad_accum"]
    return t["steps"] * samples_per_step * step_flops(cfg, layout, captions=1) / 1e12


def _suite_seconds(params: dict[str, Any]) -> float:
    from longlive_core.infer.prompts import parse_prompts

    default = float(params["generate"]["default_duration_s"])
    return sum(seg.duration_s for text in params["evaluate"]["suite"].values()
               for seg in parse_prompts(text, default))


def caption_variant(caption: dict[str, Any]) -> str:
    """What a caption rate was measured at: batch, frames per shot, new tokens (bench/caption_throughput.py)."""
    return f"bs{caption['batch_size']}-{caption['max_frames']}f-{caption['max_new_tokens']}tok"


def precision_variant(recipe: str, section: dict[str, Any]) -> str:
    """What a training rate was measured at: the recipe and the recomputation of activation
    checkpointing (``nvfp4+full-ac``; the compiler's per budget, the planner's per memory limit)."""
    ac = section.get("activation_checkpointing", "none")
    if ac == "compiler":
        ac = f"compiler{float(section.get('ac_budget', 0.5)):g}"
    elif ac == "budget":  # GiB; null: 0.9 of the GPU's
        limit = section.get("ac_memory_limit_gib")
        ac = "budget" + ("0.9x" if limit is None else f"{float(limit):g}GiB")
    return recipe + ("" if ac == "none" else f"+{ac}-ac")


def stage_work(stage: str, params: dict[str, Any], w: Workload) -> tuple[float, str, str, float]:
    """(work, its unit, the rate variant that matches params, a factor the rate's time is multiplied by)."""
    fps = _frames_per_second(params)
    if stage == "ingest":
        return w.videos, "files", "", 1.0
    if stage == "shots":
        return w.videos * w.video_seconds, "video-s", "", 1.0
    shots = w.videos * w.video_seconds / w.shot_seconds
    if stage == "iqa_filter":
        return shots * params["iqa_filter"]["frames_per_shot"], "frames", "", 1.0
    if stage == "caption":  # an upper bound: as if every shot were kept and none had a sidecar caption
        c = params["caption"]
        # and one subjects request per video, timed as a caption (its prompt has no frames: cheaper)
        return shots, "shots", caption_variant(c), 1 + w.shot_seconds / w.video_seconds
    if stage == "encode_latents":  # an upper bound: as if every second of footage were kept
        return w.videos * w.video_seconds * fps, "frames", f"sp{params['encode_latents'].get('sp', 1)}", 1.0
    if stage == "train_ar":  # the recipe and the recomputation of activation checkpointing set the rate
        t = params["train_ar"]
        return _train_tflop(params), "TFLOP", precision_variant(t["precision"]["recipe"], t), 1.0
    if stage == "distill_dmd":
        from longlive_core.models.config import dit_config

        d = params["distill_dmd"]
        blocks = dit_config(params["train_ar"]["model"]).num_layers
        # the rate was measured on 8 blocks of one rank's sample: every rank does one per iteration
        return d["steps"] * d["nnodes"] * d["nproc"], "rank-iterations", precision_variant(d["recipe"], d), blocks / 8
    if stage == "merge_w4a4":
        return 1, "models", "", 1.0
    if stage == "evaluate":
        return _suite_seconds(params) * fps, "frames", "", 1.0
    if stage == "package":
        return 1, "bundles", "", 1.0
    raise KeyError(stage)


def estimate(stage: str, params: dict[str, Any], w: Workload, rates: list[Rate]) -> StageEstimate:
    device = "cpu" if stage in CPU_STAGES else w.gpu
    work, unit, variant, factor = stage_work(stage, params, w)
    rate = find_rate(rates, stage, device, variant)
    if rate is None or rate.value is None:
        why = (rate.note if rate is not None and rate.note else
               f"no {stage} rate measured on {device}" + (f" ({variant})" if variant else ""))
        if "+budget" in variant:  # no other policy's rate stands in for it
            bench = "bench/dmd_step.py" if stage == "distill_dmd" else "bench/train_step.py"
            why += f"; activation_checkpointing budget is measured per limit: {bench} --ac budget:<GiB>"
        return StageEstimate(stage, device, work, unit, rate, None, None, f"no measured rate: {why}")
    device_seconds = work / rate.per_device * factor
    parallel = w.cpu_cores if device == "cpu" else w.gpus
    return StageEstimate(stage, device, work, unit, rate, device_seconds / 3600, device_seconds / 3600 / parallel)


def plan(params: dict[str, Any], w: Workload, rates: list[Rate], stages: list[str]) -> list[StageEstimate]:
    if w.videos < 1 or w.gpus < 1 or w.cpu_cores < 1 or w.video_seconds <= 0 or w.shot_seconds <= 0:
        raise ValueError("videos, gpus and cpu cores must be positive, and so must the video and shot lengths")
    return [estimate(s, params, w, rates) for s in stages]
