"""Ingest throughput, side by side in one run (figures go into bench/RESULTS.md).

Compares, on the same generated files:
  hashing   longlive_core's digest_file   vs  coreutils `sha256sum` (a common reference)
  probing   probe_video (demux every packet + decode head and tail)  vs  opening the header only
  ingest    the whole ingest() with workers=1 vs workers=2, cold state each time, and a warm rerun

    .venv/bin/python bench/ingest_throughput.py [--videos 40] [--seconds 4] [--width 640 --height 368]
"""
from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import av

from longlive_core.config import from_mapping
from longlive_core.data.ingest import IngestConfig, IngestState, ingest
from longlive_core.data.sources import LocalSource
from longlive_core.tracking.lineage import digest_file
from longlive_core.video.probe import probe_video
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--videos", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=368)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    src = tmp / "src"
    frames = int(args.seconds * 24)
    for i in range(args.videos):
        spec = VideoSpec(f"v{i:03d}.mp4", (ShotSpec(frames // 2, (i * 0.31) % 1, "circle", i),
                                           ShotSpec(frames - frames // 2, (i * 0.31 + 0.5) % 1, "square", i + 1)))
        write_video(src / spec.relpath, spec, 24, args.width, args.height, crf=18)
    files = sorted(src.glob("*.mp4"))
    total_mb = sum(f.stat().st_size for f in files) / 1e6

    rows = []
    t_ours = timed(lambda: [digest_file(f) for f in files])
    t_cli = timed(lambda: subprocess.run(["sha256sum", *map(str, files)], check=True, capture_output=True))
    rows.append(("hash: digest_file", t_ours, f"{total_mb / t_ours:.0f} MB/s"))
    rows.append(("hash: coreutils sha256sum", t_cli, f"{total_mb / t_cli:.0f} MB/s"))

    def header_only():
        for f in files:
            with av.open(str(f)) as c:
                _ = c.streams.video[0].frames

    t_probe = timed(lambda: [probe_video(f) for f in files])
    t_head = timed(header_only)
    rows.append(("probe: probe_video", t_probe, f"{len(files) / t_probe:.1f} files/s"))
    rows.append(("probe: header only (floor)", t_head, f"{len(files) / t_head:.1f} files/s"))

    for workers in (1, 2):
        state = tmp / f"state{workers}"
        cfg = from_mapping(IngestConfig, {"source": str(src), "workers": workers, "min_duration_s": 0.0}, "ingest")
        t = timed(lambda cfg=cfg, state=state: ingest(LocalSource(src).list(), cfg, IngestState(state), str(src)))
        rows.append((f"ingest cold, workers={workers}", t, f"{len(files) / t:.1f} files/s"))
    t = timed(lambda: ingest(LocalSource(src).list(), cfg, IngestState(tmp / "state2"), str(src)))
    rows.append(("ingest warm rerun, workers=2", t, f"{len(files) / t:.1f} files/s"))

    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{len(files)} H.264 files, {args.width}x{args.height}, {frames} frames each, {total_mb:.1f} MB")
    print(f"| {'what':32} | {'seconds':>8} | rate |")
    print(f"|{'-' * 34}|{'-' * 10}|------|")
    for name, secs, rate in rows:
        print(f"| {name:32} | {secs:8.3f} | {rate} |")
    print(f"hash ratio ours/sha256sum: {t_ours / t_cli:.2f}; probe ratio full/header-only: {t_probe / t_head:.1f}")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
