"""What training applies from outside the model: activation checkpointing changes no number, a
checkpointed block compiles as one graph and a compiled ``full`` block keeps nothing it makes, the
precision schedule's forward switch, and the launcher's torchrun command."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from longlive_core.config import ConfigError
from longlive_core.distributed.ac_budget import BudgetCheckpointing
from longlive_core.distributed.ac_plan import plan_block
from longlive_core.distributed.ac_profile import profile_block
from longlive_core.distributed.launch import RDZV_ENV, torchrun_command
from longlive_core.distributed.parallelize import (
    apply_activation_checkpointing,
    apply_attention,
    apply_sequence_parallel,
    clean_name,
)
from longlive_core.distributed.ulysses import SequenceShard
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.linear import NVFP4Linear, NVFP4Recipe
from longlive_core.quant.recipe import convert_linears, set_forward_high_precision
from longlive_core.train.ac_planning import block_inputs
from longlive_core.train.config import TrainARConfig
from longlive_core.train.layout import TeacherForcingLayout


def loss_and_grads(mode: str, compiled: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    apply_activation_checkpointing(model, mode, compiled=compiled)  # run eager here, as a probed step runs
    g = torch.Generator().manual_seed(1)
    layout = TeacherForcingLayout(4, 2, 4, 6)
    x = torch.randn(1, 48, 8, 4, 4, generator=g)
    text = torch.randn(1, 6, 32, generator=g)
    out = model(x, layout.timesteps(torch.tensor([[800.0, 100.0]])), text,
                frame_positions=layout.frame_positions(torch.arange(4)), mask_mod=layout.self_mask())
    loss = out.square().mean()
    loss.backward()
    return loss.detach(), {clean_name(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode, compiled", [("full", False), ("full", True), ("selective", False)])
def test_activation_checkpointing_changes_no_number(mode, compiled):
    loss, grads = loss_and_grads("none")
    loss_ac, grads_ac = loss_and_grads(mode, compiled)
    assert torch.equal(loss, loss_ac) and grads.keys() == grads_ac.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_compiler_policy_sets_the_partitioners_budget_and_needs_compiled_blocks(monkeypatch):
    """``compiler``: the compiled blocks' partitioner keeps ac_budget of the activations (the knob is
    read when a block first runs; its numbers are the H200 bench's); run eager (a probed step), each
    block is recomputed as ``full`` recomputes it, and so is a compiled ``none`` block; every other
    policy leaves the knob at PyTorch's default; without compile it is refused, in params first."""
    import torch._functorch.config as functorch_config

    from longlive_core.distributed.parallelize import ParallelizePlan, apply_compile, parallelize_dit

    args = block_inputs(WanDiT(DIT_CONFIGS["tiny"]), TeacherForcingLayout(4, 2, 4, 6), (2, 2), torch.float32,
                        torch.device("cpu"))

    def kept(mode: str, compiled: bool = False) -> int:  # the tensors a block's eager forward keeps for its backward
        model = WanDiT(DIT_CONFIGS["tiny"])
        apply_activation_checkpointing(model, mode, compiled=compiled)
        saved: list = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            model.blocks[0](*args)
        return len(saved)

    assert kept("compiler") == kept("none", compiled=True) == kept("full") < kept("none")
    model = WanDiT(DIT_CONFIGS["tiny"])
    apply_activation_checkpointing(model, "compiler")
    try:
        reset = []
        monkeypatch.setattr(torch._dynamo, "reset", lambda: reset.append(1))
        apply_compile(model, 0.3)
        assert functorch_config.activation_memory_budget == 0.3 and reset == [1]  # compiled code dropped
        apply_compile(WanDiT(DIT_CONFIGS["tiny"]), 0.3)
        assert reset == [1]  # the same budget: the compiled blocks serve
        apply_compile(WanDiT(DIT_CONFIGS["tiny"]))
        assert functorch_config.activation_memory_budget == 1.0
    finally:
        functorch_config.activation_memory_budget = 1.0
    with pytest.raises(ConfigError, match="needs compile: true"):
        parallelize_dit(model, None, ParallelizePlan(activation_checkpointing="compiler"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="set train_ar.compile: true"):
        TrainARConfig(activation_checkpointing="compiler").validate("train_ar")
    with pytest.raises(ConfigError, match=r"ac_budget must be in \(0, 1\]"):
        TrainARConfig(activation_checkpointing="compiler", compile=True, ac_budget=0.0).validate("train_ar")


def test_forward_high_precision_switches_only_the_forward_gemm():
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 32)
    fp4 = NVFP4Linear.from_linear(base, NVFP4Recipe(backend="torch"))
    x = torch.randn(48, 64)
    g = torch.randn(48, 32)

    def run():
        xi = x.clone().requires_grad_(True)
        base.weight.grad = None
        y = fp4(xi)
        torch.manual_seed(5)  # the same stochastic rounding draws in both backwards
        y.backward(g)
        return y.detach(), xi.grad, base.weight.grad.clone()

    y4, dx4, dw4 = run()
    fp4.recipe = dataclasses.replace(fp4.recipe, forward_high_precision=True)
    y16, dx16, dw16 = run()
    assert torch.equal(y16, F.linear(x, base.weight, base.bias)) and not torch.equal(y4, y16)
    assert torch.equal(dx4, dx16) and torch.equal(dw4, dw16)  # dgrad and wgrad stay NVFP4


def test_set_forward_high_precision_reaches_every_converted_layer():
    model = WanDiT(DIT_CONFIGS["tiny"])
    report = convert_linears(model, "nvfp4")
    assert set_forward_high_precision(model, True) == len(report.converted) > 0
    assert all(m.recipe.forward_high_precision for m in model.modules() if isinstance(m, NVFP4Linear))
    set_forward_high_precision(model, False)
    assert not any(m.recipe.forward_high_precision for m in model.modules() if isinstance(m, NVFP4Linear))


def test_attention_kernels_come_from_the_config_and_sequence_parallelism_wraps_them():
    model = WanDiT(DIT_CONFIGS["tiny"])
    apply_attention(model, "rows", torch.device("cpu"))
    assert model.attention_fn.keywords == {"backend": "rows"}
    chosen = model.attention_fn
    apply_sequence_parallel(model, SequenceShard(0, 2, None))
    assert model.attention_fn.attention_fn is chosen  # the all-to-all around the chosen kernels
    with pytest.raises(ConfigError, match="flex needs a GPU"):
        apply_attention(model, "flex", torch.device("cpu"))
    with pytest.raises(ConfigError, match="attention must be rows or flex"):
        dataclasses.replace(TrainARConfig(), attention="sdpa").validate("train_ar")


def test_torchrun_command(monkeypatch):
    one = torchrun_command("tasks.train_ar", 1, 4)
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc_per_node=4", "--standalone", "--nnodes=1", "-m",
                       "tasks.train_ar"]
    monkeypatch.delenv(RDZV_ENV, raising=False)
    with pytest.raises(ConfigError, match=RDZV_ENV):
        torchrun_command("tasks.train_ar", 2, 4)
    monkeypatch.setenv(RDZV_ENV, "node0:29500")
    many = torchrun_command("tasks.train_ar", 2, 4, rdzv_id="job7")
    assert "--nnodes=2" in many and "--rdzv_endpoint=node0:29500" in many and "--rdzv_id=job7" in many


def test_the_budget_policy_wraps_every_block_with_its_kinds_plan():
    """``budget``: compiled, each block wrapped as ``selective`` is, its context naming the planner and
    the block's kind (a partial over constants: what torch.compile accepts); eager, its checkpoint
    function naming them and the block's place among its kind in its model, counted again in another
    model; one probe copy per kind, before sharding; without a planner it is refused."""
    from longlive_core.distributed.ac_budget import BudgetCheckpointing, block_kind
    from longlive_core.distributed.parallelize import ParallelizePlan, parallelize_dit

    budget = BudgetCheckpointing()
    compiled, eager, other = (WanDiT(DIT_CONFIGS["tiny"]) for _ in range(3))
    apply_activation_checkpointing(compiled, "budget", budget, compiled=True)
    kind = block_kind(compiled.blocks[0]._checkpoint_wrapped_module)
    assert dict(budget.counts) == {kind: len(compiled.blocks)} and list(budget.probes) == [kind]
    context_fn = compiled.blocks[1].checkpoint_fn.keywords["context_fn"]
    assert context_fn.args == (budget.number, kind)
    for model in (eager, other):
        apply_activation_checkpointing(model, "budget", budget)
        assert [b.checkpoint_fn.args for b in model.blocks] == [(budget.number, kind, i) for i in range(2)]
    assert dict(budget.counts) == {kind: 3 * len(compiled.blocks)} and list(budget.probes) == [kind]
    with pytest.raises(ValueError, match="budget needs the trainer's BudgetCheckpointing"):
        parallelize_dit(WanDiT(DIT_CONFIGS["tiny"]), None, ParallelizePlan(activation_checkpointing="budget"),
                        torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe, mode", [("bf16", "full"), ("bf16", "selective"), ("bf16", "budget"),
                                          ("nvfp4", "full"), ("nvfp4", "budget"), ("bf16", "compiler")])
def test_a_checkpointed_block_compiles_as_one_graph(recipe, mode, device="cpu"):
    """A graph break inside a checkpointed block sends the whole block to eager under compile (the
    per-frame cross-attention through FlexAttention once did, for every checkpointing mode): each
    policy's block is one graph, the emulated NVFP4 product in it as the ``longlive::scaled_product``
    operator (its CUDA path calls cuBLASLt through ctypes, which tracing cannot follow)."""
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    if recipe != "bf16":
        convert_linears(model, recipe)
    budget = BudgetCheckpointing()  # the wrappers name it by number: it lives while they run
    apply_activation_checkpointing(model, mode, budget, compiled=True)  # wrapped as a compiled step's blocks are
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model.to(device, dtype)
    args = block_inputs(model, TeacherForcingLayout(4, 2, 4, 6), (2, 2), dtype, torch.device(device))
    if mode == "budget":  # a plan that keeps every output the policy may keep (the quantize operators' too)
        (kind, probe), = budget.probes.items()
        profile = profile_block(probe.to(device, dtype), args)
        budget.plans[4] = {kind: plan_block(profile, sum(op.bytes for op in profile.ops if op.candidate))}
        assert budget.use(4) and budget.plans[4][kind].saved
    explained = torch._dynamo.explain(model.blocks[0])(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    targets = {str(node.target) for graph in explained.graphs for module in graph.modules() if hasattr(module, "graph")
               for node in module.graph.nodes}
    assert ("tag_activation_checkpoint" in targets) == (mode != "compiler")  # compiler: the partitioner decides
    assert ("longlive.scaled_product.default" in targets) == (recipe == "nvfp4")


def saved_by_compiled_block(block: torch.nn.Module, args: tuple) -> list[str]:
    """The names of the floating-point tensors a compiled ``block``'s backward reads that the block
    made (not its inputs or parameters), as the min-cut partitioner torch.compile uses partitions it."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition, nop
    from torch._dynamo.backends.common import aot_autograd

    made: list[str] = []

    def backward(graph, example_inputs):
        made.extend(n.name for n in graph.graph.nodes if n.op == "placeholder" and not n.name.startswith(("primals",
                    "tangents")) and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point())
        return make_boxed_func(graph)

    backend = aot_autograd(fw_compiler=nop, bw_compiler=backward,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    out = torch.compile(block, backend=backend, dynamic=False)(*args)
    out.float().sum().backward()
    torch._dynamo.reset()
    return made


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_full_under_compile_keeps_nothing_the_block_makes(recipe):
    """Compiled, a ``full`` block's backward reads only its inputs and parameters, NVFP4's quantized
    operands and products included: torch 2.11 (the H200's) kept every NVFP4 linear's output and
    weight operand under plain checkpointing (60.2 GiB, 22 GiB above budget's keep-nothing floor), so
    compiled blocks take a policy that recomputes every op (on torch 2.14 plain checkpointing keeps
    nothing either)."""
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"])
    if recipe != "bf16":
        convert_linears(model, recipe)
    apply_activation_checkpointing(model, "full", compiled=True)
    args = block_inputs(model, TeacherForcingLayout(4, 2, 4, 6), (2, 2), torch.float32, torch.device("cpu"))
    assert saved_by_compiled_block(model.blocks[0], args) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
@pytest.mark.parametrize("mode", ["full", "budget"])
def test_a_checkpointed_block_compiles_as_one_graph_on_the_gpu(recipe, mode):
    """The same on CUDA, where the NVFP4 path launches Triton quantize kernels and calls cuBLASLt."""
    test_a_checkpointed_block_compiles_as_one_graph(recipe, mode, "cuda")


GROUP_OF_ONE = """
import torch, torch.distributed as dist
from longlive_core.distributed.config import ParallelConfig
from longlive_core.distributed.launch import join_process_group
from longlive_core.distributed.parallelize import apply_fsdp, parallel_dims
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.layout import TeacherForcingLayout

join_process_group(torch.device("cuda", 0), alone=True)
dims = parallel_dims(ParallelConfig(device="cuda"), "cuda", "train_ar")
torch.manual_seed(0)
plain = WanDiT(DIT_CONFIGS["tiny"]).cuda()
sharded = WanDiT(DIT_CONFIGS["tiny"]).cuda()
sharded.load_state_dict(plain.state_dict())
apply_fsdp(sharded, dims.fsdp_mesh, torch.float32)
layout = TeacherForcingLayout(4, 2, 4, 6)
g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1, 48, 8, 4, 4, generator=g, device="cuda")
text = torch.randn(1, 6, 32, generator=g, device="cuda")
for model in (plain, sharded):
    out = model(x, layout.timesteps(torch.tensor([[800.0, 100.0]], device="cuda")), text,
                frame_positions=layout.frame_positions(torch.arange(4, device="cuda")), mask_mod=layout.self_mask())
    out.square().mean().backward()
total = torch.ones(1, device="cuda")
dist.all_reduce(total)
assert dist.get_world_size() == 1 and total.item() == 1.0
for a, b in zip(plain.parameters(), sharded.parameters(), strict=True):
    torch.testing.assert_close(b.grad.full_tensor(), a.grad)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_a_one_rank_group_made_in_memory_trains_under_fsdp_on_cuda():
    """A one-rank stage's own group (NCCL over an in-memory store, no torchrun launcher): FSDP2 shards,
    gathers and reduces in it, and a step's gradients are the unsharded model's (float32). In its own
    process: this one may hold a gloo group already."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", GROUP_OF_ONE], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
