"""`shots` throughput in video-seconds per CPU-second, side by side in one run (figures go into
bench/RESULTS.md).

Default: a mixed set of generated files, one per codec and container (MPEG-4 Part 2 in AVI, once
with B-frames and quarter-pel motion; MPEG-2 in MPEG-PS and MPEG-TS; H.264 in MP4 and MKV; VP8 and
VP9 in WebM; FLV1; WMV2 in ASF; HEVC in MP4; MJPEG in MOV and AVI; ProRes in MOV; 640x360 to
1280x720 and odd sizes), several shots each with known cuts:
  plain      scenedetect.detect(path, AdaptiveDetector(), backend="pyav")  (the reference)
  detect     longlive_core.shots.detect.detect_cuts (the stage's detection step)
per codec and in total; whether detect_cuts finds the same cuts as the reference (exactly, or
within one frame) and as the truth; and whether its frame count and frame times equal a plain
full decode's.
Each video is measured ``--repeat`` times, plain and detect_cuts in turn; the best CPU time of
each counts. ``--breakdown`` adds where the time goes per codec (decode, conversion, detector).

``--h264`` runs the earlier table instead: 1280x720 H.264 only, plus split_video (detection +
decoding again + lossy clip encoding).

    .venv/bin/python bench/shots_throughput.py [--repeat 3] [--seconds 12] [--breakdown] [--keep DIR]
    .venv/bin/python bench/shots_throughput.py --h264 [--videos 6] [--seconds 12]
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import av
import cv2
import numpy as np

import longlive_core.shots.detect as detect_mod
from longlive_core.shots.detect import ShotsConfig, detect_cuts, frame_time
from longlive_core.shots.split import VideoJob, split_video
from longlive_core.video.synth import ShotSpec, VideoSpec, render_shot, write_video

FPS = 24


@dataclasses.dataclass(frozen=True)
class Kind:
    label: str
    container: str
    codec: str  # encoder name
    pix_fmt: str
    width: int
    height: int
    ext: str
    b_frames: int = 0  # > 0: B-frames and quarter-pel motion, as Xvid/DivX AVI files have


MIX = (  # what the mixed set holds (codecs missing from the FFmpeg build are left out and named)
    Kind("MPEG-4 Part 2 / AVI", "avi", "mpeg4", "yuv420p", 1280, 720, "avi"),
    Kind("MPEG-4 ASP, B-frames, qpel / AVI", "avi", "mpeg4", "yuv420p", 960, 540, "avi", b_frames=2),
    Kind("MPEG-2 / MPEG-PS", "mpeg", "mpeg2video", "yuv420p", 960, 540, "mpg"),
    Kind("MPEG-2 / MPEG-TS", "mpegts", "mpeg2video", "yuv420p", 1280, 720, "ts"),
    Kind("H.264 / MP4", "mp4", "libx264", "yuv420p", 1280, 720, "mp4"),
    Kind("H.264 / MKV", "matroska", "libx264", "yuv420p", 854, 480, "mkv"),
    Kind("VP8 / WebM", "webm", "libvpx", "yuv420p", 960, 540, "webm"),
    Kind("VP9 / WebM", "webm", "libvpx-vp9", "yuv420p", 640, 360, "webm"),
    Kind("FLV1 / FLV", "flv", "flv", "yuv420p", 853, 480, "flv"),
    Kind("WMV2 / ASF", "asf", "wmv2", "yuv420p", 960, 540, "wmv"),
    Kind("HEVC / MP4", "mp4", "libx265", "yuv420p", 960, 540, "mp4"),
    Kind("MJPEG / MOV", "mov", "mjpeg", "yuvj420p", 1280, 720, "mov"),
    Kind("MJPEG 4:2:2 / AVI", "avi", "mjpeg", "yuvj422p", 853, 480, "avi"),
    Kind("ProRes 422 10-bit / MOV", "mov", "prores", "yuv422p10le", 640, 360, "mov"),
)


def measure(fn, items):
    wall, cpu = time.perf_counter(), time.process_time()
    out = [fn(x) for x in items]
    return out, time.perf_counter() - wall, time.process_time() - cpu


def timed(fn, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def same_cuts(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1 for x, y in zip(sorted(a), sorted(b)))


def agreement(a: list[int], b: list[int]) -> str:
    return "yes" if sorted(a) == sorted(b) else "±1 frame" if same_cuts(a, b) else "NO"


def make_specs(n: int, seconds: float, ext: str = "mp4", min_gap: int = 1) -> list[VideoSpec]:
    """``n`` videos of 2-4 shots with random cut positions, cuts at least ``min_gap`` frames apart
    (the same videos for given arguments)."""
    rng = np.random.default_rng(0)
    specs = []
    for i in range(n):
        total = int(seconds * FPS)
        k = int(rng.integers(2, 5))
        edges = sorted(rng.choice(np.arange(30, total - 30), k - 1, replace=False))
        while min(np.diff(edges), default=min_gap) < min_gap:
            edges = sorted(rng.choice(np.arange(30, total - 30), k - 1, replace=False))
        lens = np.diff([0, *edges, total])
        hue = float(rng.uniform())
        shots = []
        for j, length in enumerate(lens):
            hue = (hue + rng.uniform(0.25, 0.75)) % 1
            shots.append(ShotSpec(int(length), hue, "circle" if j % 2 else "square", i * 10 + j))
        specs.append(VideoSpec(f"v{i}.{ext}", tuple(shots)))
    return specs


def plain_cuts(path: str) -> list[int]:
    from scenedetect import AdaptiveDetector, detect

    return [a.frame_num for a, _ in detect(path, AdaptiveDetector(), backend="pyav")[1:]]


def plain_times(path: str) -> list[float]:
    """Every frame's time from a plain full decode (default decoder options), relative to the first."""
    times: list[float] = []
    with av.open(path) as c:
        for frame in c.decode(c.streams.video[0]):
            times.append(frame_time(frame, times, float(FPS)))
    t0 = times[0] if times else 0.0
    return [t - t0 for t in times]


def run_h264(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-shots-"))
    specs = make_specs(args.videos, args.seconds)
    for spec in specs:
        write_video(tmp / spec.relpath, spec, FPS, 1280, 720, crf=20)
    paths = [str(tmp / s.relpath) for s in specs]
    video_s = sum(s.num_frames for s in specs) / FPS

    plain, pw, pc = measure(plain_cuts, paths)
    cfg = ShotsConfig(min_shot_s=1.0, max_shot_s=1000.0, clip_crf=17)
    ours, dw, dc = measure(lambda p: detect_cuts(p, cfg, float(FPS)).cuts, paths)
    jobs = [VideoJob(f"{i:064x}", p, Path(p).name, float(FPS), s.num_frames, cfg)
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


def write_mix(folder: Path, seconds: float) -> list[tuple[Kind, VideoSpec, str]]:
    """One video per available codec, written once into ``folder`` (an existing file is reused)."""
    have = av.codecs_available
    kinds = [k for k in MIX if k.codec in have]
    missing = [k.label for k in MIX if k.codec not in have]
    if missing:
        print(f"# not in this FFmpeg build, left out: {', '.join(missing)}")
    out = []
    for kind, spec in zip(kinds, make_specs(len(kinds), seconds, "x", min_gap=FPS)):
        key = hashlib.sha256(repr((kind, spec.shots)).encode()).hexdigest()[:8]  # a changed spec: a new file
        name = f"{kind.codec}-{kind.width}x{kind.height}-{key}.{kind.ext}"
        spec = dataclasses.replace(spec, relpath=name)
        path = folder / name
        if not path.is_file() and kind.b_frames:
            write_b_frames(path, spec, kind)
        elif not path.is_file():
            write_video(path, spec, FPS, kind.width, kind.height, crf=20, container=kind.container,
                        codec=kind.codec, pix_fmt=kind.pix_fmt)
        out.append((kind, spec, str(path)))
    return out


def write_b_frames(path: Path, spec: VideoSpec, kind: Kind) -> None:
    """Like synth.write_video for FFmpeg's MPEG-family encoders, with B-frames and quarter-pel motion."""
    with av.open(str(path), mode="w", format=kind.container) as out:
        stream = out.add_stream(kind.codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = kind.width, kind.height, kind.pix_fmt
        stream.codec_context.options = {"threads": "1", "flags": "+qpel+mv4"}
        stream.codec_context.max_b_frames = kind.b_frames
        stream.codec_context.qmax = 8
        n = 0
        for shot in spec.shots:
            for rgb in render_shot(shot, kind.width, kind.height):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts, n = n, n + 1
                out.mux(stream.encode(frame))
        out.mux(stream.encode())


class _NoDetector:
    def process_frame(self, timecode, frame):
        return []

    def post_process(self, timecode):
        return []


def breakdown(path: str, cfg: ShotsConfig, repeat: int) -> dict[str, float]:
    """CPU seconds (best of ``repeat``) of: the plain call's decode alone (default decoder options,
    frames not converted); that plus its conversion (full-size BGR, then cv2.resize to 256 px);
    the plain call; detect_cuts' own decode loop with conversion and detector stubbed out; that
    plus its conversion; detect_cuts. A stage's share is the difference of two columns."""
    def plain_decode(convert: bool) -> None:
        with av.open(path) as c:
            for f in c.decode(c.streams.video[0]):
                if convert:
                    im = f.to_ndarray(format="bgr24")
                    k = max(im.shape[:2]) / 256
                    if k > 1:
                        cv2.resize(im, (round(im.shape[1] / k), round(im.shape[0] / k)))

    def ours(stub_convert: bool, stub_detector: bool) -> None:
        saved = detect_mod._small_bgr, detect_mod.make_detector
        try:
            if stub_convert:
                detect_mod._small_bgr = lambda frame, size: None
            if stub_detector:
                detect_mod.make_detector = lambda cfg: _NoDetector()
            detect_cuts(path, cfg, float(FPS))
        finally:
            detect_mod._small_bgr, detect_mod.make_detector = saved

    runs = {"plain: decode": lambda: plain_decode(False), "plain: + conversion": lambda: plain_decode(True),
            "plain: all": lambda: plain_cuts(path), "ours: decode": lambda: ours(True, True),
            "ours: + conversion": lambda: ours(False, True), "ours: all": lambda: ours(False, False)}
    best = dict.fromkeys(runs, np.inf)
    for _ in range(repeat):
        for name, fn in runs.items():
            best[name] = min(best[name], timed(fn)[2])
    return best


def run_mix(args) -> None:
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-shots-mix-"))
    folder.mkdir(parents=True, exist_ok=True)
    videos = write_mix(folder, args.seconds)
    cfg = ShotsConfig(min_shot_s=1.0, max_shot_s=1000.0)
    n = len(videos)
    best = {"plain": [np.inf] * n, "ours": [np.inf] * n}
    walls = {"plain": [np.inf] * n, "ours": [np.inf] * n}
    results: dict[str, list] = {"plain": [None] * n, "ours": [None] * n}
    for r in range(args.repeat):
        for i, (_kind, _spec, path) in enumerate(videos):
            order = ("plain", "ours") if (r + i) % 2 == 0 else ("ours", "plain")
            for who in order:
                fn = plain_cuts if who == "plain" else (lambda p: detect_cuts(p, cfg, float(FPS)))
                out, w, c = timed(fn, path)
                results[who][i] = out
                best[who][i] = min(best[who][i], c)
                walls[who][i] = min(walls[who][i], w)

    print(f"# {n} videos, {args.seconds:g} s each at {FPS} fps, best of {args.repeat} runs per video "
          f"(plain and detect_cuts in turn); CPU s = process time (all threads)")
    print("| codec / container | size | frames | plain CPU s | detect_cuts CPU s | ratio | plain wall s "
          "| detect_cuts wall s | same cuts as plain | cuts = truth | frames and times = plain decode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    agree = exact = timing = 0
    for i, (kind, spec, path) in enumerate(videos):
        det = results["ours"][i]
        pc, dc = best["plain"][i], best["ours"][i]
        vs_plain, vs_truth = agreement(det.cuts, results["plain"][i]), agreement(det.cuts, spec.cut_frames)
        ref = plain_times(path)
        ok_times = len(ref) == len(det.times) and all(abs(a - b) < 1e-9 for a, b in zip(ref, det.times))
        agree, exact, timing = agree + (vs_plain != "NO"), exact + (vs_truth == "yes"), timing + ok_times
        print(f"| {kind.label} | {kind.width}x{kind.height} {kind.pix_fmt} | {len(det.times)} | {pc:.2f} | {dc:.2f} "
              f"| {pc / dc:.2f} | {walls['plain'][i]:.2f} | {walls['ours'][i]:.2f} | {vs_plain} | {vs_truth} "
              f"| {'yes' if ok_times else 'NO'} |")
    video_s = sum(s.num_frames for _, s, _ in videos) / FPS
    pc, dc = sum(best["plain"]), sum(best["ours"])
    print(f"| total ({video_s:.0f} video-s) | | {sum(s.num_frames for _, s, _ in videos)} | {pc:.2f} | {dc:.2f} "
          f"| {pc / dc:.2f} | {sum(walls['plain']):.2f} | {sum(walls['ours']):.2f} | {agree}/{n} | {exact}/{n} "
          f"| {timing}/{n} |")
    print(f"video-s per CPU-s: plain {video_s / pc:.1f}, detect_cuts {video_s / dc:.1f}; "
          f"ratio detect_cuts / plain: {pc / dc:.2f}")

    if args.breakdown:
        print(f"\n# where the time goes, CPU s per video, best of {args.repeat} "
              "(a stage: the difference of two columns)")
        cols = ("plain: decode", "plain: + conversion", "plain: all", "ours: decode", "ours: + conversion", "ours: all")
        print("| codec / container | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for kind, _, path in videos:
            row = breakdown(path, cfg, args.repeat)
            print(f"| {kind.label} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |", flush=True)
    if not args.keep:
        shutil.rmtree(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--h264", action="store_true", help="the earlier H.264-only table with split_video")
    ap.add_argument("--videos", type=int, default=6, help="--h264: how many videos")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--repeat", type=int, default=3, help="mixed set: runs per video, the best counts")
    ap.add_argument("--breakdown", action="store_true", help="mixed set: where the time goes per codec")
    ap.add_argument("--keep", help="mixed set: write the videos here and reuse them on the next run")
    args = ap.parse_args()
    if args.h264:
        run_h264(args)
    else:
        run_mix(args)


if __name__ == "__main__":
    main()
