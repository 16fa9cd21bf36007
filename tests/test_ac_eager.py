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


def test_the_last_unchecked_block_fills_the_floors_transient():
    """A pass of one kind of block whose floor holds that block's forward and backward: the last unchecked
    block's activations are already in it, so one run of a block is free of the room; the head's backward,
    run while every unchecked block's activations are held, bounds that credit."""
    from longlive_core.distributed.ac_eager import unchecked_credit

    t = {"a": EagerTrials(full_s=1.0, plan_s=1.0, unchecked_s=0.6, unchecked_kept=100)}
    assert unchecked_credit(t, block_transient=150, transient=150, on_top=0) == 100
    assert unchecked_credit(t, block_transient=150, transient=150, on_top=90) == 60  # the head's copies need 90
    assert unchecked_credit(t, block_transient=150, transient=200, on_top=0) == 0  # another pass's transient
    two = {**t, "b": EagerTrials(1.0, 1.0, 0.6, 100)}
    assert unchecked_credit(two, block_transient=150, transient=150, on_top=0) == 0  # which block runs last?
    assert unchecked_blocks(t, {"a": 4}, runs=1, room=250, credit=100) == {"a": 3}
    assert unchecked_blocks(t, {"a": 4}, runs=2, room=250, credit=100) == {"a": 1}  # 350 holds one block run twice
    choice = eager_choice(t, {"a": 4}, 1, 250, plan_keeps=False, credit=100)
    assert (choice.how, choice.unchecked, choice.kept) == ("unchecked", {"a": 3}, 300)


def test_an_unchecked_passs_predicted_peak_counts_its_last_block_once():
    from longlive_core.distributed.ac_plan import ACPlan, BlockProfile, OpCost
    from longlive_core.train.ac_planning import eager_entry

    ops = (OpCost("mm", 100, 1e-3, True),)
    profiles = {"a": BlockProfile(ops, 1e-3, 10, 150, "cuda:0")}
    plans = {"a": ACPlan((), 0, 1e-3, 1e-3, 0)}
    trials = {"a": EagerTrials(full_s=1.0, plan_s=1.0, unchecked_s=0.6, unchecked_kept=100)}
    parts = {"static": 1000, "transient": 150}
    entry = eager_entry(profiles, plans, {"a": 4}, 1, parts, 250, trials, on_top=20)
    assert entry["unchecked"] == {"a": 3} and entry["kept"] == 300
    assert entry["predicted_peak"] == 1150 + 300 - 100  # the floor and two blocks' activations beyond it
    # a head's backward of 90 over every unchecked block's activations: the credit shrinks to 60, and the
    # predicted peak is exactly that moment's
    entry = eager_entry(profiles, plans, {"a": 4}, 1, parts, 250, trials, on_top=90)
    assert entry["unchecked"] == {"a": 3} and entry["predicted_peak"] == 1000 + 300 + 90
    # another pass's transient is the floor's (distill_dmd's generator under the scores' forwards): no credit
    entry = eager_entry(profiles, plans, {"a": 4}, 1, {"static": 1000, "transient": 400}, 250, trials)
    assert entry["unchecked"] == {"a": 2} and entry["predicted_peak"] == 1400 + 200
