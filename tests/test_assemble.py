import hashlib
import json

import pandas as pd
import pytest

from longlive_core.config import ConfigError, from_mapping
from longlive_core.data.assemble import AssembleConfig, Bucket, assemble_samples, bucket_of, split_of
from longlive_core.data.captions import shot_captions
from longlive_core.data.roots import SourceError

VID_A, VID_B = "a" * 64, "b" * 64


def shots_table(spec):
    """spec: (video_id, [(start_frame, end_frame, kept), ...]) at 10 fps."""
    rows = []
    for vid, pieces in spec:
        for i, (start, end, kept) in enumerate(pieces):
            rows.append({"video_id": vid, "shot_index": i, "start_frame": start, "end_frame": end,
                         "start_s": start / 10, "end_s": end / 10, "duration_s": (end - start) / 10,
                         "path": f"{vid[0]}.mp4", "kept": kept})
    return pd.DataFrame(rows)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"shots": [
        {"start_s": 0, "end_s": 2.0, "caption": "first"}, {"start_s": 2.0, "end_s": 100, "caption": "second"}]}))
    return tmp_path


def manifest(root, copies=()):
    """The ingest manifest: a.mp4 with its sidecar's digest, b.mp4 without one, and byte-identical
    copies of a.mp4 (status duplicate, same video_id) at the paths in ``copies``."""
    digest = hashlib.sha256((root / "a.json").read_bytes()).hexdigest()
    rows = [{"video_id": VID_A, "path": "a.mp4", "status": "ok", "caption_path": "a.json", "caption_status": "ok",
             "caption_sha256": digest},
            {"video_id": VID_B, "path": "b.mp4", "status": "ok", "caption_path": None, "caption_status": "missing",
             "caption_sha256": None}]
    rows += [{"video_id": VID_A, "path": c, "status": "duplicate", "caption_path": None, "caption_status": "missing",
              "caption_sha256": None} for c in copies]
    return pd.DataFrame(rows)


CFG = dict(max_shots=3, min_duration_s=1.0, max_duration_s=5.0, missing_caption="empty", val_fraction=0.0,
           buckets=[{"name": "short", "min_s": 1.0, "max_s": 3.0, "weight": 1.0},
                    {"name": "long", "min_s": 3.0, "max_s": None, "weight": 3.0}])


def sidecar_captions(shots, m, root):
    """The caption stage's table when every caption comes from a sidecar (source: sidecar)."""
    kept = shots[shots["kept"]]
    caps = shot_captions(kept, m, root)
    return pd.DataFrame({"video_id": kept["video_id"], "shot_index": kept["shot_index"], "caption": caps,
                         "caption_source": ["sidecar" if c else "" for c in caps]})


def assemble(spec, root, copies=(), **over):
    cfg = from_mapping(AssembleConfig, {**CFG, **over}, "assemble")
    shots = shots_table(spec)
    return assemble_samples(shots, sidecar_captions(shots, manifest(root, copies), root), cfg)


def test_runs_break_at_gaps_and_limits(root):
    spec = [(VID_A, [(0, 15, True), (15, 30, True), (30, 45, False), (45, 60, True), (60, 75, True),
                     (75, 90, True), (90, 105, True), (105, 110, True)])]
    out = assemble(spec, root)
    assert [list(s) for s in out.samples["shot_indices"]] == [[0, 1], [3, 4, 5], [6, 7]]
    assert list(out.samples["duration_s"]) == [3.0, 4.5, 2.0]
    assert list(out.samples["bucket"]) == ["long", "long", "short"]
    assert out.samples.iloc[0]["captions"] == ["first", "second"]  # 0-1.5 s, then 1.5-3.0 s: most in "second"
    assert out.samples.iloc[0]["caption_sources"] == ["sidecar", "sidecar"]
    assert out.samples.iloc[1]["captions"] == ["second"] * 3
    assert (out.samples["end_frame"] > out.samples["start_frame"]).all()


def test_too_short_and_too_long(root):
    spec = [(VID_A, [(0, 5, True), (5, 8, False), (8, 70, True), (70, 85, True)])]
    out = assemble(spec, root)
    assert [list(s) for s in out.samples["shot_indices"]] == [[3]]  # 0.5 s dropped; a 6.2 s shot never fits
    assert out.counts["samples_too_short"] == 1


def test_missing_caption_policies(root):
    spec = [(VID_B, [(0, 20, True), (20, 40, True)])]
    assert assemble(spec, root).samples.iloc[0]["captions"] == ["", ""]
    dropped = assemble(spec, root, missing_caption="drop")
    assert dropped.counts["samples"] == 0 and dropped.counts["missing_captions"] == 2
    with pytest.raises(ConfigError, match="2 kept shot.*have no caption .*b.mp4#0"):
        assemble(spec, root, missing_caption="fail")


def test_bucket_weights_give_each_bucket_its_share(root):
    spec = [(VID_A, [(i * 20, i * 20 + 20, i % 2 == 0) for i in range(9)]),  # five 2 s samples
            (VID_B, [(0, 40, True)])]  # one 4 s sample
    s = assemble(spec, root).samples
    share = s.groupby("bucket")["sample_weight"].sum() / s["sample_weight"].sum()
    assert share["short"] == pytest.approx(0.25) and share["long"] == pytest.approx(0.75)


def test_split_is_by_video_and_stable():
    vids = [f"{i:064x}" for i in range(400)]
    splits = [split_of(v, 0.25, "s") for v in vids]
    assert splits == [split_of(v, 0.25, "s") for v in vids]
    assert 0.18 < splits.count("val") / len(vids) < 0.32
    assert split_of(vids[0], 0.0, "s") == "train"


def test_bucket_rules():
    buckets = [Bucket("a", 16, 32), Bucket("b", 32, 64), Bucket("c", 64, None)]
    assert [bucket_of(d, buckets) for d in (15.9, 16, 31.99, 32, 64, 1e4)] == [None, "a", "a", "b", "c", "c"]
    with pytest.raises(ConfigError, match="overlap"):
        from_mapping(AssembleConfig, {"buckets": [{"name": "x", "min_s": 1, "max_s": 5},
                                                  {"name": "y", "min_s": 4, "max_s": 9}]}, "assemble")


def test_a_video_with_byte_identical_copies_is_one_video(root):
    spec = [(VID_A, [(0, 15, True), (15, 30, True)])]
    out = assemble(spec, root, copies=["copy of a.mp4", "again/a.mp4"])
    assert [list(s) for s in out.samples["shot_indices"]] == [[0, 1]]
    assert out.samples.iloc[0]["captions"] == ["first", "second"]


def test_a_sidecar_edited_after_ingest_is_an_error_that_says_to_rerun_ingest(root):
    spec = [(VID_A, [(0, 15, True), (15, 30, True)])]
    m = manifest(root)
    (root / "a.json").write_text(json.dumps({"caption": "edited since"}))
    with pytest.raises(SourceError, match="a.json changed after ingest read it: rerun ingest"):
        shot_captions(shots_table(spec), m, root)
    (root / "a.json").unlink()
    with pytest.raises(SourceError, match="a.json changed after ingest read it"):
        shot_captions(shots_table(spec), m, root)


def test_model_captions_carry_their_source_and_a_shot_the_caption_stage_lacks_is_an_error(root):
    spec = [(VID_B, [(0, 20, True), (20, 40, True)])]
    cfg = from_mapping(AssembleConfig, CFG, "assemble")
    shots = shots_table(spec)
    captions = pd.DataFrame({"video_id": [VID_B, VID_B], "shot_index": [0, 1], "caption": ["A dog runs.", None],
                             "caption_source": ["model", ""]})
    s = assemble_samples(shots, captions, cfg).samples.iloc[0]
    assert s["captions"] == ["A dog runs.", ""] and s["caption_sources"] == ["model", ""]
    lacking = r"1 kept shot\(s\) are not in the caption stage's table \(e.g. b.mp4#1\): rerun the caption stage"
    with pytest.raises(ConfigError, match=lacking):
        assemble_samples(shots, captions.iloc[:1], cfg)
