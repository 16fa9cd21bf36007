"""Clip normalisation: rotation, portrait, variable frame rate, 10-bit input, fit and trimming."""
from __future__ import annotations

import io

import av
import numpy as np
import pytest

from longlive_core.config import ConfigError
from longlive_core.shots.clips import ClipEncoder, iter_timed_frames
from longlive_core.video.normalize import ClipFormat, ClipRejected, normalize_clip, resample_indices
from longlive_core.video.synth import encode_frames

RED = np.array([255, 0, 0])


def marked_frames(n: int, h: int, w: int) -> list[np.ndarray]:
    """Gray level = frame index * 8; a red square in the stored top-left corner."""
    frames = []
    for i in range(n):
        f = np.full((h, w, 3), 8 * i, dtype=np.uint8)
        f[:8, :8] = RED
        frames.append(f)
    return frames


def is_red(px: np.ndarray) -> bool:
    return px[0] > 200 and px[1] < 60 and px[2] < 60


def test_rotation_is_applied_as_displayed(tmp_path):
    path = tmp_path / "phone.mp4"
    encode_frames(path, marked_frames(9, 48, 64), fps=24, width=64, height=48, crf=0, rotation=90)
    frames = list(iter_timed_frames(path))
    assert {rot for _, _, rot in frames} == {90}
    clip = normalize_clip(frames, ClipFormat(fps=24, height=64, width=48))
    first = clip.frames[0]
    assert clip.frames.shape == (9, 64, 48, 3) and clip.counts["rotated"] == 1 and clip.counts["portrait"] == 1
    # turned a quarter counterclockwise: the stored top-left corner is now bottom-left
    assert is_red(first[60, 3]) and not is_red(first[3, 3]) and not is_red(first[60, 44])


def test_portrait_fits_the_landscape_format_or_is_dropped(tmp_path):
    path = tmp_path / "tall.mp4"
    encode_frames(path, marked_frames(5, 64, 32), fps=24, width=32, height=64, crf=0)
    frames = list(iter_timed_frames(path))
    cropped = normalize_clip(frames, ClipFormat(fps=24, height=16, width=32, fit="crop"))
    padded = normalize_clip(frames, ClipFormat(fps=24, height=16, width=32, fit="pad"))
    assert cropped.frames.shape == padded.frames.shape == (5, 16, 32, 3)
    assert cropped.counts["portrait"] == 1
    assert (padded.frames[:, :, :10] == 0).all() and (padded.frames[:, :, -10:] == 0).all()  # side bars
    assert not (cropped.frames[:, :, :10] == 0).all()
    with pytest.raises(ClipRejected, match="portrait"):
        normalize_clip(frames, ClipFormat(fps=24, height=16, width=32, portrait="drop"))


def test_variable_frame_rate_is_resampled_by_timestamps(tmp_path):
    path = tmp_path / "vfr.mp4"
    pts = [*range(15), *range(30, 45)]  # a 15-frame gap in the middle (1/30 s units)
    encode_frames(path, marked_frames(30, 32, 32), fps=30, width=32, height=32, crf=0, pts=pts)
    frames = list(iter_timed_frames(path))
    assert frames[15][1] - frames[14][1] == pytest.approx(16 / 30, abs=1e-3)
    clip = normalize_clip(frames, ClipFormat(fps=30, height=32, width=32))
    assert clip.counts["resampled_frames"] == 45 and clip.counts["repeated_frames"] == 15
    assert clip.frames.shape[0] == 45 and clip.counts["trimmed_frames"] == 0  # 45 = 1 + 4 * 11
    source = np.round(clip.frames[:, 16, 16, 0] / 8).astype(int)  # gray 8 * i, give or take YUV rounding
    assert list(source[12:32]) == [12, 13, *[14] * 16, 15, 16]  # the last frame before the gap holds


def test_clips_from_the_shots_stage_keep_their_timing_and_rotation(tmp_path):
    path = tmp_path / "src.mp4"
    encode_frames(path, marked_frames(12, 32, 48), fps=24, width=48, height=32, crf=0, rotation=270,
                  pts=[0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15])
    with av.open(str(path)) as c:
        decoded = list(c.decode(video=0))
    enc = ClipEncoder(48, 32, 24, 0, "veryfast", rotation=int(decoded[0].rotation) % 360)
    for frame in decoded[2:]:
        enc.add(frame)
    clip = list(iter_timed_frames(enc.finish()))
    assert [round(t * 24, 3) for _, t, _ in clip] == [0, 1, 6, 7, 8, 9, 10, 11, 12, 13]
    assert {rot for _, _, rot in clip} == {270}


def test_frame_rate_change_and_trim_are_counted():
    frames = [(np.full((8, 8, 3), i, np.uint8), i / 30, 0) for i in range(30)]  # 1 s at 30 fps
    clip = normalize_clip(frames, ClipFormat(fps=24, height=8, width=8))
    assert clip.counts["resampled_frames"] == 24 and clip.counts["dropped_source_frames"] == 6
    assert clip.counts["frames"] == 21 and clip.counts["trimmed_frames"] == 3  # 21 = 1 + 4 * 5
    assert list(resample_indices(np.arange(5) / 10, 10)) == [0, 1, 2, 3, 4]
    with pytest.raises(ClipRejected, match="at least 5 needed"):
        normalize_clip(frames[:3], ClipFormat(fps=30, height=8, width=8))


@pytest.mark.parametrize("seed", range(6))
def test_streaming_resampling_follows_the_timestamp_definition(seed):
    """normalize_clip decodes frame by frame; the frames it picks are resample_indices' on the whole list."""
    rng = np.random.default_rng(seed)
    n, fps = int(rng.integers(6, 200)), float(rng.choice([12, 24, 30]))
    steps = rng.choice([1 / 60, 1 / 30, 1 / 24, 0.1, 0.0], size=n - 1, p=[0.3, 0.3, 0.2, 0.15, 0.05])
    times = rng.uniform(0, 3) + np.concatenate([[0.0], np.cumsum(steps)])  # non-decreasing, ties included
    frames = [(np.full((4, 8, 3), i % 256, np.uint8), t, 0) for i, t in enumerate(times)]
    want = resample_indices(times, fps)
    if len(want) < 5:
        return
    clip = normalize_clip(frames, ClipFormat(fps=fps, height=4, width=8))
    assert list(clip.frames[:, 0, 0, 0]) == [i % 256 for i in want[:clip.counts["frames"]]]
    assert clip.counts["resampled_frames"] == len(want)
    assert clip.counts["dropped_source_frames"] == n - len(np.unique(want))


def test_times_that_go_backwards_or_a_rotation_that_changes_are_refused():
    frames = [(np.zeros((8, 8, 3), np.uint8), t, 0) for t in (0.0, 0.1, 0.05, 0.2, 0.3, 0.4)]
    with pytest.raises(ClipRejected, match="go backwards at frame 2"):
        normalize_clip(frames, ClipFormat(fps=10, height=8, width=8))
    frames = [(np.zeros((8, 8, 3), np.uint8), i / 10, 90 if i == 3 else 0) for i in range(6)]
    with pytest.raises(ClipRejected, match="rotation changes"):
        normalize_clip(frames, ClipFormat(fps=10, height=8, width=8))


def test_ten_bit_input_becomes_8_bit_rgb():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 32, 16, "yuv420p10le"
        for i in range(5):
            f = av.VideoFrame.from_ndarray(np.full((16, 32, 3), 40 * i, np.uint8), format="rgb24")
            f = f.reformat(format="yuv420p10le")
            f.pts = i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    frames = list(iter_timed_frames(buf.getvalue()))
    clip = normalize_clip(frames, ClipFormat(fps=24, height=16, width=32))
    assert clip.frames.dtype == np.uint8 and clip.frames.shape == (5, 16, 32, 3)
    assert abs(int(clip.frames[4, 8, 16, 1]) - 160) <= 4


def test_bad_format_params_are_refused():
    with pytest.raises(ConfigError, match="fit must be one of"):
        ClipFormat(fit="stretch").validate("encode_latents.clip")
