import os
import shutil

import pandas as pd
import pytest

from longlive_core.config import from_mapping
from longlive_core.data.ingest import MANIFEST_COLUMNS, IngestConfig, IngestState, ingest
from longlive_core.data.roots import SourceError, resolve_inside, safe_relpath
from longlive_core.data.sources import LocalSource
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video


def run_ingest(root, state_dir, **overrides):
    cfg = from_mapping(IngestConfig, {"source": str(root), **overrides}, "ingest")
    return ingest(LocalSource(root).list(), cfg, IngestState(state_dir), str(root))


def test_demo_set_gets_every_outcome(demo_copy, tmp_path):
    raw, truth = demo_copy
    out = run_ingest(raw, tmp_path / "state")
    m = out.manifest
    assert list(m.columns) == MANIFEST_COLUMNS
    assert m["path"].is_unique
    on_disk = sorted(p.relative_to(raw).as_posix() for p in raw.rglob("*.mp4"))
    assert sorted(m["path"]) == on_disk  # every input listed exactly once
    assert dict(zip(m["path"], m["status"])) == truth["expected_status"]
    quarantined = m[m["status"] == "quarantined"].set_index("path")["reason"]
    assert quarantined["broken/empty.mp4"] == "empty file (0 bytes)"
    assert quarantined["broken/notes.mp4"].startswith("not a readable video container")
    assert quarantined["broken/truncated.mp4"].startswith("truncated:")
    assert quarantined["short/blip.mp4"].startswith("too short: 0.50 s")
    (copy, original), = truth["duplicate_of"].items()
    dup = m.set_index("path").loc[copy]
    assert dup["reason"] == f"duplicate of {original}"
    assert dup["video_id"] == m.set_index("path").loc[original, "video_id"]
    ok = m[m["status"] == "ok"].set_index("path")
    for v in truth["videos"]:
        assert ok.loc[v["path"], "num_frames"] == v["num_frames"]
        assert ok.loc[v["path"], "fps"] == pytest.approx(24.0)
        expected_caption = "missing" if v["caption_form"] == "none" else "ok"
        assert ok.loc[v["path"], "caption_status"] == expected_caption
    assert ok["video_id"].str.fullmatch(r"[0-9a-f]{64}").all()
    # the duplicate is processed once: 8 distinct non-empty contents were probed, not 9
    assert out.counts["probed"] == 8 and out.counts["hashed"] == 9


def test_rerun_is_incremental(demo_copy, tmp_path):
    raw, _ = demo_copy
    state = tmp_path / "state"
    first = run_ingest(raw, state)
    again = run_ingest(raw, state)
    assert (again.counts["hashed"], again.counts["probed"]) == (0, 0)
    pd.testing.assert_frame_equal(first.manifest, again.manifest)

    new = VideoSpec("new/clip.mp4", (ShotSpec(30, 0.4, "circle", 11),))
    write_video(raw / new.relpath, new, 24, 64, 48)
    shutil.copy(raw / "sports/match.mp4", raw / "new/match again.mp4")
    added = run_ingest(raw, state)
    assert (added.counts["hashed"], added.counts["probed"]) == (2, 1)  # the copy needs no probe
    rows = added.manifest.set_index("path")
    assert rows.loc["new/clip.mp4", "status"] == "ok"
    assert rows.loc["new/match again.mp4", "reason"] == "duplicate of sports/match.mp4"

    os.utime(raw / "new/clip.mp4", ns=(1, 1))  # touched: re-hashed, same content, no re-probe
    (raw / "new/match again.mp4").unlink()
    changed = run_ingest(raw, state)
    assert (changed.counts["hashed"], changed.counts["probed"]) == (1, 0)
    assert "new/match again.mp4" not in set(changed.manifest["path"])  # removed files disappear
    assert len(IngestState(state).hashes) == len(changed.manifest) - 1  # the empty file is not hashed


def test_state_checkpoints_append_only_their_new_rows_and_the_end_folds_them(tmp_path):
    state = IngestState(tmp_path)
    for i in range(3):
        state.add_hash((f"v{i}.mp4", f"f{i}"), f"id{i}")
        state.add_probe((f"id{i}", "k"), {"error": None, "duration_s": float(i)})
        state.checkpoint()
    state.checkpoint()  # nothing new: no empty part
    hash_parts = sorted(tmp_path.glob("hashes-*.parquet"))
    assert [len(pd.read_parquet(p)) for p in hash_parts] == [1, 1, 1]
    again = IngestState(tmp_path)  # a killed run's state: the parts read back
    assert again.hashes == state.hashes and again.probes[("id2", "k")]["duration_s"] == 2.0
    again.hashes.pop(("v0.mp4", "f0"))  # the file went away
    again.save()
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == ["canonical.parquet", "hashes.parquet",
                                                                 "probes.parquet"]
    assert set(IngestState(tmp_path).hashes) == {("v1.mp4", "f1"), ("v2.mp4", "f2")}


def test_changed_decode_check_reprobes(demo_copy, tmp_path):
    raw, _ = demo_copy
    run_ingest(raw, tmp_path / "state")
    out = run_ingest(raw, tmp_path / "state", decode_check_frames=3)
    assert out.counts["probed"] == 8


def test_min_duration_applies_without_reprobing(demo_copy, tmp_path):
    raw, _ = demo_copy
    run_ingest(raw, tmp_path / "state")
    out = run_ingest(raw, tmp_path / "state", min_duration_s=0.0)
    assert out.counts["probed"] == 0
    assert out.manifest.set_index("path").loc["short/blip.mp4", "status"] == "ok"


def test_symlinks_out_of_the_root_are_quarantined_not_followed(demo_copy, tmp_path):
    raw, _ = demo_copy
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(raw / "sports/match.mp4", outside / "secret.mp4")
    os.symlink(outside / "secret.mp4", raw / "escape.mp4")
    os.symlink(outside, raw / "linked_dir")
    os.symlink(raw / "sports/match.mp4", raw / "zz_link.mp4")
    out = run_ingest(raw, tmp_path / "state")
    rows = out.manifest.set_index("path")
    assert rows.loc["escape.mp4", "status"] == "quarantined"
    assert rows.loc["escape.mp4", "reason"] == "symlink points outside the source root"
    assert not any(p.startswith("linked_dir/") for p in rows.index)
    assert out.counts["skipped_dir_links"] == 1
    # a link inside the root is read, and its content is a duplicate of the target
    assert rows.loc["zz_link.mp4", "status"] == "duplicate"


def test_invalid_sidecar_is_reported_per_video(demo_copy, tmp_path):
    raw, _ = demo_copy
    (raw / "sports/match.json").write_text('{"shots": []}')
    rows = run_ingest(raw, tmp_path / "state").manifest.set_index("path")
    assert rows.loc["sports/match.mp4", "caption_status"].startswith("invalid: match.json: 'shots' must be")
    assert rows.loc["sports/match.mp4", "status"] == "ok"


def test_missing_source_says_what_to_do(tmp_path):
    with pytest.raises(SourceError, match="put the raw videos there, or set ingest.source"):
        LocalSource(tmp_path / "nope").list()


@pytest.mark.parametrize("rel, ok", [("a/b.mp4", True), ("../x.mp4", False), ("/etc/x", False),
                                     ("a/../../x", False), ("a//b", False), ("", False), ("a\\..\\b", False)])
def test_safe_relpath(rel, ok):
    assert (safe_relpath(rel) is not None) == ok


def test_resolve_inside_refuses_escapes(tmp_path):
    assert resolve_inside(tmp_path, "a/b.mp4") == (tmp_path / "a/b.mp4").resolve()
    with pytest.raises(ValueError, match="not inside its root"):
        resolve_inside(tmp_path, "../etc/passwd")


def test_unreadable_files_are_quarantined_and_retried_next_run(demo_copy, tmp_path, monkeypatch):
    import longlive_core.data.ingest as ingest_mod

    raw, _ = demo_copy
    real = ingest_mod.digest_file

    def flaky(path, *a, **kw):
        if path.name == "match.mp4":
            raise PermissionError(13, "Permission denied")
        return real(path, *a, **kw)

    monkeypatch.setattr(ingest_mod, "digest_file", flaky)
    rows = run_ingest(raw, tmp_path / "state").manifest.set_index("path")
    assert rows.loc["sports/match.mp4", "status"] == "quarantined"
    assert rows.loc["sports/match.mp4", "reason"] == "unreadable: Permission denied"
    monkeypatch.setattr(ingest_mod, "digest_file", real)
    again = run_ingest(raw, tmp_path / "state")
    assert again.counts["hashed"] == 1  # the failure was not remembered as a result
    assert again.manifest.set_index("path").loc["sports/match.mp4", "status"] == "ok"


def test_what_is_a_video_is_decided_by_its_content(tmp_path):
    """Every file with a video extension, or with none, is probed; a non-video is quarantined."""
    from .test_video import CONTAINERS, TWO_SHOTS

    src = tmp_path / "src"
    for name, container, codec in CONTAINERS:
        write_video(src / name, TWO_SHOTS, 24, 96, 64, container=container, codec=codec)
    (src / "README").write_text("not a video, and no extension")
    (src / ".DS_Store").write_bytes(b"\0\1")  # hidden files are no candidates
    (src / ".git/objects/ab").mkdir(parents=True)  # nor is anything in a hidden folder
    (src / ".git/objects/ab/cdef0123").write_bytes(b"x" * 50)
    (src / "notes.txt").write_text("other")
    (src / "no_extension.json").write_text('{"caption": "a sidecar of a file with no extension"}')
    out = run_ingest(src, tmp_path / "state", min_duration_s=0.0)
    rows = out.manifest.set_index("path")
    assert set(rows.index) == {name for name, _, _ in CONTAINERS} | {"README"}
    assert (rows.drop(index="README")["status"] == "ok").all(), rows[["status", "reason"]]
    assert (rows.drop(index="README")["num_frames"] == 72).all()
    assert rows.loc["README", "status"] == "quarantined"
    assert rows.loc["README", "reason"].startswith("not a readable video container")
    assert rows.loc["no_extension", "caption_status"] == "ok"
    assert out.counts["other_files"] == 2  # .DS_Store and notes.txt


def test_the_manifest_records_each_sidecars_digest(demo_copy, tmp_path):
    raw, _ = demo_copy
    first = run_ingest(raw, tmp_path / "state").manifest.set_index("path")
    import hashlib

    side = raw / "nature/single_take.json"
    assert first.loc[("nature/single_take.mp4", "caption_sha256")] == hashlib.sha256(side.read_bytes()).hexdigest()
    assert first.loc[first["caption_status"] == "missing", "caption_sha256"].isna().all()
    side.write_text('{"caption": "an edited caption"}')
    again = run_ingest(raw, tmp_path / "state").manifest.set_index("path")
    key = ("nature/single_take.mp4", "caption_sha256")
    assert again.loc[key] != first.loc[key]
