import hashlib
import math
import tarfile

import av
import numpy as np
import pandas as pd
import pytest

from longlive_core.config import ConfigError, from_mapping
from longlive_core.data.ingest import IngestConfig, IngestState, ingest
from longlive_core.data.sources import LocalSource
from longlive_core.parallel import InlineExecutor, LocalProcessExecutor, make_executor
from longlive_core.shots.clips import ShardWriter, cut_clips, iter_clip_frames, read_clip
from longlive_core.shots.detect import ShotsConfig
from longlive_core.shots.rules import apply_length_rules, shots_from_cuts
from longlive_core.shots.split import split_videos
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video

DEMO_SHOTS = dict(min_scene_len=4, min_shot_s=0.5, max_shot_s=2.0, clip_crf=0, workers=1)


def test_spans_from_cuts():
    assert shots_from_cuts(100, []) == [(0, 100)]  # no cut: one shot, not zero
    assert shots_from_cuts(100, [40, 10, 40, 0, 100, 120]) == [(0, 10), (10, 40), (40, 100)]


def cfr(frames: int, fps: float = 24.0) -> list[float]:
    return [i / fps for i in range(frames + 1)]


def test_length_rules_reject_short_and_split_long_into_equal_pieces():
    pieces = apply_length_rules([(0, 5), (5, 105), (105, 125)], cfr(125), min_s=0.5, max_s=2.0)
    assert pieces[0].reason == "too short: 5 frames, 0.208 s < 0.5 s" and pieces[0].scene_index == 0
    long = [p for p in pieces if p.scene_index == 1]
    assert [(p.start_frame, p.end_frame) for p in long] == [(5, 38), (38, 72), (72, 105)]
    assert all(p.reason is None and 24 <= p.num_frames <= 48 for p in long)
    assert [(p.start_frame, p.end_frame, p.reason) for p in pieces if p.scene_index == 2] == [(105, 125, None)]


@pytest.mark.parametrize("length, max_frames", [(49, 48), (97, 48), (1000, 48), (48, 48), (25, 48), (95, 47)])
def test_split_pieces_stay_within_limits(length, max_frames):
    fps = 24.0
    pieces = apply_length_rules([(0, length)], cfr(length, fps), min_s=max_frames / 2 / fps, max_s=max_frames / fps)
    assert len(pieces) == math.ceil(length / max_frames)
    assert pieces[0].start_frame == 0 and pieces[-1].end_frame == length
    assert all(p.start_frame < p.end_frame for p in pieces)
    assert all(max_frames // 2 <= p.num_frames <= max_frames for p in pieces if length >= max_frames // 2)


def test_length_rules_count_time_on_a_variable_frame_rate():
    """30 fps, then a stretch at 10 fps: the frames of the slow stretch cover three times as long."""
    bounds = [i / 30 for i in range(61)] + [2 + i / 10 for i in range(1, 41)]  # 100 frames, 6 s
    pieces = apply_length_rules([(0, 30), (30, 100)], bounds, min_s=1.0, max_s=2.0)
    assert [p.reason for p in pieces if p.scene_index == 0] == [None]  # 30 frames, 1 s: long enough
    durations = [bounds[p.end_frame] - bounds[p.start_frame] for p in pieces if p.scene_index == 1]
    assert len(durations) == 3 and all(abs(d - 5 / 3) < 0.1 for d in durations)  # 5 s in equal-time pieces
    # the same frame counts at the average rate (100 frames / 6 s) would have made 70 frames 4.2 s: 3 pieces
    # of 23-24 frames each, the last covering 2.3 s, over the maximum
    short = apply_length_rules([(0, 12)], [i / 10 for i in range(13)], min_s=1.5, max_s=3.0)
    assert short[0].reason == "too short: 12 frames, 1.200 s < 1.5 s"
    with pytest.raises(ValueError, match="min_s <= max_s / 2"):
        apply_length_rules([(0, 12)], [i / 10 for i in range(13)], min_s=2.0, max_s=3.0)


def test_shot_params_are_checked():
    with pytest.raises(ConfigError, match="min_shot_s <= max_shot_s / 2"):
        from_mapping(ShotsConfig, {"min_shot_s": 3.0, "max_shot_s": 4.0}, "shots")
    with pytest.raises(ConfigError, match="shots.detector must be"):
        from_mapping(ShotsConfig, {"detector": "histogram"}, "shots")


def test_clips_hold_exactly_the_source_frames(demo_set):
    raw, truth = demo_set
    video = truth["videos"][0]
    spans = {i: (s["start_frame"], s["end_frame"]) for i, s in enumerate(video["shots"])}
    decoded, clips = cut_clips(raw / video["path"], spans, 24, crf=0, preset="veryfast")
    assert decoded == video["num_frames"]
    with av.open(str(raw / video["path"])) as c:
        source = [f.to_ndarray(format="yuv420p") for f in c.decode(video=0)]
    for i, (start, end) in spans.items():
        frames = list(iter_clip_frames(clips[i], fmt="yuv420p"))
        assert len(frames) == end - start
        assert all(np.array_equal(a, b) for a, b in zip(frames, source[start:end]))  # lossless: bit-exact


def test_shard_writer_publishes_only_closed_shards(tmp_path):
    w = ShardWriter(tmp_path, max_bytes=10)
    assert w.add("a/0000.mp4", b"x" * 20) == "shard-00000.tar"
    assert w.full and not (tmp_path / "shard-00000.tar").exists()
    assert w.close() == "shard-00000.tar"
    assert read_clip(tmp_path, "shard-00000.tar", "a/0000.mp4") == b"x" * 20
    w2 = ShardWriter(tmp_path, max_bytes=10)  # a later run continues the numbering
    assert w2.add("b/0000.mp4", b"y") == "shard-00001.tar"
    w2.close()
    with tarfile.open(tmp_path / "shard-00001.tar") as t:
        assert t.getnames() == ["b/0000.mp4"]
    with pytest.raises(ValueError, match="bad shard name"):
        read_clip(tmp_path, "../x.tar", "a")


def _fail_on_negative(x):
    return math.sqrt(x)


@pytest.mark.parametrize("executor", [InlineExecutor(), LocalProcessExecutor(2)])
def test_executors_report_each_items_failure(executor):
    results = dict(executor.map_unordered(_fail_on_negative, [4, -1, 9]))
    assert results[4] == 2 and results[9] == 3 and isinstance(results[-1], ValueError)
    assert isinstance(make_executor("local", 1), InlineExecutor)
    with pytest.raises(ValueError, match="executor 'ray' is not available"):
        make_executor("ray", 2)


@pytest.fixture
def demo_manifest(demo_copy, tmp_path):
    raw, truth = demo_copy
    cfg = from_mapping(IngestConfig, {"source": str(raw)}, "ingest")
    m = ingest(LocalSource(raw).list(), cfg, IngestState(tmp_path / "ingest_state"), str(raw)).manifest
    return raw, truth, m


def split(raw, m, tmp_path, **over):
    cfg = from_mapping(ShotsConfig, {**DEMO_SHOTS, **over}, "shots")
    return split_videos(m, raw, cfg, tmp_path / "state", tmp_path / "clips", make_executor("local", cfg.workers))


def test_split_finds_the_known_cuts_and_applies_the_rules(demo_manifest, tmp_path):
    raw, truth, m = demo_manifest
    out = split(raw, m, tmp_path)
    shots, rejected = out.shots, out.rejected
    assert set(shots["path"]) == {v["path"] for v in truth["videos"]}
    for v in truth["videos"]:
        rows = shots[shots["path"] == v["path"]]
        rej = rejected[rejected["path"] == v["path"]]
        scenes = pd.concat([rows, rej]).groupby("scene_index")["start_frame"].min().sort_index()
        detected_cuts = list(scenes.iloc[1:])
        assert len(detected_cuts) == len(v["cut_frames"]), (v["path"], detected_cuts, v["cut_frames"])
        assert all(abs(a - b) <= 1 for a, b in zip(detected_cuts, v["cut_frames"]))
        # every frame is in exactly one usable or rejected piece
        spans = sorted([*zip(rows["start_frame"], rows["end_frame"]), *zip(rej["start_frame"], rej["end_frame"])])
        assert spans[0][0] == 0 and spans[-1][1] == v["num_frames"]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    single = shots[shots["path"] == "nature/single_take.mp4"]
    assert set(single["scene_index"]) == {0}
    (short,) = rejected.itertuples(index=False)
    assert short.path == "nature/forest_walk.mp4" and short.reason == "too short: 6 frames, 0.250 s < 0.5 s"
    assert (shots["num_frames"] <= 48).all() and (shots["num_frames"] >= 12).all()
    assert (shots["duration_s"] - shots["num_frames"] / 24).abs().max() < 1e-9
    assert out.counts["single_shot_videos"] >= 1
    row = shots.iloc[3]
    clip = read_clip(tmp_path / "clips", row.clip_shard, row.clip_member)
    assert len(list(iter_clip_frames(clip))) == row.num_frames


def test_a_failing_video_is_rejected_and_the_others_go_on(demo_manifest, tmp_path):
    raw, truth, m = demo_manifest
    data = (raw / "sports/match.mp4").read_bytes()
    (raw / "sports/match.mp4").write_bytes(data[: len(data) // 3])  # broken after ingest
    out = split(raw, m, tmp_path)
    failed = out.rejected[out.rejected["reason"].str.startswith("failed:")]
    assert list(failed["path"]) == ["sports/match.mp4"]
    assert out.counts["videos_failed"] == 1
    assert set(out.shots["path"]) == {v["path"] for v in truth["videos"]} - {"sports/match.mp4"}
    (raw / "sports/match.mp4").write_bytes(data)  # fixed: the next run tries it again, alone
    again = split(raw, m, tmp_path)
    assert (again.counts["videos_split"], again.counts["videos_failed"]) == (1, 0)
    assert "sports/match.mp4" in set(again.shots["path"])


def test_split_is_incremental(demo_manifest, tmp_path):
    raw, truth, m = demo_manifest
    first = split(raw, m, tmp_path)
    again = split(raw, m, tmp_path)
    assert (again.counts["videos_split"], again.counts["videos_reused"]) == (0, 5)
    pd.testing.assert_frame_equal(first.shots, again.shots)
    fewer = split(raw, m[m["path"] != "sports/match.mp4"], tmp_path)
    assert "sports/match.mp4" not in set(fewer.shots["path"]) and fewer.counts["videos_split"] == 0
    gone = first.shots[first.shots["path"] == "sports/match.mp4"]
    assert first.counts["clips_orphaned"] == 0 and fewer.counts["clips_orphaned"] == len(gone) > 0
    changed = split(raw, m, tmp_path, max_shot_s=3.0)  # a detection param changed: all redone
    assert changed.counts["videos_split"] == 5
    assert len(changed.shots) < len(first.shots)
    # the shards of the old settings are gone: only what a row refers to stays on disk
    on_disk = {p.name for p in (tmp_path / "clips").glob("shard-*.tar")}
    assert changed.counts["shards_removed"] >= 1 and on_disk == set(changed.shots["clip_shard"])


def test_a_shard_mostly_of_dead_clips_is_rewritten_and_its_clips_stay_the_same(demo_manifest, tmp_path):
    """A video gone and one split again (a new frame rate) leave dead clips in the one demo shard: past
    shards.shard_min_live of dead bytes its live clips move to a new shard, the rows follow, the old
    shard goes; below it nothing moves and the dead clips are counted."""
    raw, truth, m = demo_manifest
    first = split(raw, m, tmp_path, shard_min_live=1.0)
    (old_shard,) = set(first.shots["clip_shard"])
    edited = m[m["path"] != "sports/match.mp4"].copy()
    edited.loc[edited["path"] == "nature/single_take.mp4", "fps"] = 48.0
    kept = split(raw, edited, tmp_path, shard_min_live=0.0)  # never rewrite
    assert kept.counts["shards_compacted"] == 0 and kept.counts["clips_orphaned"] > 0
    assert old_shard in set(kept.shots["clip_shard"])
    edited.loc[edited["path"] == "nature/forest_walk.mp4", "fps"] = 48.0  # one more video split again
    out = split(raw, edited, tmp_path, shard_min_live=1.0)
    assert out.counts["shards_compacted"] >= 1 and out.counts["clips_orphaned"] == 0
    on_disk = {p.name for p in (tmp_path / "clips").glob("shard-*.tar")}
    assert old_shard not in on_disk and on_disk == set(out.shots["clip_shard"])
    unchanged = first.shots[first.shots["path"].isin(set(edited["path"]) - {"nature/single_take.mp4",
                                                                            "nature/forest_walk.mp4"})]
    moved = out.shots.set_index("clip_member").loc[unchanged["clip_member"]]
    assert (moved["clip_sha256"].to_numpy() == unchanged["clip_sha256"].to_numpy()).all()
    for row in out.shots.itertuples(index=False):  # every clip readable where its row says, bytes intact
        data = read_clip(tmp_path / "clips", row.clip_shard, row.clip_member)
        assert hashlib.sha256(data).hexdigest() == row.clip_sha256
    again = split(raw, edited, tmp_path, shard_min_live=1.0)  # the moved rows are the state now
    assert again.counts["videos_split"] == 0 and again.counts["shards_compacted"] == 0
    pd.testing.assert_frame_equal(again.shots, out.shots)


def test_fast_detection_matches_plain_scenedetect_on_wider_video(tmp_path):
    """Frames 640 px wide take the subsampled-planes path (step 2); cuts equal the plain call's."""
    from scenedetect import AdaptiveDetector, detect

    from longlive_core.shots.detect import detect_cuts
    from longlive_core.video.synth import ShotSpec, VideoSpec, write_video

    spec = VideoSpec("w.mp4", (ShotSpec(40, 0.1, "circle", 1), ShotSpec(35, 0.6, "square", 2),
                               ShotSpec(30, 0.35, "circle", 3)))
    write_video(tmp_path / "w.mp4", spec, 24, 640, 384)
    plain = [a.frame_num for a, _ in detect(str(tmp_path / "w.mp4"), AdaptiveDetector(), backend="pyav")[1:]]
    ours = detect_cuts(tmp_path / "w.mp4", ShotsConfig(), 24.0).cuts
    assert ours == plain == spec.cut_frames == [40, 75]
    assert detect_cuts(tmp_path / "w.mp4", ShotsConfig(downscale=4), 24.0).cuts == [40, 75]


def manifest_of(root):
    cfg = from_mapping(IngestConfig, {"source": str(root), "min_duration_s": 0.0}, "ingest")
    return ingest(LocalSource(root).list(), cfg, IngestState(root.parent / "ingest_state"), str(root)).manifest


def test_shot_times_come_from_the_frames_timestamps(tmp_path):
    src = tmp_path / "src"
    spec = VideoSpec("x", (ShotSpec(30, 0.1, "circle", 1), ShotSpec(30, 0.6, "square", 2)))
    # a stream that starts 10 s in, and one where 24 frames (1 s) were dropped before the cut
    write_video(src / "late.ts", spec, 24, 160, 96, container="mpegts", pts=[240 + i for i in range(60)])
    write_video(src / "gap.mkv", spec, 24, 160, 96, container="matroska",
                pts=[i if i < 6 else i + 24 for i in range(60)])
    out = split(src, manifest_of(src), tmp_path, min_shot_s=0.25, max_shot_s=4.0)
    shots = out.shots.set_index("path")
    late, gap = shots.loc["late.ts"], shots.loc["gap.mkv"]
    assert list(late["start_frame"]) == list(gap["start_frame"]) == [0, 30]
    assert list(late["start_s"]) == pytest.approx([0.0, 30 / 24])  # relative to the first frame
    assert list(late["end_s"]) == pytest.approx([30 / 24, 60 / 24])
    # frame 30 is shown at (30 + 24) / 24 s: index / fps would put the cut 1 s early
    assert list(gap["start_s"]) == pytest.approx([0.0, 54 / 24], abs=1e-3)
    assert list(gap["duration_s"]) == pytest.approx([54 / 24, 30 / 24], abs=1e-3)


def test_a_variable_frame_rate_shot_is_cut_at_equal_times(tmp_path):
    """60 frames: 30 at 24 fps (1.25 s), then 30 at 8 fps (the last frame lasting the video's median
    frame, 1/24 s: 3.67 s). With a 2.5 s maximum the pieces are frames 0-39 and 40-59, about 2.5 s each;
    at the average rate they would be 30 + 30 frames, 1.25 s and 3.67 s, the second over the maximum."""
    src = tmp_path / "src"
    spec = VideoSpec("x", (ShotSpec(60, 0.1, "circle", 1),))
    write_video(src / "vfr.mp4", spec, 24, 160, 96, pts=[i if i < 30 else 30 + 3 * (i - 30) for i in range(60)])
    out = split(src, manifest_of(src), tmp_path, min_shot_s=0.5, max_shot_s=2.5)
    assert list(zip(out.shots["start_frame"], out.shots["end_frame"])) == [(0, 40), (40, 60)]
    assert list(out.shots["duration_s"]) == pytest.approx([2.5, 2.5 - 2 / 24], abs=1e-3)


def test_an_odd_sized_video_is_split_into_even_sized_clips(tmp_path):
    src = tmp_path / "src"
    spec = VideoSpec("x", (ShotSpec(30, 0.1, "circle", 1), ShotSpec(30, 0.6, "square", 2)))
    write_video(src / "odd.webm", spec, 24, 853, 481, container="webm", codec="libvpx")
    out = split(src, manifest_of(src), tmp_path, min_shot_s=0.5, max_shot_s=2.0)
    assert out.counts["videos_failed"] == 0 and list(out.shots["start_frame"]) == [0, 30]
    frames = list(iter_clip_frames(read_clip(tmp_path / "clips", out.shots.clip_shard[1], out.shots.clip_member[1])))
    assert len(frames) == 30 and frames[0].shape == (480, 852, 3)


def test_an_interrupted_clip_write_publishes_nothing_and_the_video_is_redone(demo_manifest, tmp_path, monkeypatch):
    import hashlib

    from longlive_core.io.parts import PartTable
    from longlive_core.shots.split import STATE_COLUMNS

    raw, truth, m = demo_manifest
    real_add, added = ShardWriter.add, []

    def add(self, member, data):
        added.append(member)
        if len(added) == 8:  # the disk fills up in the middle of a video's clips
            real_add(self, member, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real_add(self, member, data)

    monkeypatch.setattr(ShardWriter, "add", add)
    with pytest.raises(OSError, match="No space left"):
        split(raw, m, tmp_path, shard_max_mb=0.001)  # a shard per video: each committed on its own
    monkeypatch.setattr(ShardWriter, "add", real_add)
    assert not list((tmp_path / "clips").glob(".tmp-*"))  # the open shard was dropped, not published
    broken = added[-1].split("/")[0]
    state = PartTable(tmp_path / "state", "pieces", STATE_COLUMNS).read()
    assert 0 < state["video_id"].nunique() < 5 and broken not in set(state["video_id"])
    for r in state.dropna(subset=["clip_member"]).itertuples(index=False):  # what is recorded is whole
        assert hashlib.sha256(read_clip(tmp_path / "clips", r.clip_shard, r.clip_member)).hexdigest() == r.clip_sha256
    again = split(raw, m, tmp_path, shard_max_mb=0.001)
    assert broken in set(again.shots["video_id"]) and again.counts["videos_split"] == 5 - state["video_id"].nunique()
    pd.testing.assert_frame_equal(again.shots.drop(columns="clip_shard"),
                                  split(raw, m, tmp_path / "fresh").shots.drop(columns="clip_shard"))


def _megabytes(n):
    return b"x" * (n << 20)


def test_the_process_pool_lets_go_of_each_result_once_consumed():
    import tracemalloc

    tracemalloc.start()
    try:
        for _item, result in LocalProcessExecutor(2).map_unordered(_megabytes, [8] * 24):
            assert len(result) == 8 << 20
            del result
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 24 results of 8 MB: held until the end they would peak near 192 MB; at most 2 x workers are in flight
    assert peak < 64 << 20, peak


def test_a_video_whose_frame_rate_changed_is_split_again_and_replaces_its_rows(demo_manifest, tmp_path):
    """The detector's frame-count settings and the clips' rate come from the rate ingest measured: a
    new rate (a changed probe) makes new rows, which supersede the old ones on every later read. The
    length rules count the frames' timestamps, so the pieces stay where they were."""
    raw, truth, m = demo_manifest
    first = split(raw, m, tmp_path)
    faster = m.copy()
    faster.loc[faster["path"] == "sports/match.mp4", "fps"] = 48.0
    again = split(raw, faster, tmp_path)
    assert again.counts["videos_split"] == 1
    match = again.shots[again.shots["path"] == "sports/match.mp4"]
    assert (match["fps"] == 48.0).all() and not again.shots.duplicated(["video_id", "shot_index"]).any()
    before = first.shots[first.shots["path"] == "sports/match.mp4"]
    spans = ["start_frame", "end_frame", "start_s", "end_s"]
    pd.testing.assert_frame_equal(match[spans].reset_index(drop=True), before[spans].reset_index(drop=True))
    assert set(match["clip_sha256"]).isdisjoint(before["clip_sha256"])  # clips made again, at the new rate
    pd.testing.assert_frame_equal(split(raw, faster, tmp_path).shots, again.shots)  # and it stays so


def test_state_rows_are_each_videos_latest_and_replaced_shards_are_known(tmp_path):
    from longlive_core.shots.split import STATE_COLUMNS, ShotsState

    def rows(video, n, shard, fps=24.0):
        return [{**dict.fromkeys(STATE_COLUMNS), "video_id": video, "shot_index": i, "fps": fps, "clip_shard": shard}
                for i in range(n)]

    state = ShotsState(tmp_path, "k")
    state.append(rows("a", 3, "shard-00000.tar") + rows("b", 2, "shard-00000.tar"))
    state.append(rows("c", 1, "shard-00001.tar"))
    state.append(rows("a", 2, "shard-00002.tar", fps=48.0))  # split again: replaces all three of a's rows
    got = state.rows.sort_values(["video_id", "shot_index"])
    assert list(zip(got["video_id"], got["clip_shard"])) == [("a", "shard-00002.tar")] * 2 + [
        ("b", "shard-00000.tar")] * 2 + [("c", "shard-00001.tar")]
    assert state.superseded == {"shard-00000.tar"}
    again = ShotsState(tmp_path, "k")  # the parts on disk read back the same
    pd.testing.assert_frame_equal(again.rows.sort_values(["video_id", "shot_index"]).reset_index(drop=True),
                                  got.reset_index(drop=True), check_dtype=False)


def test_parts_left_by_a_kill_inside_compaction_never_count_twice(tmp_path):
    from longlive_core.io.parts import PartTable

    table = PartTable(tmp_path, "pieces", ["video_id", "x"])
    table.append(pd.DataFrame({"video_id": ["a", "a"], "x": [1, 2]}))
    table.append(pd.DataFrame({"video_id": ["b"], "x": [3]}))
    folded = table.read(latest_by="video_id")
    folded.to_parquet(tmp_path / "pieces.parquet")  # compact wrote the folded file and died
    assert len(table.files()) == 3
    assert table.read(latest_by="video_id").sort_values(["video_id", "x"]).values.tolist() == [["a", 1], ["a", 2],
                                                                                                 ["b", 3]]
    table.append(pd.DataFrame({"video_id": ["a"], "x": [9]}))  # a later part supersedes a's rows
    assert sorted(table.read(latest_by="video_id").values.tolist()) == [["a", 9], ["b", 3]]
    table.compact(table.read(latest_by="video_id"))
    assert [p.name for p in table.files()] == ["pieces.parquet"]
