"""The long-video inference engine: a prompt file's shots, chunk by chunk, into a stream of frames.

For each chunk of ``F_c`` latent frames: fresh noise, the few-step loop (``rollout.denoise_chunk``)
reading the KV cache, the finished latents handed to the frame stream (decoded while the next chunk
is made), then one pass at t = 0 writing the chunk's keys and values into the cache. A new shot moves
the cache's shot sink, starts the decoder on a fresh VAE cache and jumps the RoPE frame position by
the shot offset (MISSION.md "Multi-shot conventions"); a ``+`` line only changes the text the chunks
read. Nothing grows with the video's length: noise is drawn per chunk, the cache holds its window,
and the stream holds at most its depth of chunks.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from longlive_core.config import ConfigError
from longlive_core.distributed.ulysses import WHOLE, SequenceShard, chunk_part, gather_frames
from longlive_core.infer.decode import FrameStream
from longlive_core.infer.kv_cache import ATTENTIONS, KVCache, SinkConfig
from longlive_core.infer.kv_quant import KVQuantConfig
from longlive_core.infer.prompts import ShotPlan
from longlive_core.infer.rollout import RolloutConfig, denoise_chunk, write_chunk
from longlive_core.infer.sequence_parallel import ShardedCache
from longlive_core.models.wan_dit import WanDiT

KV_FORMATS = ("bf16", "nvfp4", "fp8")
PRECISIONS = ("auto", "bf16", "nvfp4", "fp8")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """``params.yaml``'s ``generate`` section; ``longlive generate``'s flags override it."""
    # the model folder's own sampling (infer/sampling.py) unless one of these says otherwise
    step_list: tuple[int, ...] | None = None  # null: the folder's (a few-step folder's list; an AR one's schedule)
    step_lists: tuple[tuple[int, ...], ...] = ((1000, 946, 854, 681, 0), (1000, 681, 0))  # --steps N's choices
    ar_steps: int = 50  # an AR (flow-matching) folder's steps on its own shifted schedule
    window: int | None = None  # latent frames a chunk attends to, itself and the sinks included; null: the folder's
    global_sink: int | None = None  # S_g: the video's first latent frames, kept all along; null: the folder's
    shot_sink: int | None = None  # S_s: the current shot's first latent frames; null: the folder's
    kv: str = "bf16"  # bf16 (as computed) | nvfp4 | fp8
    kv_smooth_keys: bool = True  # a quantized cache's keys stored minus a per-layer, per-head mean
    kv_four_over_six: str | None = None  # null | mse | mae: the NVFP4 cache's 4/6 block scale choice rule (nvfp4 only)
    attention: str = "sdpa"  # the cached self-attention: sdpa (bf16) | fp8 (cuDNN's FP8 SDPA: Hopper or newer)
    precision: str = "auto"  # auto: the folder's own (bf16: longlive-dit, nvfp4: longlive-w4a4) | bf16 | nvfp4 | fp8
    default_duration_s: float = 5.0  # a prompt line without a duration
    seed: int = 0
    decode: str = "async"  # async: the VAE decodes chunk c while the DiT makes c + 1 | sync
    compile: bool = False  # torch.compile each block (the cached attention stays eager)
    device: str = "auto"
    vae_device: str = ""  # empty: the DiT's device; cuda:1 (a second GPU decodes while the first denoises) | cpu
    vae_dtype: str = "auto"  # the VAE's weights and activations: auto (bfloat16 on a GPU, float32 on the CPU) | ...
    vae_compile: bool = False  # torch.compile the VAE's per-frame decoder call (a GPU; ~80 s once per load)
    # prompt enhancement (infer/enhance.py): a local language model rewrites the prompt file first
    enhance: bool = False
    enhance_model: str = "tiny"  # a local Qwen2.5-VL folder (the caption model's) | tiny (random: the demo's)
    enhance_examples: int = 3  # training captions shown as style examples (the model folder's example bank)
    enhance_max_new_tokens: int = 512

    def validate(self, where: str) -> None:
        for key, lists in (("step_lists", self.step_lists), ("step_list", [self.step_list] if self.step_list else [])):
            for steps in lists:
                try:
                    RolloutConfig(steps=tuple(steps), window=None)
                except ValueError as e:
                    raise ConfigError(f"{where}.{key}: {e}") from None
        if self.ar_steps < 1:
            raise ConfigError(f"{where}.ar_steps must be at least 1; got {self.ar_steps}")
        if self.kv not in KV_FORMATS:
            raise ConfigError(f"{where}.kv must be one of {KV_FORMATS}; got {self.kv!r}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"{where}.attention must be one of {ATTENTIONS}; got {self.attention!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"{where}.precision must be one of {PRECISIONS}; got {self.precision!r}")
        if self.kv_four_over_six not in (None, "mse", "mae"):
            raise ConfigError(f"{where}.kv_four_over_six must be null, mse or mae; got {self.kv_four_over_six!r}")
        if self.decode not in ("async", "sync"):
            raise ConfigError(f"{where}.decode must be async or sync; got {self.decode!r}")
        if self.vae_dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"{where}.vae_dtype must be auto, bfloat16 or float32; got {self.vae_dtype!r}")
        if self.vae_device and not (self.vae_device == "cpu" or self.vae_device.startswith("cuda")):
            raise ConfigError(f"{where}.vae_device must be empty, cpu or cuda:N; got {self.vae_device!r}")
        if self.default_duration_s <= 0 or (self.window is not None and self.window < 1):
            raise ConfigError(f"{where}: default_duration_s must be > 0 and window >= 1 (or null)")
        if any(v is not None and v < 0 for v in (self.global_sink, self.shot_sink)):
            raise ConfigError(f"{where}: global_sink and shot_sink must be >= 0 (or null)")
        if self.enhance_examples < 0 or self.enhance_max_new_tokens < 1:
            raise ConfigError(f"{where}: enhance_examples must be >= 0 and enhance_max_new_tokens >= 1")

    def kv_quant(self) -> KVQuantConfig | None:
        """How ``kv``'s format quantizes the cache (None: bf16); ``kv_four_over_six`` is the NVFP4 cache's only,
        so another format's record says it was not used."""
        if self.kv == "bf16":
            return None
        return KVQuantConfig(self.kv_smooth_keys, self.kv_four_over_six if self.kv == "nvfp4" else None, self.kv)

    def cache(self, model: WanDiT, tokens_per_frame: int, sampling: RolloutConfig) -> KVCache:
        """The KV cache of a run sampled as ``sampling`` (``infer/sampling.run_sampling``), in ``kv``'s format."""
        return KVCache(len(model.blocks), tokens_per_frame, sampling.window, self.kv_quant(),
                       SinkConfig(sampling.global_sink, sampling.shot_sink), self.attention)


@dataclasses.dataclass
class EngineStats:
    chunks: int = 0
    latent_frames: int = 0
    denoise_s: float = 0.0  # the DiT's time (device time on CUDA), cache writes included
    kv_bytes: int = 0  # the most the cache held
    kv_tokens: int = 0  # tokens held at that moment

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes / self.kv_tokens if self.kv_tokens else 0.0


class DiTTimer:
    """The DiT's own time per chunk: CUDA events on its stream (the VAE's stream runs beside it),
    the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: list = []

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, began) -> None:
        if not self.cuda:
            self.pairs.append(time.perf_counter() - began)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((began, end))

    def seconds(self) -> float:
        if not self.cuda:
            return sum(self.pairs)
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / 1000.0


@torch.no_grad()
def generate(model: WanDiT, plan: list[ShotPlan], texts: list[torch.Tensor], cache: KVCache, steps: tuple[int, ...],
             stream: FrameStream | None, latent_shape: tuple[int, int, int], shot_offset: int, seed: int,
             dtype: torch.dtype, on_chunk=None, shard: SequenceShard = WHOLE) -> EngineStats:
    """``texts``: one (1, T, D) embedding per segment of ``plan``, in order; ``latent_shape`` (C, h, w).
    ``on_chunk(stats)`` after every chunk (a progress line). With ``shard`` of P ranks each rank runs
    the DiT on F_c / P of every chunk's frames (the same seed draws the same noise everywhere), the
    chunk's x0 is gathered, and the ``stream`` (rank 0's; None elsewhere) gets it whole."""
    device = next(model.parameters()).device
    channels, h, w = latent_shape
    chunk = plan[0].chunk_frames
    try:
        lo, hi = chunk_part(chunk, shard)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    generator = torch.Generator(device).manual_seed(seed)
    stats, timer = EngineStats(), DiTTimer(device)
    total = sum(sum(shot.chunks) for shot in plan)
    position = 0
    segment = iter(texts)
    saved, model.attention_fn = model.attention_fn, (cache if shard.size == 1 else ShardedCache(cache, shard))
    try:
        for shot in plan:
            if shot.index > 0:
                cache.start_shot()
                position += shot_offset
            new_shot = True
            for count in shot.chunks:
                text = next(segment).to(device, dtype)
                for _ in range(count):
                    began = timer.start()
                    positions = torch.arange(position, position + chunk, device=device)
                    noise = torch.randn((1, channels, chunk, h, w), generator=generator, device=device)
                    x0 = denoise_chunk(model, noise[:, :, lo:hi], text, positions[lo:hi], steps, generator,
                                       dtype=dtype, part=(lo, hi, chunk))
                    whole = gather_frames(x0, shard)
                    timer.stop(began)
                    if stream is not None:
                        stream.put(whole[0], new_shot)  # synchronous decoding runs here, outside the DiT's time
                    new_shot = False
                    stats.chunks += 1
                    if stats.chunks < total:  # the last chunk's keys are never read
                        began = timer.start()
                        write_chunk(model, cache, x0, text, positions[lo:hi], dtype, frames=chunk)
                        timer.stop(began)
                    if cache.nbytes > stats.kv_bytes:
                        stats.kv_bytes, stats.kv_tokens = cache.nbytes, cache.frames * cache.tokens_per_frame
                    position += chunk
                    stats.latent_frames += chunk
                    if on_chunk is not None:
                        on_chunk(stats)
    finally:
        model.attention_fn = saved
    stats.denoise_s = timer.seconds()
    return stats
