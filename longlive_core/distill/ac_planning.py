"""``activation_checkpointing: budget`` for distill_dmd: a plan for each pass that carries a gradient,
made when the trainer starts, under one limit on the step's peak (``ac_memory_limit_gib``; null: 0.9
of the GPU's memory).

- ``critic``: the fake score over the teacher-forcing layout of ``latent_frames`` (the video as the
  clean context, its noised copy), every block once, as train_ar's window.
- ``generator``: the exit step of each of the last ``grad_frames``' chunks, every block once per
  chunk, attending to the rollout's KV cache as full as the window lets it be (what an unchecked
  block keeps: measured at each chunk's own cache, as the chunks hold it all at once).

Each pass's floor is what a ``full`` step of it holds (``train.ac_planning.StepMemory``: the frozen
backbone, the adapters and both optimizers' moments, FSDP's buffers; the pass's own gradients where
they outgrow the block inputs its backward frees as it makes them (``pass_gradients``: the generator's
first exit chunk's only); the blocks' inputs; the activations outside the blocks; one block's forward
and backward at once). The generator's floor also holds every chunk the rollout wrote to its cache (the
checkpointed exit steps reference the cache as it was until the backward) and runs the scores' forwards
on top, without gradients: its transient is the larger of a generator block's forward and backward and
a score block's no-grad forward beside its input (measured on CUDA; elsewhere a critic block's forward
and backward). Distillation does not compile, so the eager profile prices exactly what the step keeps,
but not what selective checkpointing costs in Python: on CUDA each pass runs the fastest of ``full``,
the op-level plan and its last blocks unchecked, as a block measured them
(``train.ac_planning.eager_entry``). Profiles and trials run on every rank and rank 0's are every
rank's; plans are cached on rank 0's disk by what they depend on. Profiling and trials fork the RNG and
run on a copy of a block: they change no number of the run.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from longlive_core.distill.config import DistillDMDConfig
from longlive_core.distributed.ac_budget import (
    BudgetCheckpointing,
    PlanCache,
    check_peak,
    memory_limit,
    plan_target,
)
from longlive_core.distributed.ac_eager import EagerTrials
from longlive_core.distributed.ac_plan import ACPlan, BlockProfile, plan_blocks
from longlive_core.distributed.ac_profile import PLAIN, block_trial, forward_transient, profile_block
from longlive_core.infer.kv_cache import KVCache, largest_buffer
from longlive_core.models.rope import rope_cos_sin
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.ac_planning import (
    OutsideBlocks,
    StepPeak,
    block_inputs,
    cast_probes,
    eager_entry,
    eager_trials,
    embeddings_need_grad,
    entry_metrics,
    fastest_entry,
    forked_rng,
    local_bytes,
    log_plan,
    plan_entry,
    run_key,
    step_memory,
)
from longlive_core.train.checkpointing import agree
from longlive_core.train.layout import TeacherForcingLayout

KEY = "distill_dmd.ac_memory_limit_gib"
PASSES = ("critic", "generator")


def chunk_inputs(model: WanDiT, chunk_frames: int, past_frames: int, tokens_per_frame: int, text_tokens: int,
                 grid: tuple[int, int], dtype: torch.dtype, device: torch.device) -> tuple:
    """A block's arguments for one rollout chunk's exit step (as ``WanDiT.forward`` passes them under
    the inference cache): one timestep for the chunk, self-attention over ``past_frames`` cached
    frames and the chunk's own; random values from the (forked) global RNG; gradients where the step's
    have them."""
    cfg = model.cfg
    text_grad, time_grad = embeddings_need_grad(model)
    x = torch.randn(1, chunk_frames * tokens_per_frame, cfg.dim, device=device, dtype=dtype).requires_grad_()
    context = torch.randn(1, text_tokens, cfg.dim, device=device, dtype=dtype).requires_grad_(text_grad)
    t_mod = (torch.randn(1, 1, 6, cfg.dim, device=device) / cfg.dim**0.5).requires_grad_(time_grad)
    positions = torch.arange(past_frames, past_frames + chunk_frames, device=device)
    rope = rope_cos_sin(cfg.rope_dims, positions, *grid, cfg.rope_theta)
    cache = KVCache(1, tokens_per_frame)
    if past_frames:
        kv = torch.randn(1, cfg.num_heads, past_frames * tokens_per_frame, cfg.dim // cfg.num_heads, device=device,
                         dtype=dtype)
        with cache.write(past_frames):
            cache.for_layer(0)(kv, kv, kv, None)
    return x, context, t_mod, 1, rope, None, cache.for_layer(0)


def pass_gradients(own: int, in_blocks: int, block_inputs: int, chains: int) -> tuple[int, int]:
    """What a pass's floor holds of its own ``own`` bytes of gradients (``in_blocks`` of them made in its
    blocks' backward), and what of them its kept outputs absorb. One backward chain (the critic's, as
    train_ar's one micro-batch) makes its blocks' gradients as it frees their inputs and kept outputs:
    the pass holds the larger of the gradients and the inputs, what outgrows the inputs absorbed by the
    kept outputs. The generator's ``chains`` exit chunks are as many chains, run one after another:
    every block's gradient exists once the first ends, while the other chains' inputs and kept outputs
    are still held: 1/``chains`` of the inputs replaced, nothing absorbed."""
    replaced = min(in_blocks, block_inputs // chains)
    return own - replaced, in_blocks - replaced if chains == 1 else 0


class DistillPlanner:
    """The budget plans of one DMD trainer: ``plan`` (collective), ``use`` before each gradient pass,
    ``peak.enter`` at each pass's start, ``check_peak`` after each step, ``peak.excluded()`` around work
    between steps that no plan counts, ``summary`` for MLflow."""

    def __init__(self, budget: BudgetCheckpointing, cfg: DistillDMDConfig, model: WanDiT, roles: int,
                 optimizer: torch.optim.Optimizer, chunk_frames: int, grid: tuple[int, int], text_tokens: int,
                 device: torch.device, dtype: torch.dtype, cache_dir: Path,
                 trainable: dict[str, list[torch.nn.Parameter]]):
        """``trainable``: each pass's trained parameters (the generator's adapter and the critic's, or two
        whole models with full weights): both optimizers' moments count against the limit, and a pass's
        own gradients (the other's are let go after its step: ``zero_grad(set_to_none=True)``)."""
        self.budget, self.cfg, self.model, self.chunk = budget, cfg, model, chunk_frames
        self.grid, self.text_tokens, self.device, self.dtype = grid, text_tokens, device, dtype
        # every role's model was wrapped (three copies for full weights): the blocks of one run a pass
        self.counts = {k: n // roles for k, n in budget.counts.items()}
        self.limit = memory_limit(cfg.ac_memory_limit_gib, device, KEY)
        self.margin, self.target = plan_target(self.limit, cfg.ac_plan_margin_gib, KEY)  # what the plans aim for
        memory = step_memory(model, optimizer, {}, dtype, device)
        self.grads = {name: local_bytes(trainable[name]) for name in PASSES}
        grads = sum(self.grads.values())
        self.memory = dataclasses.replace(memory, grads=grads, optimizer=0 if optimizer.state else 2 * grads)
        in_blocks = {id(p) for p in model.blocks.parameters()}
        # a pass's gradients made in its blocks' backward (the shared model's: a whole second model's are not
        # known to be, and count in full)
        self.block_grads = {name: local_bytes(p for p in trainable[name] if id(p) in in_blocks) for name in PASSES}
        self.cache = PlanCache(cache_dir)
        self.rank = dist.get_rank()
        self.report: dict[str, dict] = {}
        self.measured = 0
        self.measured_passes: dict[str, int] = {}
        self.peak = StepPeak(device)  # the latent statistics between steps are excluded
        cast_probes(budget, dtype)

    @property
    def grad_chunks(self) -> int:
        """The chunks whose exit step carries the gradient (at most the rollout's, as the trainer clamps)."""
        return min(self.cfg.grad_frames, self.cfg.latent_frames) // self.chunk

    @property
    def pass_counts(self) -> dict[str, dict[str, int]]:
        """The blocks each pass runs, of each kind (the generator's once per grad chunk)."""
        return {"critic": dict(self.counts), "generator": {k: self.grad_chunks * n for k, n in self.counts.items()}}

    @property
    def past_frames(self) -> int:
        """The most frames a grad chunk's cache holds."""
        window = self.cfg.latent_frames if self.cfg.window is None else min(self.cfg.window, self.cfg.latent_frames)
        return window - self.chunk

    @property
    def chunk_pasts(self) -> list[int]:
        """The cached frames each grad chunk's exit step attends to: the rollout's last ``grad_chunks``
        chunks, each over the frames before it that the window keeps."""
        n = self.cfg.latent_frames // self.chunk
        return [min(c * self.chunk, self.past_frames) for c in range(n - self.grad_chunks, n)]

    def _unchecked_kept(self, trials: dict[str, EagerTrials]) -> dict[str, EagerTrials]:
        """``trials`` (measured over the fullest cache) with each kind's unchecked bytes the mean over the grad
        chunks' own caches: every exit step's activations are held at once until the backward, and an
        earlier chunk's attention keeps less (each past length measured once, unchecked; rank 0's)."""
        tokens_per_frame = self.grid[0] * self.grid[1]
        pasts = self.chunk_pasts
        out = {}
        for kind, probe in sorted(self.budget.probes.items()):
            kept = {self.past_frames: trials[kind].unchecked_kept}
            for past in sorted(set(pasts) - set(kept)):
                with forked_rng(self.device):
                    args = chunk_inputs(self.model, self.chunk, past, tokens_per_frame, self.text_tokens, self.grid,
                                        self.dtype, self.device)
                    kept[past] = agree(block_trial(probe, args, PLAIN, compiled=False, repeats=1).kept)
                del args
            mean = sum(kept[p] for p in pasts) // len(pasts)
            out[kind] = dataclasses.replace(trials[kind], unchecked_kept=mean)
        return out

    def _key(self) -> dict:
        cfg = self.cfg
        return {**run_key(self.model, self.memory, self.target, self.device, self.dtype,
                          "longlive_core.distill.trainer"),
                "stage": "distill_dmd", "kinds": dict(sorted(self.counts.items())),
                "latent_frames": cfg.latent_frames, "grad_frames": cfg.grad_frames, "window": cfg.window,
                "chunk": self.chunk, "grid": list(self.grid), "text_tokens": self.text_tokens,
                "world": dist.get_world_size(), "sharding": cfg.parallel.sharding,
                "recipe": cfg.recipe, "lora": dataclasses.asdict(cfg.lora)}

    def _profiles(self, args: tuple) -> dict[str, BlockProfile]:
        made = agree({k: profile_block(p, args).to_json() for k, p in sorted(self.budget.probes.items())})
        return {k: BlockProfile.from_json(p) for k, p in made.items()}

    def measures(self) -> bool:
        """Whether the passes' ways are chosen by measured trials (CUDA: the allocator counts what a block keeps)."""
        return self.device.type == "cuda"

    def _plan(self) -> dict[str, dict]:
        cfg, dim, item = self.cfg, self.model.cfg.dim, self.dtype.itemsize
        tokens_per_frame = self.grid[0] * self.grid[1]
        blocks = sum(self.counts.values())
        layout = TeacherForcingLayout(cfg.latent_frames, self.chunk, tokens_per_frame, self.text_tokens, 1)
        static = dataclasses.asdict(self.memory)
        g = self.grad_chunks
        critic_outside = OutsideBlocks(2 * cfg.latent_frames * tokens_per_frame, dim, item)
        generator_outside = OutsideBlocks(self.chunk * tokens_per_frame, dim, item, passes=g)
        counts = self.pass_counts
        runs = {"critic": 1, "generator": g}
        for probe in self.budget.probes.values():
            probe.to(self.device)
        try:
            with forked_rng(self.device):
                args = {"critic": block_inputs(self.model, layout, self.grid, self.dtype, self.device)}
                critic = self._profiles(args["critic"])
                forwards = [forward_transient(p, args["critic"]) for p in self.budget.probes.values()]
                score_forward = agree(None if None in forwards else max(forwards))  # None: unmeasured
            with forked_rng(self.device):
                args["generator"] = chunk_inputs(self.model, self.chunk, self.past_frames, tokens_per_frame,
                                                 self.text_tokens, self.grid, self.dtype, self.device)
                generator = self._profiles(args["generator"])
            # the scores' forwards over the layout run on top of every kept activation of the generator's pass,
            # without gradients: a block's forward beside its input, or the head's copies (off CUDA, unmeasured:
            # a critic block's forward and backward, more than they hold)
            scores = max(p.transient_bytes for p in critic.values()) if score_forward is None else \
                max(p.input_bytes for p in critic.values()) + max(score_forward, critic_outside.head_bytes)
            passes = {
                "critic": (critic, counts["critic"], {
                    **static, "block_inputs": blocks * max(p.input_bytes for p in critic.values()),
                    "outside": critic_outside.held_bytes,
                    "transient": critic_outside.transient(max(p.transient_bytes for p in critic.values()))}),
                "generator": (generator, counts["generator"], {
                    **static, "block_inputs": g * blocks * max(p.input_bytes for p in generator.values()),
                    # the scores' forwards run on top of the generator's pass, every exit step's head copies
                    # held: those copies all count, and the larger transient of the two passes
                    "outside": generator_outside.held_bytes + generator_outside.head_bytes,
                    # the rollout's BF16 cache at its largest: every write but the last chunk's, in buffers
                    # with room for a chunk's reads (infer/kv_cache.py)
                    "kv_cache": blocks * 2 * dim * item * largest_buffer(
                        cfg.latent_frames // self.chunk - 1, self.chunk * tokens_per_frame,
                        None if cfg.window is None else cfg.window * tokens_per_frame),
                    "transient": max(scores, *(p.transient_bytes for p in generator.values()))})}
            # what runs while every kept activation of a pass is held: the critic's head's backward; over the
            # generator's, the scores' forwards
            on_top = {"critic": critic_outside.head_bytes, "generator": max(generator_outside.head_bytes, scores)}
            out = {}
            for name, (profiles, pass_counts, parts) in passes.items():
                parts["grads"], absorbed = pass_gradients(self.grads[name], self.block_grads[name],
                                                          parts["block_inputs"], runs[name])
                room = self.target - sum(parts.values()) + absorbed
                plans = plan_blocks(profiles, pass_counts, room)
                if self.measures():  # the fastest of full, the plan and unchecked blocks; its inputs freed after
                    trials = eager_trials(self.budget.probes, args.pop(name), plans, self.device)
                    if name == "generator":
                        trials = self._unchecked_kept(trials)
                    out[name] = eager_entry(profiles, plans, self.counts, runs[name], parts, room, trials, absorbed,
                                            on_top=on_top[name])
                else:  # no trials: the op-level plans as the profile prices them
                    out[name] = plan_entry(profiles, plans, pass_counts, parts,
                                           sum(pass_counts[k] * plans[k].saved_bytes for k in plans), absorbed)
        finally:
            for probe in self.budget.probes.values():
                probe.to("cpu")
        return out

    def plan(self) -> None:
        """Collective (every rank calls it alike): both passes' plans, from the cache or profiled now."""
        key = self._key()
        report = agree(self.cache.get(key) if self.rank == 0 else None)
        if report is None:  # rank 0's plans on every rank: one compiled partition around the collectives
            report = agree(self._plan())
            if self.rank == 0:
                self.cache.put(key, report)
        if self.rank == 0:  # each pass's fastest of its plans at this and every smaller cached limit
            below = self.cache.below(key)
            report = {name: fastest_entry(report[name], [(limit, r[name]) for limit, r in below],
                                          self.pass_counts[name], self.target) for name in PASSES}
        self.report = report = agree(report if self.rank == 0 else None)
        for name in PASSES:
            self.budget.plans[name] = {k: ACPlan.from_json(p) for k, p in report[name]["plans"].items()}
            self.budget.plain[name] = dict(report[name].get("unchecked", {}))
            log_plan(KEY, f"the {name}'s pass", report[name], self.target)
        self.budget.probes.clear()  # the shapes are fixed: no later planning
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def use(self, name: str) -> None:
        """Before a forward that carries ``name``'s gradient: its blocks keep what its plan says."""
        self.budget.use(name)

    def check_peak(self, step: int) -> None:
        """Collective on CUDA: the world's largest peak so far against the limit (an error above it, with
        the prediction of the pass that peaked highest)."""
        if self.device.type != "cuda":
            return
        self.peak.enter(None)
        self.measured, self.measured_passes = self.peak.world_sections(PASSES)
        highest = max(PASSES, key=lambda name: self.measured_passes[name])
        check_peak(self.measured, self.limit, self.report[highest]["predicted_peak"], KEY, step, self.margin)

    def summary(self) -> dict[str, float]:
        out = {"ac_limit_gib": self.limit / 2**30, "ac_plan_margin_gib": self.margin / 2**30}
        for name in PASSES:
            out.update(entry_metrics(self.report[name], name, self.budget.matched_share(name)))
        if self.measured:
            out["ac_measured_peak_gib"] = self.measured / 2**30
            for name, peak in self.measured_passes.items():
                if peak:  # a pass run (the generator's may not have been, generator_every > 1)
                    out[f"ac_measured_peak_gib_{name}"] = peak / 2**30
        return out
