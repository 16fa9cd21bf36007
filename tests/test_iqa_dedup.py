"""Near-duplicate shots in iqa_filter: copies made here (re-encoded, rescaled, cropped) are grouped
with their originals across videos, one copy kept per group; different shots stay apart."""
import itertools
import json

import numpy as np
import pandas as pd
import pytest

from longlive_core.config import ConfigError, from_mapping
from longlive_core.data.curation_report import ReportInputs, write_curation_report
from longlive_core.iqa.dedup import HASH_BITS, group_pairs, near_duplicate_pairs, parse_hashes, phash
from longlive_core.iqa.metrics import IQAConfig
from longlive_core.iqa.score import score_shots
from longlive_core.parallel import make_executor
from longlive_core.video.synth import ShotSpec, render_shot

from .helpers.shot_clips import crop, jpeg, rescale, scene, write_shots


def reencoded(frames, seed):
    rng = np.random.default_rng(seed)
    return [np.clip(jpeg(f, 25) + rng.normal(0, 4, f.shape), 0, 255).astype(np.uint8) for f in frames]


# path -> shots; the comments say which shot each copies
VIDEOS = {
    "orig/a.mp4": [scene(1), scene(2), scene(3)],
    "copies/reencoded.mp4": [scene(10), reencoded(scene(1), 0)],  # #1: a#0 as JPEG at quality 25, plus noise
    "copies/rescaled.mp4": [[rescale(f, 96, 56) for f in scene(2)]],  # a#1 at half size
    "copies/cropped_sides.mp4": [[crop(f, 0.04, 0.04, 0.04, 0.04) for f in scene(2)]],  # a#1, 4% off every side
    "copies/cropped_corner.mp4": [[crop(f, 0.05, 0.03, 0, 0) for f in scene(3)]],  # a#2, 5% off the left, 3% the top
    "other/b.mp4": [scene(4), scene(5), list(render_shot(ShotSpec(16, 0.30, "circle", 1), 192, 112)),
                    list(render_shot(ShotSpec(16, 0.34, "circle", 2), 192, 112))],
    # a dialogue: shot, reverse shot, the first set-up again; then the whole video re-uploaded
    "dialogue/original.mp4": [scene(7), scene(8), reencoded(scene(7), 1)],
    "dialogue/reupload.mp4": [reencoded(scene(7), 2), reencoded(scene(8), 3), reencoded(scene(7), 4)],
    "same/video.mp4": [scene(20), reencoded(scene(20), 5)],  # one video's repeated set-up, copied nowhere
    "fades/black.mp4": [[np.zeros((112, 192, 3), np.uint8)] * 16],
}
GROUPS = [{("orig/a.mp4", 0), ("copies/reencoded.mp4", 1)},
          {("orig/a.mp4", 1), ("copies/rescaled.mp4", 0), ("copies/cropped_sides.mp4", 0)},
          {("orig/a.mp4", 2), ("copies/cropped_corner.mp4", 0)},
          {("dialogue/original.mp4", 0), ("dialogue/original.mp4", 2), ("dialogue/reupload.mp4", 0),
           ("dialogue/reupload.mp4", 2)},
          {("dialogue/original.mp4", 1), ("dialogue/reupload.mp4", 1)}]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("dedup")
    shots, clips = write_shots(root, VIDEOS)
    cfg = from_mapping(IQAConfig, {"thresholds": {"piqe": 100.0}}, "iqa_filter")  # only copies are removed
    return shots, clips, root / "state", score_shots(shots, clips, cfg, root / "state", make_executor("local", 1))


def test_the_copies_made_here_are_cropped_at_most_5_percent_a_side():
    ys, xs = np.mgrid[0:112, 0:192]
    where = np.stack([ys, xs, xs], axis=-1).astype(np.uint8)  # each pixel holds its own row and column
    for sides in [(0.04, 0.04, 0.04, 0.04), (0.05, 0.03, 0, 0)]:
        cut = crop(where, *sides)
        (top, left, _), (last_row, last_col, _) = cut[0, 0], cut[-1, -1]
        assert max(left / 192, top / 112, (191 - last_col) / 192, (111 - last_row) / 112) <= 0.05


def test_copies_are_grouped_across_videos_and_one_copy_of_each_is_kept(made):
    _, _, _, out = made
    s = out.scores
    grouped = s[s["dup_group"] >= 0]
    groups = [set(zip(g["path"], g["shot_index"])) for _, g in grouped.groupby("dup_group")]
    assert sorted(groups, key=sorted) == sorted(GROUPS, key=sorted)
    for _, g in grouped.groupby("dup_group"):
        best = g.sort_values(["iqa_score", "path", "shot_index"]).iloc[0]  # PIQE: lower is better
        assert set(g.loc[g["kept"], "path"]) == {best["path"]}  # the best shot's video, all of its members
        reason = f"near-duplicate: of {best['path']} shot {best['shot_index']}"
        assert (g.loc[~g["kept"], "reject_reason"] == reason).all()
    dialogue = grouped[grouped["path"].str.startswith("dialogue/")]
    assert dialogue.groupby("dup_group")["kept"].sum().tolist() == [2, 1]  # one whole video's set-ups
    alone = s[s["path"].isin(["other/b.mp4", "same/video.mp4"]) | (s["shot_index"] == 0)
              & (s["path"] == "copies/reencoded.mp4")]
    assert len(alone) == 7 and alone["kept"].all() and (alone["dup_group"] == -1).all()
    assert (out.counts["duplicate_groups"], out.counts["rejected_duplicate"]) == (5, 7)
    assert out.counts["rejected_unscorable"] == 1 and out.counts["kept"] == len(s) - 8


def test_a_new_hamming_threshold_regroups_from_the_cache(made):
    shots, clips, state, first = made
    off = from_mapping(IQAConfig, {"thresholds": {"piqe": 100.0}, "dedup_hamming": None}, "iqa_filter")
    out = score_shots(shots, clips, off, state, make_executor("local", 1))
    assert out.counts["scored"] == 0 and out.counts["duplicate_groups"] == 0 and (out.scores["dup_group"] == -1).all()
    assert out.counts["kept"] == first.counts["kept"] + 7
    assert (out.scores["phash"] == first.scores["phash"]).all()


def test_the_curation_report_shows_the_groups(made, tmp_path):
    _, clips, _, out = made
    report = ReportInputs(scores=out.scores, rejected_shots=pd.DataFrame({"duration_s": [], "reason": []}),
                          samples=pd.DataFrame({"bucket": []}), clips_dir=clips, min_shot_s=0.5, max_shot_s=10.0,
                          metric="piqe", threshold=100.0, lower_better=True, min_motion=0.0, dedup_hamming=12)
    counts = write_curation_report(report, tmp_path)
    assert counts == json.loads((tmp_path / "counts.json").read_text())
    assert (counts["near_duplicate_groups"], counts["near_duplicate_shots"]) == (5, 13)
    assert counts["reject_reasons"] == {"near-duplicate": 7, "unscorable": 1} and counts["unscorable_frames"] == 3
    listed = pd.read_csv(tmp_path / "near_duplicates.csv")
    assert len(listed) == 13 and listed.groupby("dup_group")["kept"].any().all()
    index = (tmp_path / "index.md").read_text()
    assert "5 groups of near-duplicate shots across videos (each of 3 frame hashes within 12 bits); 7 copies" in index
    row = next(line for line in index.splitlines() if "copies/reencoded.mp4 #1" in line)
    assert "orig/a.mp4 #0" in row and "3 sampled frames could not be scored by piqe" in index
    assert (tmp_path / "contact_duplicates.png").read_bytes()[:4] == b"\x89PNG"


def test_pairs_equal_a_brute_force_comparison():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**63, (60, 3), dtype=np.uint64)
    flips = [rng.choice(63, size=(60, 3, k)) for k in (2, 6, 12)]  # copies 1-12 bits away per frame (repeats: fewer)
    hashes = np.concatenate([base, *[base ^ np.bitwise_or.reduce(np.uint64(1) << f.astype(np.uint64), axis=2)
                                     for f in flips]])
    videos = rng.integers(0, 50, len(hashes))
    expected = [(i, j) for i, j in itertools.combinations(range(len(hashes)), 2) if videos[i] != videos[j]
                and all(bin(int(a) ^ int(b)).count("1") <= 8 for a, b in zip(hashes[i], hashes[j]))]
    got = near_duplicate_pairs(hashes, videos, 8, block_elems=1000, threads=2)  # many blocks, on threads
    assert len(expected) > 40 and sorted(map(tuple, got.tolist())) == expected


def test_groups_are_transitive():
    assert group_pairs(7, np.array([[4, 5], [1, 2], [0, 1]])) == [[0, 1, 2], [4, 5]]
    assert group_pairs(3, np.zeros((0, 2), np.int64)) == []


def test_a_threshold_outside_the_hash_is_refused_and_bad_hashes_are_named():
    assert from_mapping(IQAConfig, {"dedup_hamming": HASH_BITS}, "iqa_filter").dedup_hamming == HASH_BITS
    assert from_mapping(IQAConfig, {"dedup_hamming": None}, "iqa_filter").dedup_hamming is None
    for bad in (HASH_BITS + 1, -1):
        with pytest.raises(ConfigError, match=r"iqa_filter.dedup_hamming must be between 0 and 63"):
            from_mapping(IQAConfig, {"dedup_hamming": bad}, "iqa_filter")
    with pytest.raises(ConfigError, match=r"iqa_filter.dedup_hamming: expected an integer"):
        from_mapping(IQAConfig, {"dedup_hamming": 10.5}, "iqa_filter")
    with pytest.raises(ValueError, match="must hold 3 hexadecimal hashes, got '00ff'"):
        parse_hashes(["00ff"])
    with pytest.raises(ValueError, match="RGB uint8 frames"):
        phash(np.zeros((8, 8), np.uint8))
