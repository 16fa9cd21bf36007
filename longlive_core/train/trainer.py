"""AR teacher-forcing training: flow matching over multi-shot samples of the latent cache.

Every rank runs ``train``. The ranks form ``dp`` groups of ``sp`` (Balanced sequence parallelism:
the ``sp`` ranks of a group split every sample's frames); one global step is ``grad_accum``
micro-batches of one sample on each group (global micro-batch slot ``m * dp + dp_rank``), each
sample's loss averaged over its noisy frames and the gradient over the global batch. A step whose
loss or gradient norm is not finite is skipped: counted, the weights, the optimizer and the EMA
left as they were, no error stored for recycling.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longlive_core.config import ConfigError
from longlive_core.devices import pick_device
from longlive_core.distributed.ac_budget import BudgetCheckpointing, default_cache_dir
from longlive_core.distributed.parallelize import ParallelDims, ParallelizePlan, parallel_dims, parallelize_dit
from longlive_core.distributed.ulysses import WHOLE, SequenceShard
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.config import dit_config
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.numerics import record_sqnr
from longlive_core.quant.recipe import set_forward_high_precision
from longlive_core.train.ac_planning import WindowPlanner
from longlive_core.train.checkpointing import CheckpointStore
from longlive_core.train.config import TrainARConfig
from longlive_core.train.data import LatentSamples, TrainSample, generator_for, sample_weights
from longlive_core.train.ema import EMA
from longlive_core.train.error_recycling import ErrorRecycler, InjectionDraws
from longlive_core.train.flops import peak_tflops, step_flops
from longlive_core.train.flow import FlowMatching
from longlive_core.train.forward import layout_of, teacher_forcing_velocity
from longlive_core.train.layout import TeacherForcingLayout
from longlive_core.train.loop import LoopSettings, MetricsSink, peak_memory_mb, run_steps, sum_over_ranks

if TYPE_CHECKING:  # the online source needs PyAV and OpenCV, which GPU images may lack
    from longlive_core.train.online_latents import OnlineSource

log = logging.getLogger(__name__)
STAGE = "train_ar"


@dataclasses.dataclass(frozen=True)
class TrainInputs:
    latents: Path  # data/latents: index.parquet + shards/
    samples: Path  # data/samples/samples.parquet: the bucket weights
    checkpoints: Path  # checkpoints/train_ar: a folder per run digest
    digest_components: dict[str, str] | None  # what a checkpoint must match to be resumed (rank 0's; None elsewhere)
    online: OnlineSource | None = None  # train_ar.latent_source online: the clips and the encoder
    ac_plans: Path | None = None  # activation_checkpointing budget's plan cache; None: $XDG_CACHE_HOME/longlive/


@dataclasses.dataclass
class Batch:
    key: tuple  # what every draw of this micro-batch came from
    sample: TrainSample  # the window, or this rank's part of it
    t_index: torch.Tensor  # (1, chunks) train-timestep index of every chunk of the window
    sigma: torch.Tensor  # (1, chunks) its noise level
    noise: torch.Tensor  # (1, C, f, h, w): this rank's frames of the window's noise
    injection: InjectionDraws | None  # error recycling's draws for the window


def draw_batch(data: LatentSamples, cfg: TrainARConfig, flow: FlowMatching, key: tuple, sample_id: str | None = None,
               shard: SequenceShard = WHOLE) -> Batch:
    """The sample, window, chunk timesteps and noise of one micro-batch slot, all from ``key``: drawn
    for the whole window and sliced to ``shard``'s frames, so they do not depend on the SP size."""
    g = generator_for(cfg.seed, *key)
    if sample_id is None:
        sample = data.load(data.draw(g), cfg.max_latent_frames, g, (shard.rank, shard.size))
    else:  # validation: a fixed sample, its first window
        sample = data.load(sample_id, cfg.max_latent_frames, None, (shard.rank, shard.size))
    frames, chunks = sample.window_frames, sample.window_frames // cfg.chunk_frames
    t_index = flow.sample_index((1, chunks), g)
    c, f, h, w = sample.latents.shape
    lo = shard.rank * f
    noise = torch.randn((c, frames, h, w), generator=g)[None, :, lo:lo + f]
    injection = None
    if cfg.error_recycling.enabled and key[0] == "train":
        injection = InjectionDraws.draw(cfg.error_recycling, chunks, generator_for(cfg.seed, "error-recycling", *key))
    return Batch(key, sample, t_index, flow.sigmas(t_index), noise, injection)


def check_inputs(model: WanDiT, sample: TrainSample) -> None:
    cfg = model.cfg
    if sample.latents.shape[0] != cfg.in_channels:
        raise ConfigError(f"the latents have {sample.latents.shape[0]} channels and the model {cfg.in_channels}: "
                          "train_ar.model must fit the VAE encode_latents used")
    if sample.text.shape[-1] != cfg.text_dim:
        raise ConfigError(f"the caption embeddings are {sample.text.shape[-1]}-dimensional and the model reads "
                          f"{cfg.text_dim}: train_ar.model must fit encode_latents.text_encoder")


def _plus(x: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
    return x if error is None else x + error


def sample_loss(model: WanDiT, batch: Batch, flow: FlowMatching, chunk: int, device: torch.device,
                dtype: torch.dtype, shard: SequenceShard = WHOLE, recycler: ErrorRecycler | None = None,
                step: int = 0, seed: int = 0) -> tuple[torch.Tensor, TeacherForcingLayout]:
    """Flow-matching loss of one sample over every noisy chunk, from one forward of [clean; noisy]:
    over this rank's frames under sequence parallelism (the sample's loss is the mean over its ranks).
    With a ``recycler``, stored errors go into the inputs and the new ones are queued."""
    s = batch.sample
    layout = layout_of(model, batch.sample, chunk, shard.size)
    lo, hi = layout.frame_range(shard.rank)
    chunks = list(range(lo // chunk, hi // chunk))
    x0 = s.latents[None].to(device, non_blocking=True)  # pinned by the prefetch: the copy does not wait
    noise = batch.noise.to(device, non_blocking=True)
    sigma = batch.sigma[:, chunks].to(device)
    t_index = batch.t_index[0, chunks].tolist()
    context = noised_from = x0
    if recycler is not None and batch.injection is not None:
        ctx_err, latent_err, noise_err = recycler.inject(batch.injection, step, chunks, layout.chunks, t_index, chunk,
                                                         x0)
        context, noised_from, noise = _plus(x0, ctx_err), _plus(x0, latent_err), _plus(noise, noise_err)
    frame_sigma = sigma.repeat_interleave(chunk, dim=1)[:, None, :, None, None]
    x_t = flow.noised(noised_from, noise, frame_sigma)
    target = flow.target(x0, noise)
    pred = teacher_forcing_velocity(model, layout, context, x_t, sigma, s.text, s.shot_of_frame, s.positions, dtype)
    if recycler is not None and batch.injection is not None:
        with torch.no_grad():  # x0 predicted minus the true x0; the noise predicted minus the noise used
            recycler.record(batch.key, chunks, layout.chunks, t_index, chunk, x_t - frame_sigma * pred - x0,
                            (1 - frame_sigma) * (pred - target), seed)
    return F.mse_loss(pred, target), layout


def validate(model: WanDiT, data: LatentSamples, cfg: TrainARConfig, flow: FlowMatching, device, dtype,
             dims: ParallelDims) -> float | None:
    """Mean loss over the first ``val_samples`` val samples at their fixed timesteps and noise, the
    samples dealt out over the data-parallel replicas."""
    ids = data.sample_ids[: cfg.val_samples]
    if not ids:
        return None
    shard, dp, dp_rank = dims.shard, cfg.parallel.dp_size, dims.dp_rank
    total = 0.0
    model.eval()
    with torch.no_grad():
        # every rank runs as many forwards (FSDP gathers weights collectively); a rank past the end
        # repeats the first sample and does not count it
        for i in range(-(-len(ids) // dp)):
            k = i * dp + dp_rank
            sample_id = ids[k] if k < len(ids) else ids[0]
            loss, _ = sample_loss(model, draw_batch(data, cfg, flow, ("val", sample_id), sample_id, shard), flow,
                                  cfg.chunk_frames, device, dtype, shard)
            total += float(loss) / shard.size if k < len(ids) else 0.0
    model.train()
    total, = sum_over_ranks([total], device)
    return total / len(ids)


def build_model(cfg: TrainARConfig) -> WanDiT:
    """The starting weights in float32 on the CPU: random from ``init_seed`` (init tiny), or a local
    Wan2.2-TI2V-5B transformer folder."""
    dit = dit_config(cfg.model)
    if cfg.init == "tiny":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            return WanDiT(dit)
    return load_dit(Path(cfg.init), dit, dtype=torch.float32)


class Trainer:
    """The model, optimizer, EMA, data and checkpoints of one rank, set up from ``cfg``."""

    def __init__(self, cfg: TrainARConfig, inputs: TrainInputs):
        self.cfg, self.inputs = cfg, inputs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = pick_device(cfg.parallel.device, "train_ar.device")
        self.dims = parallel_dims(cfg.parallel, self.device.type, STAGE)
        self.shard, self.dp_rank = self.dims.shard, self.dims.dp_rank
        self.dtype = getattr(torch, cfg.precision.param_dtype)
        self.flow = FlowMatching(cfg.num_train_timesteps, cfg.timestep_shift)
        align = cfg.chunk_frames * cfg.sp  # every SP rank holds whole chunks
        if cfg.latent_source == "online" and inputs.online is None:
            raise ConfigError("train_ar.latent_source online needs the clips and the encoder's settings "
                              "(TrainInputs.online)")
        self.online = inputs.online.open(self.device) if cfg.latent_source == "online" else None
        self.train_set = LatentSamples(inputs.latents, "train", cfg.chunk_frames, cfg.shot_rope_offset,
                                       sample_weights(inputs.samples), align, self.online)
        self.val_set = LatentSamples(inputs.latents, "val", cfg.chunk_frames, cfg.shot_rope_offset, align=align,
                                     online=self.online)
        if not len(self.train_set) or float(self.train_set.weights.sum()) <= 0:
            raise ConfigError(f"no train-split sample in {inputs.latents} has {align} latent frames (sp x "
                              f"chunk_frames; {self.train_set.too_short} too short): encode more data or lower "
                              "train_ar.chunk_frames or train_ar.sp")
        model = build_model(cfg)
        first = self.train_set.load(self.train_set.sample_ids[0], align, None)
        check_inputs(model, first)
        p = cfg.precision
        self.budget = BudgetCheckpointing() if cfg.activation_checkpointing == "budget" else None
        self.conversion = parallelize_dit(model, self.dims, ParallelizePlan(
            p.recipe, tuple(p.skip), p.keep_last_blocks, cfg.attention, cfg.activation_checkpointing, cfg.ac_budget,
            cfg.compile, self.dtype, self.budget), self.device)
        self.model = model
        self.optimizer = cfg.optimizer.build(model.parameters(), self.device)
        self.ema = EMA(model, cfg.ema.decay, cfg.ema.start_step)
        self.planner = None
        if self.budget is not None:
            _, _, h, w = first.latents.shape
            _, ph, pw = model.cfg.patch_size
            self.planner = WindowPlanner(self.budget, cfg, model, self.optimizer, self.ema.shadow, (h // ph, w // pw),
                                         first.text.shape[1], self.device, self.dtype,
                                         inputs.ac_plans or default_cache_dir())
            self.planner.plan(self.train_set.window_lengths(cfg.max_latent_frames))
        self.store = CheckpointStore(inputs.checkpoints, cfg.checkpoint.keep_checkpoints, cfg.checkpoint.keep_runs,
                                     inputs.digest_components)
        er = cfg.error_recycling
        self.recycler = (ErrorRecycler(er, self.shard.rank, cfg.sp, cfg.num_train_timesteps, self.dims.dp_group)
                         if er.enabled else None)
        self.recycling: dict[str, float] = {}  # the last step's buffer fill and injections (world totals)
        # one thread draws the next micro-batch (CPU noise, shard reads, pinning) while the GPU computes
        self._prefetch = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train-data")
                          if self.online is None else None)
        self._ahead: dict[tuple, concurrent.futures.Future] = {}

    def _train_key(self, step: int, micro: int) -> tuple:
        return ("train", step, micro * self.cfg.parallel.dp_size + self.dp_rank)

    def _draw(self, key: tuple) -> Batch:
        batch = draw_batch(self.train_set, self.cfg, self.flow, key, shard=self.shard)
        if self.device.type == "cuda":
            batch.sample.latents, batch.noise = batch.sample.latents.pin_memory(), batch.noise.pin_memory()
        return batch

    def _batch(self, key: tuple, next_key: tuple) -> Batch:
        """The micro-batch of ``key``, drawn ahead in a background thread while the previous one ran
        on the GPU; starts drawing ``next_key``'s. Draws are pure functions of their keys, so what is
        drawn ahead is what would be drawn now. The online latent source encodes on the GPU: no drawing ahead."""
        if self._prefetch is None:
            return self._draw(key)
        future = self._ahead.pop(key, None)
        self._ahead.clear()  # a key not asked for (a run's last step, a stop) is dropped
        batch = future.result() if future is not None else self._draw(key)
        self._ahead[next_key] = self._prefetch.submit(self._draw, next_key)
        return batch

    def accumulate(self, step: int, recompute_all: bool = False) -> tuple[torch.Tensor, float, float]:
        """Forward and backward of this rank's ``grad_accum`` micro-batches of ``step``; returns this
        rank's share of (loss sum, as a device scalar: no host sync per micro-batch; FLOPs; tokens):
        summed over every rank they give the global batch's. ``recompute_all``: budget's blocks keep
        nothing (as ``full``), whatever their window's plan."""
        cfg, sp = self.cfg, self.cfg.sp
        loss_sum, flops, tokens = torch.zeros((), device=self.device), 0.0, 0.0
        for micro in range(cfg.grad_accum):
            following = self._train_key(step, micro + 1) if micro + 1 < cfg.grad_accum else self._train_key(step + 1, 0)
            batch = self._batch(self._train_key(step, micro), following)
            if recompute_all and self.budget is not None:
                self.budget.use(None)
            elif self.planner is not None:
                self.planner.use(batch.sample.window_frames)
            loss, layout = sample_loss(self.model, batch, self.flow, cfg.chunk_frames, self.device, self.dtype,
                                       self.shard, self.recycler, step, cfg.seed)
            (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach() / sp
            flops += step_flops(self.model.cfg, layout, batch.sample.text.shape[0]) / sp
            tokens += 2 * layout.frames * layout.tokens_per_frame / sp
        return loss_sum, flops, tokens

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step (or, when the loss or gradient norm is not finite, none: the guard leaves
        the weights, the optimizer and the EMA as they were): the global loss and grad norm, the step's
        FLOPs and tokens, "skipped", and every SQNR probe of a probed step."""
        cfg, o = self.cfg, self.cfg.optimizer
        if cfg.precision.forward_bf16_from_step is not None:
            set_forward_high_precision(self.model, step >= cfg.precision.forward_bf16_from_step)
        probe = cfg.precision.recipe != "bf16" and cfg.precision.sqnr_every and step % cfg.precision.sqnr_every == 0
        # the probes are written from inside the blocks' backward, which no compiled graph holds: Dynamo
        # would send each block to eager with its compiled plan's kept set, over the limit (measured on
        # the H200: 55.5 GiB under a 47 GiB plan). A probed step runs eager, recomputing as full does.
        eager = bool(probe) and cfg.compile
        with (record_sqnr(self.model) if probe else contextlib.nullcontext() as sqnr,
              torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()):
            loss_sum, flops, tokens = self.accumulate(step, recompute_all=eager)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       o.grad_clip if o.grad_clip else math.inf)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        counts = self._recycling_counts()
        loss_sum, flops, tokens, *counts = sum_over_ranks([loss_sum, flops, tokens, *counts], self.device)
        loss = loss_sum / self.cfg.global_batch
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.ema.update(self.model, step)
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": loss, "grad_norm": grad_norm, "flops": flops, "tokens": tokens, "skipped": int(not finite)}
        if self.recycler is not None:
            self.recycler.commit(step, store=finite)
            entries, capacity, context, latent, noise = counts
            metrics.update({"error_buffer_fill": entries / capacity, "injected_context": context,
                            "injected_latent": latent, "injected_noise": noise})
        if sqnr is not None:
            metrics.update(sqnr.flat())
        return metrics

    def _recycling_counts(self) -> list[float]:
        """This rank's (stored errors, capacity, injections of each kind) of the step, or nothing."""
        if self.recycler is None:
            return []
        r = self.recycler
        injected = r.take_injection_counts()
        return [len(r.latent) + len(r.noise), r.latent.total_capacity + r.noise.total_capacity,
                injected["context"], injected["latent"], injected["noise"]]

    def after_step(self, done: int, seconds: float, metrics: dict[str, float]) -> dict[str, float]:
        """Throughput and MFU from the step's time, the learning rate, peak memory, and the validation
        loss every ``val_every`` steps and at the last."""
        cfg = self.cfg
        if self.planner is not None:
            self.planner.check_peak(done)
        flops, tokens = metrics.pop("flops"), metrics.pop("tokens")
        out = {**metrics, "lr": cfg.optimizer.lr, "tokens_per_s": tokens / seconds, "step_s": seconds,
               "tflops": flops / seconds / 1e12,
               "peak_memory_mb": peak_memory_mb(self.device, None if self.planner is None else self.planner.peak)}
        if self.peak:
            out["mfu"] = flops / seconds / 1e12 / (self.peak * self.world)
        if cfg.val_every and (done % cfg.val_every == 0 or done == cfg.steps):
            # no plan counts validation's no-grad forwards: their peak is kept out of the next step's check
            with self.planner.peak.excluded() if self.planner is not None else contextlib.nullcontext():
                self.val_loss = validate(self.model, self.val_set, cfg, self.flow, self.device, self.dtype, self.dims)
            if self.val_loss is not None:
                out["val_loss"] = self.val_loss
        self.last_loss = metrics["loss"]
        return out

    def checkpointed(self) -> tuple:
        return self.model, self.optimizer, {"ema": self.ema.shadow}

    def rank_state(self) -> dict[str, torch.Tensor] | None:
        return None if self.recycler is None else self.recycler.state_dict()

    def load_rank_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.recycler.load_state_dict(tensors)

    def schedule(self) -> dict:
        cfg, ac = self.cfg, self.cfg.activation_checkpointing
        return {"activation_checkpointing": ac, **({"ac_budget": cfg.ac_budget} if ac == "compiler" else {}),
                **({"ac_memory_limit_gib": cfg.ac_memory_limit_gib} if ac == "budget" else {}),
                "compile": cfg.compile,
                "attention": cfg.attention, "device": self.device.type}

    def run(self, sink: MetricsSink | None = None, stop_after: int | None = None) -> dict:
        """Trains from the newest intact checkpoint of this run digest at or before ``cfg.steps`` to
        ``cfg.steps`` (``loop.run_steps``); returns the summary and (on rank 0) the EMA weights under
        ``"ema_state"``."""
        cfg = self.cfg
        self.peak, peak_name = peak_tflops(self.device, cfg.peak_tflops)
        self.last_loss = self.val_loss = None
        summary = run_steps(self, LoopSettings(STAGE, cfg.steps, cfg.seed, cfg.log_every, cfg.checkpoint), sink,
                            stop_after)
        summary.update({"conversion": self.conversion.summary(), "mfu_denominator": peak_name,
                        "samples_train": len(self.train_set), "samples_val": len(self.val_set),
                        "samples_too_short": self.train_set.too_short + self.val_set.too_short,
                        "final_loss": self.last_loss, "final_val_loss": self.val_loss})
        if self.planner is not None:
            summary.update(self.planner.summary())
        summary["ema_state"] = self.ema.full_state_dict(keep=self.rank == 0)
        return summary


def train(cfg: TrainARConfig, inputs: TrainInputs, sink: MetricsSink | None = None, stop_after: int | None = None
          ) -> dict:
    return Trainer(cfg, inputs).run(sink, stop_after)
