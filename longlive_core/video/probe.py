"""Probe a video file with PyAV and check that it really decodes.

A header can look fine on a file whose data is cut short, so the probe demuxes every video
packet (cheap: no decoding), compares that with what the header declares, and decodes a few
frames at the start and from the last keyframe on.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from pathlib import Path

import av


class ProbeError(Exception):
    """The file is not a usable video; the message is the human-readable quarantine reason."""


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    duration_s: float
    fps: float
    variable_frame_rate: bool
    width: int
    height: int
    rotation: int
    pix_fmt: str
    codec: str
    num_frames: int
    bit_rate: int
    has_audio: bool

    def as_row(self) -> dict:
        return dataclasses.asdict(self)


PROBE_COLUMNS = [f.name for f in dataclasses.fields(ProbeResult)]


def _rotation(stream: av.video.stream.VideoStream, first_frame: av.VideoFrame | None) -> int:
    # Newer FFmpeg carries rotation as a display matrix that PyAV exposes on decoded frames;
    # older files carry a "rotate" metadata tag on the stream.
    rot = getattr(first_frame, "rotation", None) if first_frame is not None else None
    if rot is None:
        tag = stream.metadata.get("rotate")
        rot = int(float(tag)) if tag not in (None, "") else 0
    return int(round(rot)) % 360


def _decode_some(path: str, stream_index: int, n: int, seek_pts: int | None) -> tuple[int, av.VideoFrame | None]:
    with av.open(path) as container:
        stream = container.streams[stream_index]
        stream.thread_type = "AUTO"
        if seek_pts is not None:
            container.seek(seek_pts, stream=stream, backward=True, any_frame=False)
        decoded, first = 0, None
        for frame in container.decode(stream):
            if first is None:
                first = frame
            decoded += 1
            if n and decoded >= n:
                break
        return decoded, first


def probe_video(path: str | Path, decode_frames: int = 8) -> ProbeResult:
    """Returns the probe fields, or raises ProbeError with the reason to quarantine the file."""
    path = str(path)
    try:
        container = av.open(path)
    except av.error.FFmpegError as exc:
        raise ProbeError(f"not a readable video container ({exc.__class__.__name__}: {exc.strerror or exc})") from exc
    with container:
        if not container.streams.video:
            raise ProbeError("no video stream in the file")
        stream = container.streams.video[0]
        cc = stream.codec_context
        if cc.width <= 0 or cc.height <= 0:
            raise ProbeError(f"video stream has no frame size ({cc.width}x{cc.height})")
        declared = int(stream.frames or 0)
        tb: Fraction = stream.time_base or Fraction(1, 1)
        pts: list[int] = []
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue
                if packet.pts is not None:
                    pts.append(packet.pts)
        except (av.error.FFmpegError, EOFError) as exc:
            raise ProbeError(f"stream data unreadable after {len(pts)} packets ({exc})") from exc
        meta = dict(codec=cc.name, pix_fmt=str(cc.pix_fmt or (stream.format.name if stream.format else "")),
                    width=cc.width, height=cc.height, bit_rate=int(container.bit_rate or 0),
                    has_audio=bool(container.streams.audio), stream_index=stream.index,
                    avg_rate=stream.average_rate)
    if not pts:
        raise ProbeError("video stream holds no frames")
    if declared and len(pts) < declared:
        raise ProbeError(f"truncated: header declares {declared} frames but only {len(pts)} are present")
    pts.sort()
    deltas = [b - a for a, b in zip(pts, pts[1:]) if b > a]
    step = min(deltas) if deltas else 1
    span = (pts[-1] - pts[0] + step) * tb
    duration_s = float(span)
    num_frames = len(pts)
    vfr = bool(deltas) and (max(deltas) - min(deltas)) > max(1, 0.01 * min(deltas))
    fps = num_frames / duration_s if duration_s > 0 else float(meta["avg_rate"] or 0)
    if not math.isfinite(fps) or fps <= 0:
        raise ProbeError("cannot determine the frame rate")

    try:
        head, first = _decode_some(path, meta["stream_index"], decode_frames, None)
        # the last keyframe and a few frames after it: bad data at the end shows up here, not at
        # the start; decoding the whole last GOP would cost up to its length (seconds) per file
        tail, _ = _decode_some(path, meta["stream_index"], decode_frames, pts[-1])
    except (av.error.FFmpegError, EOFError) as exc:
        raise ProbeError(f"undecodable: {exc}") from exc
    if head < min(decode_frames, num_frames):
        raise ProbeError(f"undecodable: only {head} of the first {min(decode_frames, num_frames)} frames decode")
    if tail == 0:
        raise ProbeError("undecodable: no frame decodes from the last keyframe on")
    with av.open(path) as container:
        rotation = _rotation(container.streams[meta["stream_index"]], first)
    return ProbeResult(duration_s=round(duration_s, 6), fps=round(fps, 6), variable_frame_rate=vfr,
                       width=meta["width"], height=meta["height"], rotation=rotation,
                       pix_fmt=meta["pix_fmt"], codec=meta["codec"], num_frames=num_frames,
                       bit_rate=meta["bit_rate"], has_audio=meta["has_audio"])
