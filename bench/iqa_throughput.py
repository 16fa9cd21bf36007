"""IQA throughput on this machine (figures go into bench/RESULTS.md): the metric alone and the
motion score alone, on 720p frames, side by side in one run.

    .venv/bin/python bench/iqa_throughput.py [--frames 24] [--maniqa] [--maniqa-only --random-frames]

--maniqa also times MANIQA's architecture with random weights (1 crop per frame), which is what
runs in production (with 20 crops and the real KonIQ weights), on the CPU or on a CUDA device.
--maniqa-only --random-frames is for the H200 image, which has neither PyAV nor pyiqa's other
metrics' dependencies: random 720p frames instead of synthetic video, and only MANIQA.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from longlive_core.devices import pick_device
from longlive_core.iqa.metrics import IQAConfig, QualityMetric, maniqa_architecture
from longlive_core.iqa.motion import flow_magnitude


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--maniqa", action="store_true")
    ap.add_argument("--maniqa-only", action="store_true")
    ap.add_argument("--random-frames", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    if args.random_frames:
        frames = np.random.default_rng(0).integers(0, 256, (args.frames, 720, 1280, 3), dtype=np.uint8)
    else:
        from longlive_core.video.synth import ShotSpec, render_shot

        frames = np.stack(list(render_shot(ShotSpec(args.frames, 0.3, "circle", 1), 1280, 720)))
    device = pick_device("auto")
    rows = []
    if not args.maniqa_only:
        piqe = QualityMetric(IQAConfig(batch_size=8), device)
        piqe(frames[:2])  # warm-up
        t = time.perf_counter()
        piqe(frames)
        t_piqe = time.perf_counter() - t
        t = time.perf_counter()
        for a, b in zip(frames, frames[1:]):
            flow_magnitude(a, b, 128)
        t_flow = time.perf_counter() - t
        rows += [("piqe, 1280x720", args.frames / t_piqe),
                 ("motion (Farneback at 128 px)", (args.frames - 1) / t_flow)]
    if args.maniqa or args.maniqa_only:
        x = torch.from_numpy(frames[:args.batch]).permute(0, 3, 1, 2).float().div(255).to(device)
        variants = [(1, False), (20, False), (20, True)] if device.type == "cuda" else [(1, False)]
        for crops, bf16 in variants:
            net = maniqa_architecture(crops).eval().to(device)
            with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                net(x[:1])
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                reps = 5 if device.type == "cuda" else 1
                for _ in range(reps):
                    net(x)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            rate = reps * len(x) / (time.perf_counter() - t)
            dtype = "bf16 autocast" if bf16 else "fp32"
            rows.append((f"maniqa (random weights, {crops} crop(s), batch {len(x)}, {dtype}) on {device.type}", rate))
    print(f"# {torch.get_num_threads()} torch threads, device {device}")
    print("| what | frames/s |\n|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} |")


if __name__ == "__main__":
    main()
