"""The caption stage's core: sidecars first, the cache and what invalidates it, the video's earlier
captions in each request, the cut at the token bound, a failing shot skipped; on clips made here."""
import shutil

import numpy as np
import pytest

from longlive_core.caption import run as caption_run
from longlive_core.caption import text
from longlive_core.caption.config import CaptionConfig
from longlive_core.caption.model import Generated
from longlive_core.caption.run import caption_shots
from longlive_core.caption.text import cut_at_sentence_end, noun_phrases, parse_subjects
from longlive_core.config import from_mapping
from longlive_core.parallel import InlineExecutor, make_executor

from .helpers.shot_clips import write_shots


def frames(seed, n=12, w=64, h=48):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(n)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Two videos of 3 and 2 shots (half a second each) and a third that arrives later."""
    root = tmp_path_factory.mktemp("caption_clips")
    shots, clips_dir = write_shots(root, {"a.mp4": [frames(1), frames(2), frames(3)], "b.mp4": [frames(4), frames(5)],
                                          "c.mp4": [frames(6, w=80), frames(7, w=80)]}, crf=30)
    return shots.assign(kept=True), clips_dir


class FakeModel:
    """Records every request; each caption is numbered, so a request's context names the shots before it.
    Frames ``empty_width`` wide get an empty caption."""

    def __init__(self, empty_width: int | None = None):
        self.batches, self.empty_width, self.made = [], empty_width, 0

    def generate(self, items):
        self.batches.append([(None if f is None else f.shape, p) for f, p in items])
        out = []
        for f, _ in items:
            self.made += 1
            caption = "" if f is not None and f.shape[2] == self.empty_width else f"A red kite number {self.made}."
            out.append(Generated('["the red kite"]' if f is None else caption, 6, False))
        return out

    def count_tokens(self, s):
        return len(s.split())

    def prompts(self):
        return [p for batch in self.batches for shape, p in batch if shape is not None]


@pytest.fixture
def fake(monkeypatch):
    model = FakeModel()
    monkeypatch.setattr(caption_run, "worker_model", lambda cfg: model)
    return model


def cfg(**over):
    return from_mapping(CaptionConfig, {"max_pixels": 3136, "max_new_tokens": 16, "device": "cpu", **over}, "caption")


def run(shots, clips_dir, state, c, sidecar=None):
    sidecar = sidecar if sidecar is not None else [None] * len(shots)
    return caption_shots(shots, sidecar, clips_dir, c, state, InlineExecutor())


def test_sidecar_captions_come_first_unless_the_source_says_otherwise(clips, fake, tmp_path):
    shots, clips_dir = clips
    ab = shots[shots["path"] != "c.mp4"].reset_index(drop=True)
    sidecar = ["From the sidecar."] + [None] * (len(ab) - 1)  # a.mp4's first shot only
    out = run(ab, clips_dir, tmp_path / "s1", cfg(), sidecar).captions.sort_values(["path", "shot_index"])
    assert list(out["caption_source"]) == ["sidecar", "model", "model", "model", "model"]
    assert out["caption"].iloc[0] == "From the sidecar." and len(fake.prompts()) == 4
    assert any("1. From the sidecar." in p for p in fake.prompts())  # the sidecar caption: the next shot's context
    out = run(ab, clips_dir, tmp_path / "s2", cfg(source="model"), sidecar).captions
    assert list(out["caption_source"]) == ["model"] * 5
    fake.batches.clear()
    only = run(ab, clips_dir, tmp_path / "s3", cfg(source="sidecar"), sidecar)
    assert list(only.captions.sort_values(["path", "shot_index"])["caption_source"]) == ["sidecar", "", "", "", ""]
    assert fake.batches == []
    assert only.captions["caption"].isna().sum() == 4 and only.counts["without_caption"] == 4


def test_each_request_holds_the_videos_earlier_captions_in_order(clips, fake, tmp_path, monkeypatch):
    shots, clips_dir = clips
    out = run(shots, clips_dir, tmp_path / "s", cfg(max_frames=4))
    a = out.captions[out.captions["path"] == "a.mp4"]["caption"].tolist()
    short = FakeModel()  # context_shots: 1 holds the latest earlier caption only
    monkeypatch.setattr(caption_run, "worker_model", lambda c: short)
    run(shots[shots["path"] == "a.mp4"], clips_dir, tmp_path / "s1", cfg(context_shots=1))
    assert "1. A red kite number 2.\nA subject" in short.prompts()[2]
    # one generate call per round: the next shot of each video, never two of one video
    assert [len(b) for b in fake.batches] == [3, 3, 1, 3] and fake.batches[3][0][0] is None
    # 0.5 s at 2 fps: one frame, doubled (read in pairs)
    assert {shape for shape, _ in fake.batches[0]} == {(2, 48, 64, 3), (2, 48, 80, 3)}
    third = fake.batches[2][0][1]
    assert f"1. {a[0]}\n2. {a[1]}\nA subject" in third
    assert "Earlier shots" not in fake.batches[0][0][1]
    subjects = out.subjects.set_index("path")
    assert list(subjects.loc["a.mp4", "subjects"]) == ["the red kite"] and subjects["subjects_parsed"].all()
    assert any(f"1. {a[0]}\n2. {a[1]}\n3. {a[2]}\n" in p for _, p in fake.batches[3])  # the subjects request


def test_the_cache_is_reused_and_invalidated_by_template_new_video_and_model(clips, fake, tmp_path, monkeypatch):
    shots, clips_dir = clips
    ab = shots[shots["path"] != "c.mp4"].reset_index(drop=True)
    state = tmp_path / "state"
    first = run(ab, clips_dir, state, cfg())
    assert (first.counts["captioned"], first.counts["reused"]) == (5, 0)
    again = run(ab, clips_dir, state, cfg())
    assert (again.counts["captioned"], again.counts["reused"]) == (0, 5)
    assert again.captions.equals(first.captions)
    more = run(shots, clips_dir, state, cfg())  # a new video: only its shots
    assert (more.counts["captioned"], more.counts["reused"]) == (2, 5)

    templates = tmp_path / "templates"
    shutil.copytree(text.TEMPLATES, templates)
    (templates / "prompt.txt").write_text((templates / "prompt.txt").read_text() + "Mention the weather.\n")
    monkeypatch.setattr(text, "TEMPLATES", templates)
    changed = run(shots, clips_dir, state, cfg())
    assert changed.counts["captioned"] == 7 and "Mention the weather." in fake.prompts()[-1]

    for seed in (0, 1):  # the same path, other weights: every caption again
        model = tmp_path / "vlm"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
        (model / "model.safetensors").write_bytes(bytes([seed]) * 64)
        out = run(shots, clips_dir, state, cfg(model=str(model)))
        assert out.counts["captioned"] == 7


def test_a_shot_that_fails_is_reported_and_skipped_and_the_stage_goes_on(clips, monkeypatch, tmp_path):
    shots, clips_dir = clips
    ac = shots[shots["path"] != "b.mp4"].reset_index(drop=True)
    ac.loc[1, "clip_member"] = "missing/0001.mp4"  # a.mp4's second shot cannot be decoded
    model = FakeModel(empty_width=80)  # and c.mp4's shots get empty captions
    monkeypatch.setattr(caption_run, "worker_model", lambda c: model)
    out = run(ac, clips_dir, tmp_path / "s", cfg())
    c = out.captions.set_index(["path", "shot_index"])
    assert c.loc[("a.mp4", 1), "fail_reason"].startswith("decode error: KeyError: \"filename 'missing/0001.mp4'")
    assert list(c.loc["c.mp4", "fail_reason"]) == ["empty caption"] * 2
    assert c.loc[[("a.mp4", 1), ("c.mp4", 0), ("c.mp4", 1)], "caption"].isna().all()
    assert c.loc[("a.mp4", 2), "caption_source"] == "model" and out.counts["failed"] == 3
    first = c.loc[("a.mp4", 0), "caption"]
    # a.mp4's third shot was asked with the first shot's caption alone before it
    assert any(f"1. {first}\n" in p and "\n2. " not in p for p in model.prompts())
    again = run(ac, clips_dir, tmp_path / "s", cfg())  # failures are not cached: tried again
    assert again.counts["failed"] == 3 and again.counts["captioned"] == 0 and again.captions.equals(out.captions)


@pytest.mark.slow
def test_the_tiny_model_captions_through_from_pretrained_and_output_at_the_bound_is_cut_and_flagged(clips, tmp_path):
    shots, clips_dir = clips
    bc = shots[shots["path"] != "a.mp4"].reset_index(drop=True)
    out = run(bc, clips_dir, tmp_path / "s", cfg(max_new_tokens=12, batch_size=1))
    # the same captions from two worker processes, a video each (each makes and loads the tiny folder)
    spread = caption_shots(bc, [None] * len(bc), clips_dir, cfg(max_new_tokens=12, batch_size=1), tmp_path / "p",
                           make_executor("local", 2))
    assert spread.captions.equals(out.captions)
    c = out.captions
    assert (c["caption_source"] == "model").all() and c["caption"].str.len().gt(0).all()
    assert c["truncated"].all()  # random weights never end on their own
    assert (c["caption_tokens"] <= 12).all() and (c["tokens_per_s"] > 0).all()
    assert out.subjects["subjects"].map(list).tolist() == [[], []] and not out.subjects["subjects_parsed"].any()


def test_text_rules():
    assert cut_at_sentence_end("A man walks. He turns to the") == "A man walks."
    assert cut_at_sentence_end("A man walks! The dog") == "A man walks!"
    assert cut_at_sentence_end("no sentence end at all") == "no sentence end at all"
    assert noun_phrases("A woman in a red coat walks the dog. The dog runs, a woman laughs.") == {
        "a woman", "a red coat", "the dog"}
    assert parse_subjects('Sure: ["a grey dog", "the girl", "a grey dog"]') == ["a grey dog", "the girl"]
    assert parse_subjects("walks walks.") is None and parse_subjects("[1, 2]") is None
