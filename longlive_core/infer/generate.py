"""``longlive generate``: a video from any model folder the chain makes and a prompt file.

    longlive generate --model models/w4a4 --prompts story.txt --out story.mp4 [--seed N] [--steps 4|2]
                      [--kv nvfp4|fp8|bf16] [--attention sdpa|fp8] [--precision bf16|nvfp4|fp8]
                      [--decode async|sync] [--sp P]
                      [--vae-device cuda:1]

The model folder's config.json gives the sampling it was made for (the step list, or an AR model's
schedule with ``generate.ar_steps`` steps; the window and sinks), the text encoder, the VAE, the
resolution, the frame rate, the chunk length and the shot offset; ``params.yaml``'s ``generate``
section (``--params``) and the flags override the sampling only where they say so. Writes the mp4
(frames streamed in as they are decoded; the file appears only when complete) and ``<out>.json``
beside it: frames, FPS of the denoise loop and end to end, peak memory, KV bytes per token, the
recipe, the sampling that ran and where each of its settings came from. The same seed gives the same frames.
``--sp P`` re-runs the command under torchrun on P ranks (GPUs, or CPU processes): sequence
parallelism over each chunk's frames (``infer/sequence_parallel.py``, ``distributed/ulysses.py``); rank 0
decodes and writes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from longlive_core.config import ConfigError, from_mapping, load_params
from longlive_core.devices import pick_device
from longlive_core.distributed.launch import join_process_group, torchrun_command, under_torchrun
from longlive_core.distributed.ulysses import WHOLE, SequenceShard
from longlive_core.infer import attention_cudnn_fp8
from longlive_core.infer.decode import FrameStream, ShotDecoder
from longlive_core.infer.engine import KV_FORMATS, PRECISIONS, EngineStats, GenerateConfig, generate
from longlive_core.infer.enhance import Enhancement, ExampleBank, enhance, pooled_prompt, template_digest
from longlive_core.infer.kv_cache import ATTENTIONS
from longlive_core.infer.model_folder import load_model_folder
from longlive_core.infer.prompts import PromptFileError, Segment, ShotPlan, parse_prompts, plan_shots, read_prompt_file
from longlive_core.infer.sampling import RunSampling, run_sampling
from longlive_core.infer.sequence_parallel import from_first_rank
from longlive_core.infer.text_encoder import FileTextEncoder, HostTextEncoder
from longlive_core.io.atomic import atomic_path, write_json
from longlive_core.models.encoders import check_encoders
from longlive_core.models.folder import read_dit_folder
from longlive_core.models.vae import vae_from
from longlive_core.models.weights import CheckpointError
from longlive_core.progress import Progress, setup_logging
from longlive_core.quant.config import NVFP4_RECIPE_NAMES
from longlive_core.quant.recipe import convert_linears, convert_linears_fp8
from longlive_core.video.writer import VideoWriter

log = logging.getLogger("longlive.generate")


def prepare_model(directory: Path, precision: str, device: torch.device):
    """(model, config, recipe): a longlive-dit folder in bf16 (float32 on the CPU), packed NVFP4 (under
    the folder's own NVFP4 recipe where it trained under one: Four-Over-Six's block scales kept) or
    FP8 W8A8 (the AR model's skip list kept in high precision); a longlive-w4a4 folder as it is (it
    holds no BF16 weights)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if read_dit_folder(directory).format == "longlive-w4a4" and precision in ("bf16", "fp8"):
        raise ConfigError(f"{directory} holds the W4A4 model (NVFP4 weights, no BF16 copy): run it with "
                          f"--precision nvfp4, or generate from the AR model folder for {precision}")
    model, config = load_model_folder(directory, device, dtype)
    if config.format == "longlive-w4a4":
        return model, config, config.longlive_quantization.get("recipe", "nvfp4")
    rules = config.precision
    if precision == "nvfp4":  # packed as the folder's model was trained to be quantized (its block scales)
        recipe = rules.recipe if rules.recipe in NVFP4_RECIPE_NAMES else "nvfp4"
        convert_linears(model, recipe, skip=rules.skip, keep_last_blocks=rules.keep_last_blocks, packed=True)
        return model, config, recipe
    if precision == "fp8":
        convert_linears_fp8(model, skip=rules.skip, keep_last_blocks=rules.keep_last_blocks)
        return model, config, "fp8"
    return model, config, "bf16"


# what loading the model depends on
MODEL_SETTINGS = ("precision", "compile", "device", "vae_device", "vae_dtype", "vae_compile")


@dataclasses.dataclass
class Generation:
    """A prompt file's generation set up on a loaded model: ``run(stream=..., on_chunk=...)`` runs
    ``engine.generate`` on it (every rank of ``shard`` calls it; rank 0's stream gets the chunks)."""
    plan: list[ShotPlan]
    sampling: RunSampling
    run: Callable[..., EngineStats]
    encoded_at: float  # perf_counter once the prompts are embedded: what time to first frame counts from
    enhancement: Enhancement | None = None  # the prompt file's rewrite, where generate.enhance asks for one


class Generator:
    """A model folder loaded once, its DiT converted to ``cfg.precision`` and compiled where asked, the
    VAE on rank 0, for any number of prompt files (evaluate's suite, a benchmark's rows). Loading it
    again for every video costs seconds each time, and with compiled blocks on torch 2.11 (CUDA) every
    load left the previous DiT on the GPU: 9 GiB more for each video (bench/RESULTS.md). ``close``
    (or leaving a ``with`` block) lets it go, and the compiled code with it. umT5 is on the GPU only
    while a prompt file is embedded (11 GB in bf16): loaded from its folder for the file, or with
    ``keep_text_encoder`` (a process that makes many videos) kept in host memory and copied
    (``infer/text_encoder.py``)."""

    def __init__(self, model_dir: str | Path, cfg: GenerateConfig, shard: SequenceShard = WHOLE,
                 keep_text_encoder: bool = False):
        start = time.perf_counter()
        self.model_dir, self.cfg, self.shard = Path(model_dir), cfg, shard
        self.device = pick_device(cfg.device, "generate.device")
        self.folder = read_dit_folder(self.model_dir)
        # what would fail once the model is loaded is refused before: the folder's sampling under these
        # settings, --sp that does not split the model, FP8 attention where cuDNN's cannot run
        run_sampling(self.folder, cfg, None)
        heads, chunk = self.folder.dit_config.num_heads, self.folder.latent.chunk_frames
        if heads % shard.size or chunk % shard.size:
            raise ConfigError(f"--sp {shard.size}: the model's {heads} attention heads and {chunk}-frame chunks must "
                              f"both split over {shard.size} ranks")
        check_attention(cfg, self.device)
        check_enhance(cfg, shard)
        self.encoders = check_encoders(self.folder, self.model_dir)  # the ones it was made with, before loading
        self.model, self.config, self.recipe = prepare_model(self.model_dir, cfg.precision, self.device)
        self.text = self.decoder = None  # under --sp rank 0 embeds every prompt file for all ranks, and decodes
        try:  # a kept text encoder is page-locking in its thread from here: let go if the rest fails to load
            if shard.rank == 0:
                self.text = (HostTextEncoder if keep_text_encoder else FileTextEncoder)(
                    self.encoders["text_encoder"], self.config.text_encoder.max_length, self.device)
            if cfg.compile:
                for block in self.model.blocks:
                    block.compile()
            if shard.rank == 0:
                self.decoder = vae_decoder(self.encoders["vae"], vae_device(cfg.vae_device, self.device), cfg.vae_dtype,
                                           cfg.vae_compile)
                if cfg.vae_compile:  # compiled here, before a decode thread runs beside the DiT
                    latent = self.folder.latent
                    self.decoder.warm(latent.channels, latent.height, latent.width, latent.chunk_frames)
        except BaseException:
            self.close()
            raise
        self.load_s = time.perf_counter() - start

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.text is not None:
            self.text.close()
        self.model = self.decoder = self.text = None
        if self.cfg.compile:  # Dynamo's caches hold the compiled blocks' code, and with it what it was traced on
            torch._dynamo.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def settings(self, cfg: GenerateConfig | None) -> GenerateConfig:
        """``cfg`` for one video (sampling, KV cache, seed, decoding), or the generator's own; the settings
        the loaded model depends on must be the generator's."""
        if cfg is None:
            return self.cfg
        differ = [k for k in MODEL_SETTINGS if getattr(cfg, k) != getattr(self.cfg, k)]
        if differ:
            raise ConfigError(f"generate.{differ[0]} is {getattr(cfg, differ[0])!r} for this video but the model was "
                              f"loaded with {getattr(self.cfg, differ[0])!r}: load another Generator for it")
        return cfg

    def prepare(self, prompts: Path, steps: int | None = None, cfg: GenerateConfig | None = None) -> Generation:
        """The shots planned from ``prompts``, their texts embedded and the KV cache, ready to run."""
        if self.model is None:
            raise RuntimeError("this Generator was closed")
        text = read_prompt_file(prompts)
        cfg = self.settings(cfg)
        check_attention(cfg, self.device)  # a video's own settings may ask for it
        config, model = self.config, self.model
        sampling = run_sampling(self.folder, cfg, steps)
        latent = config.latent
        prefixed = config.multi_shot.scene_transition_prefix  # the captions the model was trained on
        segments = parse_prompts(text, cfg.default_duration_s, str(prompts), prefixed)
        check_enhance(cfg, self.shard)  # by every rank, before rank 0 embeds for the others
        enhancement = None

        def embed() -> torch.Tensor:
            nonlocal enhancement, segments
            with self.text.on() as encoder:  # umT5-XXL is 11 GB in bf16: gone before the DiT runs
                if cfg.enhance:
                    enhancement = self.enhanced(text, segments, cfg, encoder, str(prompts))
                    segments = parse_prompts(enhancement.enhanced, cfg.default_duration_s, str(prompts), prefixed)
                return encoder.encode([s.prompt for s in segments])

        embedded = embed() if self.shard.size == 1 else from_first_rank(embed, self.shard, self.device)
        plan = plan_shots(segments, config.video.fps, latent.chunk_frames, latent.temporal_stride)
        encoded_at = time.perf_counter()
        texts = [embedded[i:i + 1] for i in range(len(segments))]
        _, ph, pw = model.cfg.patch_size
        h, w = latent.height, latent.width
        run = functools.partial(generate, model, plan, texts, latent_shape=(latent.channels, h, w),
                                dtype=model.patch_embedding.weight.dtype, seed=cfg.seed,
                                shot_offset=config.multi_shot.shot_rope_offset, shard=self.shard)

        def run_fresh(**kwargs) -> EngineStats:  # every run on a cache of its own: the same seed, the same video
            return run(cfg.cache(model, (h // ph) * (w // pw), sampling.rollout), sampling.rollout.steps, **kwargs)

        return Generation(plan, sampling, run_fresh, encoded_at, enhancement)

    def enhanced(self, text: str, segments: list[Segment], cfg: GenerateConfig, encoder, source: str) -> Enhancement:
        """The prompt file rewritten by ``cfg.enhance_model`` (loaded for this file and let go, as umT5 is),
        shown the example bank's captions nearest the prompts by their pooled umT5 embeddings."""
        from longlive_core.caption.config import CaptionConfig
        from longlive_core.caption.model import CaptionModel

        examples: list[str] = []
        bank = ExampleBank.load(self.model_dir)
        if bank is not None and cfg.enhance_examples:
            embedded = encoder.encode([s.prompt for s in segments]).cpu().numpy()
            query = np.mean([pooled_prompt(e) for e in embedded], axis=0)
            examples = bank.nearest(query, cfg.enhance_examples)
        # the model is this call's alone: gone with it, before the DiT runs
        model = CaptionModel(CaptionConfig(model=cfg.enhance_model, max_new_tokens=cfg.enhance_max_new_tokens,
                                           device=self.device.type), self.device)
        out = enhance(text, lambda request: model.generate([(None, request)])[0].text, examples, source=source)
        if not out.rewritten:
            log.warning("prompt enhancement: %s; %s is used as given", out.reason, source)
        return out

    def generate(self, prompts: str | Path, out: str | Path, steps: int | None = None,
                 cfg: GenerateConfig | None = None, on_frame: Callable[[np.ndarray], None] | None = None
                 ) -> dict | None:
        """Generates ``out`` (mp4) and ``out``.json; returns the sidecar's contents. ``on_frame`` sees
        every (H, W, 3) uint8 frame as it goes into the file (x264's bytes are not reproducible bit for
        bit from run to run; the frames are). Under sequence parallelism every rank calls this; rank 0
        alone decodes and writes (the others return None)."""
        wall = time.perf_counter()
        prompts, out, cfg = Path(prompts), Path(out), self.settings(cfg)
        check_out(out)
        device, model, config, shard, decoder = self.device, self.model, self.config, self.shard, self.decoder
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        g = self.prepare(prompts, steps, cfg)
        plan, run, sampling = g.plan, g.run, g.sampling.rollout
        video, chunk = config.video, config.latent.chunk_frames
        if shard.rank != 0:  # the DiT's share of every chunk; rank 0 decodes and writes
            run(stream=None)
            return None
        load_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        total_chunks = sum(sum(shot.chunks) for shot in plan)
        progress = Progress(log, "generate", total_chunks, unit="chunks")
        fps = Fraction(video.fps).limit_denominator(1001000)
        log.info("%s: %d shot(s), %d chunk(s) of %d latent frames, %d frames at %dx%d, %s weights, %s KV cache, "
                 "%d steps, window %s, sinks %d + %d (sampling from: %s), seed %d", self.model_dir, len(plan),
                 total_chunks, chunk, sum(s.video_frames for s in plan), video.width, video.height, self.recipe,
                 cfg.kv, len(sampling.steps) - 1, sampling.window, sampling.global_sink, sampling.shot_sink,
                 ", ".join(f"{k} {v}" for k, v in g.sampling.source.items()), cfg.seed)
        start = time.perf_counter()
        sidecar_path = out.with_name(out.name + ".json")
        with atomic_path(out) as tmp:  # the video takes out's place only once it is checked
            with VideoWriter(tmp, fps, video.width, video.height, threads=0) as writer:
                first_frame: list[float] = []

                def write(rgb: np.ndarray) -> None:
                    if not first_frame:
                        first_frame.append(time.perf_counter())
                    writer.write(rgb)
                    if on_frame is not None:
                        on_frame(rgb)

                stream = FrameStream(decoder, write, asynchronous=cfg.decode == "async")
                try:
                    stats = run(stream=stream, on_chunk=lambda _: progress.advance())
                finally:
                    stream.close()
            elapsed = time.perf_counter() - start
            expected = sum(shot.video_frames for shot in plan)
            if stream.frames != expected:
                raise RuntimeError(f"decoded {stream.frames} frames where the plan makes {expected}")
            sidecar_path.unlink(missing_ok=True)  # an earlier video's sidecar never sits beside this video
        # K and V, every layer, 2 bytes each; a sequence-parallel rank caches a P-th of the heads
        bf16_per_token = 2 * len(model.blocks) * model.cfg.dim * 2 // shard.size
        sidecar = {
            "video": out.name, "frames": stream.frames, "fps": float(fps), "width": video.width,
            "height": video.height, "seconds": stream.frames / float(fps),
            "shots": [{"index": s.index, "latent_frames": s.latent_frames, "video_frames": s.video_frames,
                       "prompts": [seg.prompt for seg in s.segments], "lines": [seg.line for seg in s.segments]}
                      for s in plan],
            "seed": cfg.seed, "steps": list(sampling.steps), "model": str(self.model_dir),
            "model_format": config.format, "recipe": self.recipe, "kv": cfg.kv, "attention": cfg.attention,
            "kv_quant": None if (quant := cfg.kv_quant()) is None else dataclasses.asdict(quant),
            "decode": cfg.decode,
            "device": str(device), "sp": shard.size, "vae_device": str(decoder.device),
            "vae_dtype": str(decoder.dtype).removeprefix("torch."), "vae_compile": cfg.vae_compile,
            "vae_channels_last": decoder.channels_last, "vae_subpixel_upsampling": decoder.upsamplings > 0,
            "window": sampling.window, "global_sink": sampling.global_sink, "shot_sink": sampling.shot_sink,
            "sampling_from": g.sampling.source,
            "denoise_s": stats.denoise_s, "decode_s": stream.decode_s, "generate_s": elapsed,
            "load_s": self.load_s,  # once per Generator, the decoder compiled (the blocks compile in the first chunk)
            "prompt_enhancement": None if g.enhancement is None else {
                **g.enhancement.record(), "model": cfg.enhance_model, "template": template_digest()},
            "wall_s": time.perf_counter() - wall,  # this video: its prompts embedded, the cache, every chunk
            # time to the first frame handed to the encoder: from this video's call (compiling included in a
            # Generator's first), and from its prompts embedded
            "first_frame_s": first_frame[0] - wall, "first_frame_after_prompt_s": first_frame[0] - g.encoded_at,
            "denoise_fps": stream.frames / stats.denoise_s if stats.denoise_s else None,
            "end_to_end_fps": stream.frames / elapsed,
            "peak_memory_bytes": (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                                  else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
            "peak_memory_kind": "cuda max allocated" if device.type == "cuda" else "process max RSS",
            "load_peak_memory_bytes": load_peak,  # cuda: until the prompts are embedded (the DiT, VAE and umT5)
            "kv_bytes_per_token": stats.kv_bytes_per_token, "kv_bytes_per_token_bf16": bf16_per_token,  # per rank
        }
        write_json(sidecar, sidecar_path)
        log.info("%s: %d frames, denoise loop %.1f FPS, end to end %.1f FPS, decode %.1fs, peak memory %.2f GiB",
                 out, stream.frames, sidecar["denoise_fps"] or 0.0, sidecar["end_to_end_fps"], stream.decode_s,
                 sidecar["peak_memory_bytes"] / 2**30)
        return sidecar


def generate_file(model_dir: str | Path, prompts: str | Path, out: str | Path, cfg: GenerateConfig,
                  steps: int | None = None, on_frame: Callable[[np.ndarray], None] | None = None,
                  shard: SequenceShard = WHOLE) -> dict | None:
    """One video: ``Generator.generate`` on a model loaded for it (the prompt file checked first)."""
    text = read_prompt_file(Path(prompts))
    check_out(Path(out))
    # what would fail once the model is loaded fails before it: --steps the folder cannot run, a bad prompt line
    # (the generator refuses the rest before loading)
    run_sampling(read_dit_folder(Path(model_dir)), cfg, steps)
    parse_prompts(text, cfg.default_duration_s, str(prompts))
    with Generator(model_dir, cfg, shard) as generator:
        return generator.generate(prompts, out, steps, on_frame=on_frame)


def check_enhance(cfg: GenerateConfig, shard: SequenceShard) -> None:
    if cfg.enhance and shard.size > 1:
        raise ConfigError("generate.enhance with --sp > 1: every rank would have to be given rank 0's rewrite; "
                          "enhance the prompt file in a run of one rank, or turn enhance off")


def check_attention(cfg: GenerateConfig, device: torch.device) -> None:
    """``generate.attention: fp8`` only where cuDNN's FP8 attention can run."""
    if cfg.attention == "fp8" and (missing := attention_cudnn_fp8.unavailable_reason(device)):
        raise ConfigError(f"generate.attention is fp8 (cuDNN's FP8 attention) but {missing}: use sdpa here")


def check_out(out: Path) -> None:
    """The video's path is a file's, refused before anything is generated where it is a folder."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give the video's file name, such as {out / 'video.mp4'}")


def vae_decoder(path: str, device: torch.device, dtype_name: str, compile: bool = False) -> ShotDecoder:
    """The VAE's shot decoder in ``dtype_name`` (auto: bfloat16 on a GPU, where it decodes at 1.56x
    float32's speed, 50.6 dB PSNR against it: REFERENCE.md's H200 figures; float32 on the CPU), on a GPU
    in channels-last layouts (1.07x there, the same frames), and compiled where ``compile`` asks (1.50x more
    with channels-last, after ~80 s of compiling), then with sub-pixel upsampling too (1.073x more on the H200,
    51.5 dB PSNR against float32 where the plain decoder gives 51.6; measured compiled only, so only there:
    bench/RESULTS.md)."""
    gpu = device.type == "cuda"
    dtype = (torch.bfloat16 if gpu else torch.float32) if dtype_name == "auto" else getattr(torch, dtype_name)
    return ShotDecoder(vae_from(path, device).to(dtype), dtype, channels_last=gpu, compile=compile,
                       subpixel=gpu and compile)


def vae_device(name: str, dit: torch.device) -> torch.device:
    """The VAE's device: the DiT's when ``name`` is empty; a GPU asked for must exist."""
    if not name:
        return dit
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"generate.vae_device is {name} but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def config_from(params_path: str | None, overrides: dict) -> GenerateConfig:
    path = Path(params_path or "params.yaml")
    if path.is_file():
        section = load_params(path).get("generate", {})
    elif params_path is not None:
        raise ConfigError(f"{path} not found")
    else:
        log.info("no params.yaml here: generate's built-in defaults (a BF16 KV cache, nothing compiled; "
                 "--params FILE with a generate section sets production's)")
        section = {}
    return from_mapping(GenerateConfig, {**section, **{k: v for k, v in overrides.items() if v is not None}},
                        "generate")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder: models/w4a4, models/ar, ...")
    ap.add_argument("--prompts", required=True, help="the prompt file: one line per shot, [SECONDS<TAB>]PROMPT, "
                    "'+' in front for a prompt change inside the shot")
    ap.add_argument("--out", required=True, help="the mp4 to write (and OUT.json beside it)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--steps", type=int, help="sampling steps: the model folder's list when it has that many, else "
                    "the list of that length in generate.step_lists (an AR folder: its schedule with N steps)")
    ap.add_argument("--kv", choices=KV_FORMATS, help="the KV cache's format")
    ap.add_argument("--attention", choices=ATTENTIONS, help="the cached self-attention: sdpa, or fp8 (cuDNN's FP8 "
                    "SDPA, Hopper or newer, with the nvidia-cudnn-frontend package)")
    ap.add_argument("--precision", choices=PRECISIONS, help="the linear layers' weights (fp8: W8A8, Hopper's fast "
                    "path)")
    ap.add_argument("--decode", choices=("async", "sync"))
    ap.add_argument("--device", help="auto | cpu | cuda")
    ap.add_argument("--vae-device", help="the VAE's device when not the DiT's: cuda:1 (a second GPU), cpu")
    ap.add_argument("--params", help="params file with a generate section (default: ./params.yaml if present)")
    ap.add_argument("--enhance", action=argparse.BooleanOptionalAction, default=None,
                    help="rewrite the prompt file with generate.enhance_model first (the original and the rewrite go "
                         "into OUT.json; a reply that breaks the file's structure leaves it as given, with a warning)")
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks (torchrun on this machine: one GPU "
                    "each, or CPU processes); the model's heads and the chunk's latent frames must split over them")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    setup_logging()
    if args.sp < 1:
        print("longlive generate: --sp must be at least 1", file=sys.stderr)
        return 2
    if args.sp > 1 and not under_torchrun():  # re-run as P ranks of this same command
        cmd = [*torchrun_command("longlive_core.cli", 1, args.sp), "generate", *argv]
        os.execvp(cmd[0], cmd)
    try:
        cfg = config_from(args.params, {"seed": args.seed, "kv": args.kv, "attention": args.attention,
                                        "precision": args.precision,
                                        "decode": args.decode, "device": args.device, "vae_device": args.vae_device,
                                        "enhance": args.enhance})
        with sequence_parallel(args.sp, cfg.device) as shard:
            generate_file(args.model, args.prompts, args.out, cfg, args.steps, shard=shard)
    except (ConfigError, PromptFileError, CheckpointError) as e:
        print(f"longlive generate: {e}", file=sys.stderr)
        return 2
    return 0


@contextlib.contextmanager
def sequence_parallel(size: int, device_name: str):
    """The process group of ``size`` torchrun ranks (NCCL between GPUs, gloo on the CPU), or WHOLE."""
    if size == 1 and not under_torchrun():
        yield WHOLE
        return
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ConfigError(f"--sp {size} but torchrun started {world} ranks")
    join_process_group(pick_device(device_name, "generate.device"))
    try:
        yield SequenceShard(dist.get_rank(), world, dist.group.WORLD)
    finally:
        dist.destroy_process_group()

