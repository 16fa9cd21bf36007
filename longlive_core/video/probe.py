"""Probe a video file with PyAV and check that it really decodes.

A header can look fine on a file whose data is cut short, so the probe demuxes every packet
(cheap: no decoding) and compares the time the packets cover with the duration the container
declares: a frame count is no measure, since a sparse or variable-rate file (an AVI whose header
counts time-base ticks, a capture with dropped frames) holds fewer frames than ticks and is still
whole. It decodes a few frames from the first keyframe and from the last one, from packets kept
during that same pass (no seeking, which MPEG-TS and MPEG-PS answer only approximately).
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from pathlib import Path

import av

# FFmpeg's AVFMT_NOTIMESTAMPS: a raw elementary stream, whose durations are guesses from bit rates
_NO_TIMESTAMPS = 0x80


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


def truncation_tolerance_s(declared_s: float, frame_s: float) -> float:
    """How much shorter than declared the packets may run and the file still count as whole:
    containers round their durations and count a last frame's length differently."""
    return max(2.5 * frame_s, 0.005 * declared_s)


class _Group:
    """The first few packets of a group of pictures (from a keyframe on), and the frames they decode to."""

    def __init__(self, limit: int):
        self.limit, self.packets, self.frames, self.first = limit, [], 0, None

    def keep(self, packet: av.Packet) -> None:
        if len(self.packets) < self.limit:
            self.packets.append(packet)

    def decode(self, codec: av.codec.context.CodecContext) -> None:
        codec.flush_buffers()
        for packet in [*self.packets, None]:  # None drains the frames the decoder still holds
            for frame in codec.decode(packet):
                self.first = self.first if self.first is not None else frame
                self.frames += 1


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
        if container.format.flags & _NO_TIMESTAMPS:
            raise ProbeError(f"a raw {cc.name} stream with no container, so no frame times: remux it into "
                             "MP4 or MKV (e.g. ffmpeg -i IN -c copy OUT.mkv)")
        tb: Fraction = stream.time_base or Fraction(1, 1)
        pts: list[int] = []
        last_pts, last_duration = None, 0  # of the latest video frame: one may be held long
        span = [math.inf, -math.inf]  # seconds from the earliest packet start to the latest end, any stream
        first: _Group | None = None
        last: _Group | None = None
        try:
            for packet in container.demux():
                if packet.size == 0 or packet.pts is None:
                    continue
                ptb = packet.time_base or tb
                span[0] = min(span[0], float(packet.pts * ptb))
                span[1] = max(span[1], float((packet.pts + (packet.duration or 0)) * ptb))
                if packet.stream.index != stream.index:
                    continue
                if last_pts is None or packet.pts >= last_pts:
                    last_pts, last_duration = packet.pts, packet.duration or 0
                pts.append(packet.pts)
                if packet.is_keyframe:
                    last = _Group(decode_frames)
                    first = first or last
                if last is not None:  # packets before the first keyframe cannot decode on their own
                    last.keep(packet)
                if first is not last:
                    first.keep(packet)
        except (av.error.FFmpegError, EOFError) as exc:
            raise ProbeError(f"stream data unreadable after {len(pts)} video packets ({exc})") from exc
        if not pts:
            raise ProbeError("video stream holds no frames")
        if first is None:
            raise ProbeError("undecodable: the video stream has no keyframe")
        try:
            for group in {id(first): first, id(last): last}.values():
                group.decode(cc)
        except (av.error.FFmpegError, EOFError) as exc:
            raise ProbeError(f"undecodable: {exc}") from exc
        if first.frames == 0:
            raise ProbeError("undecodable: no frame decodes from the first keyframe on")
        if last.frames == 0:
            raise ProbeError("undecodable: no frame decodes from the last keyframe on")

        order = sorted(pts)
        deltas = [b - a for a, b in zip(order, order[1:]) if b > a]
        rate = stream.average_rate or stream.guessed_rate or 25
        step = min(deltas) if deltas else max(1, round(1 / (rate * tb)))
        # the span to the end of the last frame: its own duration where the container gives one
        duration_s = float((order[-1] - order[0] + max(step, last_duration)) * tb)
        num_frames = len(pts)
        fps = num_frames / duration_s if duration_s > 0 else float(stream.average_rate or 0)
        if not math.isfinite(fps) or fps <= 0:
            raise ProbeError("cannot determine the frame rate")
        _check_whole(stream, container, duration_s, span[1] - span[0], float(step * tb))
        # a fine time base rounds a constant rate to neighbouring ticks (41 and 42 ms at 24 fps); where a
        # frame lasts only a few ticks, any unequal spacing is a dropped or repeated frame
        jitter = 1 if deltas and min(deltas) >= 10 else 0
        vfr = bool(deltas) and (max(deltas) - min(deltas)) > max(jitter, 0.01 * min(deltas))
        return ProbeResult(duration_s=round(duration_s, 6), fps=round(fps, 6), variable_frame_rate=vfr,
                           width=cc.width, height=cc.height, rotation=_rotation(stream, first.first),
                           pix_fmt=str(cc.pix_fmt or (stream.format.name if stream.format else "")),
                           codec=cc.name, num_frames=num_frames, bit_rate=int(container.bit_rate or 0),
                           has_audio=bool(container.streams.audio))


def _check_whole(stream, container, video_s: float, all_s: float, frame_s: float) -> None:
    """Raises ProbeError when the packets stop well before the duration the file declares.

    The video stream's own declared duration (an MP4 index, an ASF header; an AVI header's length,
    which counts time-base ticks and which FFmpeg's duration replaces with a guess when the index at
    the end is missing) is compared with the time its packets cover. Where only the container
    declares one (Matroska, FLV), that duration may be another stream's (audio running longer), so
    it is compared with the time the packets of every stream cover. For MPEG-TS, MPEG-PS and Ogg
    FFmpeg reads the duration off the last timestamps, so a file cut short there is a valid shorter
    file, not a truncated one."""
    # a frame count times the time base never exceeds the true length: ticks are a frame or shorter
    ticks = max(stream.duration or 0, stream.frames or 0)
    if ticks:
        declared, covered = float(ticks * stream.time_base), video_s
    elif container.duration:
        declared, covered = container.duration / av.time_base, all_s
    else:
        return
    if covered < declared - truncation_tolerance_s(declared, frame_s):
        raise ProbeError(f"truncated: the packets cover {covered:.2f} s of the {declared:.2f} s the file declares")
