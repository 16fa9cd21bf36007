"""Balanced SP at the real 5B block dims on one GPU: the compute and memory of one rank of P, the
all-to-all volume it would exchange, and the projected efficiency on NVLink.

    PYTHONPATH=. python bench/sp_projection.py [--blocks 4] [--frames 48 96] [--sp 1 2 4 8] [--ac full]
                                               [--attention rows flex]

One rank of P holds F/P latent frames (clean and noisy: 2 x 880 x F/P tokens) and, inside
self-attention, H/P heads of all 2 x 880 x F tokens. This bench runs exactly that rank's work on one
GPU: the model's forward and backward on the local tokens, with an ``attention_fn`` that stands in
for the Ulysses exchange by tiling the local q, k, v P times along the sequence (as many keys as the
real exchange gathers) for H/P heads, attending with the Balanced-SP teacher-forcing mask (by its
dense rows, the default, or FlexAttention's block mask: ``--attention``), and tiling
the output back over the heads. So the GEMMs, the attention and the copies are the rank's; only the
bytes over NVLink are not moved. Those are counted: per layer, q, k, v and the output cross in the
forward, their gradients in the backward, and the forward's again when activation checkpointing
recomputes it; a rank sends (P-1)/P of each tensor:

    V(P) = layers x passes x 4 x (L/P) x dim x 2 bytes x (P-1)/P,   passes = 2 (3 with full AC)
    t_comm(P) = V(P) / 450 GB/s  (NVLink 4 on the H200: 900 GB/s per GPU, both directions together)
    efficiency(P) = t(1) / (P x (t(P) + t_comm(P)))

with t(P) the measured forward + backward of one rank (median of --steps after two warm-ups). The
all-to-all is on the critical path (attention needs all of it), so nothing is overlapped: the
projection is what the exchange costs at the link's full rate, an upper bound on efficiency.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_setup import random_dit_on_gpu
from longlive_core.distributed.parallelize import apply_activation_checkpointing
from longlive_core.models import config as model_configs
from longlive_core.models.attention import attend
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.layout import TeacherForcingLayout

H, W, TEXT_TOKENS, CHUNK = 44, 80, 512, 8
TOKENS_PER_FRAME = (H // 2) * (W // 2)
NVLINK_ONE_WAY = 450e9  # bytes/s a GPU sends over NVLink 4 (900 GB/s counts both directions)


class LoopbackExchange:
    """One rank's attention of P: the local tokens stand in for every rank's, H/P heads."""

    def __init__(self, sp: int, attention_fn):
        self.sp, self.attention_fn = sp, attention_fn

    def __call__(self, q, k, v, mask_mod):
        p = self.sp
        hp = q.shape[1] // p
        q, k, v = (t[:, :hp].repeat(1, 1, p, 1) for t in (q, k, v))
        out = self.attention_fn(q, k, v, mask_mod)
        return out[:, :, : out.shape[2] // p].repeat(1, p, 1, 1)


def a2a_bytes(layers: int, local_tokens: int, dim: int, sp: int, ac: str) -> float:
    passes = 3 if ac == "full" else 2
    return layers * passes * 4 * local_tokens * dim * 2 * (sp - 1) / sp


def measure(model: WanDiT, frames: int, sp: int, attention: str, steps: int) -> tuple[float, float]:
    """(median seconds of one rank's forward + backward, peak GiB)."""
    cfg = model.cfg
    local = frames // sp
    layout = TeacherForcingLayout(frames, CHUNK, TOKENS_PER_FRAME, TEXT_TOKENS, sp)
    attention_fn = functools.partial(attend, backend=attention)
    model.attention_fn = LoopbackExchange(sp, attention_fn) if sp > 1 else attention_fn
    g = torch.Generator(device="cuda").manual_seed(0)
    latents = torch.randn(1, 48, 2 * local, H, W, device="cuda", generator=g, dtype=torch.bfloat16)
    t = layout.timesteps(torch.rand(1, local // CHUNK, device="cuda", generator=g) * 1000)
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    positions = layout.frame_positions(torch.arange(local, device="cuda"))
    times = []
    for i in range(steps + 2):
        if i == 2:  # the peak of the steps themselves, not of the warm-ups' one-off block-mask building
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(latents, t, text, frame_positions=positions, mask_mod=layout.self_mask())
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def measure_sizes(model: WanDiT, cfg, args, attention: str, frames: int, rows: list[dict]) -> None:
    base = None
    for sp in args.sp:
        if frames % (sp * CHUNK) or cfg.num_heads % sp:
            continue
        row = {"attention": attention, "frames": frames, "tokens": 2 * frames * TOKENS_PER_FRAME, "sp": sp,
               "blocks": args.blocks, "ac": args.ac}
        try:
            step_s, peak = measure(model, frames, sp, attention, args.steps)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        volume = a2a_bytes(args.blocks, 2 * frames // sp * TOKENS_PER_FRAME, cfg.dim, sp, args.ac)
        comm = volume / NVLINK_ONE_WAY
        base = step_s if sp == 1 else base
        row.update({"rank_ms": round(step_s * 1e3, 1), "peak_gib": round(peak, 1),
                    "a2a_mb_per_rank": round(volume / 1e6, 1), "a2a_ms_projected": round(comm * 1e3, 1)})
        if base is not None:
            row["compute_scaling"] = round(base / (sp * step_s), 3)  # t(1) / (P t(P))
            row["projected_efficiency"] = round(base / (sp * (step_s + comm)), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--frames", type=int, nargs="+", default=[48, 96])
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ac", default="full", choices=["none", "full"])
    ap.add_argument("--attention", nargs="+", default=["rows"], help="self-attention backends: rows, flex")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cfg = model_configs.dit_config("wan2.2-ti2v-5b")
    cfg = dataclasses.replace(cfg, num_layers=args.blocks)
    model = random_dit_on_gpu(cfg).to(torch.bfloat16)
    apply_activation_checkpointing(model, args.ac)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.blocks} blocks of wan2.2-ti2v-5b, "
          f"AC {args.ac}", flush=True)
    rows = []
    for attention in args.attention:
        for frames in args.frames:
            measure_sizes(model, cfg, args, attention, frames, rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sp_projection.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
