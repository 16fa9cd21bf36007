"""The typed configuration of AR teacher-forcing training (``params.yaml``'s ``train_ar`` section)."""
from __future__ import annotations

import dataclasses

from longlive_core.config import ConfigError, flat_section, without_keys
from longlive_core.distributed.config import ParallelConfig
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.quant.config import DEFAULT_SKIP, RECIPE_NAMES


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.0, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    grad_clip: float = 1.0  # max total grad norm; 0: no clipping (the norm is still measured and logged)

    def build(self, params, device):
        """AdamW over ``params`` (fused, one kernel per step, on GPUs)."""
        import torch

        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), weight_decay=self.weight_decay,
                                 eps=self.eps, fused=device.type == "cuda")

    def validate(self, where: str) -> None:
        if self.lr <= 0 or len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{where}: lr must be > 0 and betas two numbers in [0, 1); got {self.lr}, {self.betas}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"{where}: grad_clip and weight_decay must be >= 0")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of a training stage (train_ar, distill_dmd); its keys sit at the stage's level."""

    checkpoint_every: int = 100
    keep_checkpoints: int = 2  # the newest N of a run digest
    keep_runs: int = 2  # the run digests kept, the most recently used: a params typo reverted finds its run
    resume: str = "auto"  # auto: this digest's checkpoints | force: also across a numeric-code change (logged)

    def validate(self, where: str) -> None:
        for key in ("checkpoint_every", "keep_checkpoints", "keep_runs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be at least 1; got {getattr(self, key)}")
        if self.resume not in ("auto", "force"):
            raise ConfigError(f"{where}.resume must be auto or force; got {self.resume!r}")


@dataclasses.dataclass(frozen=True)
class EMAConfig:
    decay: float = 0.99
    start_step: int = 100  # before it the EMA copies the weights; from it on it averages them

    def validate(self, where: str) -> None:
        if not 0 <= self.decay < 1 or self.start_step < 0:
            raise ConfigError(f"{where}: decay must be in [0, 1) and start_step >= 0")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    recipe: str = "bf16"  # bf16 | nvfp4 | nvfp4-4over6 (quant.recipe.RECIPES)
    skip: tuple[str, ...] = DEFAULT_SKIP  # globs of linear layers kept in high precision
    keep_last_blocks: int = 0  # the last blocks stay BF16 (torchtitan's NVFP4 guide: about 15%)
    forward_bf16_from_step: int | None = None  # from this step the forward GEMMs run BF16, dgrad/wgrad NVFP4
    param_dtype: str = "bfloat16"  # the compute copy FSDP gathers; masters, grads and optimizer stay float32
    sqnr_every: int = 50  # per-layer SQNR logged every N steps (NVFP4 recipes); 0: never

    def validate(self, where: str) -> None:
        if self.recipe not in RECIPE_NAMES:
            raise ConfigError(f"{where}.recipe must be one of {', '.join(RECIPE_NAMES)}; got {self.recipe!r}")
        if self.param_dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"{where}.param_dtype must be bfloat16 or float32; got {self.param_dtype!r}")
        if self.keep_last_blocks < 0 or self.sqnr_every < 0:
            raise ConfigError(f"{where}: keep_last_blocks and sqnr_every must be >= 0")
        if self.forward_bf16_from_step is not None and self.recipe == "bf16":
            raise ConfigError(f"{where}.forward_bf16_from_step switches an NVFP4 recipe's forward; recipe is bf16")


@dataclasses.dataclass(frozen=True)
class ErrorRecyclingConfig:
    enabled: bool = False
    timestep_buckets: int = 50
    position_buckets: int = 4  # relative place of a chunk in its window; a multiple of train_ar.sp
    entries_per_bucket: int = 500
    warmup_steps: int = 50  # steps whose errors every data-parallel rank of an SP rank stores
    start_step: int = 0  # no injection before this step
    clean_prob: float = 0.2  # a sample gets no error at all
    context_prob: float = 0.9
    latent_prob: float = 0.9
    noise_prob: float = 0.01
    modulate: float = 0.3
    store_dtype: str = "bfloat16"  # errors are kept in CPU memory in this dtype

    def validate(self, where: str) -> None:
        positive = ("timestep_buckets", "position_buckets", "entries_per_bucket")
        if any(getattr(self, k) < 1 for k in positive) or self.warmup_steps < 0 or self.start_step < 0:
            raise ConfigError(f"{where}: {', '.join(positive)} must be >= 1; warmup_steps, start_step >= 0")
        for key in ("clean_prob", "context_prob", "latent_prob", "noise_prob"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{where}.{key} must be a probability in [0, 1]; got {getattr(self, key)}")
        if not 0 <= self.modulate < 1:
            raise ConfigError(f"{where}.modulate must be in [0, 1); got {self.modulate}")
        if self.store_dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"{where}.store_dtype must be bfloat16 or float32; got {self.store_dtype!r}")


@dataclasses.dataclass(frozen=True)
class TrainARConfig:
    model: str = "tiny"  # a DiT config name (models/config.py)
    init: str = "tiny"  # tiny (random, seeded) | a local Wan2.2-TI2V-5B transformer folder (either layout)
    init_seed: int = 0
    seed: int = 0  # samples, windows, timesteps and noise are drawn from (seed, step, slot)
    steps: int = 600
    grad_accum: int = 2  # micro-batches of one sample per rank per step
    chunk_frames: int = 8  # latent frames per chunk (num_frame_per_block): one timestep each
    max_latent_frames: int = 96  # a longer sample is cut to a window of this many (a whole number of chunks)
    shot_rope_offset: int = 8  # frame positions jump by this at each new shot
    latent_source: str = "cache"  # cache: data/latents' shards | online: each rank VAE-encodes its frames + halo
    timestep_shift: float = 5.0
    num_train_timesteps: int = 1000
    optimizer: OptimizerConfig = OptimizerConfig()
    ema: EMAConfig = EMAConfig()
    precision: PrecisionConfig = PrecisionConfig()
    error_recycling: ErrorRecyclingConfig = ErrorRecyclingConfig()
    activation_checkpointing: str = "none"  # none | full | selective (op-level) | compiler (compile's partitioner)
    # | budget (op-level, planned from a profile of the blocks under ac_memory_limit_gib)
    ac_budget: float = 0.5  # compiler: the share of a compiled backward's activations kept (the rest recomputed)
    ac_memory_limit_gib: float | None = None  # budget: the step's peak per device; null: 0.9 of the GPU's memory
    # budget: GiB the plan aims below the limit, where the step measured more than its plan predicted
    ac_plan_margin_gib: float = 0.0
    compile: bool = False  # torch.compile each block (after activation checkpointing, before FSDP)
    attention: str = "rows"  # self-attention: rows (the mask's dense rows on SDPA's fused kernels) | flex (GPUs)
    parallel: ParallelConfig = flat_section(ParallelConfig())  # nnodes, nproc, sp, sharding, device
    val_every: int = 50  # validation loss every N steps (and at the last); 0: never
    val_samples: int = 8  # the first N val-split samples, at fixed timesteps and noise
    checkpoint: CheckpointConfig = flat_section(CheckpointConfig())
    log_every: int = 1
    peak_tflops: float | None = None  # MFU's denominator; null: the device's dense BF16 datasheet figure
    export_dtype: str = "bfloat16"  # the EMA weights written to models/ar/

    # what changes no number a checkpoint holds, only how the same math is scheduled, logged or kept
    # (the lineage records the schedule of each step range): a run resumes across a change of these
    RESUMABLE_ACROSS = ("steps", "val_every", "val_samples", "checkpoint", "log_every", "peak_tflops", "export_dtype",
                        "parallel.device", "attention", "activation_checkpointing", "ac_budget",
                        "ac_memory_limit_gib", "ac_plan_margin_gib", "compile", "precision.sqnr_every")

    def validate(self, where: str) -> None:
        if self.model not in DIT_CONFIGS:
            raise ConfigError(f"{where}.model must be one of {', '.join(DIT_CONFIGS)}; got {self.model!r}")
        positive = ("steps", "grad_accum", "chunk_frames", "max_latent_frames", "num_train_timesteps", "log_every")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be at least 1; got {getattr(self, key)}")
        if self.max_latent_frames % self.chunk_frames:
            raise ConfigError(f"{where}.max_latent_frames ({self.max_latent_frames}) must be a multiple of "
                              f"chunk_frames ({self.chunk_frames}): windows end on a chunk boundary")
        if self.timestep_shift <= 0 or self.shot_rope_offset < 0 or self.val_every < 0 or self.val_samples < 0:
            raise ConfigError(f"{where}: timestep_shift must be > 0; shot_rope_offset, val_every, val_samples >= 0")
        if self.activation_checkpointing not in ("none", "full", "selective", "compiler", "budget"):
            raise ConfigError(f"{where}.activation_checkpointing must be none, full, selective, compiler or budget; "
                              f"got {self.activation_checkpointing!r}")
        if self.activation_checkpointing == "compiler" and not self.compile:
            raise ConfigError(f"{where}.activation_checkpointing: compiler is the compiler's own recomputation: set "
                              f"{where}.compile: true, or choose full or selective")
        if self.activation_checkpointing == "budget" and self.precision.forward_bf16_from_step is not None:
            raise ConfigError(f"{where}.activation_checkpointing: budget plans the NVFP4 forward's ops, and "
                              f"precision.forward_bf16_from_step switches to another forward at step "
                              f"{self.precision.forward_bf16_from_step}: use compiler or full with it")
        if not 0 < self.ac_budget <= 1:
            raise ConfigError(f"{where}.ac_budget must be in (0, 1]; got {self.ac_budget}")
        if self.ac_memory_limit_gib is not None and not self.ac_memory_limit_gib > 0:
            raise ConfigError(f"{where}.ac_memory_limit_gib must be > 0 (GiB of the step's peak per device) or null "
                              f"(0.9 of the GPU's memory); got {self.ac_memory_limit_gib}")
        if not self.ac_plan_margin_gib >= 0 or (self.ac_memory_limit_gib is not None
                                                 and self.ac_plan_margin_gib >= self.ac_memory_limit_gib):
            raise ConfigError(f"{where}.ac_plan_margin_gib must be >= 0 and below ac_memory_limit_gib; got "
                              f"{self.ac_plan_margin_gib}")
        if self.attention not in ("rows", "flex"):
            raise ConfigError(f"{where}.attention must be rows or flex; got {self.attention!r}")
        if self.latent_source not in ("cache", "online"):
            raise ConfigError(f"{where}.latent_source must be cache or online; got {self.latent_source!r}")
        if self.export_dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"{where}.export_dtype must be bfloat16 or float32; got {self.export_dtype!r}")
        self._validate_sp(where)

    def _validate_sp(self, where: str) -> None:
        if self.max_latent_frames % (self.sp * self.chunk_frames):
            raise ConfigError(f"{where}.max_latent_frames ({self.max_latent_frames}) must be a multiple of sp x "
                              f"chunk_frames ({self.sp} x {self.chunk_frames}): each rank holds whole chunks")
        heads = DIT_CONFIGS[self.model].num_heads
        if heads % self.sp:
            raise ConfigError(f"{where}.sp ({self.sp}) must divide the {heads} attention heads of model "
                              f"{self.model}: the all-to-all gives each rank heads / sp of them")
        buckets = self.error_recycling.position_buckets
        if self.error_recycling.enabled and buckets % self.sp:
            raise ConfigError(f"{where}.error_recycling.position_buckets ({buckets}) must be a multiple of sp "
                              f"({self.sp}): each sequence-parallel rank holds whole position buckets")

    @property
    def sp(self) -> int:
        return self.parallel.sp

    @property
    def global_batch(self) -> int:
        return self.parallel.dp_size * self.grad_accum

    def resume_params(self) -> dict:
        """What a checkpoint must have been trained with to be resumed."""
        return without_keys(self, self.RESUMABLE_ACROSS)
