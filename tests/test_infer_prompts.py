"""The prompt file: shots with and without durations, prompt changes inside a shot, the scene-transition
prefix, the frames each shot gets (MISSION.md's rule), and an error naming the line for each bad one."""
from __future__ import annotations

import re

import pytest

from longlive_core.infer.prompts import PromptFileError, parse_prompts, plan_shots
from longlive_core.models.text import SCENE_TRANSITION


def test_two_shots_with_durations_get_the_frames_they_ask_for():
    text = "6.5\tA red kite over a beach.\n\n+2\tThe kite dives.\nA lighthouse at dusk.\n"
    segments = parse_prompts(text, default_duration_s=4.0)
    assert [(s.line, s.shot, s.new_shot, s.duration_s) for s in segments] == [
        (1, 0, True, 6.5), (3, 0, False, 2.0), (4, 1, True, 4.0)]
    assert segments[0].prompt == "A red kite over a beach." and segments[1].prompt == "The kite dives."
    assert segments[2].prompt == SCENE_TRANSITION + "A lighthouse at dusk."
    shots = plan_shots(segments, fps=24.0, chunk_frames=8)
    # a chunk of 8 latent frames is 32 video frames, 4/3 s at 24 fps: 6.5 s -> 5 chunks, 2 s -> 2, 4 s -> 3
    assert [p.chunks for p in shots] == [(5, 2), (3,)]
    assert [p.latent_frames for p in shots] == [56, 24]
    assert [p.video_frames for p in shots] == [1 + 4 * 55, 1 + 4 * 23]
    assert plan_shots(parse_prompts("0.1\ttiny", 1.0), 24.0, 8)[0].chunks == (1,)  # at least one chunk


@pytest.mark.parametrize("text, message", [
    ("+\tno shot yet", "line 1: a '+' line changes the prompt inside a shot"),
    ("a shot\nsix\tnot a number", "line 2: 'six' before the tab is not a duration"),
    ("-1\tnegative", "line 1: the duration must be a positive number of seconds; got '-1'"),
    ("nan\tnot finite", "the duration must be a positive number"),
    ("a shot\n\n3\t   ", "line 3: no prompt"),
    ("\n  \n", "holds no prompt"),
    ("a shot\n1.5 A red kite", "line 2: '1.5 A red kite' starts with a number but has no tab: write 1.5<TAB>prompt"),
    ("+2 more kites", "line 1: a '+' line changes"),
])
def test_a_bad_line_is_an_error_that_names_it(text, message):
    with pytest.raises(PromptFileError, match=re.escape(message)):
        parse_prompts(text, 4.0)


def test_a_byte_order_mark_is_ignored_and_a_number_after_a_tab_is_prompt_text():
    segments = parse_prompts("\ufeff1.5\tA red kite\n5\t3 dogs run\n", 4.0)
    assert [(s.prompt, s.duration_s) for s in segments] == [("A red kite", 1.5),
                                                            ("The scene transitions. 3 dogs run", 5.0)]



def test_a_prompt_that_starts_with_a_word_float_reads_is_prompt_text():
    segments = parse_prompts("Nan walks her dog\nInfinity pool at dusk\ninf. loops\n", 4.0)
    assert [s.prompt.removeprefix(SCENE_TRANSITION) for s in segments] == [
        "Nan walks her dog", "Infinity pool at dusk", "inf. loops"]
    for number in ("12 dogs", "-3 dogs", ".5 moons", "1e3 stars"):
        with pytest.raises(PromptFileError, match="starts with a number but has no tab"):
            parse_prompts(number, 4.0)
