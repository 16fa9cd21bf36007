"""What training applies to the model from outside, in torchtitan's order: the precision recipe,
sequence parallelism, activation checkpointing, compilation, then FSDP2 sharding."""
from __future__ import annotations

import collections
import functools
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from longlive_core.config import ConfigError
from longlive_core.models.attention import attend
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.config import dit_config
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.recipe import ConversionReport, convert_linears, set_amax_group
from longlive_core.train.config import PrecisionConfig, TrainARConfig
from longlive_core.train.sequence_parallel import SequenceShard, UlyssesAttention

log = logging.getLogger(__name__)
WRAPPED = "_checkpoint_wrapped_module."  # what checkpoint_wrapper puts in parameter names


def clean_name(name: str) -> str:
    """A parameter's name as the model file spells it (state-dict keys), wrappers removed."""
    return name.replace(WRAPPED, "")


def build_model(cfg: TrainARConfig) -> WanDiT:
    """The starting weights in float32 on the CPU: random from ``init_seed`` (init tiny), or a local
    Wan2.2-TI2V-5B transformer folder."""
    dit = dit_config(cfg.model)
    if cfg.init == "tiny":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            return WanDiT(dit)
    return load_dit(Path(cfg.init), dit, dtype=torch.float32)


def apply_precision(model: nn.Module, precision: PrecisionConfig) -> ConversionReport:
    return convert_linears(model, precision.recipe, skip=tuple(precision.skip),
                           keep_last_blocks=precision.keep_last_blocks)


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


def apply_activation_checkpointing(model: WanDiT, mode: str) -> None:
    """none | full (each block's activations recomputed in backward) | selective (op-level: keeps
    matmul and attention outputs, every second matmul's excepted, and recomputes the rest)."""
    if mode == "none":
        return
    for i, block in enumerate(model.blocks):
        if mode == "full":
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            model.blocks[i] = checkpoint_wrapper(block, context_fn=_selective_context, preserve_rng_state=False)


def apply_compile(model: WanDiT) -> None:
    """torch.compile per block, in place (parameter names unchanged): every block has the same code,
    so one compilation serves them all."""
    for block in model.blocks:
        # static shapes: inductor 2.11 fails on the dynamic token count (CantSplit); a training run
        # sees few lengths (most windows are max_latent_frames), each compiled once
        block.compile(dynamic=False)


def sequence_groups(cfg: TrainARConfig, device_type: str) -> tuple[SequenceShard, dist.ProcessGroup]:
    """This rank's sequence-parallel shard (consecutive ranks form an SP group, so it stays within a
    node) and its data-parallel group (the ranks that hold the same SP rank)."""
    mesh = init_device_mesh(device_type, (cfg.dp_size, cfg.sp), mesh_dim_names=("dp", "sp"))
    return (SequenceShard(dist.get_rank() % cfg.sp, cfg.sp, mesh.get_group("sp")), mesh.get_group("dp"))


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


def device_mesh(cfg: TrainARConfig, device_type: str) -> DeviceMesh:
    if cfg.sharding == "hybrid":  # shard within a node, replicate across nodes
        return init_device_mesh(device_type, (cfg.nnodes, cfg.nproc), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (cfg.world_size,), mesh_dim_names=("dp_shard",))


def apply_fsdp(model: WanDiT, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    """FSDP2 per block and at the root. Masters, gradients and optimizer state stay float32; the
    gathered compute copy is ``param_dtype``; gradients reduce in float32. Inputs are not cast: the
    model keeps its per-frame modulation and timesteps in float32 on purpose."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
