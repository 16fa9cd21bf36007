"""`shots` throughput in video-seconds per CPU-second, side by side in one run (figures go into
bench/RESULTS.md).

On the same generated 720p H.264 files (several shots each, known cuts):
  plain      scenedetect.detect(path, AdaptiveDetector(), backend="pyav")  (the reference)
  detect     longlive_core.shots.detect.detect_cuts (the stage's detection step)
  split      longlive_core.shots.split.split_video (detection + decoding again + lossy clip encoding)
and whether each finds the same cuts as the reference (within one frame) and as the truth.

    .venv/bin/python bench/shots_throughput.py [--videos 6] [--seconds 12]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from longlive_core.shots.detect import ShotsConfig, detect_cuts
from longlive_core.shots.split import VideoJob, split_video
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video


def measure(fn, items):
    wall, cpu = time.perf_counter(), time.process_time()
    out = [fn(x) for x in items]
    return out, time.perf_counter() - wall, time.process_time() - cpu


def same_cuts(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1 for x, y in zip(sorted(a), sorted(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--videos", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=12.0)
    args = ap.parse_args()
    from scenedetect import AdaptiveDetector, detect

    tmp = Path(tempfile.mkdtemp(prefix="bench-shots-"))
    rng = np.random.default_rng(0)
    specs = []
    for i in range(args.videos):
        total = int(args.seconds * 24)
        n = int(rng.integers(2, 5))
        edges = sorted(rng.choice(np.arange(30, total - 30), n - 1, replace=False))
        lens = np.diff([0, *edges, total])
        hue = float(rng.uniform())
        shots = []
        for j, length in enumerate(lens):
            hue = (hue + rng.uniform(0.25, 0.75)) % 1
            shots.append(ShotSpec(int(length), hue, "circle" if j % 2 else "square", i * 10 + j))
        spec = VideoSpec(f"v{i}.mp4", tuple(shots))
        write_video(tmp / spec.relpath, spec, 24, 1280, 720, crf=20)
        specs.append(spec)
    paths = [str(tmp / s.relpath) for s in specs]
    video_s = sum(s.num_frames for s in specs) / 24

    plain, pw, pc = measure(lambda p: [a.frame_num for a, _ in detect(p, AdaptiveDetector(), backend="pyav")[1:]],
                            paths)
    cfg = ShotsConfig(min_shot_s=1.0, max_shot_s=1000.0, clip_crf=17)
    ours, dw, dc = measure(lambda p: detect_cuts(p, cfg, 24.0), paths)
    jobs = [VideoJob(f"{i:064x}", p, Path(p).name, 24.0, s.num_frames, cfg)
            for i, (p, s) in enumerate(zip(paths, specs))]
    split, sw, sc = measure(split_video, jobs)

    truth = [s.cut_frames for s in specs]
    print(f"# {len(paths)} videos, 1280x720 H.264, {video_s:.0f} video-seconds")
    print("| what | wall s | CPU s | video-s per CPU-s | same cuts as plain | cuts = truth |")
    print("|---|---|---|---|---|---|")
    for name, w, c, cuts in (("plain detect (reference)", pw, pc, plain), ("detect_cuts", dw, dc, ours),
                             ("split_video (detect + clips)", sw, sc, [r.cuts for r in split])):
        agree = sum(same_cuts(a, b) for a, b in zip(cuts, plain))
        exact = sum(same_cuts(a, b) for a, b in zip(cuts, truth))
        print(f"| {name} | {w:.2f} | {c:.2f} | {video_s / c:.1f} | {agree}/{len(paths)} | {exact}/{len(paths)} |")
    print(f"ratio detect_cuts / plain (video-s per CPU-s): {pc / dc:.2f}; split_video / plain: {pc / sc:.2f}")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
