"""Writing RGB frames into a video file one at a time, with PyAV, so a long video never sits in memory."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np


class VideoWriter:
    """``with VideoWriter(path, fps, width, height) as out: out.write(rgb)``: H.264 in MP4 (index at
    the front) by default, or any codec and container FFmpeg writes (matroska, avi, mpeg, mpegts,
    flv, asf, ogg ...). ``rotation`` writes a display matrix (as phones do). ``threads``: the
    encoder's (0: FFmpeg picks; one thread encodes 720p at about 16 frames/s on the H200's host, too
    slow for generation, plenty for the small synthetic videos of the demo and the tests)."""

    def __init__(self, path: str | Path, fps: int | Fraction, width: int, height: int, crf: int = 23, rotation: int = 0,
                 container: str = "mp4", codec: str = "libx264", pix_fmt: str = "yuv420p",
                 time_base: Fraction | None = None, threads: int = 1):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.time_base = time_base or 1 / Fraction(fps)
        options = {"movflags": "+faststart"} if container in ("mp4", "mov") else {}
        self.out = av.open(str(path), mode="w", format=container, options=options)
        stream = self.out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt
        if codec in ("libx264", "libx265"):
            stream.codec_context.options = {"crf": str(crf), "preset": "veryfast", "threads": str(threads),
                                            f"{codec[3:]}-params": "log-level=warning" if codec == "libx264"
                                            else "log-level=error"}
        elif codec.startswith("libvpx"):
            stream.codec_context.options = {"crf": str(min(crf, 63)), "b": "4M", "threads": "1"}
        else:  # FFmpeg's own MPEG-family encoders: a quantiser cap instead of their low default bit rate
            stream.codec_context.options = {"threads": "1"}
            stream.codec_context.qmax = 8
        stream.codec_context.time_base = self.time_base
        if rotation:
            stream.set_display_rotation(rotation)
        self.stream = stream
        self.frames = 0

    def write(self, rgb: np.ndarray, pts: int | None = None) -> None:
        """One (H, W, 3) uint8 frame; ``pts`` in units of the time base (default: the frame's index)."""
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame.pts = self.frames if pts is None else pts
        frame.time_base = self.time_base
        for packet in self.stream.encode(frame):
            self.out.mux(packet)
        self.frames += 1

    def close(self) -> None:
        for packet in self.stream.encode():
            self.out.mux(packet)
        self.out.close()

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.out.close()
