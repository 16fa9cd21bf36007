"""IQA throughput on this machine (figures go into bench/RESULTS.md): the metric alone and the
motion score alone, on 720p frames, side by side in one run.

    .venv/bin/python bench/iqa_throughput.py [--frames 24] [--maniqa]

--maniqa also times MANIQA's architecture with random weights (1 crop per frame), which is what
runs in production (with 20 crops and the real KonIQ weights), on the CPU or on a CUDA device.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from longlive_core.iqa.metrics import IQAConfig, QualityMetric, maniqa_architecture, pick_device
from longlive_core.iqa.motion import flow_magnitude
from longlive_core.video.synth import ShotSpec, render_shot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--maniqa", action="store_true")
    args = ap.parse_args()
    frames = np.stack(list(render_shot(ShotSpec(args.frames, 0.3, "circle", 1), 1280, 720)))
    device = pick_device("auto")
    piqe = QualityMetric(IQAConfig(batch_size=8), device)
    piqe(frames[:2])  # warm-up
    t = time.perf_counter()
    piqe(frames)
    t_piqe = time.perf_counter() - t
    t = time.perf_counter()
    for a, b in zip(frames, frames[1:]):
        flow_magnitude(a, b, 128)
    t_flow = time.perf_counter() - t
    rows = [("piqe, 1280x720", args.frames / t_piqe), ("motion (Farneback at 128 px)", (args.frames - 1) / t_flow)]
    if args.maniqa:
        net = maniqa_architecture(1).eval().to(device)
        x = torch.from_numpy(frames[:8]).permute(0, 3, 1, 2).float().div(255).to(device)
        with torch.inference_mode():
            net(x[:1])
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            net(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
        rows.append((f"maniqa (random weights, 1 crop) on {device.type}", len(x) / (time.perf_counter() - t)))
    print(f"# {torch.get_num_threads()} torch threads, device {device}")
    print("| what | frames/s |\n|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} |")


if __name__ == "__main__":
    main()
