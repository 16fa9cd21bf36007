"""Shot clips: encoded per shot, stored many to a tar shard so DVC never tracks one file per clip.

A shard is an uncompressed tar of ``<video_id>/<shot_index>.mp4`` members (H.264, yuv420p, every
clip starting on a keyframe). Shards are written under a temporary name and renamed when closed,
so a shard on disk is always complete; one that fails while open is deleted, never published. A
clip holds exactly the frames [start_frame, end_frame) of the source; with ``clip_crf: 0`` they are
bit-identical in YUV. 4:2:0 needs even sizes, so a source of odd width or height (853x480 is a
standard 16:9 size) loses its last column or row.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import tarfile
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import av
import av.logging
import numpy as np

from longlive_core.io.atomic import TMP_PREFIX

# Clip timestamps keep the source's, relative to the shot's first frame, in this time base: a
# variable-frame-rate source stays one, so the latent stage can resample by timestamps.
CLIP_TIME_BASE = Fraction(1, 90000)


def even_yuv420p(frame: av.VideoFrame) -> np.ndarray:
    """The frame as PyAV's yuv420p array (Y rows, then U, then V), cut to even width and height."""
    if frame.format.name != "yuv420p":
        frame = frame.reformat(format="yuv420p")  # swscale converts any size, odd ones too
    w, h = frame.width & ~1, frame.height & ~1
    planes = [np.frombuffer(p, np.uint8).reshape(p.height, p.line_size) for p in frame.planes]
    y = planes[0][:h, :w]
    u, v = (c[: h // 2, : w // 2] for c in planes[1:])
    return np.concatenate([y.ravel(), u.ravel(), v.ravel()]).reshape(h * 3 // 2, w)


class ClipEncoder:
    """Streams frames into an in-memory MP4, keeping their relative timing and the display rotation."""

    def __init__(self, width: int, height: int, fps: float, crf: int, preset: str, rotation: int = 0):
        self.buf = io.BytesIO()
        self.fps = Fraction(fps).limit_denominator(1001 * 1000)
        self.container = av.open(self.buf, mode="w", format="mp4")
        self.stream = self.container.add_stream("libx264", rate=self.fps)
        self.stream.width, self.stream.height = width & ~1, height & ~1
        self.stream.pix_fmt = "yuv420p"
        self.stream.codec_context.options = {"crf": str(crf), "preset": preset, "threads": "1",
                                             "x264-params": "log-level=warning"}
        self.stream.codec_context.time_base = CLIP_TIME_BASE
        self.stream.time_base = CLIP_TIME_BASE
        if rotation:
            self.stream.set_display_rotation(rotation)
        self.n = 0
        self.t0: float | None = None
        self.last_pts = -1

    def add(self, frame: av.VideoFrame) -> None:
        out = av.VideoFrame.from_ndarray(even_yuv420p(frame), format="yuv420p")
        t = frame.time if frame.time is not None else self.n / float(self.fps)
        self.t0 = t if self.t0 is None else self.t0
        pts = max(round((t - self.t0) / CLIP_TIME_BASE), self.last_pts + 1)  # strictly increasing
        out.pts, out.time_base, self.last_pts = pts, CLIP_TIME_BASE, pts
        for packet in self.stream.encode(out):
            self.container.mux(packet)
        self.n += 1

    def finish(self) -> bytes:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()
        return self.buf.getvalue()


def cut_clips(path: str | Path, spans: dict[int, tuple[int, int]], fps: float, crf: int,
              preset: str) -> tuple[int, dict[int, bytes]]:
    """One decode pass over ``path``; returns (frames decoded, {key: clip bytes}) for the spans."""
    # FFmpeg prints to stderr at INFO by default, and libx264 its stats per clip. Lower FFmpeg's own
    # level; never PyAV's set_level, whose Python log callback can deadlock threaded decoders.
    av.logging.set_libav_level(av.logging.ERROR)
    starts = {start: key for key, (start, _) in spans.items()}
    clips: dict[int, bytes] = {}
    current: tuple[int, int, ClipEncoder] | None = None
    index = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if current is None and index in starts:
                key = starts[index]
                encoder = ClipEncoder(frame.width, frame.height, fps, crf, preset,
                                      rotation=int(round(getattr(frame, "rotation", 0) or 0)) % 360)
                current = (key, spans[key][1], encoder)
            if current is not None:
                current[2].add(frame)
                if index + 1 == current[1]:
                    clips[current[0]] = current[2].finish()
                    current = None
            index += 1
    if current is not None:
        raise ValueError(f"video ended after {index} frames, inside shot {current[0]} (ends at {current[1]})")
    return index, clips


class ShardWriter:
    """Appends clips to numbered tar shards in ``directory``; each shard appears only when closed."""

    def __init__(self, directory: str | Path, max_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        numbers = [int(m.group(1)) for p in self.dir.glob("shard-*.tar")
                   if (m := re.fullmatch(r"shard-(\d+)\.tar", p.name))]
        self.next = max(numbers, default=-1) + 1
        self._tar: tarfile.TarFile | None = None
        self._tmp: Path | None = None
        self.name: str | None = None
        self.size = 0

    def add(self, member: str, data: bytes) -> str:
        """Adds one clip; returns the shard file name it will live in."""
        if self._tar is None:
            self.name = f"shard-{self.next:05d}.tar"
            self.next += 1
            self._tmp = self.dir / f"{TMP_PREFIX}{self.name}"
            self._tar = tarfile.open(self._tmp, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 - closed in close()
            self.size = 0
        info = tarfile.TarInfo(member)
        info.size = len(data)
        self._tar.addfile(info, io.BytesIO(data))
        self.size += len(data) + 512
        return self.name  # type: ignore[return-value]

    @property
    def full(self) -> bool:
        return self._tar is not None and self.size >= self.max_bytes

    def abort(self) -> None:
        """Drops the open shard: a run that fails while writing (a full disk, Ctrl-C) publishes
        nothing half-written, and the videos in that shard are split again next time."""
        if self._tar is not None:
            with contextlib.suppress(OSError):  # closing writes the tar's end blocks: the disk may be full
                self._tar.close()
            self._tmp.unlink(missing_ok=True)  # type: ignore[union-attr]
        self._tar = self._tmp = None

    def close(self) -> str | None:
        """Finishes the open shard (if any) and returns its name."""
        if self._tar is None:
            return None
        self._tar.close()
        with open(self._tmp, "rb+") as fh:  # type: ignore[arg-type]
            os.fsync(fh.fileno())
        os.replace(self._tmp, self.dir / self.name)  # type: ignore[arg-type, operator]
        name, self._tar, self._tmp = self.name, None, None
        return name


def read_clip(shards_dir: str | Path, shard: str, member: str) -> bytes:
    if "/" in shard or shard.startswith("."):
        raise ValueError(f"bad shard name {shard!r}")
    with tarfile.open(Path(shards_dir) / shard, "r") as tar:
        fh = tar.extractfile(member)
        if fh is None:
            raise KeyError(f"{member} not in {shard}")
        return fh.read()


def iter_clip_frames(data: bytes, fmt: str = "rgb24") -> Iterator[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format=fmt)


def clip_frames_at(data: bytes, indices: Iterable[int], fmt: str = "rgb24") -> dict[int, np.ndarray]:
    """The clip's frames at ``indices`` (those it has): frames up to the last wanted one are decoded,
    as inter frames need, but only the wanted ones are converted, and nothing after them decoded."""
    wanted = set(indices)
    out: dict[int, np.ndarray] = {}
    if not wanted:
        return out
    last = max(wanted)
    with av.open(io.BytesIO(data)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in wanted:
                out[i] = frame.to_ndarray(format=fmt)
            if i >= last:
                break
    return out


def iter_timed_frames(source: bytes | str | Path) -> Iterator[tuple[np.ndarray, float, int]]:
    """(8-bit RGB frame as stored, time in seconds, display rotation in degrees) of a clip's bytes or a
    video file; any pixel format (10-bit, 4:2:2 ...) is converted to 8-bit RGB by swscale."""
    av.logging.set_libav_level(av.logging.ERROR)
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            t = frame.time if frame.time is not None else float(i)
            yield frame.to_ndarray(format="rgb24"), t, int(round(getattr(frame, "rotation", 0) or 0)) % 360
