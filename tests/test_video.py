import hashlib
import json

import av
import numpy as np
import pytest

from longlive_core.data.demo import DemoDataConfig, make_demo_data
from longlive_core.video.probe import ProbeError, probe_video
from longlive_core.video.synth import ShotSpec, VideoSpec, encode_frames, render_shot, write_video

W, H, FPS = 96, 64, 24


def _frames(path):
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24").astype(np.float32) for f in c.decode(video=0)]


def test_cuts_are_where_the_spec_says(tmp_path):
    spec = VideoSpec("v.mp4", (ShotSpec(20, 0.0, "circle", 1), ShotSpec(15, 0.5, "square", 2),
                               ShotSpec(18, 0.15, "circle", 3)))
    path = tmp_path / "v.mp4"
    assert write_video(path, spec, FPS, W, H) == 53
    frames = _frames(path)
    assert len(frames) == 53
    diffs = np.array([np.abs(b - a).mean() for a, b in zip(frames, frames[1:])])
    # frame i+1 starts a shot exactly where the difference to frame i is among the largest
    top = sorted(int(i) + 1 for i in np.argsort(diffs)[-2:])
    assert top == spec.cut_frames == [20, 35]
    inside = np.delete(diffs, [19, 34])
    assert diffs[[19, 34]].min() > 3 * inside.max()


def test_probe_reports_the_fields(tmp_path):
    spec = VideoSpec("v.mp4", (ShotSpec(30, 0.3, "circle", 5),))
    write_video(tmp_path / "v.mp4", spec, FPS, W, H)
    p = probe_video(tmp_path / "v.mp4")
    assert (p.num_frames, p.width, p.height, p.codec, p.pix_fmt) == (30, W, H, "h264", "yuv420p")
    assert p.fps == pytest.approx(24.0) and p.duration_s == pytest.approx(30 / 24)
    assert p.variable_frame_rate is False and p.rotation == 0 and p.has_audio is False


def test_probe_sees_rotation_and_variable_frame_rate(tmp_path):
    shot = ShotSpec(12, 0.6, "square", 9)
    encode_frames(tmp_path / "rot.mp4", render_shot(shot, W, H), FPS, W, H, rotation=90)
    assert probe_video(tmp_path / "rot.mp4").rotation == 90
    pts = [0, 1, 2, 4, 5, 8, 9, 10, 12, 13, 14, 17]  # dropped frames: irregular spacing
    encode_frames(tmp_path / "vfr.mp4", render_shot(shot, W, H), FPS, W, H, pts=pts)
    p = probe_video(tmp_path / "vfr.mp4")
    assert p.variable_frame_rate is True and p.num_frames == 12
    assert p.duration_s == pytest.approx(18 / 24)
    assert p.fps == pytest.approx(12 / (18 / 24))


def test_probe_rejects_bad_files_with_reasons(tmp_path):
    spec = VideoSpec("v.mp4", (ShotSpec(40, 0.3, "circle", 5),))
    write_video(tmp_path / "v.mp4", spec, FPS, W, H)
    data = (tmp_path / "v.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ProbeError, match=r"truncated: the packets cover 0\.\d+ s of the 1\.67 s the file declares"):
        probe_video(tmp_path / "cut.mp4")
    (tmp_path / "text.mp4").write_text("hello")
    with pytest.raises(ProbeError, match="not a readable video container"):
        probe_video(tmp_path / "text.mp4")
    # a valid container with audio and no video
    with av.open(str(tmp_path / "audio.m4a"), "w") as c:
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, 0
        for pkt in s.encode(frame):
            c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    with pytest.raises(ProbeError, match="no video stream"):
        probe_video(tmp_path / "audio.m4a")


def test_demo_data_is_deterministic_and_complete(tmp_path):
    cfg = DemoDataConfig(width=64, height=48, shot_seconds_min=0.5, shot_seconds_max=0.8)
    t1 = make_demo_data(cfg, tmp_path / "a", tmp_path / "a.json")
    t2 = make_demo_data(cfg, tmp_path / "b", tmp_path / "b.json")
    assert t1 == t2 == json.loads((tmp_path / "a.json").read_text())

    def contents(root):
        """Each file's bytes, or for a video its decoded frames (the half-file copy: whether it is the first
        half of the first video's bytes). x264's
        output is not reproducible in a long-lived process (seen in full test runs, never alone: its
        rate control computes in floats, and a library loaded earlier can change how the process
        rounds them), so the same rendered frames may encode to other bits and decoded frames differ
        a little."""
        out = {}
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if not p.is_file():
                continue
            if rel == "broken/truncated.mp4":
                whole = (root / t1["videos"][0]["path"]).read_bytes()
                out[rel] = p.read_bytes() == whole[: len(whole) // 2]
            elif p.suffix == ".mp4" and p.stat().st_size > 1000:
                with av.open(str(p)) as container:
                    out[rel] = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out

    a, b = contents(tmp_path / "a"), contents(tmp_path / "b")
    assert a.keys() == b.keys() and a["broken/truncated.mp4"] is b["broken/truncated.mp4"] is True
    for rel, got in a.items():
        if not isinstance(got, np.ndarray):
            assert got == b[rel], rel
            continue
        assert got.shape == b[rel].shape, rel
        mse = float(np.mean((got.astype(np.float64) - b[rel]) ** 2))
        # the same frames: another x264 preset gives 31.7-33.9 dB here, shots of another seed 12-15 dB
        assert mse == 0 or 10 * np.log10(255**2 / mse) >= 30, (rel, mse)
    videos = {p for p in a if p.endswith(".mp4")}
    assert videos == set(t1["expected_status"])  # every video file has an expected outcome
    assert sorted(t1["expected_status"].values()).count("quarantined") == 4
    assert any(v["cut_frames"] == [] for v in t1["videos"])  # the single-shot video
    assert any(" " in v["path"] and not v["path"].isascii() for v in t1["videos"])
    assert sum(len(v["static_shots"]) for v in t1["videos"]) == 1
    shortest = min(s["end_frame"] - s["start_frame"] for v in t1["videos"] for s in v["shots"])
    assert shortest == cfg.short_shot_frames
    for v in t1["videos"]:
        assert probe_video(tmp_path / "a" / v["path"]).num_frames == v["num_frames"]


def test_demo_data_disabled_writes_no_videos(tmp_path):
    truth = make_demo_data(DemoDataConfig(enabled=False), tmp_path / "raw", tmp_path / "t.json")
    assert truth["enabled"] is False and truth["videos"] == []
    assert list((tmp_path / "raw").iterdir()) == []


TWO_SHOTS = VideoSpec("x", (ShotSpec(36, 0.1, "circle", 1), ShotSpec(36, 0.6, "square", 2)))
# what real collections hold: (file name, FFmpeg container, codec)
CONTAINERS = [("a.mpg", "mpeg", "mpeg2video"), ("a.vob", "vob", "mpeg2video"), ("a.ts", "mpegts", "mpeg2video"),
              ("a.m2ts", "mpegts", "libx264"), ("a.flv", "flv", "flv"), ("a.wmv", "asf", "wmv2"),
              ("a.3gp", "3gp", "mpeg4"), ("a.ogv", "ogg", "libvpx"), ("a.avi", "avi", "mpeg4"),
              ("a.mkv", "matroska", "libx264"), ("no_extension", "mp4", "libx264")]


@pytest.mark.parametrize("name, container, codec", CONTAINERS)
def test_probe_takes_every_common_container(tmp_path, name, container, codec):
    write_video(tmp_path / name, TWO_SHOTS, FPS, W, H, container=container, codec=codec)
    p = probe_video(tmp_path / name)
    assert p.num_frames == 72 and p.fps == pytest.approx(24.0, abs=0.01)
    assert p.duration_s == pytest.approx(3.0, abs=0.002) and (p.width, p.height) == (W, H)


def test_a_sparse_avi_is_whole_and_variable_rate(tmp_path):
    """An AVI's header counts time-base ticks: with dropped frames it declares more than it holds."""
    pts = [i + i // 5 for i in range(72)]  # a frame dropped after every fifth
    write_video(tmp_path / "sparse.avi", TWO_SHOTS, FPS, W, H, container="avi", codec="mpeg4", pts=pts)
    with av.open(str(tmp_path / "sparse.avi")) as c:
        assert c.streams.video[0].frames == 86  # the header's count, which is not the frames held
    p = probe_video(tmp_path / "sparse.avi")
    assert p.variable_frame_rate and p.num_frames == 72 and p.duration_s == pytest.approx(86 / 24)


def test_an_odd_sized_video_is_probed_at_its_size(tmp_path):
    write_video(tmp_path / "odd.webm", TWO_SHOTS, FPS, 853, 480, container="webm", codec="libvpx")
    assert (probe_video(tmp_path / "odd.webm").width, probe_video(tmp_path / "odd.webm").height) == (853, 480)


@pytest.mark.parametrize("name, container, codec, whole", [
    ("a.avi", "avi", "mpeg4", False), ("a.mkv", "matroska", "libx264", False), ("a.flv", "flv", "flv", False),
    ("a.ts", "mpegts", "mpeg2video", True), ("a.mpg", "mpeg", "mpeg2video", True)])
def test_a_file_cut_in_half_is_truncated_only_where_it_declares_its_length(tmp_path, name, container, codec, whole):
    """AVI, Matroska and FLV declare a duration or an index; MPEG-TS and MPEG-PS declare none, so
    their first half is a valid, shorter file."""
    write_video(tmp_path / name, TWO_SHOTS, FPS, 320, 192, container=container, codec=codec)
    data = (tmp_path / name).read_bytes()
    (tmp_path / f"cut-{name}").write_bytes(data[: len(data) // 2])
    if whole:
        p = probe_video(tmp_path / f"cut-{name}")
        assert 10 < p.num_frames < 72 and p.duration_s == pytest.approx(p.num_frames / 24, abs=0.05)
    else:
        with pytest.raises(ProbeError, match=r"truncated: the packets cover [\d.]+ s of the 3\.\d+ s the file"):
            probe_video(tmp_path / f"cut-{name}")


def test_a_raw_stream_without_a_container_says_how_to_remux_it(tmp_path):
    write_video(tmp_path / "raw", TWO_SHOTS, FPS, W, H, container="h264")
    with pytest.raises(ProbeError, match="a raw h264 stream with no container.*remux it into MP4 or MKV"):
        probe_video(tmp_path / "raw")
