"""The VAE decode as ``longlive generate`` runs it (``ShotDecoder``: one chunk of latent frames at a
time, the causal feature cache kept across chunks), its variants side by side in one run against the
float32 decode of the same latents.

    python bench/vae_decode.py [--chunks 6] [--variants bf16,bf16-cl,bf16-compile,bf16-compile-cl]
    python bench/vae_decode.py --chunks 4 --variants bf16-compile-cl,bf16-compile-cl-f2,bf16-compile-cl-bm
    python bench/vae_decode.py --content demo [--variants ...]   # latents of a demo shot, not noise
    python bench/vae_decode.py --tiny --device cpu --chunks 3 --variants bf16,bf16-cl   # the code path, anywhere
    python bench/vae_decode.py --variants bf16-compile-cl --profile     # where a steady chunk's GPU time goes

Wan2.2's VAE with random weights made on the device, 704x1280, chunks of 8 latent frames (32 video
frames) of one shot drawn N(0, 1); each variant decodes a warm-up shot (compiling where it compiles),
then the timed shot: the median of its steady chunks (the shot's first makes 29 frames, not 32).
Per variant: FPS, TFLOP/s against the dense BF16 peak (FlopCounterMode over one steady chunk), and
against float32's frames the PSNR and the largest difference in 8-bit levels, and the timed shot's
peak memory. Variants: ``fp32``, ``bf16`` (the product's default on a GPU), ``-cl`` channels-last
weights and input, ``-compile`` each decoder call compiled with fixed shapes, ``-fN`` N latent frames
per decoder call after a shot's first (``ShotDecoder(frames_per_call=N)``; the product's is 1; 8 ran
out of an H100's 80 GB), ``-sp`` each nearest 2x upsampling and its 3x3 convolution as one sub-pixel convolution
(``ShotDecoder(subpixel=True)``, ``infer/vae_upsample.py``), ``-bm`` cuDNN's autotuner on for the convolutions
(``torch.backends.cudnn.benchmark``, which the product leaves off: compiled and channels-last, it
gained nothing on an H100, bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_setup import print_kernels  # noqa: E402
from longlive_core.infer.decode import ShotDecoder  # noqa: E402
from longlive_core.infer.vae_upsample import subpixel_upsampling  # noqa: E402
from longlive_core.models.vae import build_vae, encode_video, frames_to_input  # noqa: E402
from longlive_core.train.flops import PEAK_BF16_TFLOPS  # noqa: E402
from longlive_core.video.synth import ShotSpec, render_shot  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decoder_for(variant: str, state: dict, name: str, device: torch.device) -> ShotDecoder:
    """A fresh VAE with the reference weights, as ``variant`` asks."""
    dtype = torch.float32 if variant.startswith("fp32") else torch.bfloat16
    with torch.device(device):
        vae = build_vae(name)
    vae.load_state_dict(state)
    # process-wide, so set for every variant: on for this one's decodes, off for the next unless it asks
    torch.backends.cudnn.benchmark = "-bm" in variant
    calls = re.search(r"-f(\d+)", variant)
    return ShotDecoder(vae.to(dtype).eval(), dtype, channels_last="-cl" in variant, compile="-compile" in variant,
                       frames_per_call=int(calls.group(1)) if calls else 1, subpixel="-sp" in variant)


def decode_shot(decoder: ShotDecoder, latents: list[torch.Tensor], device) -> tuple[torch.Tensor, list[float]]:
    """The shot's frames (uint8, on the CPU) and each chunk's wall seconds."""
    decoder.start_shot()
    frames, times = [], []
    for z in latents:
        sync(device)
        t0 = time.perf_counter()
        out = decoder.decode(z)
        sync(device)
        times.append(time.perf_counter() - t0)
        frames.append(out.cpu())
    return torch.cat(frames), times


def demo_latents(vae, height: int, width: int, latent_frames: int, device: torch.device) -> torch.Tensor:
    """(C, latent_frames, h, w): a demo shot (``video.synth``: a textured gradient, two moving shapes)
    rendered at the decode's size, 1 + 4 (latent_frames - 1) frames, encoded by ``vae`` (float32)."""
    shot = ShotSpec(1 + 4 * (latent_frames - 1), 0.6, "circle", 3)
    frames = np.stack(list(render_shot(shot, width, height)))
    return encode_video(vae, frames_to_input(frames, device)).float()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0 ** 2 / mse)).item()


def explain_call(decoder: ShotDecoder, latents: list[torch.Tensor]) -> None:
    """How Dynamo splits a steady decoder call (the first of a shot's second chunk): its graphs and why it
    broke between them (a break makes the callee a function compiled apart, with its own recompile limit)."""
    decoder.start_shot()
    decoder.decode(latents[0])
    x, first = next(decoder.calls(latents[1]))
    with torch.no_grad():
        explained = torch._dynamo.explain(decoder.eager_frame)(x, first)
    print(f"  Dynamo: {explained.graph_count} graphs, {explained.graph_break_count} breaks", flush=True)
    for reason in explained.break_reasons[:6]:
        where = reason.user_stack[-1] if reason.user_stack else ""
        print(f"    break: {str(reason.reason)[:160]} at {where}", flush=True)
    decoder.start_shot()


def profile_chunk(decoder: ShotDecoder, latents: list[torch.Tensor], device: torch.device, top: int = 12) -> None:
    """One steady chunk (the shot's second) under torch.profiler: the kernels by device time, and the
    share of the convolutions' (cuDNN's and Triton's convolution kernels, by name)."""
    from torch.profiler import ProfilerActivity, profile

    decoder.start_shot()
    decoder.decode(latents[0])
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        decoder.decode(latents[1])
        sync(device)
    print_kernels(prof, top, {"convolutions": ("conv", "xmma", "cudnn")})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--variants", default="bf16,bf16-cl,bf16-compile,bf16-compile-cl")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one steady chunk of each variant: its kernels by GPU time, convolutions apart")
    ap.add_argument("--explain", action="store_true",
                    help="also print how Dynamo splits a steady decoder call of each compiled variant")
    ap.add_argument("--content", choices=("noise", "demo"), default="noise",
                    help="latents drawn N(0, 1), or the demo's synthetic shots rendered at full size and encoded "
                         "by the same random VAE in float32")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    name = "tiny" if args.tiny else "wan2.2"
    h, w, chunk = (4, 4, 2) if args.tiny else (44, 80, 8)
    torch.manual_seed(0)
    with torch.device(device):
        state = {k: v.clone() for k, v in build_vae(name).state_dict().items()}
    fp32 = decoder_for("fp32", state, name, device)
    if args.content == "demo":
        latents = list(demo_latents(fp32.vae, 16 * h, 16 * w, chunk * args.chunks, device).split(chunk, dim=1))
    else:
        g = torch.Generator(device).manual_seed(1)
        latents = [torch.randn(48, chunk, h, w, device=device, generator=g) for _ in range(args.chunks)]
    cuda = device.type == "cuda"
    print(f"# {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, {name} VAE, "
          f"{16 * h}x{16 * w}, {args.chunks} chunks of {chunk} latent frames, latents: {args.content}", flush=True)
    # the reference in float32 throughout: torch lets cuDNN's float32 convolutions run in TF32 by default
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        reference, _ = decode_shot(fp32, latents, device)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    from torch.utils.flop_counter import FlopCounterMode

    tflops_of = {}  # a steady chunk's FLOPs, plain and with sub-pixel upsampling (the other variants do the same)
    for subpixel in (False, True):
        if subpixel:
            subpixel_upsampling(fp32.vae.decoder)
        fp32.start_shot()
        fp32.decode(latents[0])
        with FlopCounterMode(display=False) as counter:
            fp32.decode(latents[1])
        tflops_of[subpixel] = counter.get_total_flops() / 1e12
    print(f"# a steady chunk: {tflops_of[False]:.1f} TFLOP, {tflops_of[True]:.1f} with sub-pixel upsampling",
          flush=True)
    del fp32
    frames_per_chunk = 4 * chunk
    # more latent frames a call compile the up blocks apart for each of their frame counts (past 8 Dynamo ran
    # them eagerly in the H100's -f2 variant)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for variant in args.variants.split(","):
        # compiled code is kept per function, not per decoder: without a reset, a variant's recompiles count toward
        # the limit of the variants before it (8 a function) and past it Dynamo runs the calls eagerly
        torch._dynamo.reset()
        decoder = decoder_for(variant, state, name, device)
        t0 = time.perf_counter()
        decode_shot(decoder, latents[:2], device)  # warm-up: compiles every graph a shot needs
        warm = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        frames, times = decode_shot(decoder, latents, device)
        peak = f"; peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if cuda else ""
        ms = statistics.median(times[1:] or times) * 1000
        tflop = tflops_of[decoder.upsamplings > 0]
        tflops = tflop / ms * 1000
        levels = (frames.int() - reference.int()).abs().max().item()
        print(f"{variant}: {ms:.0f} ms per chunk -> {frames_per_chunk / ms * 1000:.1f} FPS; {tflop:.1f} TFLOP per "
              f"chunk -> {tflops:.0f} TFLOP/s"
              + (f" ({tflops / PEAK_BF16_TFLOPS['H200']:.0%} of the H200's dense BF16 peak)" if cuda else "")
              + f"; against fp32: PSNR {psnr(frames, reference):.1f} dB, at most {levels} levels off; "
              f"warm-up {warm:.0f} s{peak}"
              + (f"; {decoder.upsamplings} upsamplings sub-pixel" if decoder.upsamplings else ""), flush=True)
        if args.profile:
            profile_chunk(decoder, latents, device)
        if args.explain and "-compile" in variant:  # after the timed shots: its tracing is reset with the variant
            explain_call(decoder, latents)
        del decoder
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
