"""How a DiT is made parallel, the same way for every role (the AR trainer, distillation's roles):
``parallelize_dit`` applies, in torchtitan's order, the precision recipe, the attention kernels,
sequence parallelism, activation checkpointing, compilation, then FSDP2 sharding over the data-
parallel mesh. ``parallel_dims`` places this rank in the world once: its sequence-parallel shard, its
data-parallel group and rank, and the mesh FSDP shards over."""
from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from longlive_core.config import ConfigError
from longlive_core.distributed.config import ParallelConfig
from longlive_core.distributed.ulysses import SequenceShard, UlyssesAttention
from longlive_core.models.attention import attend
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.recipe import ConversionReport, convert_linears, set_amax_group

WRAPPED = "_checkpoint_wrapped_module."  # what checkpoint_wrapper puts in parameter names
AC_MODES = ("none", "full", "selective", "compiler", "budget")


def clean_name(name: str) -> str:
    """A parameter's name as the model file spells it (state-dict keys), wrappers removed."""
    return name.replace(WRAPPED, "")


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the world."""

    shard: SequenceShard  # its slice of every sample (rank ``shard.rank`` of an SP group of ``shard.size``)
    dp_rank: int  # which data-parallel replica (SP group) it belongs to
    dp_group: dist.ProcessGroup  # the ranks that hold the same SP rank of every replica
    fsdp_mesh: DeviceMesh  # what FSDP shards over: the world, or (nodes, ranks of a node) for hybrid


def parallel_dims(cfg: ParallelConfig, device_type: str, stage: str) -> ParallelDims:
    """Collective: the world mesh (data-parallel x sequence-parallel; consecutive ranks form an SP
    group, so it stays within a node) and the FSDP mesh the sharding asks for."""
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise ConfigError(f"{stage}.nnodes x nproc is {cfg.world_size} but {world} ranks were started")
    mesh = init_device_mesh(device_type, (cfg.dp_size, cfg.sp), mesh_dim_names=("dp", "sp"))
    if cfg.sharding == "hybrid":  # shard within a node, replicate across nodes
        fsdp = init_device_mesh(device_type, (cfg.nnodes, cfg.nproc), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        fsdp = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
    rank = dist.get_rank()
    return ParallelDims(SequenceShard(rank % cfg.sp, cfg.sp, mesh.get_group("sp")), rank // cfg.sp,
                        mesh.get_group("dp"), fsdp)


class BlockCheckpointing(Protocol):
    """Per-block selective checkpointing decided outside this module (``activation_checkpointing:
    budget``: ``ac_budget.BudgetCheckpointing``, whose plans come from profiling the blocks)."""

    def contexts_for(self, block: nn.Module) -> Callable:
        """The ``context_fn`` of a compiled ``block``'s checkpoint wrapper (called before the block is sharded)."""

    def checkpoint_fn_for(self, block: nn.Module, index: int) -> Callable:
        """The ``checkpoint_fn`` of an eager ``block``'s wrapper, ``model.blocks[index]`` (called for each
        block of a model in order, before the block is sharded)."""


@dataclasses.dataclass(frozen=True)
class ParallelizePlan:
    """What ``parallelize_dit`` applies. ``recipe`` None: the linears are left as they are (a role
    converted them itself); ``attention`` None: the model's own kernels."""

    recipe: str | None = None
    skip: tuple[str, ...] = ()  # globs of linear layers the recipe keeps in high precision
    keep_last_blocks: int = 0
    attention: str | None = None  # rows | flex
    activation_checkpointing: str = "none"  # none | full | selective | compiler (compiled blocks only) | budget
    ac_budget: float = 1.0  # compiler: the share of the activations the partitioner may keep (1.0: all)
    compile: bool = False
    param_dtype: torch.dtype = torch.bfloat16  # FSDP's gathered compute copy
    budget: BlockCheckpointing | None = None  # activation_checkpointing budget: the policies (the trainer plans them)


def parallelize_dit(model: WanDiT, dims: ParallelDims, plan: ParallelizePlan, device: torch.device
                    ) -> ConversionReport | None:
    """Applies ``plan`` to ``model`` in place, in one order for every role, and moves it to ``device``."""
    if plan.activation_checkpointing == "compiler" and not plan.compile:
        raise ConfigError("activation_checkpointing: compiler is the compiler's own recomputation: it needs compile: "
                          "true (or choose full or selective)")
    if plan.activation_checkpointing == "budget" and plan.budget is None:
        raise ValueError("activation_checkpointing: budget needs the trainer's BudgetCheckpointing (plan.budget)")
    report = None
    if plan.recipe is not None:
        report = convert_linears(model, plan.recipe, skip=plan.skip, keep_last_blocks=plan.keep_last_blocks)
    if plan.attention is not None:
        apply_attention(model, plan.attention, device)
    apply_sequence_parallel(model, dims.shard)
    apply_activation_checkpointing(model, plan.activation_checkpointing, plan.budget, plan.compile)
    if plan.compile:
        if plan.activation_checkpointing == "budget":
            # a block's compiled code is reused across models with the same block code and shapes, and
            # the policy it traced with is another model's plan: this model's blocks trace their own
            torch._dynamo.reset()
        apply_compile(model, plan.ac_budget if plan.activation_checkpointing == "compiler" else 1.0)
    model.to(device)
    apply_fsdp(model, dims.fsdp_mesh, plan.param_dtype)
    return report


# ops whose outputs selective checkpointing keeps (every second matmul's is recomputed instead):
# the expensive ones to redo; everything elementwise is recomputed
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _selective_context():
    counts: collections.Counter = collections.Counter()

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op in _MATMULS:
            counts[mode] += 1
            if counts[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _full_context():
    """``full`` for compiled blocks, as a policy that names every op. Plain checkpointing tags only the
    ops Dynamo traced at the block's own level, so torch 2.11's partitioner saw the ops inside an
    autograd.Function (the NVFP4 linear's quantize and product operators) untagged, could not
    recompute a custom operator, and kept every linear's output and weight operand: 60.2 GiB on the
    H200 at 8 blocks, 22 GiB above budget's keep-nothing floor (bench/RESULTS.md). A policy tags each
    op as it is dispatched, nested ones included."""
    return create_selective_checkpoint_contexts(_recompute_everything)


def _checkpoint_when_eager(block: nn.Module, *args, **kwargs):
    """The wrapper of compiled blocks without checkpointing of their own: traced, the block runs as it
    is and the partitioner decides what to recompute; run eager (a step that probes NVFP4 SQNRs:
    ``Trainer.train_step``), it recomputes as ``full`` does, not keeping every activation."""
    if torch.compiler.is_compiling():
        return block(*args, **kwargs)
    return checkpoint(block, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def apply_activation_checkpointing(model: WanDiT, mode: str, budget: BlockCheckpointing | None = None,
                                   compiled: bool = False) -> None:
    """none | full (each block's activations recomputed in backward) | selective (op-level: keeps
    matmul and attention outputs, every second matmul's excepted, and recomputes the rest) |
    compiler (the compiled blocks' partitioner recomputes under ``apply_compile``'s budget) |
    budget (what ``budget``'s plan for the block says: op-level, or eager blocks also unchecked).
    ``compiler``'s blocks, and ``none``'s where they are ``compiled``, recompute as ``full`` does when
    a step runs them eager (one that probes NVFP4 SQNRs): eager, a block keeps more than compiled (124
    against 101 GiB without checkpointing, bench/RESULTS.md)."""
    if mode == "none" and not compiled:
        return
    for i, block in enumerate(model.blocks):
        if mode in ("none", "compiler"):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_fn=_checkpoint_when_eager)
        elif mode == "full" and compiled:
            model.blocks[i] = checkpoint_wrapper(block, context_fn=_full_context, preserve_rng_state=False)
        elif mode == "full":
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "budget" and compiled:
            model.blocks[i] = checkpoint_wrapper(block, context_fn=budget.contexts_for(block),
                                                 preserve_rng_state=False)
        elif mode == "budget":
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_fn=budget.checkpoint_fn_for(block, i))
        else:
            model.blocks[i] = checkpoint_wrapper(block, context_fn=_selective_context, preserve_rng_state=False)


def apply_compile(model: WanDiT, ac_budget: float = 1.0) -> None:
    """torch.compile per block, in place (parameter names unchanged): every block has the same code,
    so one compilation serves them all. ``ac_budget`` < 1: the min-cut partitioner keeps at most that
    share of the activations a plain compiled backward would and recomputes the cheapest rest
    (``activation_checkpointing: compiler``). The knob is process-wide and read when a block is first
    compiled, and Dynamo reuses a block's compiled code for every model with the same block code (its
    guards are on shapes, not on the module), so a change of budget drops the compiled code first:
    measured on the H200, without that a second model ran the first one's partition."""
    import torch._functorch.config as functorch_config

    if functorch_config.activation_memory_budget != ac_budget:
        torch._dynamo.reset()
        functorch_config.activation_memory_budget = ac_budget
    for block in model.blocks:
        # static shapes: inductor 2.11 fails on the dynamic token count (CantSplit); a training run
        # sees few lengths (most windows are max_latent_frames), each compiled once
        block.compile(dynamic=False)


def apply_attention(model: WanDiT, backend: str, device: torch.device) -> None:
    """Self-attention's kernels (``train_ar.attention``): the teacher-forcing mask's dense rows on SDPA,
    or FlexAttention's block mask (faster where a rank holds few heads: bench/RESULTS.md)."""
    if backend == "flex" and device.type != "cuda":
        raise ConfigError("train_ar.attention: flex needs a GPU (FlexAttention has no CPU backward); use rows")
    model.attention_fn = functools.partial(attend, backend=backend)


def apply_sequence_parallel(model: WanDiT, shard: SequenceShard) -> None:
    """Self-attention (the model's ``attention_fn``) through the Ulysses all-to-all over the shard's
    group; NVFP4 amaxes reduced over it. Nothing to do on one rank."""
    if shard.size == 1:
        return
    model.attention_fn = UlyssesAttention(shard, model.attention_fn)
    set_amax_group(model, shard.group)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    """FSDP2 per block and at the root. Masters, gradients and optimizer state stay float32; the
    gathered compute copy is ``param_dtype``; gradients reduce in float32. Inputs are not cast: the
    model keeps its per-frame modulation and timesteps in float32 on purpose."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
