"""An eager pass's choice among full, the op-level plan and unchecked blocks (distributed/ac_eager.py),
from injected trial times: the fastest as measured, ``full`` unless another is faster beyond a tie,
unchecked blocks only within the room, the kinds sparing the most per byte first."""
from __future__ import annotations

from longlive_core.distributed.ac_eager import EagerTrials, eager_choice, unchecked_blocks


def test_unchecked_blocks_fill_the_room_with_each_run_of_a_block_counted():
    t = {"a": EagerTrials(full_s=1.0, plan_s=1.2, unchecked_s=0.6, unchecked_kept=100)}
    assert unchecked_blocks(t, {"a": 4}, runs=1, room=250) == {"a": 2}
    assert unchecked_blocks(t, {"a": 4}, runs=2, room=250) == {"a": 1}  # a block run twice keeps twice
    assert unchecked_blocks(t, {"a": 4}, runs=1, room=10_000) == {"a": 4}  # no more than a model has
    assert unchecked_blocks(t, {"a": 4}, runs=1, room=99) == {}
    slower = {"a": EagerTrials(1.0, 1.0, 1.0, 100)}
    assert unchecked_blocks(slower, {"a": 4}, runs=1, room=10_000) == {}  # spares nothing


def test_the_kind_that_spares_the_most_per_byte_goes_first():
    t = {"cheap": EagerTrials(1.0, 1.0, 0.5, 100), "dear": EagerTrials(1.0, 1.0, 0.5, 400)}
    assert unchecked_blocks(t, {"cheap": 2, "dear": 2}, runs=1, room=600) == {"cheap": 2, "dear": 1}
    assert unchecked_blocks(t, {"cheap": 2, "dear": 2}, runs=1, room=550) == {"cheap": 2}


def test_an_eager_pass_runs_the_fastest_measured_way():
    blocks = {"a": 4}
    # selective checkpointing's Python costs more than its plan spares: full, however much room
    slow_plan = {"a": EagerTrials(full_s=1.0, plan_s=1.2, unchecked_s=1.0, unchecked_kept=100)}
    assert eager_choice(slow_plan, blocks, 1, 10_000, plan_keeps=True).how == "full"
    # unchecked blocks beat the plan
    t = {"a": EagerTrials(full_s=1.0, plan_s=0.9, unchecked_s=0.6, unchecked_kept=100)}
    choice = eager_choice(t, blocks, 2, 450, plan_keeps=True)
    assert (choice.how, choice.unchecked, choice.kept) == ("unchecked", {"a": 2}, 400)
    assert abs(choice.seconds - 2 * (2 * 0.6 + 2 * 1.0)) < 1e-9
    # no room for a block: the plan (which holds its own room)
    assert eager_choice(t, blocks, 2, 150, plan_keeps=True).how == "plan"
    # a plan that keeps nothing is full
    assert eager_choice(t, blocks, 2, 150, plan_keeps=False).how == "full"


def test_within_a_tie_of_full_full_is_kept():
    t = {"a": EagerTrials(full_s=1.0, plan_s=0.995, unchecked_s=0.995, unchecked_kept=1)}
    choice = eager_choice(t, {"a": 4}, 1, 10_000, plan_keeps=True)
    assert (choice.how, choice.unchecked, choice.kept) == ("full", {}, 0)
