"""``activation_checkpointing: budget`` on the CPU (no compile): the planner saves what buys the most
recomputation per byte and more memory never gives a slower plan; the policy changes no number; the
bytes kept for the backward are the plan's, at train_ar's window and at distillation's rollout chunk;
plans are cached, reused and made for a new window length; a bad setting, train_ar's or
distill_dmd's, is one line naming its key. (Distillation's budget runs: tests/test_distill_trainer.py.)"""
from __future__ import annotations

import gc
import inspect
import itertools
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from longlive_core.config import ConfigError, from_mapping, load_params
from longlive_core.distill.ac_planning import DistillPlanner, chunk_inputs, pass_gradients
from longlive_core.distill.config import DistillDMDConfig
from longlive_core.distill.trainer import DMDTrainer
from longlive_core.distributed import ac_budget, ac_plan
from longlive_core.distributed.ac_budget import BudgetCheckpointing, PlanCache, block_kind, check_peak, require_limit
from longlive_core.distributed.ac_eager import EagerTrials
from longlive_core.distributed.ac_plan import ACPlan, BlockProfile, OpCost, measured_plans, plan_block, plan_blocks
from longlive_core.distributed.ac_profile import PLAIN, block_trial, forward_transient, profile_block
from longlive_core.distributed.parallelize import apply_activation_checkpointing, clean_name
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train import ac_planning
from longlive_core.train.ac_planning import OutsideBlocks, StepPeak, block_inputs
from longlive_core.train.config import TrainARConfig
from longlive_core.train.layout import TeacherForcingLayout
from longlive_core.train.trainer import Trainer, TrainInputs

from .helpers.latent_cache import make_cache

REPO = Path(__file__).resolve().parents[1]
WINDOW = 4  # latent frames: a 2-chunk teacher-forcing sample of 4 tokens per frame
LAYOUT = TeacherForcingLayout(WINDOW, 2, 4, 6)


class Toy(nn.Module):
    """Four candidate outputs: a wide linear and its GELU (4096 bytes each), a narrow linear and its
    GELU (1024 bytes each)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.c(nn.functional.gelu(self.b(nn.functional.gelu(self.a(x)))))


def test_the_planner_saves_what_buys_the_most_recomputation_per_byte():
    torch.manual_seed(0)
    costs = {"aten.addmm.default#0": 1.0, "aten.gelu.default#0": 0.1,  # 244 and 24 us per byte
             "aten.addmm.default#1": 0.5, "aten.gelu.default#1": 0.4}  # 488 and 391 us per byte
    profile = profile_block(Toy(), (torch.randn(16, 8, requires_grad=True),), costs=costs)
    by_id = {op.id: op for op in profile.ops if op.candidate}
    assert {k: by_id[k].bytes for k in costs} == {"aten.addmm.default#0": 4096, "aten.gelu.default#0": 4096,
                                                  "aten.addmm.default#1": 1024, "aten.gelu.default#1": 1024}
    assert set(by_id) == set(costs)  # the output is not read by the backward, the views hold nothing new
    saved = {limit: set(plan_block(profile, limit).saved) for limit in (1023, 2048, 4096, 6144, 10240)}
    assert saved[1023] == set()
    assert saved[2048] == {"aten.addmm.default#1", "aten.gelu.default#1"}  # the most time per byte
    assert saved[4096] == {"aten.addmm.default#0"}  # 1.0 s beats 0.9 s for the same bytes
    assert saved[6144] == {"aten.addmm.default#0", "aten.addmm.default#1", "aten.gelu.default#1"}
    assert saved[10240] == set(costs)
    plan = plan_block(profile, 2048)
    assert plan.saved_bytes == 2048 and plan.recompute_s == pytest.approx(profile.forward_s - 0.9)
    assert ACPlan.from_json(plan.to_json()) == plan and BlockProfile.from_json(profile.to_json()) == profile


def tiny_block_profile(costs=None, shape: str = "window") -> tuple[BudgetCheckpointing, str, BlockProfile, tuple,
                                                                   tuple]:
    """A tiny block, its checkpoint context and profile, at train_ar's teacher-forcing window or at
    distillation's rollout chunk (its exit step, self-attention over a 2-frame KV cache)."""
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    budget = BudgetCheckpointing()
    block = model.blocks[0]
    context_fn = budget.contexts_for(block)
    kind = block_kind(block)
    torch.manual_seed(1)
    cpu = torch.device("cpu")
    args = (block_inputs(model, LAYOUT, (2, 2), torch.float32, cpu) if shape == "window" else
            chunk_inputs(model, 2, 2, 4, 6, (2, 2), torch.float32, cpu))
    return budget, kind, profile_block(budget.probes[kind], args, costs=costs), (block, context_fn), args


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_more_memory_never_gives_a_slower_plan(compiled):
    profiles = [tiny_block_profile()[2]]
    rng = random.Random(0)  # and a profile with many items of every size and speed, each made from earlier ones
    profiles.append(BlockProfile(tuple(OpCost(f"aten.{rng.choice(['mm.default', 'mul.Tensor'])}#{i}",
                                              rng.randint(1, 5000), rng.uniform(0, 1e-3), rng.random() < 0.7,
                                              True, tuple(sorted(rng.sample(range(i), min(i, rng.randint(0, 3))))))
                                       for i in range(60)), 0.1, 1, 1, "cpu"))
    shares = {"k": 0.3}  # compiled: the fusible ops (the random profile's mul) at 0.3 of their eager time
    for profile in profiles:
        savable = [i for i, op in enumerate(profile.ops) if op.savable and op.bytes > 0]
        total = sum(profile.ops[i].bytes for i in savable) if compiled else sum(op.bytes for op in profile.ops
                                                                                 if op.candidate)
        last = None
        steps = 25 if compiled else 300  # a compiled plan builds its greedy order and swaps in each room every time
        for limit in [*range(0, total, max(1, total // steps)), total]:
            plan = plan_blocks({"k": profile}, {"k": 1}, limit, compiled, shares)["k"]
            assert plan.saved_bytes <= limit
            assert last is None or plan.recompute_s <= last.recompute_s, (limit, plan, last)
            last = plan
        if compiled:  # with room for all, it recomputes only what cannot be kept
            assert last.recompute_s == pytest.approx(profile.recomputed_s(set(savable), 0.3), abs=1e-9)
        else:
            assert last.saved_bytes == total  # with room for all, it keeps every candidate


def test_a_compiled_plan_swaps_small_outputs_out_for_a_large_one_that_spares_more():
    """Filled along the greedy order, four small outputs (1.1 ms a byte) take the room before a large one
    (1.0 ms a byte) comes up, which then no longer fits; swapping three of them out for it spares more (on
    the H200 profile of the 5B block: the FFN's up-projection, passed over at a 65 GiB limit)."""
    ops = tuple(OpCost(f"aten.mm.default#{i}", 3, 3.3e-3, True) for i in range(4)) + (
        OpCost("aten.addmm.default#0", 10, 10e-3, True),)
    profile = BlockProfile(ops, 23.2e-3, 1, 1, "cpu")
    plan = plan_blocks({"k": profile}, {"k": 1}, 13, compiled=True)["k"]
    assert "aten.addmm.default#0" in plan.saved and plan.saved_bytes == 13
    assert plan.recompute_s == pytest.approx(23.2e-3 - 13.3e-3)  # against 23.2 - 13.2 with the four small ones


def test_a_compiled_plan_prices_what_the_partitioner_recomputes():
    """Compiled, what the backward reads is recomputed with the unsaved ops it is made from, and an op
    nothing reads is never recomputed: keeping a cheap output made from an expensive unread one spares
    both, which the eager price (each op its own time) cannot see."""
    ops = (OpCost("mm#0", 8, 10e-3, False),  # expensive, its output read by no backward
           OpCost("gelu#0", 4, 1e-3, True, True, (0,)),  # cheap, made from mm#0
           OpCost("mm#1", 4, 5e-3, True))
    profile = BlockProfile(ops, 16e-3, 1, 1, "cpu")
    assert profile.recomputed_s(set()) == pytest.approx(16e-3) and profile.recomputed_s({1}) == pytest.approx(5e-3)
    assert profile.recomputed_s({0}) == pytest.approx(6e-3) and profile.recomputed_s({1, 2}) == 0
    assert plan_block(profile, 4).saved == ("mm#1",)  # eager: 5 ms of its own beats 1 ms
    compiled = plan_blocks({"k": profile}, {"k": 1}, 4, compiled=True)["k"]
    assert compiled.saved == ("gelu#0",) and compiled.recompute_s == pytest.approx(5e-3)
    assert plan_blocks({"k": profile}, {"k": 1}, 8, compiled=True)["k"].saved == ("gelu#0", "mm#1")
    # an output too large for the room left is passed over: the next that fits is kept
    wide = BlockProfile((OpCost("mm#0", 8, 10e-3, True), OpCost("mm#1", 4, 1e-3, True)), 11e-3, 1, 1, "cpu")
    assert plan_blocks({"k": wide}, {"k": 1}, 6, compiled=True)["k"].saved == ("mm#1",)


def test_fusible_ops_are_priced_at_the_share_their_compiled_recomputation_was_measured_to_cost():
    """Compiled, elementwise aten ops run fused into a few memory-bound kernels: their share of eager
    time comes from a compiled block timed with nothing and with everything kept, and at a small share
    the plan keeps a matrix product's output where eager times would keep an elementwise chain's."""
    assert [OpCost(i, 1, 0.0, True).fusible for i in ("aten.gelu.default#0", "aten._to_copy.default#3",
                                                      "aten.addmm.default#0", "longlive.scaled_product.default#0",
                                                      "aten._scaled_dot_product_cudnn_attention.default#1",
                                                      "mm#0")] == [True, True, False, False, False, False]
    ops = (OpCost("aten.addmm.default#0", 4, 2e-3, True),  # a matrix product: 2 ms for 4 bytes
           OpCost("aten.mul.Tensor#0", 4, 1.5e-3, False),  # an elementwise chain: 3 ms eager in all
           OpCost("aten.add.Tensor#0", 4, 1.5e-3, True, True, (1,)))
    profile = BlockProfile(ops, 5e-3, 1, 1, "cpu")
    assert profile.recomputed_split(set()) == pytest.approx((2e-3, 3e-3))
    # recomputing everything cost 2.6 ms compiled: the product's 2 ms and 0.2 of the chain's 3
    assert profile.fused_share(full_s=10.6e-3, none_s=8e-3) == pytest.approx(0.2)
    assert profile.fused_share(full_s=9e-3, none_s=8e-3) == 0.0 and profile.fused_share(20e-3, 8e-3) == 1.0
    assert plan_blocks({"k": profile}, {"k": 1}, 4, compiled=True)["k"].saved == ("aten.add.Tensor#0",)
    cheap = plan_blocks({"k": profile}, {"k": 1}, 4, compiled=True, fused_shares={"k": 0.2})["k"]
    assert cheap.saved == ("aten.addmm.default#0",) and cheap.recompute_s == pytest.approx(0.6e-3)

    def measure(kind, saved):  # kept bytes, transient, and the compiled forward and backward's seconds
        return 4 * len(saved), 0, 8e-3 + (0 if saved else 2.6e-3)

    chosen = measured_plans({"k": profile}, {"k": 1}, 0, 4, measure)
    assert chosen.fused_shares == {"k": pytest.approx(0.2)} and chosen.plans["k"].saved == ("aten.addmm.default#0",)
    assert chosen.share_trials == {"k": (pytest.approx(10.6e-3), 8e-3)}  # kept beside the share: its noise is theirs


def test_a_profile_names_the_ops_each_op_is_made_from():
    """A view reads its base's maker; parameters and the block's inputs are made by no op."""
    costs = {"aten.addmm.default#0": 1.0, "aten.gelu.default#0": 0.1, "aten.addmm.default#1": 0.5,
             "aten.gelu.default#1": 0.4, "aten.addmm.default#2": 2.0}
    profile = profile_block(Toy(), (torch.randn(16, 8, requires_grad=True),), costs=costs)
    index = {op.id: i for i, op in enumerate(profile.ops)}
    made_from = {op.id: {profile.ops[j].id for j in op.inputs} for op in profile.ops if op.id in costs}
    assert made_from == {"aten.addmm.default#0": set(), "aten.gelu.default#0": {"aten.addmm.default#0"},
                         "aten.addmm.default#1": {"aten.gelu.default#0"},
                         "aten.gelu.default#1": {"aten.addmm.default#1"},
                         "aten.addmm.default#2": {"aten.gelu.default#1"}}
    # the last linear's output is read by no backward: compiled, it is never recomputed
    assert profile.recomputed_s(set()) == pytest.approx(2.0) and not profile.ops[index["aten.addmm.default#2"]].read


def test_two_block_kinds_share_one_limit():
    one = BlockProfile((OpCost("mm#0", 100, 1.0, True),), 2.0, 1, 1, "cpu")
    other = BlockProfile((OpCost("mm#0", 100, 0.3, True),), 2.0, 1, 1, "cpu")
    # three blocks of the first kind need 300 bytes for 3 s, one of the other 100 for 0.3 s
    plans = plan_blocks({"a": one, "b": other}, {"a": 3, "b": 1}, 300)
    assert plans["a"].saved == ("mm#0",) and plans["b"].saved == ()
    assert plan_blocks({"a": one, "b": other}, {"a": 3, "b": 1}, 399)["b"].saved == ()


def loss_and_grads(mode: str, limit_share: float = 0.5, unchecked: int = 0, runs: list | None = None
                   ) -> tuple[torch.Tensor, dict, ACPlan | None]:
    """One step of the tiny model under ``mode``; budget: a plan of ``limit_share`` of the candidates'
    bytes, the last ``unchecked`` blocks run unchecked; ``runs`` collects the index of each block
    forward run (a recomputation runs it again)."""
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    if runs is not None:
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: runs.append(i))
    budget = BudgetCheckpointing()
    apply_activation_checkpointing(model, mode, budget)
    plan = None
    if mode == "budget":
        args = block_inputs(model, LAYOUT, (2, 2), torch.float32, torch.device("cpu"))
        profiles = {kind: profile_block(probe, args) for kind, probe in budget.probes.items()}
        (kind,) = profiles
        total = sum(op.bytes for op in profiles[kind].ops if op.candidate)
        budget.plans[WINDOW] = plans = plan_blocks(profiles, budget.counts, int(limit_share * total * 2))
        budget.plain[WINDOW] = {kind: unchecked}
        assert budget.use(WINDOW)
        plan = plans[kind]
        if runs is not None:
            runs.clear()  # the profile's forwards ran the probe, a copy: nothing is counted, but to be sure
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 48, WINDOW * 2, 4, 4, generator=g)
    text = torch.randn(1, 6, 32, generator=g)
    out = model(x, LAYOUT.timesteps(torch.tensor([[800.0, 100.0]])), text,
                frame_positions=LAYOUT.frame_positions(torch.arange(WINDOW)), mask_mod=LAYOUT.self_mask())
    loss = out.square().mean()
    loss.backward()
    return loss.detach(), {clean_name(n): p.grad for n, p in model.named_parameters()}, plan


@pytest.mark.parametrize("share, unchecked", [(0.5, 0), (0.5, 1), (0.0, 1), (0.0, 0)])
def test_the_budget_policy_changes_no_number(share, unchecked, monkeypatch):
    """Eager blocks as the plan says: the last ``unchecked`` run once, the others are recomputed, under
    selective checkpointing where their plan keeps something and plainly where it keeps nothing."""
    loss, grads, _ = loss_and_grads("none")
    if share == 0.0:  # nothing kept: no dispatch mode (its Python costs every op, ac_eager)
        monkeypatch.setattr(ac_budget, "create_selective_checkpoint_contexts", None)
    runs = []
    loss_ac, grads_ac, plan = loss_and_grads("budget", share, unchecked, runs)
    if share:
        assert plan.saved and 0 < plan.recompute_fraction < 1  # some outputs kept, some recomputed
    else:
        assert not plan.saved
    # the backward recomputes the checkpointed blocks: with one unchecked, the first (the last is unchecked)
    assert runs == ([0, 1, 0] if unchecked else [0, 1, 1, 0])
    assert torch.equal(loss, loss_ac) and grads.keys() == grads_ac.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


class _Made(TorchDispatchMode):
    """The storages every op of a forward makes, by weak reference (nothing kept alive)."""

    def __init__(self, known):
        super().__init__()
        self.known, self.made = known, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.known:
                    self.made.setdefault(ref, t.untyped_storage().nbytes())
        return out


def _storages(tensors) -> set:
    return {StorageWeakRef(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("shape", ["window", "chunk"])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_the_bytes_kept_for_the_backward_are_the_plans(share, shape):
    """Counted two ways, each by storage: the storages the forward made that are still alive when it
    returns (its output aside), and, where torch routes selective checkpointing's cache through the
    caller's ``saved_tensors_hooks``, what those hooks see packed."""
    budget, kind, profile, (block, context_fn), args = tiny_block_profile(shape=shape)
    total = sum(op.bytes for op in profile.ops if op.candidate)
    plan = plan_block(profile, int(share * total))
    budget.plans[WINDOW] = {kind: plan}
    budget.use(WINDOW)
    known = _storages(tree_leaves(args)) | _storages(block.parameters())
    with _Made(known) as made:
        out = checkpoint(block, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=False)
    gc.collect()
    held = sum(n for ref, n in made.made.items() if not ref.expired() and ref not in _storages([out]))
    assert held == plan.saved_bytes
    assert (held == 0) == (share == 0.0) and (held == total) == (share == 1.0)
    out.sum().backward()
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        packed: dict = {}

        def pack(t):
            packed.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            checkpoint(block, *args, use_reentrant=False, context_fn=context_fn, preserve_rng_state=False,
                       respect_saved_tensors_hooks=True)
        assert sum(n for ref, n in packed.items() if ref not in known) == plan.saved_bytes


def test_with_frozen_embeddings_a_profile_reads_what_the_models_own_block_saves():
    """distill_dmd's LoRA freezes the caption and timestep embeddings: a profile's block inputs then
    need no gradient, as the step's do, and the bytes its backward reads cover what a block of the
    model's own forward saves for its backward (counted by storage; an op counts whole, as selective
    checkpointing keeps it: a layer norm whose backward reads its mean and rstd only counts its output
    too); with the embeddings training (train_ar), the backward reads more: the modulated norms'
    outputs, which only the modulation's gradients need."""
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("blocks.") and p.dim() == 2)  # the blocks' linears train, as adapters do
    torch.manual_seed(1)
    args = block_inputs(model, LAYOUT, (2, 2), torch.float32, torch.device("cpu"))
    assert args[0].requires_grad and not args[1].requires_grad and not args[2].requires_grad
    reads = sum(op.bytes for op in profile_block(model.blocks[1], args).ops if op.candidate)

    saved: dict = {}
    inside: list[set] = []  # while block 1 runs: the storages it was handed (its inputs and parameters)
    block = model.blocks[1]
    pre = block.register_forward_pre_hook(lambda m, a: inside.append(_storages(tree_leaves(a)) |
                                                                       _storages(m.parameters())))
    post = block.register_forward_hook(lambda m, a, out: inside.clear())

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if inside and ref not in inside[0]:
            saved.setdefault(ref, t.untyped_storage().nbytes())
        return t

    g = torch.Generator().manual_seed(2)
    x, text = torch.randn(1, 48, 8, 4, 4, generator=g), torch.randn(1, 6, 32, generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, LAYOUT.timesteps(torch.tensor([[800.0, 100.0]])), text,
              frame_positions=LAYOUT.frame_positions(torch.arange(WINDOW)), mask_mod=LAYOUT.self_mask())
    pre.remove(), post.remove()
    assert 0 < sum(saved.values()) <= reads
    model.requires_grad_(True)
    training = block_inputs(model, LAYOUT, (2, 2), torch.float32, torch.device("cpu"))
    assert training[1].requires_grad and training[2].requires_grad
    assert sum(op.bytes for op in profile_block(model.blocks[1], training).ops if op.candidate) > reads


def non_monotone_search() -> tuple[BlockProfile, object]:
    """A toy whose measured search is not monotone: keeping a slow op shrinks the backward's transient,
    and the rooms the rounds try at 1,350 bytes settle on a plan that recomputes more than 1,300's."""
    rng = random.Random(12)
    ops = tuple(OpCost(f"aten.mm.default#{i}", rng.randint(50, 500), rng.uniform(1e-4, 1e-3), True) for i in range(8))
    by_id = {op.id: op for op in ops}
    slow = {op.id for op in ops if op.seconds > 6e-4}

    def measure(kind, saved):  # the time measured is the forward and what it recomputes, as priced
        return sum(by_id[i].bytes for i in saved), 800 - 60 * len(slow & set(saved)), \
            0.01 + sum(op.seconds for op in ops if op.id not in saved)

    return BlockProfile(ops, 0.01, 1, 1, "cpu"), measure


def test_more_memory_never_gives_a_slower_plan_than_a_smaller_limits_cached_one(tmp_path):
    profile, measure = non_monotone_search()

    def entry(limit: int, timed: bool = False) -> dict:
        m = measured_plans({"a": profile}, {"a": 1}, 0, limit, measure)
        return ac_planning.plan_entry({"a": profile}, m.plans, {"a": 1}, {"transient": m.transient_bytes},
                                      m.kept_bytes, 0, m.fused_shares, m.share_trials, m.room_trials,
                                      m.seconds if timed else None)

    small, large = entry(1300), entry(1350)
    assert large["recompute_s"] > small["recompute_s"]  # each search on its own
    cache, key = PlanCache(tmp_path), {"shape": [1, 2], "limit": 1350}
    for limit, e in [(1300, small), (1350, large), (1400, entry(1400))]:
        cache.put({**key, "limit": limit}, e)
    faster = {**small, "plans": {"a": ACPlan(tuple(op.id for op in profile.ops), 1, 0, 0.01, 1).to_json()}}
    cache.put({"shape": [1, 3], "limit": 1000}, faster)  # another shape's: never a candidate
    cache.put({**key, "limit": 1200}, {**faster, "predicted_peak": 1351})  # its peak is above 1,350
    (tmp_path / "half.json").write_text('{"format": 1')
    assert sorted(limit for limit, _ in cache.below(key)) == [1200, 1300]  # this shape's, below 1,350, whole
    chosen = ac_planning.fastest_entry(large, cache.below(key), {"a": 1}, 1350)
    assert ACPlan.from_json(chosen["plans"]["a"]) == ACPlan.from_json(small["plans"]["a"])
    assert chosen["planned_for"] == 1300
    assert ac_planning.fastest_entry(small, cache.below({**key, "limit": 1300}), {"a": 1}, 1300) is small
    assert ac_planning.entry_metrics(chosen, "4f", None)["ac_planned_for_gib_4f"] == 1300 / 2**30
    # where the plans were measured (compiled), by their measured time, faster beyond the tie between runs;
    # an entry without one is no candidate, nor one that keeps what this limit's plans keep
    timed = ac_planning.fastest_entry({**large, "measured_s": 2.0}, [(1200, {**small, "measured_s": 1.5}),
                                                                    (1300, {**small, "measured_s": 1.8}),
                                                                    (1250, small)], {"a": 1}, 1350)
    assert (timed["measured_s"], timed["planned_for"]) == (1.5, 1200)
    assert "planned_for" not in ac_planning.fastest_entry({**large, "measured_s": 2.0},
                                                          [(1300, {**small, "measured_s": 1.995}),
                                                           (1200, {**large, "measured_s": 1.0})], {"a": 1}, 1350)
    # over a sweep of limits cached in any order, what each limit runs is never slower than a smaller one's:
    # priced (eager), and measured (compiled; within the tie between runs)
    limits = list(range(900, 3000, 50))
    for timed in (False, True):
        sweep = PlanCache(tmp_path / f"sweep-{timed}")
        for limit in random.Random(0).sample(limits, len(limits)):
            sweep.put({**key, "limit": limit}, entry(limit, timed))
        alone = [sweep.get({**key, "limit": limit}) for limit in limits]
        runs = [ac_planning.fastest_entry(e, sweep.below({**key, "limit": limit}), {"a": 1}, limit)
                for e, limit in zip(alone, limits, strict=True)]
        assert all(r["predicted_peak"] <= limit for r, limit in zip(runs, limits, strict=True))
        time = "measured_s" if timed else "recompute_s"
        assert any(b[time] > a[time] * (1 + ac_plan.MEASURED_TIE) for a, b in itertools.pairwise(alone))
        assert all(b[time] <= a[time] / (1 - ac_plan.MEASURED_TIE) if timed else b[time] <= a[time]
                   for a, b in itertools.pairwise(runs))


TWO_LENGTHS = {"x": ("train", [4]), "y": ("train", [8]), "z": ("train", [6]), "v": ("val", [4])}
BASE = {"model": "tiny", "steps": 2, "grad_accum": 2, "chunk_frames": 2, "max_latent_frames": 8,
        "optimizer": {"lr": 1e-3}, "ema": {"decay": 0.9, "start_step": 1}, "val_every": 0, "checkpoint_every": 2,
        "device": "cpu", "activation_checkpointing": "budget", "ac_memory_limit_gib": 1.0}


@pytest.fixture(scope="module")
def two_lengths(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("latents"), TWO_LENGTHS, weights={"x": 1.0, "y": 1.0, "z": 0.0, "v": 1})


def budget_trainer(latents, tmp, plans, **overrides) -> Trainer:
    cfg = from_mapping(TrainARConfig, {**BASE, **overrides}, "train_ar")
    return Trainer(cfg, TrainInputs(latents, latents / "samples.parquet", tmp / "ckpt", {"run": "d", "code": "c"},
                                    ac_plans=plans))


def test_plans_are_cached_reused_and_made_for_a_new_window_length(tmp_path, two_lengths, gloo_world, monkeypatch):
    profiled: list[int] = []
    real = ac_planning.profile_block

    def counting(block, args, *rest, **kw):
        profiled.append(args[0].shape[1] // 8)  # 2 x 4 tokens per latent frame
        return real(block, args, *rest, **kw)

    monkeypatch.setattr(ac_planning, "profile_block", counting)
    plans = tmp_path / "plans"
    first = budget_trainer(two_lengths, tmp_path / "a", plans)
    assert sorted(first.budget.plans) == [4, 8] and profiled == [4, 8]  # z (6 frames) is never drawn
    assert len(list(plans.glob("*.json"))) == 2
    again = budget_trainer(two_lengths, tmp_path / "b", plans)
    assert profiled == [4, 8] and again.budget.plans == first.budget.plans  # from the cache
    budget_trainer(two_lengths, tmp_path / "e", plans, grad_accum=3)
    assert profiled == [4, 8]  # two micro-batches or three: the same plans
    budget_trainer(two_lengths, tmp_path / "c", plans, ac_memory_limit_gib=2.0)
    assert profiled == [4, 8, 4, 8]  # the limit is part of the key
    # a margin moves what the plans aim for, and the key with it: 2 GiB less 1 are the first run's plans for
    # 1 GiB, from the cache; the check still holds the 2 GiB
    margin = budget_trainer(two_lengths, tmp_path / "m", plans, ac_memory_limit_gib=2.0, ac_plan_margin_gib=1.0)
    assert profiled == [4, 8, 4, 8] and margin.budget.plans == first.budget.plans
    assert (margin.planner.target, margin.planner.limit) == (2**30, 2 * 2**30)
    shorter = budget_trainer(two_lengths, tmp_path / "d", plans, max_latent_frames=6)
    assert profiled[4:] == [6] and sorted(shorter.budget.plans) == [4, 6]
    shorter.planner.use(2)  # a window first seen mid-run (one rank): planned when it comes
    assert profiled[5:] == [2] and shorter.budget._saved == {k: frozenset(p.saved)
                                                              for k, p in shorter.budget.plans[2].items()}
    # the trainer's code is part of the key (a kernel that keeps or takes more would outgrow a cached plan)
    digests = []
    monkeypatch.setattr(ac_planning, "code_digest", lambda module: digests.append(module) or "edited")
    budget_trainer(two_lengths, tmp_path / "f", plans)
    assert profiled[6:] == [4, 8] and set(digests) == {"longlive_core.train.trainer"}


def test_a_limit_whose_own_plans_recompute_more_runs_a_smaller_limits_cached_ones(tmp_path, two_lengths, gloo_world,
                                                                                    monkeypatch):
    plans = tmp_path / "plans"
    first = budget_trainer(two_lengths, tmp_path / "a", plans)  # 1 GiB: some outputs kept
    real = ac_planning.plan_blocks
    # a search at 2 GiB that keeps nothing: slower than what 1 GiB's kept
    monkeypatch.setattr(ac_planning, "plan_blocks", lambda profiles, counts, limit, *rest, **kw:
                        real(profiles, counts, 0, *rest, **kw))
    larger = budget_trainer(two_lengths, tmp_path / "b", plans, ac_memory_limit_gib=2.0)
    assert larger.budget.plans == first.budget.plans
    assert all(any(p.saved for p in first.budget.plans[w].values()) for w in (4, 8))
    summary = larger.planner.summary()
    assert summary["ac_planned_for_gib_4f"] == summary["ac_planned_for_gib_8f"] == 1.0
    assert len(list(plans.glob("*.json"))) == 4  # 2 GiB's own plans cached beside them


def test_a_budget_run_trains_as_a_run_without_checkpointing_and_reports_its_plans(tmp_path, two_lengths, gloo_world):
    budget = budget_trainer(two_lengths, tmp_path / "a", tmp_path / "plans").run()
    plain = budget_trainer(two_lengths, tmp_path / "b", tmp_path / "plans", activation_checkpointing="none").run()
    assert budget["final_loss"] == plain["final_loss"]
    assert all(torch.equal(budget["ema_state"][k], plain["ema_state"][k]) for k in plain["ema_state"])
    assert budget["ac_limit_gib"] == 1.0
    for window in (4, 8):
        assert 0 < budget[f"ac_kept_gib_{window}f"] < budget[f"ac_predicted_peak_gib_{window}f"] < 1.0
        assert 0 <= budget[f"ac_recompute_fraction_{window}f"] < 1
        assert budget[f"ac_floor_gib_{window}f"] < budget[f"ac_predicted_peak_gib_{window}f"]
        assert budget[f"ac_saved_matched_{window}f"] == 1.0  # eager: the policy met every id the plan saves
    assert budget["lineage"][0]["ac_memory_limit_gib"] == 1.0


def test_an_eager_run_on_cuda_leaves_the_blocks_its_trials_measured_fastest_unchecked(tmp_path, two_lengths,
                                                                                     gloo_world, monkeypatch):
    """Eager on CUDA each window runs the fastest of full, its plan and unchecked blocks (ac_eager); the
    trials are injected (on the CPU the planner measures nothing): unchecked blocks, as many as the limit
    holds, train as no checkpointing does."""
    monkeypatch.setattr(ac_planning.WindowPlanner, "measures", lambda self: True)
    trials = EagerTrials(full_s=1.0, plan_s=1.2, unchecked_s=0.5, unchecked_kept=1)
    monkeypatch.setattr(ac_planning, "eager_trials", lambda probes, args, plans, device: dict.fromkeys(plans, trials))
    budget = budget_trainer(two_lengths, tmp_path / "a", tmp_path / "plans").run()
    plain = budget_trainer(two_lengths, tmp_path / "b", tmp_path / "plans", activation_checkpointing="none").run()
    assert budget["final_loss"] == plain["final_loss"]
    for window in (4, 8):
        assert budget[f"ac_unchecked_blocks_{window}f"] == 2 and budget[f"ac_op_level_{window}f"] == 0.0
        assert budget[f"ac_kept_gib_{window}f"] == 2 / 2**30 and budget[f"ac_recompute_fraction_{window}f"] == 0.0


def test_a_probed_step_of_a_compiled_run_runs_eager_and_keeps_nothing(tmp_path, two_lengths, gloo_world,
                                                                      monkeypatch):
    """NVFP4's SQNR probes are written from inside the blocks' backward, which no compiled graph holds:
    a probed step runs eager (nothing is compiled) and its budget blocks keep nothing, as full's do."""
    trainer = budget_trainer(two_lengths, tmp_path, tmp_path / "plans", compile=True,
                             precision={"recipe": "nvfp4", "sqnr_every": 2})
    assert any(p.saved for plans in trainer.budget.plans.values() for p in plans.values())
    kept: list = []
    contexts = trainer.budget.contexts
    monkeypatch.setattr(trainer.budget, "contexts", lambda kind: kept.append(trainer.budget._saved) or contexts(kind))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    metrics = trainer.train_step(0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert kept and all(saved == {} for saved in kept)
    assert any(k.startswith("sqnr") for k in metrics) and math.isfinite(metrics["loss"])


def test_one_micro_batch_counts_the_blocks_gradients_where_they_replace_what_the_blocks_kept(tmp_path, two_lengths,
                                                                                           gloo_world):
    """With one micro-batch a block's gradients are made as the backward frees its input and kept
    outputs: the plan counts the larger of the two, so it keeps more under the same limit; with
    accumulation every gradient is held beside the next micro-batch's activations."""
    limit = {"ac_memory_limit_gib": 0.0049}  # ~0.4 MB above the tiny step's floor with accumulation

    one = budget_trainer(two_lengths, tmp_path / "a", tmp_path / "plans", grad_accum=1, **limit).planner.report[8]
    two = budget_trainer(two_lengths, tmp_path / "b", tmp_path / "plans", **limit).planner.report[8]
    inputs, grads = two["floor_parts"]["block_inputs"], two["floor_parts"]["grads"]
    model_grads = budget_trainer(two_lengths, tmp_path / "c", tmp_path / "plans", grad_accum=1, **limit).model
    block_grads = sum(p.numel() * p.element_size() for p in model_grads.blocks.parameters())
    assert one["floor_parts"]["grads"] == grads - min(block_grads, inputs)
    absorbed = max(0, block_grads - inputs)
    assert one["predicted_peak"] == one["floor"] + max(0, one["kept"] - absorbed)
    assert one["predicted_peak"] <= limit["ac_memory_limit_gib"] * 2**30
    assert two["predicted_peak"] == two["floor"] + two["kept"]
    assert one["kept"] > two["kept"]  # the room the gradients left


DISTILL = {"device": "cpu", "activation_checkpointing": "budget", "ac_memory_limit_gib": 1.0}
STAGES = {"train_ar": (TrainARConfig, BASE), "distill_dmd": (DistillDMDConfig, DISTILL)}


@pytest.mark.parametrize("stage, change, message", [
    ("train_ar", {"ac_memory_limit_gib": 0},
     "train_ar.ac_memory_limit_gib must be > 0 (GiB of the step's peak per device)"),
    ("train_ar", {"activation_checkpointing": "budgeted"},
     "train_ar.activation_checkpointing must be none, full, selective, compiler or budget; got 'budgeted'"),
    ("train_ar", {"precision": {"recipe": "nvfp4", "forward_bf16_from_step": 3}},
     "train_ar.activation_checkpointing: budget plans the NVFP4 forward's ops, and precision.forward_bf16_from_step"),
    ("train_ar", {"ac_plan_margin_gib": 1.0},
     "train_ar.ac_plan_margin_gib must be >= 0 and below ac_memory_limit_gib; got 1.0"),
    ("distill_dmd", {"ac_plan_margin_gib": -0.5},
     "distill_dmd.ac_plan_margin_gib must be >= 0 and below ac_memory_limit_gib; got -0.5"),
    ("distill_dmd", {"ac_memory_limit_gib": -1},
     "distill_dmd.ac_memory_limit_gib must be > 0 (GiB of the step's peak per device)"),
    ("distill_dmd", {"activation_checkpointing": "compiler"},
     "distill_dmd.activation_checkpointing must be none, full, selective or budget (distillation does not compile"),
    ("distill_dmd", {"sp": 2, "nproc": 2},
     "distill_dmd.activation_checkpointing: budget plans distillation with one rank per prompt (sp: 1), and sp is 2"),
    ("distill_dmd", {"lora": {"dropout": 0.1}},
     "distill_dmd.lora.dropout is 0.1 with activation_checkpointing budget: the recomputation would draw other"),
])
def test_a_bad_budget_setting_is_one_line_naming_its_key(stage, change, message):
    """(And a good one changes no number a checkpoint holds: a run resumes across it.)"""
    config, base = STAGES[stage]
    with pytest.raises(ConfigError) as err:
        from_mapping(config, {**base, **change}, stage)
    assert message in str(err.value) and "\n" not in str(err.value)
    plain = from_mapping(config, {**base, "activation_checkpointing": "none"}, stage)
    assert from_mapping(config, {**base, "ac_memory_limit_gib": 7.5}, stage).resume_params() == \
        plain.resume_params()


@pytest.mark.parametrize("stage", ["train_ar", "distill_dmd"])
def test_without_a_limit_a_cpu_run_is_refused_before_it_starts(monkeypatch, stage):
    import importlib

    params = load_params(REPO / "params.yaml")
    params[stage].update({"device": "cpu", "activation_checkpointing": "budget", "ac_memory_limit_gib": None})
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=rf"^{stage}.ac_memory_limit_gib: null means 0.9 of the GPU's memory, "
                                          r"and this run is on the cpu: give the limit in GiB$"):
        importlib.import_module(f"tasks.{stage}").prepare(params)
    require_limit(2.0, torch.device("cpu"), "k")  # a number is enough


def test_a_measured_peak_above_the_limit_says_by_how_much_and_the_margin_to_set():
    check_peak(2**30, 2**30, None, "train_ar.ac_memory_limit_gib", 1)
    with pytest.raises(ConfigError, match=r"step 3 peaked at 1.50 GiB, 0.50 GiB above the limit of 1.00 GiB; the plan "
                                          r"predicted 0.90 GiB: set train_ar.ac_plan_margin_gib to at least 0.60 GiB "
                                          r"\(now 0.00\)"):
        check_peak(3 * 2**29, 2**30, int(0.9 * 2**30), "train_ar.ac_memory_limit_gib", 3)
    with pytest.raises(ConfigError, match=r"set distill_dmd.ac_plan_margin_gib to at least 0.60 GiB \(now 0.10\)"):
        check_peak(3 * 2**29, 2**30, int(0.9 * 2**30), "distill_dmd.ac_memory_limit_gib", 3, int(0.1 * 2**30))


class FakeCudaMemory:
    """CUDA's peak counter faked: bytes allocated now, and the peak since the last reset."""

    def __init__(self, monkeypatch):
        self.now = self.peak = 0
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.now))

    def allocate(self, peak: int, now: int = 2) -> None:
        self.peak, self.now = max(self.peak, peak), now


def checked_planner(checked: list) -> SimpleNamespace:
    """A planner's peak and check: each check records (step, the steps' peak it saw)."""
    planner = SimpleNamespace(peak=StepPeak(torch.device("cuda", 0)))
    planner.check_peak = lambda step: checked.append((step, planner.peak.local()))
    return planner


def test_the_latent_statistics_between_steps_are_left_out_of_the_next_steps_check(monkeypatch):
    """distill_dmd's statistics run no-grad rollouts after a step's check, which no plan counts: the
    next step's check sees the steps' largest peak, not theirs."""
    mem = FakeCudaMemory(monkeypatch)
    checked = []

    def latent_stats() -> dict[str, float]:
        mem.allocate(peak=9)
        return {"critic_eval_loss": 0.0}

    trainer = SimpleNamespace(cfg=SimpleNamespace(stats_every=1, stats_samples=1, steps=3),
                              device=torch.device("cuda", 0), planner=checked_planner(checked),
                              latent_stats=latent_stats, critic_eval=[], critic_losses=[])
    trainer._peak_mb = lambda: DMDTrainer._peak_mb(trainer)
    reported = []
    for step, peak in ((1, 5), (2, 6), (3, 4)):
        mem.allocate(peak)
        reported.append(DMDTrainer.after_step(trainer, step, 1.0, {"critic_loss": 0.0})["peak_memory_mb"])
    assert checked == [(1, 5), (2, 6), (3, 6)]
    # what the run reports is what the GPU held at most, the statistics' included, after every reset
    assert [r * 2**20 for r in reported] == [5, 9, 9] and trainer._peak_mb() * 2**20 == 9
    assert StepPeak(torch.device("cpu")).local() == 0


def test_each_pass_of_a_dmd_step_is_measured_apart_and_checked_against_its_own_prediction(monkeypatch):
    """distill_dmd's step runs the generator's pass, then the critic's, each planned for the limit with a
    prediction of its own: each one's peak is measured apart (``StepPeak.enter``; the generator's pass from
    its rollout to its optimizer step), reported beside its prediction, and a step above the limit names
    the prediction of the pass that peaked there."""
    gib = 2**30
    mem = FakeCudaMemory(monkeypatch)
    peak = StepPeak(torch.device("cuda", 0))
    entry = lambda predicted: {"kept": 0, "recompute_s": 0.0, "forward_s": 1.0, "predicted_peak": predicted,  # noqa: E731
                               "floor": predicted, "planned_kept": 0}
    planner = SimpleNamespace(device=torch.device("cuda", 0), peak=peak, limit=6 * gib, margin=0, measured=0,
                              measured_passes={}, budget=SimpleNamespace(matched_share=lambda name: None),
                              report={"generator": entry(int(5.5 * gib)), "critic": entry(int(5.75 * gib))})
    monkeypatch.setattr(peak, "world_sections",  # one rank: the world's peaks are this one's
                        lambda names: (peak.local(), {n: peak.sections.get(n, 0) for n in names}))
    for step, (generator, critic) in enumerate(((4 * gib, 5 * gib), (3 * gib, 2 * gib)), 1):
        peak.enter("generator")
        mem.allocate(generator)
        peak.enter("critic")
        mem.allocate(critic)
        DistillPlanner.check_peak(planner, step)
    assert peak.sections == {"generator": 4 * gib, "critic": 5 * gib} and peak.local() == 5 * gib
    summary = DistillPlanner.summary(planner)
    assert (summary["ac_measured_peak_gib"], summary["ac_measured_peak_gib_generator"],
            summary["ac_measured_peak_gib_critic"]) == (5.0, 4.0, 5.0)
    assert summary["ac_predicted_peak_gib_generator"] == 5.5
    peak.enter("critic")
    mem.allocate(6 * gib)
    with peak.excluded():  # work no plan counts, inside a pass: the pass's peak so far is kept, and the pass goes on
        mem.allocate(9 * gib)
    mem.allocate(3 * gib)
    peak.enter(None)
    assert peak.sections["critic"] == 6 * gib and peak.excluded_peak == 9 * gib and peak.local() == 6 * gib
    peak.enter("generator")
    mem.allocate(7 * gib)
    peak.enter("critic")
    with pytest.raises(ConfigError, match=r"step 3 peaked at 7.00 GiB, 1.00 GiB above the limit of 6.00 GiB; the plan "
                                          r"predicted 5.50 GiB: set distill_dmd.ac_plan_margin_gib to at least 1.50"):
        DistillPlanner.check_peak(planner, 3)


def test_a_passs_gradients_take_the_place_of_the_inputs_its_first_backward_chain_frees():
    """One chain (the critic's): the gradients made in the blocks replace the inputs they outgrow or
    not, the excess absorbed by kept outputs; a gradient made outside the blocks counts in full. Three
    chains (the generator's exit chunks): every block's gradient exists once the first chain's backward
    ends, so a third of the inputs at most is replaced and nothing absorbed."""
    assert pass_gradients(own=10, in_blocks=8, block_inputs=30, chains=1) == (2, 0)
    assert pass_gradients(own=10, in_blocks=8, block_inputs=6, chains=1) == (4, 2)
    assert pass_gradients(own=10, in_blocks=8, block_inputs=30, chains=3) == (2, 0)
    assert pass_gradients(own=10, in_blocks=8, block_inputs=18, chains=3) == (4, 0)


def test_the_generators_unchecked_blocks_are_priced_at_each_grad_chunks_own_cache(monkeypatch):
    """Every exit step of the generator's pass holds its activations until the backward, and an earlier
    chunk attends to fewer cached frames: what an unchecked block keeps is the mean over the chunks'
    own caches (measured once per length), not the fullest cache's for each (7.6 GiB over at 16 blocks)."""
    from longlive_core.distill import ac_planning as distill_planning

    cfg = SimpleNamespace(latent_frames=32, grad_frames=24, window=None)
    planner = SimpleNamespace(cfg=cfg, chunk=8, grid=(2, 2), text_tokens=4, model=None, dtype=torch.float32,
                              device=torch.device("cpu"), budget=SimpleNamespace(probes={"a": None}))
    planner.grad_chunks = DistillPlanner.grad_chunks.fget(planner)
    planner.past_frames = DistillPlanner.past_frames.fget(planner)
    assert DistillPlanner.chunk_pasts.fget(planner) == [8, 16, 24]  # chunks 1-3 of 4, the window all frames
    planner.chunk_pasts = DistillPlanner.chunk_pasts.fget(planner)
    measured = []
    monkeypatch.setattr(distill_planning, "chunk_inputs", lambda model, chunk, past, *rest: past)
    monkeypatch.setattr(distill_planning, "block_trial",
                        lambda probe, past, saved, compiled, repeats: measured.append(past) or SimpleNamespace(
                            kept=100 * past))
    monkeypatch.setattr(distill_planning, "agree", lambda value: value)
    trials = {"a": EagerTrials(1.0, 1.0, 0.5, 100 * 24)}
    out = DistillPlanner._unchecked_kept(planner, trials)
    assert measured == [8, 16] and out["a"] == EagerTrials(1.0, 1.0, 0.5, 100 * 16)
    cfg.window = 16  # a window of 16 frames: every chunk's cache holds 8
    assert DistillPlanner.chunk_pasts.fget(SimpleNamespace(cfg=cfg, chunk=8, grad_chunks=3, past_frames=8)) == [8, 8, 8]


def test_a_no_grad_forward_is_unmeasured_off_cuda():
    """Without the allocator's statistics the scores' forwards are priced as a block's forward and
    backward (``DistillPlanner``), an upper bound: nothing is measured."""
    assert forward_transient(nn.Linear(4, 4), (torch.randn(2, 4),)) is None


def test_train_ars_validation_is_left_out_of_the_next_steps_check_and_its_peak_reported(monkeypatch):
    """train_ar's validation between steps runs no-grad forwards that no plan counts (as distill_dmd's
    statistics): the next step's check sees the steps' peak, and the steps' reported peak keeps what came
    before a reset (validation's, a window planned mid-run)."""
    from longlive_core.train import trainer as trainer_module

    mem = FakeCudaMemory(monkeypatch)
    checked = []

    def validate(*args) -> float:
        mem.allocate(peak=9)
        return 0.5

    monkeypatch.setattr(trainer_module, "validate", validate)
    trainer = SimpleNamespace(cfg=SimpleNamespace(val_every=1, steps=3, optimizer=SimpleNamespace(lr=1e-4)),
                              device=torch.device("cuda", 0), planner=checked_planner(checked), peak=None, world=1,
                              model=None, val_set=None, flow=None, dtype=None, dims=None)
    reported = []
    for step, peak in ((1, 5), (2, 6), (3, 4)):
        mem.allocate(peak)
        out = Trainer.after_step(trainer, step, 1.0, {"loss": 1.0, "flops": 1.0, "tokens": 1})
        reported.append(out["peak_memory_mb"] * 2**20)
    assert checked == [(1, 5), (2, 6), (3, 6)]
    assert reported == [5, 9, 9]  # the first step's before any validation ran


@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_plans_are_sized_by_what_the_compiled_step_was_measured_to_keep(ratio):
    """The compiled step keeps ``ratio`` times the bytes the eager profile priced: the plan kept is
    the one that spares the most forward time among those measured within the limit."""
    rng = random.Random(1)
    profile = BlockProfile(tuple(OpCost(f"op#{i}", rng.randint(100, 1000), rng.uniform(1e-4, 1e-3), True)
                                 for i in range(40)), 0.1, 1, 1, "cpu")
    by_id = {op.id: op for op in profile.ops}
    calls = []

    def measure(kind, saved):
        calls.append(saved)
        # keeping more, less to redo; the ops are no aten ops: their time is never scaled
        return int(ratio * sum(by_id[i].bytes for i in saved)), 500 - 10 * len(saved), 1.0

    static, limit, counts = 1000, 1000 + 4 * 3000, {"a": 4}
    chosen = measured_plans({"a": profile}, counts, static, limit, measure)
    eager = plan_blocks({"a": profile}, counts, limit - static - 500)  # priced by the eager bytes alone
    assert calls[0] == () and len(calls[1]) == 40  # the floor first (nothing kept), then everything kept
    assert chosen.peak(static) <= limit
    assert chosen.kept_bytes == int(ratio * chosen.plans["a"].saved_bytes) * 4
    if ratio < 1:  # the compiled step keeps less than priced: the room grows and more is saved
        assert chosen.plans["a"].recompute_s < eager["a"].recompute_s
    else:  # it keeps more: the eager plan would overshoot; a smaller one is kept
        assert int(ratio * eager["a"].saved_bytes) * 4 + 500 - 10 * len(eager["a"].saved) + static > limit
        assert 0 < chosen.plans["a"].saved_bytes < eager["a"].saved_bytes


@pytest.mark.parametrize("transient_with_big", [100, 300])
def test_a_plan_that_keeps_more_is_tried_where_its_smaller_transient_lets_it_fit(transient_with_big):
    """Keeping the big output spares the backward its recomputation (transient 1200 without it): the
    rounds, sized by each plan's own transient, settle on the small outputs; the reach past them tries
    the room the least transient leaves, and keeps it only where its measured peak holds."""
    ops = (*(OpCost(f"op#{i}", 100, 1e-3, True) for i in range(5)), OpCost("big#0", 1000, 5e-3, True))
    profile = BlockProfile(ops, 0.1, 1, 1, "cpu")
    by_id = {op.id: op for op in ops}

    calls = []

    def measure(kind, saved):
        calls.append(frozenset(saved))
        return sum(by_id[i].bytes for i in saved), transient_with_big if "big#0" in saved else 1200, 1.0

    limit = 1650
    chosen = measured_plans({"a": profile}, {"a": 1}, 0, limit, measure)
    assert chosen.peak(0) <= limit
    assert len(calls) == len(set(calls))  # no saved set is compiled and measured twice
    rounds_only = measured_plans({"a": profile}, {"a": 1}, 0, limit, measure, reach=0)
    assert "big#0" not in rounds_only.plans["a"].saved and len(rounds_only.plans["a"].saved) == 4
    # each plan measured on the way is recorded: the rounds' one, then the reach's
    assert [t["room"] for t in rounds_only.room_trials] == [450] and chosen.room_trials[0]["kept"] == 400
    assert [t["within"] for t in chosen.room_trials] == [True, True]
    if transient_with_big == 100:  # 1,500 kept + 100 fits: every output kept, measured before the rounds
        assert set(chosen.plans["a"].saved) == set(by_id)
        assert [t["compiled_trials"] for t in chosen.room_trials] == [1, 0]
    else:  # 1,500 + 300 would not; the room that 300 leaves keeps the big output and three small ones
        assert "big#0" in chosen.plans["a"].saved and chosen.kept_bytes + 300 <= limit
        assert chosen.plans["a"].recompute_s < rounds_only.plans["a"].recompute_s
    # the big output alone and its transient overshoot, and the small ones leave the 1,200: nothing fits,
    # and no reach over the limit is kept
    assert measured_plans({"a": profile}, {"a": 1}, 0, 1000 + transient_with_big - 1, measure).plans["a"].saved == ()


def test_a_plan_is_chosen_by_its_measured_time_and_the_best_room_filled_along_other_shares_orders(monkeypatch):
    """The floor and everything-kept trials put the fused share at 1.0, so the room's order takes two
    elementwise outputs (each predicted to spare 0.6 ms) before the matmul's (1 ms); their recomputation
    really costs a quarter of that. Filled along half the share's order, the room keeps the matmul's
    output, and that plan is measured faster: it is kept, though predicted slower."""
    ops = (OpCost("aten.mm.default#0", 100, 1e-3, True), *(OpCost(f"aten.mul.Tensor#{i}", 50, 6e-4, True)
                                                           for i in range(4)))
    profile = BlockProfile(ops, 0.01, 1, 1, "cpu")

    def measure(kind, saved):
        if not saved:
            return 0, 10, 1.0034  # against everything kept: (3.4 - 1.0 unfused) / 2.4 fused, a share of 1.0
        return 50 * len(saved) + 50 * ("aten.mm.default#0" in saved), 10, 1.0 + 1e-3 * (
            "aten.mm.default#0" not in saved) + 0.25 * 6e-4 * sum(op.id not in saved for op in ops[1:])

    chosen = measured_plans({"a": profile}, {"a": 1}, 0, 110, measure)
    assert chosen.fused_shares["a"] == pytest.approx(1.0)
    assert chosen.plans["a"].saved == ("aten.mm.default#0",) and chosen.seconds == pytest.approx(1.0006)
    assert [t["share_factor"] for t in chosen.room_trials] == [1.0, 0.5]  # 2.0 orders as 1.0 did: not measured again
    monkeypatch.setattr(ac_plan, "SHARE_FACTORS", ())
    alone = measured_plans({"a": profile}, {"a": 1}, 0, 110, measure)
    assert len(alone.plans["a"].saved) == 2 and alone.seconds > chosen.seconds
    assert alone.plans["a"].recompute_s < chosen.plans["a"].recompute_s  # predicted faster at the shares


def test_the_reach_starts_from_the_largest_room_that_held_the_limit_not_the_fastest():
    """Keeping more is measured slower here (it writes more), and 8 outputs leave a smaller transient: the
    rounds try 800 bytes (fastest) and 1,000 (held the limit); the reach starts above 1,000, where no
    room is left, so nothing below a room that fit is measured again."""
    ops = tuple(OpCost(f"op#{i}", 100, 1e-3, True) for i in range(10))
    by_id = {op.id: op for op in ops}

    def measure(kind, saved):
        return sum(by_id[i].bytes for i in saved), 100 if len(saved) >= 8 else 300, 1.1 if not saved else \
            1.0 + 1e-4 * len(saved)

    chosen = measured_plans({"a": BlockProfile(ops, 0.01, 1, 1, "cpu")}, {"a": 1}, 0, 1100, measure)
    assert [t["room"] for t in chosen.room_trials] == [800, 1000] and all(t["within"] for t in chosen.room_trials)
    assert len(chosen.plans["a"].saved) == 8 and chosen.seconds == pytest.approx(1.0008)


def test_a_reach_that_overshoots_bisects_and_is_never_kept():
    """Every output kept measures the least transient (50), but the plan for the room it leaves does
    not keep the slow output, so its transient is 300 and its peak overshoots: the next trial takes the
    midpoint, which overshoots too, and the rounds' plan stays."""
    ops = (*(OpCost(f"op#{i}", 100, 1e-3, True) for i in range(5)), OpCost("big#0", 1000, 5e-3, True),
           OpCost("slow#0", 2000, 1e-6, True))
    by_id = {op.id: op for op in ops}

    def measure(kind, saved):
        transient = 50 if len(saved) == len(ops) else 300 if "big#0" in saved else 1200
        return sum(by_id[i].bytes for i in saved), transient, 1.0

    chosen = measured_plans({"a": BlockProfile(ops, 0.1, 1, 1, "cpu")}, {"a": 1}, 0, 1650, measure)
    assert [t["within"] for t in chosen.room_trials] == [True, False, False]
    assert [t["room"] for t in chosen.room_trials[1:]] == [1600, (450 + 1600) // 2]
    saved = chosen.plans["a"].saved
    assert len(saved) == 4 and all(i.startswith("op#") for i in saved) and chosen.peak(0) == 1600


def test_with_nothing_within_the_limit_nothing_is_kept():
    profile = BlockProfile((OpCost("op#0", 100, 1e-3, True),), 0.1, 1, 1, "cpu")
    chosen = measured_plans({"a": profile}, {"a": 2}, 1000, 1200, lambda kind, saved: (400 * len(saved), 300, 1.0))
    assert chosen.plans["a"].saved == () and chosen.peak(1000) == 1300  # over the limit: full's floor, reported


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_a_compiled_block_is_measured_as_the_compiler_keeps_it():
    block = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1024)).cuda()
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    eager = profile_block(block, (x,))
    candidates = tuple(op.id for op in eager.ops if op.candidate)
    nothing, transient_full, seconds_full = block_trial(block, (x,))
    everything, transient_all, seconds_all = block_trial(block, (x,), candidates)
    assert all(p.grad is None for p in block.parameters())  # as profile_block left them
    assert nothing < 2**20 < everything  # full keeps (almost) nothing; keeping every candidate keeps some
    assert transient_full > 0 and transient_all > 0 and seconds_full > 0 and seconds_all > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_an_eager_block_is_measured_checkpointed_planned_and_unchecked_on_the_gpu():
    """distill_dmd's eager trials: plain checkpointing keeps (almost) nothing, a plan what it saves, an
    unchecked block what autograd saves; the gradients are left as they were."""
    block = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1024)).cuda()
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    eager = profile_block(block, (x,))
    first = next(op for op in eager.ops if op.candidate)
    full = block_trial(block, (x,), (), compiled=False)
    plan = block_trial(block, (x,), (first.id,), compiled=False)
    unchecked = block_trial(block, (x,), PLAIN, compiled=False)
    assert all(p.grad is None for p in block.parameters()) and x.grad is None
    assert full.kept < 2**20 and plan.kept >= first.bytes and unchecked.kept > plan.kept
    assert min(full.seconds, plan.seconds, unchecked.seconds) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_a_no_grad_forward_is_measured_below_the_forward_and_backward_on_the_gpu():
    """What distill_dmd's scores run beside the generator's kept activations: a block's forward without
    gradients holds its output and at most a few intermediates, less than its forward and backward."""
    block = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1024)).cuda()
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    forward = forward_transient(block, (x,))
    hidden = 8192 * 4096 * 4
    assert 8192 * 1024 * 4 + hidden <= forward <= 3 * hidden < profile_block(block, (x,)).transient_bytes
    assert all(p.grad is None for p in block.parameters()) and x.grad is None


def test_a_heads_copies_bound_the_transient_but_never_add_to_a_blocks():
    """The head's float32 copies are freed before any block's backward: the step's transient is the
    larger of the two, in the eager accounting and in the compiled plans alike."""
    outside = OutsideBlocks(tokens=100, dim=8, itemsize=2)
    assert outside.held_bytes == 100 * 8 * 2  # one activation held through the blocks' backward
    assert outside.transient(10_000) == 10_000 and outside.transient(10) == 100 * 8 * 8
    # three passes (the generator's exit steps): two heads still wait while the last pass's blocks run
    assert OutsideBlocks(100, 8, 2, passes=3).held_bytes == 3 * 100 * 8 * 2 + 2 * 100 * 8 * 8
    profile = BlockProfile((OpCost("op#0", 100, 1e-3, True),), 0.1, 1, 1, "cpu")

    def measure(kind, saved):
        return 100 * len(saved), 300, 1.0

    assert measured_plans({"a": profile}, {"a": 2}, 1000, 1500, measure).plans["a"].saved == ("op#0",)
    # a head's copies larger than the block's transient leave no room for the kept outputs
    bounded = measured_plans({"a": profile}, {"a": 2}, 1000, 1500, measure, least_transient=400)
    assert bounded.plans["a"].saved == () and bounded.peak(1000) == 1400
