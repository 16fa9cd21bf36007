"""The typed configurations of DMD distillation and the W4A4 merge (``params.yaml``'s ``distill_dmd``
and ``merge_w4a4`` sections): nothing here imports torch."""
from __future__ import annotations

import dataclasses

from longlive_core.config import ConfigError, flat_section, without_keys
from longlive_core.distributed.config import ParallelConfig
from longlive_core.infer.config import RolloutConfig
from longlive_core.quant.config import NVFP4_RECIPE_NAMES, RECIPE_NAMES
from longlive_core.train.config import CheckpointConfig, OptimizerConfig


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    rank: int = 128
    alpha: float = 128.0
    dropout: float = 0.0

    def validate(self, where: str) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"{where}: rank must be >= 1, alpha > 0 and dropout in [0, 1)")


@dataclasses.dataclass(frozen=True)
class DistillDMDConfig:
    seed: int = 0  # prompts, noise, exit steps and score timesteps are keyed by (seed, step, slot)
    steps: int = 5000  # critic steps; the generator steps on every generator_every-th
    generator_every: int = 5
    latent_frames: int = 32  # generated per sample (whole chunks of models/ar's chunk_frames)
    grad_frames: int = 32  # the last frames whose exit step carries the generator's gradient
    denoising_steps: tuple[int, ...] = (1000, 946, 854, 681, 0)
    window: int | None = 32  # latent frames a rollout chunk attends to, itself and the sinks included; null: all
    global_sink: int = 8  # the video's first latent frames, kept in the rollout's cache (as inference)
    shot_sink: int = 8  # the current shot's first latent frames, kept while the shot lasts
    real_guidance: float = 3.0  # real = cond + g (cond - uncond) against the empty prompt
    fake_guidance: float = 0.0
    timestep_shift: float = 5.0
    min_timestep: float = 20.0
    max_timestep: float = 980.0
    lora: LoRASettings = LoRASettings()
    generator_optimizer: OptimizerConfig = OptimizerConfig(lr=1e-5)
    critic_optimizer: OptimizerConfig = OptimizerConfig(lr=2e-6)
    recipe: str = "nvfp4"  # the frozen backbone's: nvfp4 | nvfp4-4over6 (held packed) | bf16
    param_dtype: str = "bfloat16"  # the compute copy FSDP gathers (adapters); masters float32
    activation_checkpointing: str = "none"  # none | full | selective | budget, as train_ar's (every role's blocks)
    ac_memory_limit_gib: float | None = None  # budget: the step's peak per device; null: 0.9 of the GPU's memory
    # budget: GiB the plan aims below the limit, where the step measured more than its plan predicted
    ac_plan_margin_gib: float = 0.0
    stats_every: int = 100  # latent statistics of generated samples against the teacher's; 0: never
    stats_samples: int = 2  # val-split prompts, fixed
    teacher_steps: int = 16  # the teacher's sampling steps for those statistics (its shifted schedule)
    memory_comparison: bool = False  # after the run: one iteration's peak GPU memory against BF16 full weights
    parallel: ParallelConfig = flat_section(ParallelConfig())  # nnodes, nproc, sp (ranks distilling one prompt)
    checkpoint: CheckpointConfig = flat_section(CheckpointConfig())
    log_every: int = 1

    RESUMABLE_ACROSS = ("steps", "stats_every", "stats_samples", "teacher_steps", "memory_comparison", "checkpoint",
                        "log_every", "parallel.device", "activation_checkpointing", "ac_memory_limit_gib",
                        "ac_plan_margin_gib")

    def validate(self, where: str) -> None:
        for key in ("steps", "generator_every", "latent_frames", "grad_frames", "log_every", "teacher_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be at least 1; got {getattr(self, key)}")
        try:
            RolloutConfig(steps=tuple(self.denoising_steps), window=None)
        except ValueError as exc:
            raise ConfigError(f"{where}.denoising_steps: {exc}") from None
        if (self.window is not None and self.window < 1) or self.global_sink < 0 or self.shot_sink < 0:
            raise ConfigError(f"{where}: window must be at least 1 (or null) and the sinks at least 0; the window "
                              "must also hold both sinks and a chunk (checked against the AR model's chunk)")
        if not 0 <= self.min_timestep < self.max_timestep <= 1000 or self.timestep_shift <= 0:
            raise ConfigError(f"{where}: need 0 <= min_timestep < max_timestep <= 1000 and timestep_shift > 0")
        if self.recipe not in RECIPE_NAMES:
            raise ConfigError(f"{where}.recipe must be one of {', '.join(RECIPE_NAMES)}; got {self.recipe!r}")
        if self.param_dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"{where}.param_dtype must be bfloat16 or float32; got {self.param_dtype!r}")
        if self.activation_checkpointing not in ("none", "full", "selective", "budget"):
            raise ConfigError(f"{where}.activation_checkpointing must be none, full, selective or budget "
                              "(distillation does not compile its blocks, so compiler is not offered); got "
                              f"{self.activation_checkpointing!r}")
        if self.ac_memory_limit_gib is not None and not self.ac_memory_limit_gib > 0:
            raise ConfigError(f"{where}.ac_memory_limit_gib must be > 0 (GiB of the step's peak per device) or null "
                              f"(0.9 of the GPU's memory); got {self.ac_memory_limit_gib}")
        if not self.ac_plan_margin_gib >= 0 or (self.ac_memory_limit_gib is not None
                                                 and self.ac_plan_margin_gib >= self.ac_memory_limit_gib):
            raise ConfigError(f"{where}.ac_plan_margin_gib must be >= 0 and below ac_memory_limit_gib; got "
                              f"{self.ac_plan_margin_gib}")
        if self.activation_checkpointing == "budget" and self.sp > 1:
            raise ConfigError(f"{where}.activation_checkpointing: budget plans distillation with one rank per prompt "
                              f"(sp: 1), and sp is {self.sp}: use full or selective with sequence parallelism")
        if self.lora.dropout > 0 and self.activation_checkpointing != "none":
            raise ConfigError(f"{where}.lora.dropout is {self.lora.dropout} with activation_checkpointing "
                              f"{self.activation_checkpointing}: the recomputation would draw other dropout masks than "
                              "the forward (wrong gradients); set lora.dropout: 0 or activation_checkpointing: none")
        if self.stats_every < 0 or self.stats_samples < 0:
            raise ConfigError(f"{where}: stats_every and stats_samples must be >= 0")
        self.lora.validate(f"{where}.lora")
        self.generator_optimizer.validate(f"{where}.generator_optimizer")
        self.critic_optimizer.validate(f"{where}.critic_optimizer")

    def check_chunk(self, chunk_frames: int) -> None:
        """Refuses frame counts that are not whole chunks of the AR model's ``chunk_frames``, and
        chunks or windows that do not split over ``sp`` ranks."""
        for key in ("latent_frames", "grad_frames"):
            if getattr(self, key) % chunk_frames:
                raise ConfigError(f"distill_dmd.{key} ({getattr(self, key)}) must be a whole number of the AR "
                                  f"model's {chunk_frames}-frame chunks")
        try:
            self.rollout(chunk_frames)
        except ValueError as exc:
            raise ConfigError(f"distill_dmd: {exc}") from None
        if chunk_frames % self.sp or self.latent_frames % (self.sp * chunk_frames):
            raise ConfigError(f"distill_dmd.sp ({self.sp}) must divide the {chunk_frames}-frame chunks (the rollouts "
                              f"split each one) and latent_frames ({self.latent_frames}) must be whole chunks per rank")

    def rollout(self, chunk_frames: int) -> RolloutConfig:
        return RolloutConfig(chunk_frames, tuple(self.denoising_steps), self.window, self.global_sink, self.shot_sink)

    @property
    def sp(self) -> int:
        return self.parallel.sp

    def resume_params(self) -> dict:
        """What a checkpoint must have been distilled with to be resumed."""
        return without_keys(self, self.RESUMABLE_ACROSS)


@dataclasses.dataclass(frozen=True)
class MergeW4A4Config:
    recipe: str = "nvfp4"  # nvfp4 (16x16 weight tiles) | nvfp4-4over6
    dtype: str = "bfloat16"  # the tensors outside the packed layers (the skip list, norms, modulation)
    calibration_inputs: int = 8  # fixed chunk inputs whose layer inputs calibrate input_global_scale
    eval_inputs: int = 8  # other fixed chunk inputs for the W4A4-against-BF16 output error
    seed: int = 0
    max_rel_error: float = 0.1  # the W4A4 model's output error against the BF16 merged model; over it, the merge fails
    device: str = "auto"
    example_captions: int = 4096  # train captions kept in the folder as prompt enhancement's examples (0: none)

    def validate(self, where: str) -> None:
        if self.recipe not in NVFP4_RECIPE_NAMES:
            raise ConfigError(f"{where}.recipe must be an NVFP4 recipe ({', '.join(NVFP4_RECIPE_NAMES)}); got "
                              f"{self.recipe!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"{where}.dtype must be bfloat16 or float32; got {self.dtype!r}")
        if self.calibration_inputs < 1 or self.eval_inputs < 1:
            raise ConfigError(f"{where}: calibration_inputs and eval_inputs must be at least 1")
        if not self.max_rel_error > 0:
            raise ConfigError(f"{where}.max_rel_error must be > 0; got {self.max_rel_error}")
        if self.example_captions < 0:
            raise ConfigError(f"{where}.example_captions must be >= 0 (0: no example bank); got "
                              f"{self.example_captions}")
