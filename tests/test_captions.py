import json

import pytest

from longlive_core.data.captions import CaptionError, parse_sidecar, read_sidecar


def test_whole_video_caption_covers_any_interval():
    sc = parse_sidecar({"caption": " A dog runs. "})
    assert sc.caption_for(0, 1) == "A dog runs."
    assert sc.caption_for(500, 900) == "A dog runs."


def test_per_shot_captions_go_to_the_largest_overlap():
    sc = parse_sidecar({"shots": [{"start_s": 0.0, "end_s": 4.0, "caption": "one"},
                                  {"start_s": 4.0, "end_s": 6.0, "caption": "two"},
                                  {"start_s": 6.0, "end_s": 9.0, "caption": "three"}]})
    assert sc.caption_for(0.1, 3.9) == "one"
    assert sc.caption_for(3.5, 5.9) == "two"  # 0.5 s with one, 1.9 s with two
    assert sc.caption_for(5.0, 9.0) == "three"
    assert sc.caption_for(3.0, 5.0) == "one"  # a tie goes to the earlier interval
    assert sc.caption_for(10.0, 12.0) is None  # no overlap: no caption


@pytest.mark.parametrize("data, message", [
    ([], "expected a JSON object"),
    ({"caption": ""}, "'caption' must be a non-empty string"),
    ({"caption": "a", "shots": []}, "exactly one of"),
    ({"shots": []}, "'shots' must be a non-empty list"),
    ({"shots": [{"start_s": 0}]}, r"shots\[0\] needs start_s, end_s and caption"),
    ({"shots": [{"start_s": 2, "end_s": 1, "caption": "x"}]}, r"0 <= start_s < end_s"),
    ({"shots": [{"start_s": "0", "end_s": 1, "caption": "x"}]}, "must be numbers"),
])
def test_malformed_sidecars_say_what_to_fix(data, message):
    with pytest.raises(CaptionError, match=message):
        parse_sidecar(data, "clip.json")


def test_read_sidecar_reports_bad_json(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(CaptionError, match="a.json: not readable JSON"):
        read_sidecar(tmp_path / "a.json")
    (tmp_path / "b.json").write_text(json.dumps({"caption": "fine"}))
    assert read_sidecar(tmp_path / "b.json")[0].caption_for(0, 1) == "fine"
