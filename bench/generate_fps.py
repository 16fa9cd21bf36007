"""The inference engine's speed at the real 5B dims: the denoise loop, the VAE decode alone and end to
end, beside the plain-PyTorch block floor measured in the same run.

    python bench/generate_fps.py [--chunks 10] [--steps 4] [--out /tmp/bench.mp4]
    python bench/generate_fps.py --tiny --device cpu --chunks 4     # the code path, anywhere

Random weights (Wan2.2-TI2V-5B DiT and VAE architectures), bf16, 704x1280, chunks of 8 latent
frames (32 video frames), the production window (a chunk attends to 32 latent frames, itself and the
global and shot sinks of 8 included), one shot. Steady state: chunks after the window has filled
(the first three), median per chunk.
- denoise loop: ``engine.generate`` with the frames dropped, bf16 and NVFP4 KV caches;
- decode alone: ``ShotDecoder`` on one shot's chunks, nothing else on the GPU; its FLOPs counted by
  ``FlopCounterMode`` over one more steady chunk, as TFLOP/s against the dense BF16 peak;
- end to end: ``engine.generate`` with ``FrameStream`` (async: the VAE on its own CUDA stream, and
  sync) writing H.264 through ``VideoWriter``, wall clock from the first chunk to the file closed;
- floor: one plain block (q/k/v/o linears, SDPA over the window's keys, cross-attention over 512
  text tokens, the FFN; no adaLN, RoPE or norms) x 30 blocks x (steps + 1) passes per chunk, as
  REFERENCE.md §7 measures it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_setup import random_dit_on_gpu  # noqa: E402
from longlive_core.infer.decode import FrameStream, ShotDecoder  # noqa: E402
from longlive_core.infer.engine import GenerateConfig, generate  # noqa: E402
from longlive_core.infer.prompts import Segment, ShotPlan  # noqa: E402
from longlive_core.infer.rollout import RolloutConfig  # noqa: E402
from longlive_core.models.config import dit_config  # noqa: E402
from longlive_core.models.vae import build_vae  # noqa: E402
from longlive_core.models.wan_dit import WanDiT  # noqa: E402
from longlive_core.train.flops import PEAK_BF16_TFLOPS  # noqa: E402

STEPS = {4: (1000, 946, 854, 681, 0), 2: (1000, 681, 0)}


class DroppedFrames:
    """A frame stream that drops the latents: the DiT alone."""
    frames = 0

    def put(self, z, new_shot) -> None:
        pass

    def close(self) -> None:
        pass


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(model, cfg: GenerateConfig, steps, stream, chunks: int, chunk: int, shape, device, dtype, text):
    """(per-chunk wall seconds with a sync after each chunk, or None when asynchronous; wall total; stats)."""
    plan = [ShotPlan(0, (Segment(1, 0, "bench", 1.0, True),), (chunks,), chunk, 4)]
    _, _, ph, pw = (None, *model.cfg.patch_size)
    sampling = RolloutConfig(chunk, tuple(steps), cfg.window, cfg.global_sink, cfg.shot_sink)
    cache = cfg.cache(model, (shape[1] // ph) * (shape[2] // pw), sampling)
    marks: list[float] = []
    timed = isinstance(stream, DroppedFrames)

    def mark(_stats) -> None:
        if timed:
            sync(device)
        marks.append(time.perf_counter())

    sync(device)
    start = time.perf_counter()
    stats = generate(model, plan, [text], cache, steps, stream, shape, 8, 0, dtype, on_chunk=mark)
    stream.close()
    sync(device)
    wall = time.perf_counter() - start
    per_chunk = [b - a for a, b in zip([start] + marks, marks)] if timed else None
    return per_chunk, wall, stats, cache


def plain_block_ms(device, dtype, dim: int, heads: int, ffn: int, tokens: int, keys: int, text: int,
                   repeats: int = 20) -> float:
    lin = lambda i, o: torch.nn.Linear(i, o, device=device, dtype=dtype)  # noqa: E731
    q, k, v, o, cq, ck, cv, co = (lin(dim, dim) for _ in range(8))
    up, down = lin(dim, ffn), lin(ffn, dim)
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    ctx = torch.randn(1, text, dim, device=device, dtype=dtype)
    past = torch.randn(1, heads, keys - tokens, dim // heads, device=device, dtype=dtype)

    def split(t):
        return t.view(1, t.shape[1], heads, -1).transpose(1, 2)

    def block():
        a = F.scaled_dot_product_attention(split(q(x)), torch.cat([past, split(k(x))], 2),
                                           torch.cat([past, split(v(x))], 2))
        h = x + o(a.transpose(1, 2).flatten(2))
        c = F.scaled_dot_product_attention(split(cq(h)), split(ck(ctx)), split(cv(ctx)))
        h = h + co(c.transpose(1, 2).flatten(2))
        return h + down(F.gelu(up(h), approximate="tanh"))

    times = []
    with torch.no_grad():
        for i in range(repeats + 3):
            sync(device)
            t0 = time.perf_counter()
            block()
            sync(device)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--steps", type=int, choices=sorted(STEPS), default=4)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true", help="also the denoise loop with every block compiled")
    ap.add_argument("--fp8", action="store_true", help="last, the denoise loop with FP8 W8A8 linears (eager and, "
                    "with --compile, compiled)")
    ap.add_argument("--out", default=None, help="the end-to-end mp4 (default: a temporary file)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    dit_cfg = dit_config("tiny" if args.tiny else "wan2.2-ti2v-5b")
    model = (random_dit_on_gpu(dit_cfg) if cuda else WanDiT(dit_cfg)).to(dtype).eval()
    h, w = (4, 8) if args.tiny else (44, 80)
    chunk, window, sink = (2, 8, 2) if args.tiny else (8, 32, 8)
    shape = (dit_cfg.in_channels, h, w)
    text = torch.randn(1, 16 if args.tiny else 512, dit_cfg.text_dim, device=device, dtype=dtype)
    steps = STEPS[args.steps]
    cfg = dict(window=window, global_sink=sink, shot_sink=sink, device=args.device)
    vae = build_vae("tiny" if args.tiny else "wan2.2").to(device, dtype)
    decoder = ShotDecoder(vae, dtype)
    steady = slice(window // chunk - 1, None)  # a chunk reads the whole window from the fourth on
    frames_per_chunk = 4 * chunk
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {name}, torch {torch.__version__}, {'tiny' if args.tiny else 'wan2.2-ti2v-5b'}, {16 * h}x{16 * w}, "
          f"{args.chunks} chunks of {chunk} latent frames, window {window} (the chunk and sinks {sink}/{sink} in it), "
          f"{args.steps} steps, {dtype}")

    run(model, GenerateConfig(**cfg), steps, DroppedFrames(), 2, chunk, shape, device, dtype, text)  # warm-up
    for kv in ("bf16", "nvfp4"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        per_chunk, wall, stats, cache = run(model, GenerateConfig(kv=kv, **cfg), steps, DroppedFrames(),
                                            args.chunks, chunk, shape, device, dtype, text)
        ms = statistics.median(per_chunk[steady] or per_chunk) * 1000
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        print(f"denoise loop, {kv} KV: {ms:.0f} ms per chunk -> {frames_per_chunk / ms * 1000:.1f} FPS; "
              f"KV {stats.kv_bytes_per_token * cache.tokens_per_frame / 2**20:.2f} MiB per latent frame "
              f"({stats.kv_bytes_per_token:.0f} B per token); peak {peak:.1f} GiB")
        if kv == "bf16":
            denoise_ms = ms
    if args.compile:
        for block in model.blocks:
            block.compile()
        t0 = time.perf_counter()
        run(model, GenerateConfig(**cfg), steps, DroppedFrames(), 2, chunk, shape, device, dtype, text)
        print(f"compile and warm-up: {time.perf_counter() - t0:.0f} s")
        per_chunk, _, _, _ = run(model, GenerateConfig(**cfg), steps, DroppedFrames(), args.chunks, chunk, shape,
                                 device, dtype, text)
        ms = statistics.median(per_chunk[steady] or per_chunk) * 1000
        print(f"denoise loop, bf16 KV, compiled blocks: {ms:.0f} ms per chunk -> "
              f"{frames_per_chunk / ms * 1000:.1f} FPS")
        denoise_ms = ms  # the end-to-end runs below use the compiled blocks too

    z = torch.randn(shape[0], chunk, h, w, device=device)
    times = []
    decoder.start_shot()
    for i in range(6):
        sync(device)
        t0 = time.perf_counter()
        decoder.decode(z)
        sync(device)
        if i >= 1:  # the shot's first chunk makes 1 + 4 (F - 1) frames: not a steady chunk
            times.append(time.perf_counter() - t0)
    decode_ms = statistics.median(times) * 1000
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:  # one steady chunk's decoder FLOPs, counted (not timed)
        decoder.decode(z)
    tflop = counter.get_total_flops() / 1e12
    print(f"decode alone: {decode_ms:.0f} ms per chunk -> {frames_per_chunk / decode_ms * 1000:.1f} FPS; "
          f"{tflop:.1f} TFLOP per chunk -> {tflop / decode_ms * 1000:.0f} TFLOP/s"
          + (f" ({tflop / decode_ms * 1000 / PEAK_BF16_TFLOPS['H200']:.0%} of the H200's dense BF16 peak)"
             if cuda else ""))

    from longlive_core.video.writer import VideoWriter

    out = Path(args.out or tempfile.mkdtemp()) / "bench.mp4" if not args.out else Path(args.out)
    for mode in ("async", "sync"):
        with VideoWriter(out, 24, 16 * w, 16 * h, threads=0) as writer:
            stream = FrameStream(decoder, writer.write, asynchronous=mode == "async")
            _, wall, stats, _ = run(model, GenerateConfig(decode=mode, **cfg), steps, stream, args.chunks, chunk,
                                    shape, device, dtype, text)
        print(f"end to end, {mode} decode, H.264 written: {stream.frames} frames in {wall:.1f} s -> "
              f"{stream.frames / wall:.1f} FPS (decode {stream.decode_s:.1f} s of it)")
    serial = frames_per_chunk / (denoise_ms + decode_ms) * 1000
    print(f"denoise + decode timed alone, one after the other: {serial:.1f} FPS")

    if args.fp8:
        from longlive_core.quant.recipe import convert_linears_fp8

        convert_linears_fp8(model)  # the blocks' linears; embeddings, head and norms stay as they are
        if args.compile:
            for block in model.blocks:
                block.compile()
        run(model, GenerateConfig(**cfg), steps, DroppedFrames(), 2, chunk, shape, device, dtype, text)  # warm-up
        per_chunk, _, _, _ = run(model, GenerateConfig(**cfg), steps, DroppedFrames(), args.chunks, chunk, shape,
                                 device, dtype, text)
        ms = statistics.median(per_chunk[steady] or per_chunk) * 1000
        print(f"denoise loop, bf16 KV, FP8 W8A8 linears{', compiled blocks' if args.compile else ''}: {ms:.0f} ms per "
              f"chunk -> {frames_per_chunk / ms * 1000:.1f} FPS ({denoise_ms / ms:.2f}x the bf16 loop above)")

    if not args.tiny:
        keys = window * (h // 2) * (w // 2)
        block = plain_block_ms(device, dtype, dit_cfg.dim, dit_cfg.num_heads, dit_cfg.ffn_dim,
                               chunk * (h // 2) * (w // 2), keys, 512)
        floor_ms = block * dit_cfg.num_layers * len(steps)
        print(f"floor: plain block {block:.2f} ms with {keys} keys -> {floor_ms:.0f} ms per chunk -> "
              f"{frames_per_chunk / floor_ms * 1000:.1f} FPS; denoise loop at {denoise_ms / floor_ms:.2f}x the floor")


if __name__ == "__main__":
    main()
