"""DMD distillation with self-forcing rollouts: the AR model (``models/ar/``) made a few-step generator.

Every rank runs ``distill``. Step s (a critic step) draws a prompt for each rank's slot from the
train split of the latent cache (its captions, frame positions and shot layout over a window of
``latent_frames``), an exit step (drawn on rank 0, broadcast) and noise. When s is a generator step
(every ``generator_every``-th) the generator rolls the video out chunk by chunk with its KV cache,
the last chunks' exit step carrying the gradient, and steps on the DMD loss; then the critic (the
fake score) steps on the flow loss of a fresh, detached rollout. The scores read the generated video
in the teacher-forcing layout of training (the video as the clean context, its noised copy as the
noisy chunks), one timestep for the whole sample. A step whose loss or gradient norm is not finite
leaves that optimizer's weights alone and is counted. Checkpoints hold the adapters and both
optimizers; a killed run resumes from its last one, never from the AR model.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from longlive_core.config import ConfigError
from longlive_core.devices import pick_device
from longlive_core.distill.ac_planning import DistillPlanner
from longlive_core.distill.config import DistillDMDConfig
from longlive_core.distill.dmd import (
    critic_loss,
    dmd_gradient,
    dmd_timesteps,
    generator_loss,
    guided,
    is_generator_step,
)
from longlive_core.distill.roles import FullRoles, LoRARoles
from longlive_core.distributed.ac_budget import BudgetCheckpointing, default_cache_dir
from longlive_core.distributed.parallelize import ParallelizePlan, parallel_dims, parallelize_dit
from longlive_core.distributed.ulysses import gather_frames, gather_video, rank_frames
from longlive_core.infer.rollout import RolloutConfig, rollout, teacher_schedule
from longlive_core.latents.files import EMPTY_PROMPT
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.folder import read_dit_folder
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.checkpointing import CheckpointStore, agree
from longlive_core.train.data import LatentSamples, TrainSample, generator_for
from longlive_core.train.forward import layout_of, teacher_forcing_velocity
from longlive_core.train.loop import LoopSettings, MetricsSink, peak_memory_mb, run_steps, sum_over_ranks

log = logging.getLogger(__name__)
STAGE = "distill_dmd"
EVAL_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)  # where on the score's timestep schedule the critic is evaluated


@dataclasses.dataclass(frozen=True)
class DistillInputs:
    ar_model: Path  # models/ar: the weights and config.json
    latents: Path  # data/latents: the prompts' caption embeddings and the empty prompt's
    checkpoints: Path  # checkpoints/distill_dmd: a folder per run digest
    digest_components: dict[str, str] | None  # what a checkpoint must match to be resumed (rank 0's; None elsewhere)
    ac_plans: Path | None = None  # activation_checkpointing budget's plan cache; None: $XDG_CACHE_HOME/longlive/


@dataclasses.dataclass
class Prompt:
    sample: TrainSample  # captions, shot of each frame, RoPE positions of the window (its latents: the data's)
    noise: torch.Tensor  # (1, C, F, h, w)


class PhaseTimes:
    """Seconds spent in each named phase of the steps, the device synchronized at every boundary: for
    benchmarks (a trainer without one never synchronizes inside a step)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] += time.perf_counter() - t0


class DMDTrainer:
    """The three roles, both optimizers, the prompts and the checkpoints of one rank."""

    phases: PhaseTimes | None = None  # set by benchmarks

    def _phase(self, name: str):
        return self.phases(name) if self.phases is not None else contextlib.nullcontext()

    def __init__(self, cfg: DistillDMDConfig, inputs: DistillInputs, full_weights: bool = False):
        self.cfg, self.inputs = cfg, inputs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = pick_device(cfg.parallel.device, "distill_dmd.device")
        self.dims = parallel_dims(cfg.parallel, self.device.type, STAGE)
        self.shard = self.dims.shard
        self.slot = self.dims.dp_rank  # the SP group's: its ranks distil one prompt together
        self.dtype = getattr(torch, cfg.param_dtype)
        ar = read_dit_folder(inputs.ar_model, "train_ar")
        self.chunk = ar.latent.chunk_frames
        cfg.check_chunk(self.chunk)
        heads = ar.dit_config.num_heads
        if heads % cfg.sp:
            raise ConfigError(f"distill_dmd.sp ({cfg.sp}) must divide the AR model's {heads} attention heads")
        self.rollout_cfg: RolloutConfig = cfg.rollout(self.chunk)
        shot_offset = ar.multi_shot.shot_rope_offset
        # every window exactly latent_frames long: each rank then runs as many forwards per step (FSDP's
        # gathers are collective), whatever prompt it drew
        self.prompts = LatentSamples(inputs.latents, "train", self.chunk, shot_offset, align=cfg.latent_frames)
        if not len(self.prompts):
            raise ConfigError(f"no train-split sample in {inputs.latents} has distill_dmd.latent_frames "
                              f"({cfg.latent_frames}) latent frames ({self.prompts.too_short} shorter): lower it or "
                              "encode longer samples")
        val = LatentSamples(inputs.latents, "val", self.chunk, shot_offset, align=cfg.latent_frames)
        self.stats_prompts = val if len(val) else self.prompts
        empty = inputs.latents / EMPTY_PROMPT
        if not empty.is_file():
            raise ConfigError(f"{empty} is missing: rerun encode_latents (it stores the empty prompt for guidance)")
        self.empty_text = load_file(str(empty))["text"].float()[None]  # (1, T, D): one caption
        base = load_dit(inputs.ar_model, ar.dit_config, dtype=torch.float32)
        precision = ar.precision
        with torch.random.fork_rng(devices=[]):  # the adapters' initial A matrices: the same on every rank and run
            torch.manual_seed(generator_for(cfg.seed, "lora-init").initial_seed())
            self.roles = (FullRoles(base) if full_weights else
                          LoRARoles(base, cfg.lora, cfg.recipe, precision.skip, precision.keep_last_blocks))
        self.budget = BudgetCheckpointing() if cfg.activation_checkpointing == "budget" else None
        plan = ParallelizePlan(activation_checkpointing=cfg.activation_checkpointing, param_dtype=self.dtype,
                               budget=self.budget)
        for module in self.roles.modules:  # the roles converted their linears themselves (packed, frozen)
            parallelize_dit(module, self.dims, plan, self.device)
        self.critic_opt = cfg.critic_optimizer.build(self.roles.critic_params(), self.device)
        self.generator_opt = cfg.generator_optimizer.build(self.roles.generator_params(), self.device)
        self.optimizers = (self.critic_opt, self.generator_opt)
        self.planner = None
        if self.budget is not None:
            first = self.prompts.load(self.prompts.sample_ids[0], cfg.latent_frames, None)
            _, _, h, w = first.latents.shape
            _, ph, pw = ar.dit_config.patch_size
            self.planner = DistillPlanner(self.budget, cfg, self.roles.modules[0], len(self.roles.modules),
                                          self.critic_opt, self.chunk, (h // ph, w // pw), self.empty_text.shape[1],
                                          self.device, self.dtype, inputs.ac_plans or default_cache_dir(),
                                          {"generator": self.roles.generator_params(),
                                           "critic": self.roles.critic_params()})
            self.planner.plan()
        self.store = CheckpointStore(inputs.checkpoints, cfg.checkpoint.keep_checkpoints, cfg.checkpoint.keep_runs,
                                     inputs.digest_components, self.roles.is_checkpointed)

    # ------------------------------------------------------------------ draws
    def _prompt(self, data: LatentSamples, key: tuple, sample_id: str | None = None) -> Prompt:
        g = generator_for(self.cfg.seed, *key)
        sample = data.load(sample_id or data.draw(g), self.cfg.latent_frames, g if sample_id is None else None)
        c, f, h, w = sample.latents.shape
        return Prompt(sample, torch.randn((1, c, f, h, w), generator=g))

    def _exit_index(self, step: int) -> int:
        """The denoising step every chunk of the step's rollouts stops at: drawn on rank 0, broadcast."""
        value = None
        if self.rank == 0:
            g = generator_for(self.cfg.seed, "exit", step)
            value = int(torch.randint(0, len(self.rollout_cfg.steps) - 1, (1,), generator=g))
        return agree(value)

    # ------------------------------------------------------------------ model calls
    def generate(self, model: WanDiT, prompt: Prompt, key: tuple, exit_index: int | None = None,
                 grad: bool = False, cfg: RolloutConfig | None = None) -> torch.Tensor:
        """The rollout for ``prompt``, each chunk reading its own shot's caption, the cache's shot sink
        moving where the sample starts a shot (as inference); with ``grad``, the exit step of the last
        ``grad_frames`` frames carries the gradient. Under sequence parallelism this rank's frames of
        every chunk (``video`` joins them)."""
        s, cfg = prompt.sample, cfg or self.rollout_cfg
        frames = s.latents.shape[1]
        n = frames // self.chunk
        shots = [int(s.shot_of_frame[c * self.chunk]) for c in range(n)]
        texts = [s.text[shot][None].to(self.device, self.dtype) for shot in shots]
        grad_from = max(0, n - self.cfg.grad_frames // self.chunk) if grad else None
        return rollout(model, prompt.noise.to(self.device), texts, cfg, generator_for(self.cfg.seed, "rollout", *key),
                       s.positions.to(self.device), exit_index, grad_from, self.dtype, self.shard, shots)

    def video(self, x: torch.Tensor) -> torch.Tensor:
        """The whole generated video from every SP rank's frames of it (detached)."""
        return gather_video(x, self.shard, self.chunk).detach()

    def _slice(self, s: TrainSample) -> tuple[int, int]:
        """This rank's frames [lo, hi) of the teacher-forcing layout (whole chunks)."""
        return layout_of(self.roles.modules[0], s, self.chunk, self.shard.size).frame_range(self.shard.rank)

    def _noised(self, x: torch.Tensor, key: tuple, u: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_t, the noise, sigma (1, 1)): x noised at one timestep of the shifted, clamped schedule, at
        quantile ``u`` (default: drawn)."""
        g = generator_for(self.cfg.seed, "score", *key)
        c = self.cfg
        u_t = torch.rand(1, generator=g) if u is None else torch.tensor([u])
        t = dmd_timesteps(u_t, c.timestep_shift, c.min_timestep, c.max_timestep)
        sigma = (t / 1000.0).to(self.device)[:, None]
        noise = torch.randn(x.shape, generator=g).to(self.device)
        return (1 - sigma[..., None, None, None]) * x + sigma[..., None, None, None] * noise, noise, sigma

    def _velocity(self, model: WanDiT, x: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, s: TrainSample,
                  text: torch.Tensor | None = None) -> torch.Tensor:
        """A score's velocity for this rank's frames (all of them on one rank) of x_t in the
        teacher-forcing layout, the generated x (whole video) as the clean context; ``text`` (1, T, D)
        replaces the captions (the empty prompt)."""
        layout = layout_of(model, s, self.chunk, self.shard.size)
        lo, hi = layout.frame_range(self.shard.rank)
        return teacher_forcing_velocity(model, layout, x[:, :, lo:hi], x_t[:, :, lo:hi],
                                        sigma.expand(1, (hi - lo) // self.chunk), s.text if text is None else text,
                                        s.shot_of_frame[lo:hi], s.positions[lo:hi], self.dtype)

    def _x0(self, model: WanDiT, x: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor, s: TrainSample,
            text: torch.Tensor | None = None) -> torch.Tensor:
        """The x0 a score predicts for this rank's frames of the layout."""
        lo, hi = self._slice(s)
        return x_t[:, :, lo:hi] - sigma[..., None, None, None] * self._velocity(model, x, x_t, sigma, s, text)

    # ------------------------------------------------------------------ steps
    def _plan(self, name: str) -> None:
        """activation_checkpointing budget: the plan of the gradient pass that follows."""
        if self.planner is not None:
            self.planner.use(name)

    def _enter(self, name: str) -> None:
        """activation_checkpointing budget: the step's peak from here on (its rollout included) is ``name``'s pass's."""
        if self.planner is not None:
            self.planner.peak.enter(name)

    def critic_pass(self, prompt: Prompt, key: tuple, exit_index: int) -> torch.Tensor:
        """The critic's flow loss on a fresh, detached rollout."""
        self._enter("critic")
        with self._phase("critic/rollout"), self.roles.generator() as generator, torch.no_grad():
            x = self.video(self.generate(generator, prompt, ("critic", *key), exit_index))
        self._plan("critic")
        with self._phase("critic/fake_score"):
            return self._flow_loss(prompt, x, ("critic", *key))

    def _flow_loss(self, prompt: Prompt, x: torch.Tensor, key: tuple, u: float | None = None, role: str = "fake"
                   ) -> torch.Tensor:
        """A score's flow-matching loss on the generated (detached, whole) x: the fake score's (the
        critic's), or the real one's; over this rank's frames under sequence parallelism."""
        x_t, noise, sigma = self._noised(x, key, u)
        with getattr(self.roles, role)() as model:
            v = self._velocity(model, x, x_t, sigma, prompt.sample)
        lo, hi = self._slice(prompt.sample)
        return critic_loss(v, x[:, :, lo:hi], noise[:, :, lo:hi])

    def generator_pass(self, prompt: Prompt, key: tuple, exit_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The DMD loss of a rollout with gradient, and the mean |DMD gradient| (after normalisation)."""
        cfg, s = self.cfg, prompt.sample
        self._enter("generator")
        self._plan("generator")
        with self._phase("generator/rollout"), self.roles.generator() as generator:
            mine = self.generate(generator, prompt, ("generator", *key), exit_index, grad=True)
        x = self.video(mine)
        x_t, _, sigma = self._noised(x, ("generator", *key))
        lo, hi = self._slice(s)
        with torch.no_grad():
            with self._phase("generator/fake_score"), self.roles.fake() as fake:
                fake_x0 = self._x0(fake, x, x_t, sigma, s)
                if cfg.fake_guidance:
                    fake_x0 = guided(fake_x0, self._x0(fake, x, x_t, sigma, s, self.empty_text), cfg.fake_guidance)
            with self._phase("generator/real_score"), self.roles.real() as real:
                cond = self._x0(real, x, x_t, sigma, s)
                uncond = self._x0(real, x, x_t, sigma, s, self.empty_text)
            grad = dmd_gradient(x[:, :, lo:hi], fake_x0, guided(cond, uncond, cfg.real_guidance), self.chunk)
            grad = gather_frames(grad, self.shard)  # the slices' gradients, whole; then this rank's rollout frames
        return generator_loss(mine, rank_frames(grad, self.shard, self.chunk)), grad.abs().mean()

    def _optimizer_step(self, role: str, loss: torch.Tensor, params: list, optimizer: torch.optim.Optimizer,
                        grad_clip: float) -> tuple[float, float, bool]:
        """Backward, clip and step (skipped when the world's loss or the gradient norm is not finite);
        returns (the world's mean loss, grad norm, stepped)."""
        with self._phase(f"{role}/backward"):
            loss.backward()
        with self._phase(f"{role}/optimizer"):
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip else math.inf)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            mean, = sum_over_ranks([loss.detach()], self.device)
            mean /= self.world
            finite = math.isfinite(mean) and math.isfinite(norm)
            if finite:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return mean, norm, finite

    def train_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        key = (step, self.slot)  # one prompt slot per SP group (per rank without SP)
        prompt = self._prompt(self.prompts, ("prompt", *key))
        exit_index = self._exit_index(step)
        metrics: dict[str, float] = {"exit_index": exit_index}
        skipped = 0
        if is_generator_step(step, cfg.generator_every):
            loss, grad_abs = self.generator_pass(prompt, key, exit_index)
            # activation checkpointing recomputes the rollout's exit steps in the backward: with the generator's adapter
            with self.roles.generator():
                mean, norm, ok = self._optimizer_step("generator", loss, self.roles.generator_params(),
                                                      self.generator_opt, cfg.generator_optimizer.grad_clip)
            metrics.update({"dmd_loss": mean, "generator_grad_norm": norm, "dmd_grad_mean_abs": float(grad_abs)})
            skipped += not ok
        loss = self.critic_pass(prompt, key, exit_index)
        mean, norm, ok = self._optimizer_step("critic", loss, self.roles.critic_params(), self.critic_opt,
                                              cfg.critic_optimizer.grad_clip)
        metrics.update({"critic_loss": mean, "critic_grad_norm": norm})
        metrics["skipped"] = skipped + (not ok)
        return metrics

    def _sample_mean(self, loss: torch.Tensor) -> float:
        """A loss over this rank's frames -> the sample's (the mean over its SP group's equal slices)."""
        if self.shard.size == 1:
            return float(loss)
        total = loss.detach().reshape(1).double()
        dist.all_reduce(total, group=self.shard.group)
        return float(total) / self.shard.size

    @torch.no_grad()
    def latent_stats(self) -> dict[str, float]:
        """On fixed val prompts: mean and std of a few generated samples (the full few-step rollout)
        against the teacher's (the AR model over its own shifted schedule) and the data's; and the
        critic's flow loss on those samples at fixed timesteps (``EVAL_QUANTILES`` of the score
        schedule) and noise, which, unlike the training loss, does not swing with the drawn timestep."""
        cfg, data = self.cfg, self.stats_prompts
        teacher = dataclasses.replace(self.rollout_cfg, steps=teacher_schedule(cfg.teacher_steps, cfg.timestep_shift))
        made: dict[str, list[torch.Tensor]] = {"generated": [], "teacher": [], "data": []}
        critic: list[float] = []
        teacher_fit: list[float] = []
        for i in range(cfg.stats_samples):
            prompt = self._prompt(data, ("stats", i), data.sample_ids[i % len(data)])
            with self.roles.generator() as generator:
                x = self.video(self.generate(generator, prompt, ("stats", i)))
            for role, losses in (("fake", critic), ("real", teacher_fit)):
                losses += [self._sample_mean(self._flow_loss(prompt, x, ("critic-eval", i, j), u, role))
                           for j, u in enumerate(EVAL_QUANTILES)]
            made["generated"].append(x.float().cpu())
            with self.roles.real() as real:
                made["teacher"].append(self.video(self.generate(real, prompt, ("stats-teacher", i), cfg=teacher))
                                       .float().cpu())
            made["data"].append(prompt.sample.latents)
        out = {"critic_eval_loss": sum(critic) / len(critic), "teacher_eval_loss": sum(teacher_fit) / len(teacher_fit)}
        out["critic_eval_ratio"] = out["critic_eval_loss"] / max(out["teacher_eval_loss"], 1e-12)
        for name, xs in made.items():
            x = torch.cat([t.flatten() for t in xs])
            out[f"latent_{name}_mean"], out[f"latent_{name}_std"] = float(x.mean()), float(x.std())
        out["latent_std_ratio"] = out["latent_generated_std"] / max(out["latent_teacher_std"], 1e-12)
        return out

    # ------------------------------------------------------------------ the run
    def after_step(self, done: int, seconds: float, metrics: dict[str, float]) -> dict[str, float]:
        """The step's time and peak memory; the latent statistics every ``stats_every`` steps, at the
        first (where the critic and the generator started) and at the last."""
        cfg = self.cfg
        out = {**metrics, "step_s": seconds, "peak_memory_mb": self._peak_mb()}
        if self.planner is not None:
            self.planner.check_peak(done)
        if cfg.stats_every and cfg.stats_samples and (done % cfg.stats_every == 0 or done in (1, cfg.steps)):
            # no-grad rollouts that no plan counts: their peak is kept out of the next step's check
            with self.planner.peak.excluded() if self.planner is not None else contextlib.nullcontext():
                out.update(self.latent_stats())
            self.critic_eval.append(out["critic_eval_loss"])
        self.critic_losses.append(out["critic_loss"])
        self.last_metrics = out
        return out

    def _peak_mb(self) -> float:
        """The run's peak so far, the latent statistics' included."""
        return peak_memory_mb(self.device, None if self.planner is None else self.planner.peak)

    def checkpointed(self) -> tuple:
        return self.roles.checkpointed, self.optimizers, {}

    def rank_state(self) -> None:
        return None

    def load_rank_state(self, tensors: dict) -> None:
        raise AssertionError("distillation keeps no per-rank state")

    def schedule(self) -> dict:
        ac = self.cfg.activation_checkpointing
        return {"activation_checkpointing": ac, "device": self.device.type,
                **({"ac_memory_limit_gib": self.cfg.ac_memory_limit_gib} if ac == "budget" else {})}

    def run(self, sink: MetricsSink | None = None, stop_after: int | None = None) -> dict:
        """Distils from the newest intact checkpoint of this run digest at or before ``cfg.steps`` to
        ``cfg.steps`` (``loop.run_steps``); returns the summary and (on rank 0) the generator's adapter
        under ``"adapter_state"`` (LoRA roles)."""
        cfg = self.cfg
        self.critic_losses: list[float] = []
        self.critic_eval: list[float] = []
        self.last_metrics: dict[str, float] = {}
        summary = run_steps(self, LoopSettings(STAGE, cfg.steps, cfg.seed, cfg.log_every, cfg.checkpoint), sink,
                            stop_after)
        summary.update({"conversion": self.roles.conversion.summary(), "prompts_train": len(self.prompts),
                        "peak_memory_mb": self._peak_mb(),
                        **{k: v for k, v in self.last_metrics.items() if k.startswith("latent_")}})
        losses = self.critic_losses
        if losses:
            head, tail = losses[: max(1, len(losses) // 5)], losses[-max(1, len(losses) // 5):]
            summary.update({"critic_loss_first": sum(head) / len(head), "critic_loss_last": sum(tail) / len(tail)})
        if self.critic_eval:
            summary.update({"critic_eval_loss_first": self.critic_eval[0],
                            "critic_eval_loss_last": self.critic_eval[-1]})
        if self.planner is not None:
            summary.update(self.planner.summary())
        if isinstance(self.roles, LoRARoles):
            summary["adapter_state"] = self.roles.generator_adapter()
        return summary


def distill(cfg: DistillDMDConfig, inputs: DistillInputs, sink: MetricsSink | None = None,
            stop_after: int | None = None) -> dict:
    return DMDTrainer(cfg, inputs).run(sink, stop_after)


def comparison_config(cfg: DistillDMDConfig) -> DistillDMDConfig:
    """What ``memory_comparison`` runs: one iteration a generator and a critic step, no statistics, and
    ``budget`` checkpointing measured as ``full``: a budget plan fills the GPU to its limit whatever the
    weights, so its peak would compare the limit with itself; ``full``'s peak is what each needs."""
    ac = "full" if cfg.activation_checkpointing == "budget" else cfg.activation_checkpointing
    return dataclasses.replace(cfg, generator_every=1, stats_every=0, activation_checkpointing=ac)


def memory_comparison(cfg: DistillDMDConfig, inputs: DistillInputs, scratch: Path) -> dict:
    """Collective: the peak GPU memory of one iteration (a generator and a critic step) of this
    configuration against BF16 full-weight distillation (three whole copies, two of them trained)
    on the same config (``comparison_config``), each from a fresh trainer; ``scratch`` takes their
    checkpoint folders. Measured on CUDA only: a CPU process's peak RSS mixes in everything else it ever
    held."""
    device = pick_device(cfg.parallel.device, "distill_dmd.device")
    if device.type != "cuda":
        return {"measured": False, "reason": "GPU memory is measured on CUDA devices only"}
    one = comparison_config(cfg)
    peaks = {}
    for name, full in (("configured", False), ("bf16_full_weights", True)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        trainer = DMDTrainer(dataclasses.replace(one, recipe="bf16") if full else one,
                             dataclasses.replace(inputs, checkpoints=scratch / name), full_weights=full)
        trainer.train_step(0)
        torch.cuda.synchronize(device)
        peaks[name] = torch.cuda.max_memory_allocated(device) / 2**20
        del trainer
    return {"measured": True, "peak_mb": peaks["configured"], "bf16_full_weights_peak_mb": peaks["bf16_full_weights"],
            "ratio": peaks["configured"] / peaks["bf16_full_weights"],
            "activation_checkpointing": one.activation_checkpointing}
