"""Prompt enhancement (infer/enhance.py): the structure of the prompt file survives a rewrite, a reply
that breaks it leaves the file as given with the reason, and examples are the nearest captions."""
from __future__ import annotations

import numpy as np
import pytest

from longlive_core.infer.enhance import ExampleBank, build_request, enhance, parse_reply, pooled
from longlive_core.infer.prompts import PromptFileError, parse_prompts
from longlive_core.models.text import SCENE_TRANSITION

FILE = "2.5\tA red kite over a beach\n+1\tThe kite dives\n\nA city street at night\n4\t3 dogs run\n"


def numbered_upper(request: str) -> str:
    """A model that answers as asked: a preamble, then each numbered prompt in capitals."""
    lines = [line for line in request.splitlines() if line[:1].isdigit()]
    return "Here are the prompts:\n" + "\n".join(f"{line.split('. ', 1)[0]}. {line.split('. ', 1)[1].upper()}"
                                                 for line in lines)


def test_a_rewrite_keeps_durations_changes_and_shots_and_replaces_the_prompts():
    seen = []
    out = enhance(FILE, lambda r: seen.append(r) or numbered_upper(r), examples=["A dense caption."])
    assert out.rewritten and out.reason == "" and out.original == FILE
    assert "Example of the style: A dense caption." in seen[0] and "4. 3 dogs run" in seen[0]
    before, after = parse_prompts(FILE, 5.0), parse_prompts(out.enhanced, 5.0)
    assert [(s.line, s.shot, s.duration_s, s.new_shot) for s in after] == \
        [(s.line, s.shot, s.duration_s, s.new_shot) for s in before]
    assert [s.prompt for s in after] == ["A RED KITE OVER A BEACH", "THE KITE DIVES",
                                         SCENE_TRANSITION + "A CITY STREET AT NIGHT", SCENE_TRANSITION + "3 DOGS RUN"]


@pytest.mark.parametrize("reply, why", [
    ("1. a\n2. b\n3. c", "did not give back 4 numbered prompts"),  # one missing
    ("1. a\n2. b\n2. b again\n3. c\n4. d", "did not give back 4 numbered prompts"),  # one twice
    ("1. a\n2. b\n3. \n4. d", "did not give back 4 numbered prompts"),  # one empty
    ("1. a\n2. b\n3. 12 lanterns\n4. d", "does not read"),  # line 4 has no duration: a number first is an error
    ("I cannot help with that.", "did not give back 4 numbered prompts"),
    ("1. a\n2. b\n3. + c\n4. d", "shots and prompt changes differ"),  # line 4's shot made a prompt change
])
def test_a_reply_that_breaks_the_structure_leaves_the_file_as_given(reply, why):
    out = enhance(FILE, lambda _: reply)
    assert not out.rewritten and out.enhanced == FILE and why in out.reason


def test_a_bad_prompt_file_is_the_users_error_before_the_model_is_asked():
    asked = []
    with pytest.raises(PromptFileError, match="line 1"):
        enhance("+\tno shot before\n", lambda r: asked.append(r) or "")
    assert not asked


def test_requests_and_replies_number_the_prompts():
    assert "1. a\n2. b" in build_request(["a", "b"], [], "$examples$prompts")
    assert parse_reply("2) two\n1: one", 2) == ["one", "two"]


def test_examples_are_the_captions_nearest_the_prompts_and_travel_with_the_folder(tmp_path):
    e = np.array([[1, 0, 0], [0, 1, 0], [0.6, 0.8, 0]], dtype=np.float32)
    bank = ExampleBank(("x", "y", "xy"), e)
    assert bank.nearest(np.array([2.0, 0.1, 0.0]), 2) == ["x", "xy"]
    assert bank.nearest(np.array([0.0, 1.0, 0.0]), 5) == ["y", "xy", "x"]
    bank.save(tmp_path)
    again = ExampleBank.load(tmp_path)
    assert again.captions == bank.captions and np.array_equal(again.embeddings, e)
    assert ExampleBank.load(tmp_path / "none") is None
    v = pooled(np.array([[3.0, 4.0], [100.0, 0.0]]), np.array([True, False]))
    assert np.allclose(v, [0.6, 0.8])
