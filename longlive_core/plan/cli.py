"""``longlive plan``: what a production run will cost, stage by stage, before a cluster is booked.

    longlive plan --videos 120000 --gpus 32 [--gpu h200|gb200] [--params configs/production.yaml]

The work of each stage comes from the params (the production overlay by default) and the workload
flags; the rates from bench/rates.yaml, each a measurement named with its source and date. A stage
without a measured rate is listed as such and left out of the totals, which say so.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longlive_core.params_overlay import overlaid_params
from longlive_core.plan.capacity import StageEstimate, Workload, plan
from longlive_core.plan.rates import DEFAULT_RATES, load_rates

REPO = Path(__file__).resolve().parents[2]
STAGES = ["ingest", "shots", "iqa_filter", "caption", "encode_latents", "train_ar", "distill_dmd", "merge_w4a4",
          "evaluate", "package"]


def render(estimates: list[StageEstimate], w: Workload) -> str:
    lines = [f"plan for {w.videos:,} videos (mean {w.video_seconds:g} s, shots of {w.shot_seconds:g} s) on "
             f"{w.gpus} {w.gpu.upper()} GPUs and {w.cpu_cores} CPU cores", "",
             f"{'stage':<15} {'on':<6} {'work':>22} {'hours':>9} {'device-hours':>13}  rate"]
    for e in estimates:
        work = f"{e.work:,.0f} {e.work_unit}"
        if e.hours is None:
            lines.append(f"{e.stage:<15} {e.device:<6} {work:>22} {'-':>9} {'-':>13}  {e.missing}")
        else:
            r = e.rate
            unit = "core-h" if e.device == "cpu" else "GPU-h"
            lines.append(f"{e.stage:<15} {e.device:<6} {work:>22} {e.hours:>9.1f} {e.device_hours:>7.1f} {unit:<5}"
                         f"  {r.per_device:g} {r.unit} per {'core' if e.device == 'cpu' else 'GPU'} ({r.cite()})")
    known = [e for e in estimates if e.hours is not None]
    gpu_hours = sum(e.device_hours for e in known if e.device != "cpu")
    hours = sum(e.hours for e in known)
    left_out = [e.stage for e in estimates if e.hours is None]
    lines += ["", f"total of the estimated stages: {hours:.1f} hours one after another, {gpu_hours:.1f} GPU-hours"]
    if left_out:
        lines.append(f"not in the total (no measured rate): {', '.join(left_out)}")
    lines.append("rates: bench/rates.yaml (each with its bench/RESULTS.md row, machine, date and command)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--videos", type=int, required=True, help="raw videos to curate")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs the run books")
    ap.add_argument("--gpu", default="h200", help="GPU kind the rates are for (h200, gb200)")
    ap.add_argument("--cpu-cores", type=int, default=64, help="CPU cores for the curation stages (default 64)")
    ap.add_argument("--video-seconds", type=float, default=56.0,
                    help="mean raw video length (default 56: the paper's mix of a third each of 16-32, 32-64 and "
                         ">64 s, taking 24, 48 and 96 s)")
    ap.add_argument("--shot-seconds", type=float, default=6.0, help="mean usable shot length (default 6)")
    ap.add_argument("--params", type=Path, default=REPO / "configs/production.yaml",
                    help="params overlay the run uses (default: configs/production.yaml)")
    ap.add_argument("--rates", type=Path, default=DEFAULT_RATES, help="rates file (default: bench/rates.yaml)")
    args = ap.parse_args(argv)
    w = Workload(videos=args.videos, gpus=args.gpus, gpu=args.gpu.lower(), cpu_cores=args.cpu_cores,
                 video_seconds=args.video_seconds, shot_seconds=args.shot_seconds)
    try:
        estimates = plan(overlaid_params(REPO / "params.yaml", args.params), w, load_rates(args.rates), STAGES)
    except ValueError as exc:
        print(f"longlive plan: {exc}", file=sys.stderr)
        return 2
    print(render(estimates, w))
    return 0
