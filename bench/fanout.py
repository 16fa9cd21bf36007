"""The curation fan-out: the `shots` stage's per-video work (`split_video`) through the local process
executor and the Dask executor (a local cluster), side by side in one run (figures go into
bench/RESULTS.md).

  videos/s     split_video over ``--videos`` generated H.264 videos, for each executor and worker count
  overhead     a no-op task ``--tasks`` times: the executor's own cost per item, in milliseconds
  start        starting the workers: for the local executor one task's map (each map spawns its pool;
               taken out of the two figures above), for Dask a standing local cluster's start (the
               executor connects to it by address, as to a team's scheduler)

    .venv/bin/python bench/fanout.py [--videos 16] [--seconds 4] [--workers 1 2] [--tasks 400]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from longlive_core.config import from_mapping
from longlive_core.parallel import DaskConfig, DaskExecutor, LocalProcessExecutor, cluster_settings
from longlive_core.shots.detect import ShotsConfig
from longlive_core.shots.split import VideoJob, split_video
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video

FPS = 24


def noop(x: int) -> int:
    return x


def make_videos(root: Path, n: int, seconds: float) -> list[VideoJob]:
    cfg = from_mapping(ShotsConfig, {"min_shot_s": 0.5, "max_shot_s": 10.0, "clip_crf": 17}, "shots")
    jobs = []
    per_shot = int(seconds * FPS / 2)
    for i in range(n):
        spec = VideoSpec(f"v{i}.mp4", (ShotSpec(per_shot, 0.1 * (i % 10), "circle", i),
                                       ShotSpec(per_shot, 0.1 * (i % 10) + 0.5, "square", i + 100)))
        path = root / spec.relpath
        write_video(path, spec, FPS, 640, 360, crf=20)
        jobs.append(VideoJob(f"id{i}", str(path), spec.relpath, float(FPS), spec.num_frames, cfg))
    return jobs


def standing_cluster(workers: int):
    import dask
    from dask.distributed import LocalCluster

    with dask.config.set(cluster_settings(DaskConfig().retries)):  # as DaskExecutor's own
        return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)


def timed(executor, fn, items) -> tuple[float, int]:
    t = time.perf_counter()
    failures = sum(isinstance(r, BaseException) for _, r in executor.map_unordered(fn, items))
    return time.perf_counter() - t, failures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--videos", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tasks", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = make_videos(Path(tmp), args.videos, args.seconds)
        print(f"{args.videos} videos of {args.seconds:g} s at 640x360 ({args.videos * args.seconds:g} video-s)")
        print(f"{'executor':<8} {'workers':>7} {'videos/s':>9} {'video-s/s':>10} {'no-op ms/task':>14} {'start s':>8}")
        for w in args.workers:
            for name in ("local", "dask"):
                cluster = None
                if name == "local":  # each map starts its own pool: one task's map times that
                    ex = LocalProcessExecutor(w)
                    start, _ = timed(ex, noop, [0])
                else:  # a standing cluster, as a team's scheduler is: its start timed once
                    t = time.perf_counter()
                    cluster = standing_cluster(w)
                    start = time.perf_counter() - t
                    ex = DaskExecutor(w, DaskConfig(address=cluster.scheduler_address))
                    timed(ex, noop, [0])  # the workers import what the tasks need
                work_s, failed = timed(ex, split_video, jobs)
                noop_s, _ = timed(ex, noop, range(args.tasks))
                if cluster is None:
                    work_s, noop_s = work_s - start, noop_s - start
                else:
                    cluster.close()
                if failed:
                    raise SystemExit(f"{failed} videos failed under {name}")
                print(f"{name:<8} {w:>7} {args.videos / work_s:>9.2f} {args.videos * args.seconds / work_s:>10.2f} "
                      f"{1000 * noop_s / args.tasks:>14.2f} {start:>8.2f}")


if __name__ == "__main__":
    main()
