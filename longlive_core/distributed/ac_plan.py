"""Which activations a checkpointed block keeps under a memory limit (``activation_checkpointing:
budget``): from a profile of one block's forward (``ac_profile``), the outputs to save that buy the
most recomputation time for the bytes the limit leaves.

An op's output is a candidate when the backward reads it and saving it holds storage of its own that
no later op overwrites; saving it costs those bytes (every block of its kind holds them until its
backward) and spares the op's own time in the recomputation. The rest of the forward is recomputed:
a plan's recompute time is the forward's time less what it saves. That is the eager replay's cost;
under compile the partitioner also drops recomputation nothing in the backward needs, so it is an
upper bound there.

Under compile a plan is priced as the partitioner runs it (``compiled``): what the backward reads and
is not saved is recomputed, with whatever unsaved ops it is made from (each op's ``inputs``, the
counted ops that made its arguments' storage), and nothing else. Saving an output then spares its
op and every op recomputed only for it; an op the backward never reads costs nothing either way.
The plan follows one order built greedily by the time each next output spares per byte given those
before it (an output may spare nothing alone and much after another), keeping each that still fits,
then swaps a large output passed over for small ones kept where that spares more; it is the fastest
of those filled into a fixed set of rooms up to the limit, so again more memory never gives a slower
plan. The compiler fuses the elementwise ops it recomputes (``OpCost.fusible``)
into a few memory-bound kernels, where eager runs each on its own: they are priced at a share of
their eager time (``fused_share``, measured from two compiled steps of the block), the matrix
products and attention at theirs.

The eager choice is a 0/1 knapsack, solved twice and the better kept: by dynamic programming over bytes
counted in units of a quantum fixed by the profile (the candidates' common divisor, or a multiple of
it that leaves at most ``GRID`` units; rounded up per item, so a plan never exceeds its limit) and
by the greedy prefix in order of time per byte (exact bytes). Each answer is the best over every
limit up to the one given (the table's "at most c" capacities; a longer prefix), so more memory
never gives a slower plan. Times are counted in whole nanoseconds, so that holds exactly.

A compiled step's plan is then sized by measurement (``measured_plans``): the rooms it tries follow
from what each trial measured, so two limits may try different rooms, and the plan kept at a larger
limit can be slower than one a smaller limit's trials found. The measured choice is the plan whose
blocks were measured fastest within the limit (not the one predicted to recompute least: the best
room is also filled along the orders of other fused shares, which are a small difference of two
measured times), and its record (``MeasuredPlan.room_trials``) says which rooms were tried. A trainer
then runs the fastest of it and the plans cached for smaller limits of the same shapes
(``train.ac_planning.fastest_entry``: by measured time, or priced by ``priced_ns`` where the step does
not compile), so more memory never gives a slower plan than a smaller limit's.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

import numpy as np

GRID = 16384  # the knapsack's units over all candidates at most: each ~0.006% of their bytes
FILL_ROOMS = 256  # the equal steps of room a compiled plan is also filled into (besides the order's prefixes)
SWAP_CANDIDATES = 4  # a compiled plan's swaps try the outputs left out that would spare the most time alone
SWAPS = 4  # swaps per room at most
SHARE_FACTORS = (0.5, 2.0)  # a measured plan's room is filled again with the fused shares scaled by these
MEASURED_TIE = 0.01  # measured times within this share of each other are a tie: a block's median of ten
# trials moved 0.5-0.6% between two processes on the H200
# bumped when a profile or plan means something else (5: compiled plans priced fused; 6: a head's copies
# no longer beside a block's transient; 7: profiled with the caption and modulation needing gradients only
# where the step's do; 8: compiled plans swap; 9: measured plans reach past the rounds; 10: measured plans
# chosen, and compared with smaller limits', by their measured time; 11: eager plans measured against plain
# checkpointing and unchecked blocks; 12: an eager pass's last unchecked block counted once): cached ones are
# then not read
FORMAT = 12


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


# aten ops the compiler runs as kernels of their own: matrix products, attention, random draws; it
# fuses every other aten op with its neighbours (operators of other namespaces are opaque to it)
_UNFUSED = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward",
    "native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint"})


@dataclasses.dataclass(frozen=True)
class OpCost:
    id: str  # "aten.mm.default#3": the op and how many of it came before in the block's forward (ac_profile.OpCounter)
    bytes: int  # new storage its outputs hold: what saving it keeps alive
    seconds: float  # its time in the forward: what recomputing it costs
    read: bool  # the backward reads one of its outputs
    savable: bool = True  # it makes storage of its own that no later op writes in place
    inputs: tuple[int, ...] = ()  # the indices in the profile's ops of those that made its arguments' storage

    @property
    def candidate(self) -> bool:
        return self.read and self.savable and self.bytes > 0

    @property
    def fusible(self) -> bool:
        """Compiled, it runs fused with its neighbours (an aten op that is no matrix product, attention
        or random draw)."""
        namespace, _, rest = self.id.partition(".")
        return namespace == "aten" and rest.partition(".")[0] not in _UNFUSED


@dataclasses.dataclass(frozen=True)
class BlockProfile:
    ops: tuple[OpCost, ...]  # the counted ops, in forward order
    forward_s: float  # the whole forward, ops that are not counted included
    input_bytes: int  # the block's first input: the residual stream every block's checkpoint keeps
    transient_bytes: int  # the most one block's forward and backward add at once (measured on CUDA, of the
    # compiled block where the step compiles; on the CPU, which has no allocator statistics, every
    # output's bytes: an upper bound)
    device: str

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: Mapping) -> BlockProfile:
        fields = {k: v for k, v in d.items() if k != "format"}
        return cls(**{**fields, "ops": tuple(OpCost(**{**op, "inputs": tuple(op.get("inputs", ()))})
                                              for op in d["ops"])})

    def recomputed_split(self, saved: set[int]) -> tuple[float, float]:
        """The compiled backward's recomputation with the ops at indices ``saved`` kept, at eager times,
        as (unfused ops', fusible ops'): every op whose output the backward reads, or that such an op
        is recomputed from, unless kept (``inputs``)."""
        needed = [False] * len(self.ops)
        unfused = fused = 0.0
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            if i in saved or not (op.read or needed[i]):
                continue
            if op.fusible:
                fused += op.seconds
            else:
                unfused += op.seconds
            for j in op.inputs:
                needed[j] = True
        return unfused, fused

    def recomputed_s(self, saved: set[int], fused_share: float = 1.0) -> float:
        """``recomputed_split``'s time, the fusible ops' at ``fused_share`` of their eager time."""
        unfused, fused = self.recomputed_split(saved)
        return unfused + fused_share * fused

    def fused_share(self, full_s: float, none_s: float) -> float:
        """The share of their eager time the fusible ops cost as the compiled backward recomputes them,
        from one compiled block's forward and backward timed with nothing kept (``full_s``) and with
        every output kept (``none_s``): what recomputing everything cost beyond the unfused ops' eager
        time, over the fusible ops' (clamped to [0, 1]; 1 where nothing fusible is recomputed). A low
        estimate: keeping every output also makes the forward write what its fused kernels would not."""
        unfused, fused = self.recomputed_split(set())
        if fused <= 0:
            return 1.0
        return min(1.0, max(0.0, (full_s - none_s - unfused) / fused))


@dataclasses.dataclass(frozen=True)
class ACPlan:
    saved: tuple[str, ...]  # op ids whose outputs a block keeps (MUST_SAVE); everything else is recomputed
    saved_bytes: int  # what one block holds for its backward
    recompute_s: float  # predicted recomputation per block (the forward less what is saved)
    forward_s: float
    limit_bytes: int  # what this kind's blocks could hold together

    @property
    def recompute_fraction(self) -> float:
        return self.recompute_s / self.forward_s if self.forward_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: Mapping) -> ACPlan:
        fields = {k: v for k, v in d.items() if k != "format"}
        return cls(**{**fields, "saved": tuple(d["saved"])})


def plan_block(profile: BlockProfile, limit_bytes: int) -> ACPlan:
    """The plan of one block that may hold ``limit_bytes`` for its backward."""
    return plan_blocks({"block": profile}, {"block": 1}, limit_bytes)["block"]


def plan_blocks(profiles: Mapping[str, BlockProfile], counts: Mapping[str, int], limit_bytes: int,
                compiled: bool = False, fused_shares: Mapping[str, float] | None = None) -> dict[str, ACPlan]:
    """A plan per block kind, the ``counts[kind]`` blocks of each kind together holding at most
    ``limit_bytes`` (one choice over every kind's candidates: a kind with more blocks pays more
    per saved output and gains more); ``compiled``: priced as the compiled partitioner recomputes,
    each kind's fusible ops at its ``fused_shares`` of their eager time (none given: all of it)."""
    if compiled:
        shares = {kind: (fused_shares or {}).get(kind, 1.0) for kind in profiles}
        return _compiled_plans(profiles, counts, int(limit_bytes), shares)
    kinds = sorted(profiles)
    items = [(kind, op) for kind in kinds for op in profiles[kind].ops if op.candidate]
    weights = [op.bytes * counts[kind] for kind, op in items]
    values = [_ns(op.seconds) * counts[kind] for kind, op in items]
    chosen = _best(weights, values, max(0, int(limit_bytes)))
    plans = {}
    for kind in kinds:
        ops = [op for i, (k, op) in enumerate(items) if i in chosen and k == kind]
        p = profiles[kind]
        forward = _ns(p.forward_s)
        recompute = max(0, forward - sum(_ns(op.seconds) for op in ops))
        plans[kind] = ACPlan(tuple(op.id for op in ops), sum(op.bytes for op in ops), recompute / 1e9, forward / 1e9,
                             int(limit_bytes))
    return plans


def priced_ns(profiles: Mapping[str, BlockProfile], counts: Mapping[str, int], plans: Mapping[str, ACPlan],
              fused_shares: Mapping[str, float] | None = None) -> int | None:
    """The nanoseconds ``plans`` recompute in all, priced by ``profiles`` as ``plan_blocks`` prices
    (``fused_shares`` given: as the compiled partitioner recomputes, at those shares; else the forward
    less what is kept): plans made from another profile of the same shapes compared on one scale. None
    where a plan keeps an op ``profiles`` lack, or lacks a kind."""
    total = 0
    for kind, profile in profiles.items():
        plan = plans.get(kind)
        index = {op.id: i for i, op in enumerate(profile.ops)}
        if plan is None or any(op not in index for op in plan.saved):
            return None
        saved = {index[op] for op in plan.saved}
        if fused_shares:
            ns = _ns(profile.recomputed_s(saved, fused_shares.get(kind, 1.0)))
        else:
            ns = max(0, _ns(profile.forward_s) - sum(_ns(profile.ops[i].seconds) for i in saved))
        total += counts[kind] * ns
    return total


def _compiled_order(profiles: Mapping[str, BlockProfile], counts: Mapping[str, int],
                    shares: Mapping[str, float]) -> list[tuple[str, int]]:
    """The savable outputs that spare recomputation, as (kind, op index), in the order the greedy choice
    takes them: next the one that spares the most per byte given those before it (on a tie the fewer
    bytes); an output that spares nothing once those before it are kept is left out."""
    left = {(kind, i) for kind in profiles for i, op in enumerate(profiles[kind].ops) if op.savable and op.bytes > 0}
    saved = {kind: set() for kind in profiles}
    now = {kind: _ns(profiles[kind].recomputed_s(set(), shares[kind])) for kind in profiles}
    order = []
    while left:
        def gain(item):
            kind, i = item
            return (now[kind] - _ns(profiles[kind].recomputed_s(saved[kind] | {i}, shares[kind]))) * counts[kind]

        gains = {item: gain(item) for item in left}
        kind, i = max(left, key=lambda it: (gains[it] / (profiles[it[0]].ops[it[1]].bytes * counts[it[0]]),
                                            -profiles[it[0]].ops[it[1]].bytes, it))
        if gains[(kind, i)] <= 0:  # nothing left spares any time
            break
        order.append((kind, i))
        left.discard((kind, i))
        saved[kind].add(i)
        now[kind] = _ns(profiles[kind].recomputed_s(saved[kind], shares[kind]))
    return order


def _first_fit(order: list[tuple[str, int]], sizes: list[int], room: int) -> list[int]:
    """The positions in ``order`` taken when each output is kept if it still fits in ``room``."""
    taken, used = [], 0
    for pos, size in enumerate(sizes):
        if used + size <= room:
            taken.append(pos)
            used += size
    return taken


def _swapped(taken: frozenset[int], sizes: list[int], cost, room: int) -> frozenset[int]:
    """``taken`` (positions in the greedy order) improved by swaps: one output left out comes in (of the
    ``SWAP_CANDIDATES`` that would spare the most time alone), the kept ones that spare the least per byte
    go out until ``room`` holds them again, and the swap stays where the plan then recomputes less; at
    most ``SWAPS`` times. Filling along the order passes over an output too large for what the outputs
    before it left, where dropping a few small ones for it spares more: on the H200 profile of the 5B
    block, the FFN's up-projection (1.5 GB, 6.2 ms a block) at a 65 GiB limit."""
    for _ in range(SWAPS):
        now = cost(taken)
        outside = [p for p in range(len(sizes)) if p not in taken and sizes[p] <= room]
        outside.sort(key=lambda p: (cost(taken | {p}) - now, p))
        best = None
        for p in outside[:SWAP_CANDIDATES]:
            trial = taken | {p}
            with_it, used = cost(trial), sum(sizes[i] for i in trial)
            # out go the kept outputs whose loss costs least a byte, each priced once, until the room holds
            for q in sorted(taken, key=lambda q: ((cost(trial - {q}) - with_it) / max(sizes[q], 1), q)):
                if used <= room:
                    break
                trial, used = trial - {q}, used - sizes[q]
            if used <= room and cost(trial) < (now if best is None else cost(best)):
                best = trial
        if best is None:
            break
        taken = best
    return taken


def _compiled_plans(profiles: Mapping[str, BlockProfile], counts: Mapping[str, int], limit: int,
                    shares: Mapping[str, float]) -> dict[str, ACPlan]:
    """Along the greedy order, each output that still fits is kept (one too large for the room left
    is passed over, not the end of the plan), then swaps improve it (``_swapped``). That alone could give
    a slower plan for more memory, so the plan is the fastest of those filled into a fixed set of rooms
    at most ``limit``: every prefix of the order and ``FILL_ROOMS`` equal steps up to all of it (a larger
    limit only adds rooms)."""
    order = _compiled_order(profiles, counts, shares)
    sizes = [profiles[kind].ops[i].bytes * counts[kind] for kind, i in order]
    total = sum(sizes)
    rooms = set(itertools.accumulate(sizes, initial=0)) | {total * j // FILL_ROOMS for j in range(1, FILL_ROOMS + 1)}
    costs: dict[frozenset[int], int] = {}

    def chosen_of(taken) -> dict[str, set[int]]:
        chosen = {kind: set() for kind in profiles}
        for pos in taken:
            kind, i = order[pos]
            chosen[kind].add(i)
        return chosen

    def cost(taken: frozenset[int]) -> int:
        if taken not in costs:
            chosen = chosen_of(taken)
            costs[taken] = sum(counts[k] * _ns(profiles[k].recomputed_s(chosen[k], shares[k])) for k in profiles)
        return costs[taken]

    def plan_of(room: int) -> tuple[int, int, frozenset[int]]:
        taken = _swapped(frozenset(_first_fit(order, sizes, room)), sizes, cost, room)
        return cost(taken), sum(sizes[pos] for pos in taken), taken

    best = min((plan_of(room) for room in sorted(rooms) if room <= limit), key=lambda c: c[:2])
    best = (*best[:2], chosen_of(best[2]))
    plans = {}
    for kind, p in sorted(profiles.items()):
        idx = sorted(best[2][kind])
        plans[kind] = ACPlan(tuple(p.ops[i].id for i in idx), sum(p.ops[i].bytes for i in idx),
                             _ns(p.recomputed_s(set(idx), shares[kind])) / 1e9, _ns(p.forward_s) / 1e9, int(limit))
    return plans


@dataclasses.dataclass(frozen=True)
class MeasuredPlan:
    """Plans per kind with what the compiled step was measured to hold for them."""
    plans: dict[str, ACPlan]
    kept_bytes: int  # every block's kept bytes together, measured
    transient_bytes: int  # the most one block's backward adds at once, measured (the largest kind's)
    fused_shares: dict[str, float] = dataclasses.field(default_factory=dict)  # each kind's, as measured
    # each kind's (nothing kept, every output kept) trial seconds the share comes from: its noise is theirs
    share_trials: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # every plan measured on the way, in order: the room it was planned for, what it kept, its transient,
    # its predicted recomputation, its blocks' measured seconds, whether its peak held (which room a run
    # settled on, and why), the factor its order's fused shares were scaled by (``SHARE_FACTORS``) and the
    # compiled trials it cost (0 where every kind's plan was measured before)
    room_trials: tuple[dict, ...] = ()
    seconds: float = 0.0  # every block's forward and backward as measured with these plans (what a plan is chosen by)

    def peak(self, static: int) -> int:
        return static + self.kept_bytes + self.transient_bytes


def measured_plans(profiles: Mapping[str, BlockProfile], counts: Mapping[str, int], static: int, limit: int,
                   measure, rounds: int = 3, least_transient: int = 0, reach: int = 2) -> MeasuredPlan:
    """The plans under ``limit`` as the compiled step holds them: ``measure(kind, saved)`` gives what a
    compiled block of ``kind`` keeps, what its backward adds at once and the seconds its forward and
    backward take, with the outputs ``saved`` names kept (``ac_profile.block_trial``);
    ``static`` is everything else the step holds (the floor less its transient); ``least_transient``: a
    transient outside the blocks (the head's backward) that the step's transient is at least. Each
    kind's fusible ops are priced at the share of their eager time that its blocks measured with nothing
    and with every output kept (``BlockProfile.fused_share``), the rest at their eager time; the plans'
    bytes at the eager profile's. Each round scales the room they get by what the last plan measured
    against what it planned, and the plan kept is the one whose blocks were measured fastest among those
    within the limit (nothing saved when none is; on equal times the one predicted to recompute less).
    The rounds size each room by the last plan's own transient, and a plan that keeps more leaves its
    backward less to redo at once: a larger room can fit where they predicted it would not. So ``reach``
    trials more bisect between the largest room that held the limit and the one the least transient
    measured (every output kept) would leave. A kind's saved set is measured once: a room whose plan was
    measured before costs no compiled trial. Last, the best room is filled along the orders of the fused
    shares scaled by each of ``SHARE_FACTORS`` (the shares come from a small difference of two measured
    times, and which outputs a room takes depends on them), and a plan measured faster is kept."""
    trials: dict[tuple[str, tuple[str, ...]], tuple] = {}  # (kind, saved) -> its measurement, taken once

    def once(kind: str, saved: tuple[str, ...]) -> tuple:
        if (kind, saved) not in trials:
            trials[kind, saved] = measure(kind, saved)
        return trials[kind, saved]

    floor = {kind: once(kind, ()) for kind in profiles}  # nothing saved: full's floor
    every = {kind: once(kind, tuple(op.id for op in p.ops if op.savable and op.bytes > 0))
             for kind, p in profiles.items()}
    shares = {kind: profiles[kind].fused_share(floor[kind][2], every[kind][2]) for kind in profiles}

    def measured(plans: dict[str, ACPlan], real: dict | None = None) -> MeasuredPlan:
        real = real or {kind: once(kind, plans[kind].saved) for kind in plans}
        return MeasuredPlan(plans, sum(counts[k] * real[k][0] for k in real),
                            max(least_transient, *(r[1] for r in real.values())), shares,
                            {kind: (floor[kind][2], every[kind][2]) for kind in profiles},
                            seconds=sum(counts[k] * real[k][2] for k in real))

    def rank(m: MeasuredPlan) -> tuple[float, float]:
        """The faster measured first; on a tie (the same time measured) the one predicted to recompute less."""
        return m.seconds, sum(counts[k] * p.recompute_s for k, p in m.plans.items())

    def planned(m: MeasuredPlan) -> int:
        return sum(counts[k] * p.saved_bytes for k, p in m.plans.items())

    history: list[dict] = []

    def plan_for(room: int, factor: float = 1.0) -> dict[str, ACPlan]:
        """The plans for ``room``, ordered by the shares times ``factor`` and priced at the shares."""
        ordered = {k: min(1.0, factor * s) for k, s in shares.items()}
        return priced(plan_blocks(profiles, counts, room, compiled=True, fused_shares=ordered))

    seen: set[tuple] = set()  # the plans measured, as every kind's saved set

    def signature(plans: dict[str, ACPlan]) -> tuple:
        return tuple(sorted((k, p.saved) for k, p in plans.items()))

    def tried(room: int, plans: dict[str, ACPlan], factor: float = 1.0) -> MeasuredPlan:
        seen.add(signature(plans))
        before = len(trials)
        m = measured(plans)
        history.append({"room": room, "share_factor": factor, "kept": m.kept_bytes, "transient": m.transient_bytes,
                        "recompute_s": sum(counts[k] * p.recompute_s for k, p in m.plans.items()),
                        "seconds": m.seconds, "within": m.peak(static) <= limit,
                        "compiled_trials": len(trials) - before})
        return m

    def priced(plans: dict[str, ACPlan]) -> dict[str, ACPlan]:
        return {k: dataclasses.replace(p, recompute_s=priced_ns({k: profiles[k]}, {k: 1}, {k: p}, shares) / 1e9)
                for k, p in plans.items()}

    def better(trial: MeasuredPlan, than: MeasuredPlan) -> bool:
        return trial.peak(static) <= limit and rank(trial) < rank(than)

    best = measured(plan_blocks(profiles, counts, 0, compiled=True, fused_shares=shares), floor)
    best_room, room = 0, limit - best.peak(static)
    fit, fit_room = None, 0  # the trial of the largest room that held the limit (not always the fastest)
    for _ in range(rounds):
        if room <= 0:
            break
        trial = tried(room, plan_for(room))
        if trial.peak(static) <= limit and room > fit_room:
            fit, fit_room = trial, room
        if better(trial, best):
            best, best_room = trial, room
        if trial.kept_bytes <= 0 or planned(trial) <= 0:
            break
        # the bytes the limit leaves above this plan's own transient, at the eager-to-measured ratio
        grown = int((limit - static - trial.transient_bytes) * planned(trial) / trial.kept_bytes)
        if grown == room:
            break
        room = grown
    if fit is None or fit.kept_bytes <= 0 or planned(fit) <= 0:  # no room that keeps something held the limit
        return dataclasses.replace(best, room_trials=tuple(history))
    least = max(least_transient, *(every[kind][1] for kind in profiles))
    high = room = int((limit - static - least) * planned(fit) / fit.kept_bytes)
    low = fit_room
    for _ in range(reach):
        if room <= low:
            break
        trial = tried(room, plan_for(room))
        if trial.peak(static) <= limit:
            if better(trial, best):
                best, best_room = trial, room
            low = room
        else:
            high = room
        room = (low + high) // 2
    # the shares are a small difference of two measured times, and they order the candidates: the best
    # room is filled again along the orders of other shares, and the one measured fastest is kept
    for factor in SHARE_FACTORS if best_room > 0 else ():
        plans = plan_for(best_room, factor)
        if signature(plans) not in seen:  # another order filled the room otherwise
            trial = tried(best_room, plans, factor)
            if better(trial, best):
                best = trial
    return dataclasses.replace(best, room_trials=tuple(history))


def _best(weights: list[int], values: list[int], limit: int) -> set[int]:
    """The item indices of the better of the two solutions (the larger saved time; then the fewer
    bytes)."""
    table, greedy = _by_table(weights, values, limit), _by_greedy_prefix(weights, values, limit)

    def rank(chosen: set[int]) -> tuple[int, int]:
        return sum(values[i] for i in chosen), -sum(weights[i] for i in chosen)

    return max((table, greedy), key=rank)


def _by_greedy_prefix(weights: list[int], values: list[int], limit: int) -> set[int]:
    """The longest prefix, in order of time per byte, that fits: a larger limit only lengthens it."""
    order = sorted(range(len(weights)), key=lambda i: (-values[i] / weights[i], i))
    chosen, used = set(), 0
    for i in order:
        if used + weights[i] > limit:
            break
        chosen.add(i)
        used += weights[i]
    return chosen


def _by_table(weights: list[int], values: list[int], limit: int) -> set[int]:
    """0/1 knapsack by dynamic programming over quantised bytes; best[c] is the most time any set of
    at most c units saves, so it never decreases in c."""
    if not weights:
        return set()
    common = math.gcd(*weights)  # tensors' bytes share factors: exact where that leaves few units
    quantum = common * max(1, math.ceil(sum(weights) // common / GRID))
    units = [math.ceil(w / quantum) for w in weights]
    capacity = min(sum(units), limit // quantum)
    best = np.zeros(capacity + 1, dtype=np.int64)
    take = np.zeros((len(units), capacity + 1), dtype=bool)
    for i, (u, v) in enumerate(zip(units, values)):
        if u > capacity:
            continue
        with_item = best[:capacity + 1 - u] + v
        better = with_item > best[u:]
        take[i, u:] = better
        best[u:] = np.where(better, with_item, best[u:])
    chosen, c = set(), capacity
    for i in range(len(units) - 1, -1, -1):
        if take[i, c]:
            chosen.add(i)
            c -= units[i]
    return chosen
