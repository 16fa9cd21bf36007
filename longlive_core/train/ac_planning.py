"""``activation_checkpointing: budget`` for train_ar: a plan per window length the run can draw
(``LatentSamples.window_lengths``: production's windows are 64 or 96 latent frames), made when the
trainer starts from a profile of one block of each kind at that window's shapes, and chosen per
micro-batch by its window.

The limit is the step's peak on one device (``ac_memory_limit_gib``; null: 0.9 of the GPU's
memory). Outside what a plan keeps, a step holds (``StepMemory``): what is resident when planning
starts (parameter shards, the EMA), the float32 gradient shards, AdamW's two moments (made at the
first optimizer step), FSDP's buffers (two blocks' gathered compute copies, one block's unsharded
float32 gradients, the root's gathered parameters); and per window every block's input (the
residual stream each checkpoint keeps), one block's forward and backward at once (the transient:
the block in backward recomputes what it did not keep) and the activations outside the blocks (the
embedding's output, the head's float32 copies). That is what a ``full`` step keeps, the floor; what
the limit leaves above it the knapsack shares among the blocks. With one micro-batch per step the
blocks' gradients are made as the backward frees what the blocks kept, so the step holds the larger
of the two (with accumulation, the later micro-batches run over every gradient). Where the step is compiled (on
CUDA), the compiled partitioner decides what a checkpointed block keeps and when it recomputes, and
the eager profile overprices both (H200, 5B dims, 56,320 tokens: a floor ~4 GiB high, kept bytes
~1.8x), and fuses the elementwise ops it recomputes: the floor's transient and each candidate
plan's bytes are then measured on a compiled copy of the block, and the fused ops' share of their
eager time from its time with nothing and with everything kept (``ac_plan.measured_plans``, a few
compilations when training starts). Eager on CUDA (distill_dmd's passes alike), selective
checkpointing's Python dispatch mode costs what the profile does not price, so the step runs the
fastest of ``full``, the plan and its last blocks unchecked, as one block measured them
(``eager_trials``, ``eager_entry``, ``distributed.ac_eager``). After every step
the measured peak (on CUDA, the world's largest) is checked against the limit.

Profiles run on every rank at once (sequence parallelism's all-to-all is inside a block) and rank
0's profile and plan are every rank's: the ranks of a group must recompute the same collectives.
Plans are cached on rank 0's disk by what they depend on. A window no plan covers (a one-rank run
whose ``max_latent_frames`` changed, as the benchmark does) is planned when it first comes; on more
ranks it runs as ``full`` does, with a warning. Profiling forks the RNG, and runs on a copy of a
block: it changes no number of the run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from longlive_core.distributed.ac_budget import (
    BudgetCheckpointing,
    PlanCache,
    check_peak,
    memory_limit,
    plan_target,
)
from longlive_core.distributed.ac_eager import EagerTrials, eager_choice, unchecked_credit
from longlive_core.distributed.ac_plan import MEASURED_TIE, ACPlan, BlockProfile, measured_plans, plan_blocks, priced_ns
from longlive_core.distributed.ac_profile import PLAIN, block_trial, profile_block
from longlive_core.models.rope import rope_cos_sin
from longlive_core.models.wan_dit import WanDiT
from longlive_core.tracking.lineage import code_digest, runtime_versions
from longlive_core.train.checkpointing import agree
from longlive_core.train.config import TrainARConfig
from longlive_core.train.layout import TeacherForcingLayout

log = logging.getLogger(__name__)
KEY = "train_ar.ac_memory_limit_gib"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """What ``tensors`` hold on this rank (a DTensor's local shard)."""
    return sum(_local(t).numel() * t.element_size() for t in tensors)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes a step holds whatever the window (see the module's docstring)."""

    resident: int
    grads: int
    optimizer: int
    fsdp: int

    @property
    def total(self) -> int:
        return self.resident + self.grads + self.optimizer + self.fsdp


def step_memory(model: WanDiT, optimizer: torch.optim.Optimizer, ema: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> StepMemory:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    if device.type == "cuda":
        resident = torch.cuda.memory_allocated(device)
    else:  # no allocator statistics: the shards and the EMA
        resident = local_bytes(params) + local_bytes(ema.values()) + local_bytes(model.buffers())
    grads = local_bytes(trainable)
    return StepMemory(resident, grads, 0 if optimizer.state else 2 * grads, fsdp_bytes(model, dtype))


def run_key(model: WanDiT, memory: StepMemory, target: int, device: torch.device, dtype: torch.dtype,
            trainer: str) -> dict:
    """What every trainer's plans depend on beside its shapes: the model, the step's memory, the target, the
    device, the dtype, and the kernels the profile prices: torch's, CUDA's, Triton's and the code the trainer
    runs (``trainer``: its module; comments and docstrings aside), so a plan cached before a kernel changed
    what it takes or keeps is made again. The cache outlives runs and checkouts ($XDG_CACHE_HOME)."""
    return {"dit": dataclasses.asdict(model.cfg), "dtype": str(dtype), **runtime_versions(), "limit": target,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "code": code_digest(trainer),
            # what is measured resident varies a little between runs of the same config
            "memory": [memory.resident // 2**26, memory.grads, memory.optimizer, memory.fsdp]}


def fsdp_bytes(model: WanDiT, dtype: torch.dtype) -> int:
    """FSDP's buffers at once: two blocks' gathered compute copies, the root's, one block's unsharded
    float32 gradients."""
    in_blocks = {id(p) for p in model.blocks.parameters()}
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)  # the largest, whole (DTensor.numel)
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return (2 * block + root) * dtype.itemsize + 4 * block


def embeddings_need_grad(model: WanDiT) -> tuple[bool, bool]:
    """Whether a step's (caption embedding, timestep modulation) need gradients: whether what makes them
    trains. distill_dmd's LoRA leaves both frozen, and then the blocks' backward neither reads the
    activations that only their gradients need (two modulated norms' float32 inputs: 1.4 GB a block at
    56,320 tokens of the 5B) nor makes those gradients."""
    trains = lambda *modules: any(p.requires_grad for m in modules for p in m.parameters())  # noqa: E731
    return trains(model.text_embedding), trains(model.time_embedding, model.time_projection)


def block_inputs(model: WanDiT, layout: TeacherForcingLayout, grid: tuple[int, int], dtype: torch.dtype,
                 device: torch.device) -> tuple:
    """A block's arguments for one sample of ``layout`` on this rank (as ``WanDiT.forward`` passes them),
    one caption, random values from the (forked) global RNG; gradients where the step's have them."""
    cfg, f = model.cfg, layout.local_frames
    n = 2 * f * layout.tokens_per_frame
    text_grad, time_grad = embeddings_need_grad(model)
    x = torch.randn(1, n, cfg.dim, device=device, dtype=dtype).requires_grad_()
    context = torch.randn(1, layout.text_tokens, cfg.dim, device=device, dtype=dtype).requires_grad_(text_grad)
    t_mod = (torch.randn(1, 2 * f, 6, cfg.dim, device=device) / cfg.dim**0.5).requires_grad_(time_grad)
    rope = rope_cos_sin(cfg.rope_dims, layout.frame_positions(torch.arange(f, device=device)), *grid, cfg.rope_theta)
    return x, context, t_mod, 2 * f, rope, layout.self_mask(), model.attention_fn


def cast_probes(budget: BudgetCheckpointing, dtype: torch.dtype) -> None:
    """The profiler's block copies as FSDP gathers them: floating-point parameters in the compute
    dtype (packed NVFP4 codes and scales are buffers, left as they are)."""
    for probe in budget.probes.values():
        for p in probe.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)


@dataclasses.dataclass(frozen=True)
class OutsideBlocks:
    """What a step holds of activations outside the blocks, for ``passes`` passes through the model of
    ``tokens`` tokens each (the model's input is block 0's input, counted with the blocks' inputs)."""

    tokens: int
    dim: int
    itemsize: int
    passes: int = 1

    @property
    def head_bytes(self) -> int:
        """One head's float32 copies (8 bytes an element), saved for its backward: a step holds them
        while that head's backward runs, before its blocks' backward, so never beside a block's
        transient. Measured (H200, 8 blocks, 56,320 tokens): not live at the step's peak, in a block's
        backward."""
        return self.tokens * self.dim * 8

    @property
    def held_bytes(self) -> int:
        """Held through every block's backward: the model's output and the loss's copies (one activation
        of the compute dtype a pass; 0.25 GiB measured where this counts 0.32) and the heads of the
        passes whose backward has not started."""
        return self.passes * self.tokens * self.dim * self.itemsize + (self.passes - 1) * self.head_bytes

    def transient(self, block_transient: int) -> int:
        """The step's largest transient: a block's forward and backward at once, or a head's copies."""
        return max(block_transient, self.head_bytes)


class StepPeak:
    """The steps' peak of allocated memory on this GPU, carried across the resets made between steps
    for work that no plan counts (a window planned mid-run, distillation's latent statistics): that
    work's own peak is left out of the limit's check, the steps' before it kept. Off CUDA it reads 0."""

    def __init__(self, device: torch.device):
        self.device = device
        self.carried = 0
        self.excluded_peak = 0  # the largest of the excluded work's own peaks
        self.sections: dict[str, int] = {}  # each named part of a step's largest peak (``enter``)
        self._section: str | None = None

    def enter(self, name: str | None) -> None:
        """What follows, to the next ``enter``, is ``name``'s (None: no part's): the peak of each part of
        a step (distill_dmd's passes) against the part's own prediction."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            if self._section is not None:
                self.sections[self._section] = max(self.sections.get(self._section, 0), peak)
            self.carried = max(self.carried, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._section = name

    def local(self) -> int:
        """This rank's largest step peak so far."""
        if self.device.type != "cuda":
            return 0
        return max(self.carried, torch.cuda.max_memory_allocated(self.device))

    def overall(self) -> int:
        """This rank's largest peak so far, the excluded work's included (what the GPU held at most)."""
        return max(self.local(), self.excluded_peak)

    @contextlib.contextmanager
    def excluded(self):
        """Work between steps: the peak so far is carried (an open part's folded into it), and the counter
        starts again after it, in the same part."""
        section = self._section
        self.enter(None)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                self.excluded_peak = max(self.excluded_peak, torch.cuda.max_memory_allocated(self.device))
                torch.cuda.reset_peak_memory_stats(self.device)
            self._section = section

    def world(self) -> int:
        """Collective: the largest step peak so far on any rank."""
        return self.world_sections(())[0]

    def world_sections(self, names: tuple[str, ...]) -> tuple[int, dict[str, int]]:
        """Collective: ``world()`` and each named part's largest peak on any rank (0: not run yet), in one
        reduction."""
        peaks = torch.tensor([float(self.local())] + [float(self.sections.get(n, 0)) for n in names],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        values = [int(v) for v in peaks.tolist()]
        return values[0], dict(zip(names, values[1:], strict=True))


@contextlib.contextmanager
def forked_rng(device: torch.device):
    """A profile's random inputs from a forked RNG seeded 0: the run's draws are left as they were."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []), \
            (torch.cuda.device(device) if cuda else contextlib.nullcontext()):
        torch.random.default_generator.manual_seed(0)
        if cuda:  # this device's generator alone (manual_seed would touch every GPU's)
            torch.cuda.manual_seed(0)
        yield


def plan_entry(profiles: dict[str, BlockProfile], plans: dict[str, ACPlan], counts: dict[str, int],
               parts: dict[str, int], kept: int, absorbed: int = 0, fused_shares: dict[str, float] | None = None,
               share_trials: dict[str, tuple[float, float]] | None = None, room_trials: tuple[dict, ...] = (),
               measured_s: float | None = None) -> dict:
    """What a plan cache entry and MLflow hold of one planned shape: the profiles, the plans, the
    floor (what a ``full`` step holds: ``parts`` summed) and what the plans keep above it, with
    ``counts`` blocks of each kind running the shape once each. ``absorbed``: the floor's bytes that
    kept bytes take the place of (gradients made as kept outputs are freed): the peak grows by what
    is kept beyond them. ``fused_shares``: what compiled recomputation of fusible ops was measured to
    cost, per kind, as a share of their eager time, from ``share_trials``: a compiled block's seconds with
    nothing and with every output kept. ``room_trials``: the plans measured on the way
    (``MeasuredPlan.room_trials``); ``measured_s``: every block's forward and backward as measured with
    the plans (compiled, or eager: ``ac_eager``)."""
    floor = sum(parts.values())
    measured = {} if measured_s is None else {"measured_s": measured_s}
    return {**measured, "profiles": {k: p.to_json() for k, p in profiles.items()}, "fused_shares": fused_shares or {},
            "share_trials": {k: {"nothing_kept_s": a, "everything_kept_s": b}
                             for k, (a, b) in (share_trials or {}).items()},
            "room_trials": list(room_trials),
            "plans": {k: p.to_json() for k, p in plans.items()},
            "floor": floor, "floor_parts": parts, "kept": kept, "predicted_peak": floor + max(0, kept - absorbed),
            "planned_kept": sum(counts[k] * plans[k].saved_bytes for k in plans),
            "recompute_s": sum(counts[k] * plans[k].recompute_s for k in plans),
            "forward_s": sum(counts[k] * plans[k].forward_s for k in plans),
            "candidates": sum(sum(op.candidate for op in p.ops) for p in profiles.values()),
            "saved": sum(len(p.saved) for p in plans.values())}


EAGER_TRIAL_REPEATS = 10  # a block's eager trials: forward and backward timed this many times, the median kept
# (as compiled trials are, which ac_plan.MEASURED_TIE was measured on)


def eager_trials(probes: Mapping[str, torch.nn.Module], args: tuple, plans: Mapping[str, ACPlan],
                 device: torch.device) -> dict[str, EagerTrials]:
    """Each kind's block measured eager at ``args`` (collective: every rank runs them, rank 0's numbers
    are every rank's): checkpointed plainly, under its plan, unchecked."""
    out = {}
    for kind, probe in sorted(probes.items()):
        with forked_rng(device):  # a block's backward may draw (stochastic rounding)
            full = block_trial(probe, args, (), compiled=False, repeats=EAGER_TRIAL_REPEATS)
            plan = block_trial(probe, args, plans[kind].saved, compiled=False, repeats=EAGER_TRIAL_REPEATS) \
                if plans[kind].saved else full
            unchecked = block_trial(probe, args, PLAIN, compiled=False, repeats=EAGER_TRIAL_REPEATS)
        out[kind] = agree((full.seconds, plan.seconds, unchecked.seconds, unchecked.kept))
    return {kind: EagerTrials(*t) for kind, t in out.items()}


def eager_entry(profiles: dict[str, BlockProfile], plans: dict[str, ACPlan], blocks: Mapping[str, int], runs: int,
                parts: dict[str, int], room: int, trials: Mapping[str, EagerTrials], absorbed: int = 0,
                on_top: int = 0) -> dict:
    """``plan_entry`` of an eager pass run the fastest measured way (``ac_eager.eager_choice``): ``plans``
    as planned for the pass's ``room`` (the limit less the floor, ``absorbed`` given back), ``blocks`` of
    each kind in a model, each run ``runs`` times; ``on_top``: the most the step adds while every kept
    activation is held (a head's backward; ``ac_eager.unchecked_credit``)."""
    counts = {k: runs * n for k, n in blocks.items()}
    kept = sum(counts[k] * plans[k].saved_bytes for k in plans)
    credit = unchecked_credit(trials, max(p.transient_bytes for p in profiles.values()), parts["transient"], on_top)
    choice = eager_choice(trials, blocks, runs, room, plan_keeps=kept > 0, credit=credit)
    if choice.how != "plan":  # full or unchecked: what the other blocks keep is nothing
        plans = {k: dataclasses.replace(p, saved=(), saved_bytes=0, recompute_s=p.forward_s) for k, p in plans.items()}
        kept = choice.kept
    if choice.how == "unchecked":  # the last unchecked block's activations fill the floor's transient
        absorbed += credit
    entry = plan_entry(profiles, plans, counts, parts, kept, absorbed, measured_s=choice.seconds)
    entry["recompute_s"] = runs * sum((blocks[k] - choice.unchecked.get(k, 0)) * p.recompute_s
                                      for k, p in plans.items())  # unchecked: none
    entry["planned_kept"] = kept  # the unchecked blocks' bytes as measured are all it prices
    return {**entry, "eager": choice.how, "unchecked": choice.unchecked,
            "eager_trials": {k: t.to_json() for k, t in trials.items()}}


def fastest_entry(entry: dict, below: list[tuple[float, dict]], counts: Mapping[str, int], target: int) -> dict:
    """Of ``entry`` and the entries cached for smaller plan targets (``PlanCache.below``: (target,
    entry)), the fastest among those whose predicted peak holds ``target``: by the blocks' measured
    time where the plans were measured (compiled, or eager against plain checkpointing: ``ac_eager``;
    faster by more than ``MEASURED_TIE``, since the times come from other runs), else by what they
    recompute priced by ``entry``'s profiles (on a tie the fewer bytes kept, then ``entry``). Plans
    that keep what ``entry``'s keep (and leave the same blocks unchecked), or name ops its profiles
    lack, are not candidates. Each target's plans come from a search of its own, and a measured search
    tries rooms that follow from what it measured: this is what makes more memory never give a slower
    plan than a smaller one's cached. An entry of another target says which (``planned_for``)."""
    profiles = {k: BlockProfile.from_json(p) for k, p in entry["profiles"].items()}
    shares = entry.get("fused_shares") or None
    plans_of = lambda e: {k: ACPlan.from_json(p) for k, p in e["plans"].items()}  # noqa: E731
    timed = "measured_s" in entry

    def rank(e: dict, plans: dict[str, ACPlan]) -> tuple | None:
        price = priced_ns(profiles, counts, plans, shares)
        if price is None or (timed and "measured_s" not in e):
            return None
        return (e["measured_s"] if timed else price), e["kept"]

    def keeps(e: dict, plans: dict[str, ACPlan]) -> tuple:  # each kind's saved set, its unchecked blocks
        return {k: p.saved for k, p in plans.items()}, e.get("unchecked", {})

    own = plans_of(entry)
    best, best_rank, own_keeps = entry, rank(entry, own), keeps(entry, own)
    for limit, other in below:
        if other["predicted_peak"] > target:
            continue
        plans = plans_of(other)
        if keeps(other, plans) == own_keeps:
            continue
        r = rank(other, plans)
        if r is None:
            continue
        faster = r[0] < best_rank[0] * (1 - MEASURED_TIE) if timed else r < best_rank
        if faster:
            best, best_rank = {**other, "planned_for": limit}, r
    return best


def log_plan(key: str, what: str, entry: dict, limit: int) -> None:
    """``what``: the planned shape, as a log line names it ("32-frame windows", "the critic's pass")."""
    if entry["predicted_peak"] > limit:
        log.warning("%s: %s: with every activation recomputed the step needs %.2f GiB, above the %.2f GiB the plan "
                    "aims for (the limit less ac_plan_margin_gib): nothing is kept (raise the limit, lower the margin, "
                    "or give the step more GPUs)", key, what, entry["floor"] / 2**30, limit / 2**30)
    log.info("%s: %s: %d of %d candidate outputs per block kept, %.2f GiB in all, %.0f%% of the forward recomputed; "
             "predicted peak %.2f GiB of %.2f", key, what, entry["saved"], entry["candidates"], entry["kept"] / 2**30,
             100 * entry["recompute_s"] / max(entry["forward_s"], 1e-12), entry["predicted_peak"] / 2**30,
             limit / 2**30)
    if "eager" in entry:  # distill_dmd: the way its blocks measured fastest (ac_eager)
        log.info("%s: %s: runs %s (measured fastest: %.3f s its blocks' forward and backward), %s", key, what,
                 {"full": "full checkpointing", "plan": "the op-level plan", "unchecked": "blocks unchecked"}
                 [entry["eager"]], entry["measured_s"],
                 f"{sum(entry['unchecked'].values())} blocks of a model unchecked" if entry["unchecked"] else
                 "every block checkpointed")
    if "planned_for" in entry:
        log.info("%s: %s: the plans made for a target of %.2f GiB (cached), %s than this target's own", key, what,
                 entry["planned_for"] / 2**30, "measured faster" if "measured_s" in entry else "priced faster")


def entry_metrics(entry: dict, suffix: str, matched: float | None) -> dict[str, float]:
    """MLflow's numbers of one planned shape: the bytes kept, the share of the forward recomputed, the
    predicted peak and its floor; ``matched``: the share of saved ids the policy met."""
    out = {f"ac_kept_gib_{suffix}": entry["kept"] / 2**30,
           f"ac_recompute_fraction_{suffix}": entry["recompute_s"] / max(entry["forward_s"], 1e-12),
           f"ac_predicted_peak_gib_{suffix}": entry["predicted_peak"] / 2**30,
           f"ac_floor_gib_{suffix}": entry["floor"] / 2**30}
    if entry["planned_kept"] != entry["kept"]:  # compiled: the eager profile's price beside the measured
        out[f"ac_planned_kept_gib_{suffix}"] = entry["planned_kept"] / 2**30
    if matched is not None:  # below 1: the policy never met some saved ids (renamed ops under compile)
        out[f"ac_saved_matched_{suffix}"] = matched
    if "planned_for" in entry:  # a smaller target's plans, faster than this target's search found
        out[f"ac_planned_for_gib_{suffix}"] = entry["planned_for"] / 2**30
    if entry.get("fused_shares"):  # compiled: the fusible ops' recomputation against their eager time
        out[f"ac_fused_share_{suffix}"] = max(entry["fused_shares"].values())
    if "eager" in entry:  # measured eager (distill_dmd): which way won, and the blocks of a model left unchecked
        out[f"ac_unchecked_blocks_{suffix}"] = sum(entry["unchecked"].values())
        out[f"ac_op_level_{suffix}"] = float(entry["eager"] == "plan")
    return out


class WindowPlanner:
    """The budget plans of one trainer: ``plan`` (collective), ``use`` per micro-batch, ``check_peak``
    after each step, ``summary`` for MLflow."""

    def __init__(self, budget: BudgetCheckpointing, cfg: TrainARConfig, model: WanDiT, optimizer, ema: dict,
                 grid: tuple[int, int], text_tokens: int, device: torch.device, dtype: torch.dtype,
                 cache_dir: Path):
        self.budget, self.cfg, self.model = budget, cfg, model
        self.grid, self.text_tokens, self.device, self.dtype = grid, text_tokens, device, dtype
        self.limit = memory_limit(cfg.ac_memory_limit_gib, device, KEY)
        self.margin, self.target = plan_target(self.limit, cfg.ac_plan_margin_gib, KEY)  # what the plans aim for
        self.memory = step_memory(model, optimizer, ema, dtype, device)
        self.cache = PlanCache(cache_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.report: dict[int, dict] = {}
        self.measured = 0
        self.peak = StepPeak(device)
        self._warned: set[int] = set()
        self._on_device = False
        cast_probes(budget, dtype)

    def _key(self, window: int) -> dict:
        cfg, p = self.cfg, self.cfg.precision
        return {**run_key(self.model, self.memory, self.target, self.device, self.dtype, "longlive_core.train.trainer"),
                "kinds": dict(sorted(self.budget.counts.items())),
                "window": window, "chunk": cfg.chunk_frames, "grid": list(self.grid), "text_tokens": self.text_tokens,
                "sp": cfg.sp, "world": self.world, "sharding": cfg.parallel.sharding,
                # the plans differ only by whether the blocks' gradients replace their inputs (``_profiled``)
                "one_micro_batch": cfg.grad_accum == 1,
                "recipe": [p.recipe, list(p.skip), p.keep_last_blocks], "attention": cfg.attention,
                "compile": cfg.compile}

    @contextlib.contextmanager
    def _probing(self, layout: TeacherForcingLayout):
        """The probes on the device and one sample's block arguments, drawn from a forked RNG."""
        if not self._on_device:
            for probe in self.budget.probes.values():
                probe.to(self.device)
            self._on_device = True
        with forked_rng(self.device):
            yield block_inputs(self.model, layout, self.grid, self.dtype, self.device)

    def measures(self) -> bool:
        """Whether plans are chosen by measured trials (CUDA: the allocator counts what a block keeps)."""
        return self.device.type == "cuda"

    def _plan_window(self, window: int) -> dict:
        layout = TeacherForcingLayout(window, self.cfg.chunk_frames, self.grid[0] * self.grid[1], self.text_tokens,
                                      self.cfg.sp)
        key = self._key(window)
        entry = agree(self.cache.get(key) if self.rank == 0 else None)
        if entry is None:
            entry = self._profiled(layout, key)
        # rank 0's choice on every rank, as its plans are
        return agree(fastest_entry(entry, self.cache.below(key), self.budget.counts, self.target)
                     if self.rank == 0 else None)

    def _profiled(self, layout: TeacherForcingLayout, key: dict) -> dict:
        """``layout``'s plans made now from a profile of its blocks (collective), cached under ``key``."""
        counts = self.budget.counts
        outside = OutsideBlocks(2 * layout.local_frames * layout.tokens_per_frame, self.model.cfg.dim,
                                self.dtype.itemsize)
        with self._probing(layout) as args:
            profiles = agree({k: profile_block(p, args).to_json() for k, p in sorted(self.budget.probes.items())})
            profiles = {k: BlockProfile.from_json(p) for k, p in profiles.items()}
            parts = {**dataclasses.asdict(self.memory),
                     "block_inputs": sum(counts.values()) * max(p.input_bytes for p in profiles.values()),
                     "outside": outside.held_bytes}
            absorbed = 0
            if self.cfg.grad_accum == 1:
                # one micro-batch: the blocks' gradients are made as the backward frees the blocks' inputs
                # and kept outputs, so the step holds the larger of the two, not both (with accumulation
                # the later micro-batches run over every gradient); what outgrows the inputs is absorbed
                # by kept outputs
                block_grads = local_bytes(p for p in self.model.blocks.parameters() if p.requires_grad)
                replaced = min(block_grads, parts["block_inputs"])
                parts["grads"] -= replaced
                absorbed = block_grads - replaced
            static = sum(parts.values()) - absorbed  # what the knapsack's room is counted from
            eager = None  # the entry of an eager step's measured choice
            if self.measures() and self.cfg.compile:
                # every rank runs each trial (a block's collectives) and takes rank 0's numbers: one decision
                def measure(kind: str, saved: tuple[str, ...]) -> tuple[int, int, float]:
                    return tuple(agree(tuple(block_trial(self.budget.probes[kind], args, saved))))

                chosen = measured_plans(profiles, counts, static, self.target, measure,
                                        least_transient=outside.head_bytes)
                plans, kept, transient = chosen.plans, chosen.kept_bytes, chosen.transient_bytes
                shares, trials, rooms = chosen.fused_shares, chosen.share_trials, chosen.room_trials
                seconds = chosen.seconds
            else:
                shares = trials = seconds = None
                rooms = ()
                transient = outside.transient(max(p.transient_bytes for p in profiles.values()))
                room = self.target - static - transient
                plans = plan_blocks(profiles, counts, room)
                kept = sum(counts[k] * plans[k].saved_bytes for k in plans)
                if self.measures():  # eager on CUDA: the fastest of full, the plan and unchecked blocks
                    eager = eager_entry(profiles, plans, counts, 1, {**parts, "transient": transient}, room,
                                        eager_trials(self.budget.probes, args, plans, self.device), absorbed,
                                        on_top=outside.head_bytes)
        parts["transient"] = transient
        # rank 0's plans on every rank (the ranks' own memory can differ by a shard's padding): one compiled
        # partition around the collectives, and a rerun's cached plans are the first run's
        entry = agree(eager or plan_entry(profiles, plans, counts, parts, kept, absorbed, shares, trials, rooms,
                                          seconds))
        if self.rank == 0:
            self.cache.put(key, entry)
        return entry

    def plan(self, windows: list[int]) -> None:
        """Plans every window of ``windows`` not planned yet (collective: every rank calls it alike)."""
        todo = [w for w in windows if w not in self.budget.plans]
        if not todo:
            return
        for window in todo:
            entry = self._plan_window(window)
            self.budget.plans[window] = {k: ACPlan.from_json(p) for k, p in entry["plans"].items()}
            self.budget.plain[window] = dict(entry.get("unchecked", {}))
            self.report[window] = entry
            log_plan(KEY, f"{window}-frame windows", entry, self.target)
        if self.world > 1:  # no later planning: the copies' memory goes back
            self.budget.probes.clear()
        elif self._on_device:
            for probe in self.budget.probes.values():
                probe.to("cpu")
            self._on_device = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def use(self, window: int) -> None:
        """Before a micro-batch of ``window`` frames: its plan (made now on one rank when missing)."""
        if window not in self.budget.plans and self.world == 1 and self.budget.probes:
            with self.peak.excluded():  # a planning between steps: its peak is no step's
                self.plan([window])
        if not self.budget.use(window) and window not in self._warned:
            self._warned.add(window)
            log.warning("%s: no plan for %d-frame windows (not in the latent index when training started): they "
                        "recompute every activation, as full does", KEY, window)

    def check_peak(self, step: int) -> None:
        """Collective on CUDA: the world's largest peak so far against the limit (an error above it)."""
        if self.device.type != "cuda":
            return
        self.measured = self.peak.world()
        predicted = max((e["predicted_peak"] for e in self.report.values()), default=None)
        check_peak(self.measured, self.limit, predicted, KEY, step, self.margin)

    def summary(self) -> dict[str, float]:
        """MLflow's numbers: the limit, and per window the bytes kept, the share of the forward
        recomputed and the predicted peak; the measured peak (CUDA)."""
        out = {"ac_limit_gib": self.limit / 2**30, "ac_plan_margin_gib": self.margin / 2**30}
        for window, e in sorted(self.report.items()):
            out.update(entry_metrics(e, f"{window}f", self.budget.matched_share(window)))
        if self.measured:
            out["ac_measured_peak_gib"] = self.measured / 2**30
        return out
