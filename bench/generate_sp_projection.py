"""``longlive generate --sp P`` projected from one GPU: one rank of P's work per chunk, measured, plus
what its all-to-alls would cost on NVLink, as bench/sp_projection.py projects training.

    python bench/generate_sp_projection.py [--sp 1 2 4] [--chunks 8] [--steps 4] [--compile]
    python bench/generate_sp_projection.py --tiny --device cpu --sp 1 2 --chunks 4   # the code path, anywhere

Rank 0 of P runs ``engine.generate`` as it does under ``--sp P`` (F_c / P of every chunk's latent
frames, the KV cache of H / P heads), with the exchanges looped back on the one GPU: each all-to-all
returns this rank's own part P times (the shapes, copies and attention of the real exchange, the
bytes not moved) and the frame gather repeats this rank's frames. Per layer and pass, q, k, v and the
output cross, a rank sending (P - 1) / P of each:

    V(P) = layers x (steps + 1) x 4 x (L / P) x dim x 2 bytes x (P - 1) / P   (the cache write is a pass)
    t_comm(P) = V(P) / 450 GB/s (NVLink 4 on the H200, one direction)

Projected denoise FPS = 4 F_c / (t(P) + t_comm(P)). End to end, the decode (``ShotDecoder`` as the
product builds it: bf16, channels-last on a GPU, compiled with ``--compile``; steady chunks timed alone
in the same run) adds to rank 0's time when the VAE shares its GPU
(on one GPU the two add up: bench/RESULTS.md), and runs beside the DiT with ``--vae-device`` on a
spare GPU: 4 F_c / max(t(P) + t_comm(P), t_decode). Random 5B weights, bf16, 704x1280, the paper's
window (32 latent frames, sinks 8 + 8), one shot, steady chunks' median. A projection: no exchange
crosses a link, and NCCL reaches a fraction of the link's rate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_setup import random_dit_on_gpu  # noqa: E402
from longlive_core.distributed import ulysses  # noqa: E402
from longlive_core.distributed.ulysses import SequenceShard  # noqa: E402
from longlive_core.infer import engine  # noqa: E402
from longlive_core.infer.decode import ShotDecoder  # noqa: E402
from longlive_core.infer.engine import GenerateConfig  # noqa: E402
from longlive_core.infer.prompts import Segment, ShotPlan  # noqa: E402
from longlive_core.infer.rollout import RolloutConfig  # noqa: E402
from longlive_core.models.config import dit_config  # noqa: E402
from longlive_core.models.vae import build_vae  # noqa: E402
from longlive_core.models.wan_dit import WanDiT  # noqa: E402

STEPS = {4: (1000, 946, 854, 681, 0), 2: (1000, 681, 0)}
NVLINK_ONE_WAY = 450e9


class DroppedFrames:
    frames = 0

    def put(self, z, new_shot) -> None:
        pass


def loop_back(rank: int) -> None:
    """This process as rank ``rank`` of the exchange's P, its parts standing in for everyone's."""
    def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
        return x[rank:rank + 1].expand_as(x).contiguous()  # a fresh buffer, as the received one is

    def gather(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        return x if shard.size == 1 else torch.cat([x] * shard.size, dim=2)

    ulysses._all_to_all = all_to_all
    engine.gather_frames = gather


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rank_chunk_seconds(model, sp: int, chunks: int, chunk: int, window: int, sink: int, steps, shape, text, device,
                       dtype) -> list[float]:
    """Rank 0 of ``sp``: each chunk's wall seconds, synchronised after each."""
    shard = SequenceShard(0, sp, None)
    sampling = RolloutConfig(chunk, tuple(steps), window, sink, sink)
    _, ph, pw = model.cfg.patch_size
    cache = GenerateConfig(window=window, global_sink=sink, shot_sink=sink).cache(
        model, (shape[1] // ph) * (shape[2] // pw), sampling)
    plan = [ShotPlan(0, (Segment(1, 0, "bench", 1.0, True),), (chunks,), chunk, 4)]
    marks: list[float] = []

    def mark(_stats) -> None:
        sync(device)
        marks.append(time.perf_counter())

    sync(device)
    start = time.perf_counter()
    engine.generate(model, plan, [text], cache, steps, DroppedFrames(), shape, 8, 0, dtype, on_chunk=mark, shard=shard)
    return [b - a for a, b in zip([start, *marks], marks)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--steps", type=int, choices=sorted(STEPS), default=4)
    ap.add_argument("--compile", action="store_true",
                    help="every block and the decoder compiled, as production's generate runs")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    cfg = dit_config("tiny" if args.tiny else "wan2.2-ti2v-5b")
    model = (random_dit_on_gpu(cfg) if cuda else WanDiT(cfg)).to(dtype).eval()
    if args.compile:
        for block in model.blocks:
            block.compile()
    h, w = (4, 4) if args.tiny else (44, 80)
    chunk, window, sink = (2, 6, 2) if args.tiny else (8, 32, 8)
    shape = (cfg.in_channels, h, w)
    text = torch.randn(1, 16 if args.tiny else 512, cfg.text_dim, device=device, dtype=dtype)
    steps = STEPS[args.steps]
    frames = 4 * chunk
    steady = slice(window // chunk - 1, None)
    print(f"# {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
          f"{'tiny' if args.tiny else 'wan2.2-ti2v-5b'}, {16 * h}x{16 * w}, {args.chunks} chunks of {chunk} latent "
          f"frames, window {window} (sinks {sink} + {sink}), {args.steps} steps, "
          f"{'compiled' if args.compile else 'eager'} blocks; a projection from one GPU", flush=True)

    # the product's decoder (generate.vae_decoder): channels-last on a GPU, compiled where the blocks are
    decoder = ShotDecoder(build_vae("tiny" if args.tiny else "wan2.2").to(device, dtype), dtype,
                          channels_last=cuda, compile=args.compile)
    if args.compile:
        decoder.warm(shape[0], h, w, chunk)
    z = torch.randn(shape[0], chunk, h, w, device=device)
    decoder.start_shot()
    times = []
    for i in range(5):  # a shot's first two chunks meet other feature caches: steady from the third
        sync(device)
        t0 = time.perf_counter()
        decoder.decode(z)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    decode_s = statistics.median(times)
    del decoder
    print(f"decode alone ({str(dtype).removeprefix('torch.')} ShotDecoder{', compiled' if args.compile else ''}): "
          f"{decode_s * 1000:.0f} ms per chunk -> "
          f"{frames / decode_s:.1f} FPS",
          flush=True)

    tokens = chunk * (h // 2) * (w // 2)
    base = None
    for sp in args.sp:
        if cfg.num_heads % sp or chunk % sp:
            print(f"P = {sp}: the {cfg.num_heads} heads or {chunk}-frame chunks do not split; skipped")
            continue
        loop_back(0)
        rank_chunk_seconds(model, sp, 2, chunk, window, sink, steps, shape, text, device, dtype)  # warm-up
        per_chunk = rank_chunk_seconds(model, sp, args.chunks, chunk, window, sink, steps, shape, text, device, dtype)
        t = statistics.median(per_chunk[steady] or per_chunk)
        volume = cfg.num_layers * len(steps) * 4 * (tokens / sp) * cfg.dim * 2 * (sp - 1) / sp
        comm = volume / NVLINK_ONE_WAY
        base = base or t
        rank = t + comm
        print(f"P = {sp}: rank 0 {t * 1000:.0f} ms per chunk + exchange {comm * 1000:.1f} ms ({volume / 1e9:.2f} GB) "
              f"-> denoise {frames / rank:.1f} FPS (efficiency {base / (sp * rank):.3f}); end to end, the VAE on "
              f"rank 0's GPU {frames / (rank + decode_s):.1f} FPS, on a spare GPU {frames / max(rank, decode_s):.1f} "
              f"FPS (projected)", flush=True)


if __name__ == "__main__":
    main()
