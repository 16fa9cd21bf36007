"""How an eager step's blocks keep their activations under ``activation_checkpointing: budget``,
chosen by measured time (``ac_profile.block_trial``): the op-level plan (``ac_plan.plan_blocks``),
plain checkpointing (``full``: nothing kept), or the last blocks of each kind unchecked and the rest
checkpointed plainly.

The eager profile prices what a plan spares on the GPU, not what selective checkpointing costs on
the CPU: its dispatch mode runs every op of the forward and of the recomputation through Python
(2.6x a tiny NVFP4 block's forward and backward on this CPU), and where a pass is too small to keep
the GPU busy that is the pass's time (on an H100, distill_dmd's generator pass with the op-level plans
ran slower than ``full``, bench/RESULTS.md). An unchecked block pays no such cost and spares its
whole recomputation, for every byte it keeps. So a pass takes the fastest of the three as its blocks
measured them, a candidate kept only where it is faster than ``full`` by more than ``ac_plan.MEASURED_TIE``.
Unchecked blocks fill the room above the floor and one block run more where the floor's transient is
that block's own forward and backward (``unchecked_credit``): counted twice, the last one's activations
made the H100's critic pass predict its peak 10 GiB high (bench/RESULTS.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from longlive_core.distributed.ac_plan import MEASURED_TIE


@dataclasses.dataclass(frozen=True)
class EagerTrials:
    """One block kind's forward and backward, measured three ways at a pass's shapes."""

    full_s: float  # checkpointed plainly (nothing kept)
    plan_s: float  # under the op-level plan's policy (full_s where the plan keeps nothing)
    unchecked_s: float  # not checkpointed
    unchecked_kept: int  # the bytes an unchecked block keeps for its backward

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EagerChoice:
    how: str  # full | plan | unchecked
    unchecked: dict[str, int]  # the blocks of each kind in a model that run unchecked (the last ones)
    kept: int  # what the unchecked blocks keep, every run of them together (0 for full and plan)
    seconds: float  # the pass's blocks' forward and backward, as measured


def unchecked_blocks(trials: Mapping[str, EagerTrials], blocks: Mapping[str, int], runs: int,
                     room: int, credit: int = 0) -> dict[str, int]:
    """How many blocks of each kind (of ``blocks[kind]`` in a model, each run ``runs`` times a pass with
    its activations held until the backward) run unchecked within ``room`` bytes: the kinds that spare
    the most time per byte first. ``credit``: what the unchecked blocks may keep beyond the room
    (``unchecked_credit``)."""
    def per_byte(kind: str) -> float:
        t = trials[kind]
        return (t.full_s - t.unchecked_s) / max(1, runs * t.unchecked_kept)

    out, left = {}, room + credit
    for kind in sorted(trials, key=per_byte, reverse=True):
        t = trials[kind]
        if t.unchecked_s >= t.full_s:
            continue
        cost = runs * t.unchecked_kept
        k = blocks[kind] if cost <= 0 else min(blocks[kind], max(0, left) // cost)
        if k:
            out[kind] = int(k)
            left -= k * cost
    return out


def unchecked_credit(trials: Mapping[str, EagerTrials], block_transient: int, transient: int, on_top: int) -> int:
    """The bytes of a pass's floor that its unchecked blocks' activations take the place of. The floor
    holds one block's forward and backward at once (``transient``). A run of the pass's blocks leaves its
    last ones unchecked, so its backward begins with them: the last one's backward is that transient with
    its own kept activations in it, and the run's checkpointed blocks recompute after its unchecked ones
    are freed (earlier runs' stay held, as counted). So with one kind of block, and the floor's transient
    that block's own (``block_transient``: not another pass's), one block run keeps nothing beyond the
    floor, as long as what runs on top of every unchecked block's activations (``on_top`` bytes: a head's
    backward, other models' forwards) still fits under the rest of the transient. 0 otherwise."""
    if len(trials) != 1 or transient > block_transient:
        return 0
    (t,) = trials.values()
    return max(0, min(t.unchecked_kept, transient - on_top))


def eager_choice(trials: Mapping[str, EagerTrials], blocks: Mapping[str, int], runs: int, room: int,
                 plan_keeps: bool, credit: int = 0) -> EagerChoice:
    """The fastest of ``full``, the op-level plan (where ``plan_keeps``: it keeps something, within the
    room by its own prediction) and unchecked blocks within ``room`` bytes and ``credit``
    (``unchecked_blocks``), for a pass that runs ``blocks[kind]`` blocks of each kind ``runs`` times."""
    def seconds(unchecked: Mapping[str, int], plan: bool) -> float:
        total = 0.0
        for kind, n in blocks.items():
            t, k = trials[kind], unchecked.get(kind, 0)
            total += k * t.unchecked_s + (n - k) * (t.plan_s if plan else t.full_s)
        return runs * total

    best = EagerChoice("full", {}, 0, seconds({}, False))
    unchecked = unchecked_blocks(trials, blocks, runs, room, credit)
    candidates = []
    if plan_keeps:
        candidates.append(EagerChoice("plan", {}, 0, seconds({}, True)))
    if unchecked:
        kept = runs * sum(k * trials[kind].unchecked_kept for kind, k in unchecked.items())
        candidates.append(EagerChoice("unchecked", unchecked, kept, seconds(unchecked, False)))
    for c in sorted(candidates, key=lambda c: c.seconds):
        if c.seconds < best.seconds * (1 - MEASURED_TIE):
            best = c
    return best
