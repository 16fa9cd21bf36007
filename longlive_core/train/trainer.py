"""AR teacher-forcing training: flow matching over multi-shot samples of the latent cache.

Every rank runs ``train``; one global step is ``grad_accum`` micro-batches of one sample on each of
the ``world`` ranks (global micro-batch slot ``m * world + rank``), each sample's loss averaged over
its noisy frames and the gradient over the global batch. A step whose loss or gradient norm is not
finite is skipped: counted, the weights, the optimizer and the EMA left as they were.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longlive_core.config import ConfigError
from longlive_core.devices import pick_device
from longlive_core.models.wan_dit import WanDiT
from longlive_core.progress import Progress
from longlive_core.quant.numerics import record_sqnr
from longlive_core.quant.recipe import set_forward_high_precision
from longlive_core.train.checkpointing import CheckpointStore, agree
from longlive_core.train.config import TrainARConfig
from longlive_core.train.data import LatentSamples, TrainSample, generator_for
from longlive_core.train.ema import EMA
from longlive_core.train.flops import peak_tflops, step_flops
from longlive_core.train.flow import FlowMatching
from longlive_core.train.layout import TeacherForcingLayout
from longlive_core.train.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    apply_precision,
    build_model,
    device_mesh,
)

log = logging.getLogger(__name__)
MetricsSink = Callable[[dict, int], None]  # (metrics, step): rank 0's MLflow logging


@dataclasses.dataclass(frozen=True)
class TrainInputs:
    latents: Path  # data/latents: index.parquet + shards/
    samples: Path  # data/samples/samples.parquet: the bucket weights
    checkpoints: Path
    digest: str  # what a checkpoint must match to be resumed


@dataclasses.dataclass
class Batch:
    sample: TrainSample
    sigma: torch.Tensor  # (1, chunks) noise level of each chunk
    noise: torch.Tensor  # (1, C, F, h, w)


def draw_batch(data: LatentSamples, cfg: TrainARConfig, flow: FlowMatching, key: tuple, sample_id: str | None = None
               ) -> Batch:
    """The sample, window, chunk timesteps and noise of one micro-batch slot, all from ``key``."""
    g = generator_for(cfg.seed, *key)
    if sample_id is None:
        sample = data.load(data.draw(g), cfg.max_latent_frames, g)
    else:  # validation: a fixed sample, its first window
        sample = data.load(sample_id, cfg.max_latent_frames, None)
    chunks = sample.latents.shape[1] // cfg.chunk_frames
    sigma = flow.sigmas(flow.sample_index((1, chunks), g))
    noise = torch.randn(sample.latents.shape, generator=g)[None]
    return Batch(sample, sigma, noise)


def layout_of(model: WanDiT, batch: Batch, chunk: int) -> TeacherForcingLayout:
    _, f, h, w = batch.sample.latents.shape
    _, ph, pw = model.cfg.patch_size
    return TeacherForcingLayout(f, chunk, (h // ph) * (w // pw), batch.sample.text.shape[1])


def check_inputs(model: WanDiT, sample: TrainSample) -> None:
    cfg = model.cfg
    if sample.latents.shape[0] != cfg.in_channels:
        raise ConfigError(f"the latents have {sample.latents.shape[0]} channels and the model {cfg.in_channels}: "
                          "train_ar.model must fit the VAE encode_latents used")
    if sample.text.shape[-1] != cfg.text_dim:
        raise ConfigError(f"the caption embeddings are {sample.text.shape[-1]}-dimensional and the model reads "
                          f"{cfg.text_dim}: train_ar.model must fit encode_latents.text_encoder")


def sample_loss(model: WanDiT, batch: Batch, flow: FlowMatching, chunk: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, TeacherForcingLayout]:
    """Flow-matching loss of one sample over every noisy chunk, from one forward of [clean; noisy]."""
    s = batch.sample
    layout = layout_of(model, batch, chunk)
    x0 = s.latents[None].to(device)
    noise = batch.noise.to(device)
    sigma = batch.sigma.to(device)
    x_t = flow.noised(x0, noise, sigma.repeat_interleave(chunk, dim=1)[:, None, :, None, None])
    text = s.text.reshape(1, -1, s.text.shape[-1]).to(device, dtype)
    # one caption: every frame reads it, no mask needed (and none to build)
    cross = layout.cross_mask(s.shot_of_frame[None].to(device)) if s.text.shape[0] > 1 else None
    out = model(layout.sequence(x0, x_t).to(dtype), layout.timesteps(flow.timestep(sigma)), text,
                frame_positions=layout.frame_positions(s.positions.to(device)), mask_mod=layout.self_mask(),
                cross_mask_mod=cross)
    return F.mse_loss(layout.noisy_part(out).float(), flow.target(x0, noise)), layout


def _sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def validate(model: WanDiT, data: LatentSamples, cfg: TrainARConfig, flow: FlowMatching, device, dtype) -> float | None:
    """Mean loss over the first ``val_samples`` val samples at their fixed timesteps and noise."""
    ids = data.sample_ids[: cfg.val_samples]
    if not ids:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    total = 0.0
    model.eval()
    with torch.no_grad():
        # every rank runs as many forwards (FSDP gathers weights collectively); a rank past the end
        # repeats the first sample and does not count it
        for i in range(-(-len(ids) // world)):
            k = i * world + rank
            sample_id = ids[k] if k < len(ids) else ids[0]
            loss, _ = sample_loss(model, draw_batch(data, cfg, flow, ("val", sample_id), sample_id), flow,
                                  cfg.chunk_frames, device, dtype)
            total += float(loss) if k < len(ids) else 0.0
    model.train()
    total, = _sum_over_ranks([total], device)
    return total / len(ids)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Trainer:
    """The model, optimizer, EMA, data and checkpoints of one rank, set up from ``cfg``."""

    def __init__(self, cfg: TrainARConfig, inputs: TrainInputs):
        self.cfg, self.inputs = cfg, inputs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != cfg.world_size:
            raise ConfigError(f"train_ar.nnodes x nproc is {cfg.world_size} but {self.world} ranks were started")
        self.device = pick_device(cfg.device, "train_ar.device")
        self.dtype = getattr(torch, cfg.precision.param_dtype)
        self.flow = FlowMatching(cfg.num_train_timesteps, cfg.timestep_shift)
        weights = pd.read_parquet(inputs.samples, columns=["sample_id", "sample_weight"])
        self.train_set = LatentSamples(inputs.latents, "train", cfg.chunk_frames, cfg.shot_rope_offset,
                                       dict(zip(weights["sample_id"], weights["sample_weight"])))
        self.val_set = LatentSamples(inputs.latents, "val", cfg.chunk_frames, cfg.shot_rope_offset)
        if not len(self.train_set) or float(self.train_set.weights.sum()) <= 0:
            raise ConfigError(f"no train-split sample in {inputs.latents} has a whole {cfg.chunk_frames}-frame "
                              f"chunk ({self.train_set.too_short} too short): encode more data or lower "
                              "train_ar.chunk_frames")
        model = build_model(cfg)
        check_inputs(model, self.train_set.load(self.train_set.sample_ids[0], cfg.chunk_frames, None))
        self.conversion = apply_precision(model, cfg.precision)
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
        if cfg.compile:
            apply_compile(model)
        model.to(self.device)
        apply_fsdp(model, device_mesh(cfg, self.device.type), self.dtype)
        self.model = model
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas),
                                           weight_decay=o.weight_decay, eps=o.eps,
                                           fused=self.device.type == "cuda")  # one kernel per step on GPUs
        self.ema = EMA(model, cfg.ema.decay, cfg.ema.start_step)
        self.store = CheckpointStore(inputs.checkpoints, inputs.digest, cfg.keep_checkpoints)

    def accumulate(self, step: int) -> tuple[float, float, int]:
        """Forward and backward of this rank's ``grad_accum`` micro-batches of ``step``; returns this
        rank's (loss sum, FLOPs, tokens)."""
        cfg = self.cfg
        loss_sum, flops, tokens = 0.0, 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = draw_batch(self.train_set, cfg, self.flow, ("train", step, micro * self.world + self.rank))
            loss, layout = sample_loss(self.model, batch, self.flow, cfg.chunk_frames, self.device, self.dtype)
            (loss / cfg.grad_accum).backward()
            loss_sum += float(loss.detach())
            flops += step_flops(self.model.cfg, layout, batch.sample.text.shape[0])
            tokens += 2 * layout.frames * layout.tokens_per_frame
        return loss_sum, flops, tokens

    def train_step(self, step: int) -> tuple[float, float, float, float]:
        """One optimizer step (or, when the loss or gradient norm is not finite, none: the guard leaves
        the weights, the optimizer and the EMA as they were). Returns the global (loss, grad norm,
        FLOPs, tokens)."""
        o = self.cfg.optimizer
        loss_sum, flops, tokens = self.accumulate(step)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip if o.grad_clip else math.inf)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        loss_sum, flops, tokens = _sum_over_ranks([loss_sum, flops, tokens], self.device)
        loss = loss_sum / self.cfg.global_batch
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.ema.update(self.model, step)
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, flops, tokens

    def run(self, sink: MetricsSink | None = None, stop_after: int | None = None) -> dict:
        """Trains from the newest matching checkpoint to ``cfg.steps``; returns the summary and (on
        rank 0) the EMA weights under ``"ema_state"``. ``stop_after`` ends the run after that step,
        as a kill after a checkpoint would (for tests of resumption)."""
        cfg, o, rank, world, device = self.cfg, self.cfg.optimizer, self.rank, self.world, self.device
        model, ema, store = self.model, self.ema, self.store
        start, why = agree(store.resume_step() if rank == 0 else None)
        log.info("train_ar: %s", why)
        skipped = 0
        if start:
            store.load(start, model, self.optimizer, {"ema": ema.shadow})
            skipped = int(store.meta(start).get("skipped_steps", 0))
        peak, peak_name = peak_tflops(device, cfg.peak_tflops)
        last = min(cfg.steps, stop_after) if stop_after is not None else cfg.steps
        progress = Progress(log, "train_ar", max(0, last - start), "steps") if rank == 0 else None
        history = store.history.open("a") if rank == 0 else None
        summary: dict = {"start_step": start, "resume": why, "conversion": self.conversion.summary(),
                         "mfu_denominator": peak_name, "samples_train": len(self.train_set),
                         "samples_val": len(self.val_set),
                         "samples_too_short": self.train_set.too_short + self.val_set.too_short}
        loss_value = val_loss = None
        try:
            for step in range(start, last):
                t0 = time.perf_counter()
                torch.manual_seed(generator_for(cfg.seed, "rng", step, rank).initial_seed())  # stochastic rounding
                if cfg.precision.forward_bf16_from_step is not None:
                    set_forward_high_precision(model, step >= cfg.precision.forward_bf16_from_step)
                probe = (cfg.precision.recipe != "bf16" and cfg.precision.sqnr_every
                         and step % cfg.precision.sqnr_every == 0)
                with record_sqnr(model) if probe else contextlib.nullcontext() as sqnr:
                    loss_value, grad_norm, flops, tokens = self.train_step(step)
                if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                    skipped += 1
                    log.warning("train_ar: step %d skipped: loss %s, grad norm %s", step + 1, loss_value, grad_norm)
                done = step + 1
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                val_now = bool(cfg.val_every) and (done % cfg.val_every == 0 or done == cfg.steps)
                if val_now:
                    val_loss = validate(model, self.val_set, cfg, self.flow, device, self.dtype)
                metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": o.lr, "tokens_per_s": tokens / dt,
                           "step_s": dt, "tflops": flops / dt / 1e12, "peak_memory_mb": peak_memory_mb(device),
                           "skipped_steps": skipped}
                if peak:
                    metrics["mfu"] = flops / dt / 1e12 / (peak * world)
                if val_now and val_loss is not None:
                    metrics["val_loss"] = val_loss
                if sqnr is not None:
                    metrics.update(sqnr.flat())
                if rank == 0:
                    history.write(json.dumps({"step": done, **{k: v for k, v in metrics.items()
                                                                if not k.startswith("sqnr/")}}) + "\n")
                    history.flush()
                    if sink is not None and (done % cfg.log_every == 0 or done == last):
                        sink(metrics, done)
                    progress.advance()
                if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                    store.save(done, model, self.optimizer, {"ema": ema.shadow}, {"skipped_steps": skipped})
        finally:
            if history is not None:
                history.close()
        summary.update({"steps": last, "steps_run": max(0, last - start), "skipped_steps": skipped,
                        "final_loss": loss_value, "final_val_loss": val_loss})
        summary["ema_state"] = ema.full_state_dict(keep=rank == 0)
        return summary


def train(cfg: TrainARConfig, inputs: TrainInputs, sink: MetricsSink | None = None, stop_after: int | None = None
          ) -> dict:
    return Trainer(cfg, inputs).run(sink, stop_after)
