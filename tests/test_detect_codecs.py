"""detect_cuts on several codecs and containers: the plain call's cuts, the true cuts, and every
frame with the timestamp a plain full decode gives it (skipped deblocking and one decoder thread
must not drop, add or retime a frame)."""
import av
import cv2
import numpy as np
import pytest

import longlive_core.shots.detect as detect_mod
from longlive_core.shots.detect import ShotsConfig, _small_bgr, detect_cuts, frame_time
from longlive_core.video.synth import ShotSpec, VideoSpec, render_shot, write_video

FPS = 24
SHOTS = (ShotSpec(12, 0.1, "circle", 1), ShotSpec(10, 0.6, "square", 2), ShotSpec(11, 0.35, "circle", 3))
CFG = ShotsConfig(min_scene_len=4)  # shots this short need a shorter minimum than the default 15

CASES = [  # container, encoder, pix_fmt, width, height
    ("avi", "mpeg4", "yuv420p", 320, 180),
    ("mpegts", "mpeg2video", "yuv420p", 800, 450),
    ("mov", "mjpeg", "yuvj422p", 801, 451),  # odd size, 4:2:2 full range
    ("flv", "flv", "yuv420p", 321, 181),  # odd size
    ("matroska", "libx264", "yuv420p", 320, 180),
    ("webm", "libvpx", "yuv420p", 320, 180),
    ("mov", "prores", "yuv422p10le", 320, 180),  # 10-bit planes
]


def _plain(path: str) -> tuple[list[int], list[float]]:
    from scenedetect import AdaptiveDetector, detect

    cuts = [a.frame_num for a, _ in detect(path, AdaptiveDetector(min_scene_len=CFG.min_scene_len),
                                           backend="pyav")[1:]]
    times: list[float] = []
    with av.open(path) as c:
        for frame in c.decode(c.streams.video[0]):
            times.append(frame_time(frame, times, float(FPS)))
    return cuts, [t - times[0] for t in times]


@pytest.mark.parametrize("container, codec, pix_fmt, width, height", CASES,
                         ids=[f"{c[1]}-{c[0]}-{c[3]}x{c[4]}" for c in CASES])
def test_cuts_and_frame_times_equal_the_plain_calls(tmp_path, monkeypatch, container, codec, pix_fmt, width, height):
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} is not in this FFmpeg build")
    spec = VideoSpec("v", SHOTS)
    path = str(tmp_path / f"v.{container}")
    write_video(path, spec, FPS, width, height, crf=20, container=container, codec=codec, pix_fmt=pix_fmt)
    seen = []

    def spy(frame, size):
        seen.append((frame.width, frame.format.name, size))
        return _small_bgr(frame, size)

    monkeypatch.setattr(detect_mod, "_small_bgr", spy)
    ours = detect_cuts(path, CFG, float(FPS))
    plain_cuts, plain_times = _plain(path)
    assert ours.cuts == plain_cuts == spec.cut_frames == [12, 22]
    assert len(ours.times) == len(plain_times) == spec.num_frames
    assert ours.times == pytest.approx(plain_times, abs=1e-9)
    k = max(width, height) / 256
    assert {s for _, _, s in seen} == {(round(width / k), round(height / k))}  # the plain call's frame size
    assert {w for w, _, _ in seen} == {width}  # decoded at full size


def _smooth_frame(width: int, height: int) -> av.VideoFrame:
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack([xx * 255 // (width - 1), yy * 255 // (height - 1), ((xx // 80 + yy // 45) % 8) * 32], -1)
    return av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")


@pytest.mark.parametrize("pix_fmt", ["yuv420p", "yuvj420p", "yuv422p", "yuv444p", "yuv420p10le", "yuv422p10le",
                                     "nv12", "nv21", "p010le", "gray", "rgb24"])
@pytest.mark.parametrize("colorspace", [None, "ITU709"])
def test_small_frames_match_swscales_conversion(pix_fmt, colorspace):
    """Every pixel format (planes sampled directly, or swscale for the rest) gives the colours that
    swscale's full-size conversion gives, with its matrix and range."""
    src = _smooth_frame(640, 360)
    frame = src.reformat(format=pix_fmt, dst_colorspace=colorspace) if colorspace else src.reformat(format=pix_fmt)
    if colorspace:
        frame.colorspace = 1  # what a decoder reports for a BT.709 stream
    ref = cv2.resize(frame.reformat(format="bgr24").to_ndarray(), (256, 144), interpolation=cv2.INTER_NEAREST)
    out = _small_bgr(frame, (256, 144))
    assert out.shape == (144, 256, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - ref).mean() < 2.0


def test_b_frames_in_avi_keep_every_frame_and_its_time(tmp_path):
    """MPEG-4 ASP with B-frames and quarter-pel motion in AVI (as Xvid writes it): the true cuts, and
    a plain decode's frames and times. The plain call numbers frames from their timestamps, and the
    first one here is 1/24 s (the B-frame delay): its cuts may come one frame late."""
    spec = VideoSpec("v", SHOTS)
    path = str(tmp_path / "v.avi")
    with av.open(path, mode="w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 800, 450, "yuv420p"
        stream.codec_context.options = {"threads": "1", "flags": "+qpel+mv4"}
        stream.codec_context.max_b_frames = 2
        stream.codec_context.qmax = 8
        for i, rgb in enumerate(f for shot in SHOTS for f in render_shot(shot, 800, 450)):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    ours = detect_cuts(path, CFG, float(FPS))
    plain_cuts, plain_times = _plain(path)
    assert ours.cuts == spec.cut_frames
    assert len(plain_cuts) == len(ours.cuts) and all(abs(a - b) <= 1 for a, b in zip(plain_cuts, ours.cuts))
    assert len(ours.times) == spec.num_frames and ours.times == pytest.approx(plain_times, abs=1e-9)
