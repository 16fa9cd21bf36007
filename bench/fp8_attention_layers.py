"""cuDNN's FP8 attention against BF16 SDPA, layer by layer, on the inputs each self-attention of the
5B DiT sees while ``longlive generate`` makes one chunk over a full window of cached frames.

    PYTHONPATH=. python bench/fp8_attention_layers.py [--frames 32] [--chunk 8] [--json F] [--dump F.safetensors]

The DiT has random N(0, 0.02) weights in bf16 (made on the GPU), 704x1280 latents (880 tokens a
frame), a random 512-token caption. The cache is filled by write passes over ``--frames - --chunk``
random clean frames, as the rollout fills it; then the next chunk's first denoising step (t = 1000,
pure noise) runs twice:

- on the BF16 path, every self-attention call also run through ``attention_cudnn_fp8.attention_fp8``
  on the same queries, keys and values: per layer the relative L2 error of FP8 against BF16 (every
  head) and of each against float32 attention (two heads), and what the per-tensor scales leave the
  typical value (Q's, smoothed K's and V's amax over their root mean square; the output's amax
  against V's, the bound O's scale is set by);
- with FP8 attention in every layer: the relative error of the chunk's predicted velocity against
  the BF16 path's, what the errors add up to over the 30 layers of one step;
- the chunk's passes as ``longlive generate`` runs them with ``attention: fp8`` (the KV cache's own path:
  the window in E4M3 kept from the first pass, a later pass quantizing only its own rows with the first
  pass's scales, ``attention_fp8_io.FP8Window``): at t = 1000, 750, 500, 250 and 0, the inputs noise
  blended with one random clean chunk, each pass's velocity against the BF16 cache's on the same input,
  and the share of the chunk's own key and value codes at E4M3's top, +-448 (saturated past the headroom,
  or rounded there). (A video's first chunk, with no cached frames, keeps no window: each of its passes
  quantizes its own rows with their own scales.)

Random weights make near-uniform attention; real weights sharpen it, which the recipe's emulation
puts at 6% for N(0, 1) inputs and 10% for 3x sharper queries (infer/attention_cudnn_fp8.py).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from bench.gpu_setup import random_dit_on_gpu
from longlive_core.infer import attention_cudnn_fp8, kv_cache
from longlive_core.infer.kv_cache import KVCache
from longlive_core.infer.rollout import write_chunk
from longlive_core.models.config import dit_config

LATENT_H, LATENT_W, TEXT_TOKENS = 44, 80, 512


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def peak_over_rms(x: torch.Tensor) -> float:
    x = x.float()
    return float(x.abs().amax() / x.square().mean().sqrt())


def kept_window_passes(model, cache: KVCache, noise: torch.Tensor, text: torch.Tensor, positions: torch.Tensor
                       ) -> list[dict]:
    """One chunk's passes through the cache with ``attention`` sdpa, then fp8 (the window kept from the first
    FP8 pass): per pass the velocity's relative error and the saturated share of the own rows' codes."""
    clean = torch.randn_like(noise)
    rows = []
    for t in (1000.0, 750.0, 500.0, 250.0, 0.0):
        x = ((t / 1000) * noise.float() + (1 - t / 1000) * clean.float()).to(noise.dtype)
        step = torch.full((1,), t, device="cuda")
        cache.attention = "sdpa"
        v_bf16 = model(x, step, text, frame_positions=positions)
        cache.attention = "fp8"
        v_fp8 = model(x, step, text, frame_positions=positions)
        own = [(w.k8[:, :, w.cached:], w.v8[:, :, w.cached:]) for _, w in cache.fp8_windows]
        saturated = [sum(float((c.float().abs() == 448).sum()) for c in codes) / sum(c.numel() for c in codes)
                     for codes in zip(*own)]
        rows.append({"t": t, "velocity_fp8_vs_bf16": relative(v_fp8, v_bf16), "k_saturated": saturated[0],
                     "v_saturated": saturated[1]})
    cache.attention = "sdpa"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=32, help="the window in latent frames, the chunk included")
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump", default=None, help="a .safetensors file for head 0 of --dump-layer: its q, k, v, "
                    "both outputs and the per-tensor amaxes, to replay the FP8 numerics off the GPU")
    ap.add_argument("--dump-layer", type=int, default=1)
    args = ap.parse_args()
    missing = attention_cudnn_fp8.unavailable_reason("cuda")
    if missing is not None:
        raise SystemExit(f"cuDNN FP8 attention is unavailable here: {missing}")
    cfg = dit_config("wan2.2-ti2v-5b")
    torch.manual_seed(0)
    model = random_dit_on_gpu(cfg).to(torch.bfloat16).eval()
    _, ph, pw = cfg.patch_size
    tokens_per_frame = (LATENT_H // ph) * (LATENT_W // pw)
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(len(model.blocks), tokens_per_frame, args.frames)
    past = args.frames - args.chunk
    model.attention_fn = cache
    for start in range(0, past, args.chunk):
        x0 = torch.randn(1, cfg.in_channels, args.chunk, LATENT_H, LATENT_W, device="cuda", dtype=torch.bfloat16)
        write_chunk(model, cache, x0, text, torch.arange(start, start + args.chunk, device="cuda"),
                    frames=args.chunk)
    noise = torch.randn(1, cfg.in_channels, args.chunk, LATENT_H, LATENT_W, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(past, past + args.chunk, device="cuda")
    t = torch.full((1,), 1000.0, device="cuda")
    bf16_attend = kv_cache.attend
    layers: list[dict] = []

    def compared(q, k, v, mask, backend):
        out = bf16_attend(q, k, v, mask, backend=backend)
        fp8 = attention_cudnn_fp8.attention_fp8(q, k, v)
        ref = F.scaled_dot_product_attention(q[:, :2].float(), k[:, :2].float(), v[:, :2].float())
        smoothed = k - k.mean(dim=2, keepdim=True)
        if args.dump and len(layers) == args.dump_layer:
            print(f"dumped layer {len(layers)}: q {tuple(q.shape)} {q.stride()}, k {tuple(k.shape)} {k.stride()}, "
                  f"v {tuple(v.shape)} {v.stride()}, mask {mask!r}, backend {backend!r}", flush=True)
            save_file({"q": q[:, :1].contiguous(), "k": k[:, :1].contiguous(), "v": v[:, :1].contiguous(),
                       "bf16": out[:, :1].contiguous(), "fp8": fp8[:, :1].contiguous(),
                       "amax": torch.stack([q.float().abs().amax(), smoothed.float().abs().amax(),
                                            v.float().abs().amax()]).cpu()}, args.dump)
        layers.append({"layer": len(layers), "fp8_vs_bf16": relative(fp8, out),
                       "fp8_vs_fp32": relative(fp8[:, :2], ref), "bf16_vs_fp32": relative(out[:, :2], ref),
                       "keys": k.shape[2],
                       # how much of E4M3's range each per-tensor scale leaves the typical value: the amax
                       # over the root mean square, and |O| against the amax(V) bound its scale is set by
                       "q_peak": peak_over_rms(q), "k_peak": peak_over_rms(smoothed), "v_peak": peak_over_rms(v),
                       "o_of_v_amax": float(out.float().abs().amax() / v.float().abs().amax())})
        return out

    def fp8_everywhere(q, k, v, mask, backend):
        return attention_cudnn_fp8.attention_fp8(q, k, v)

    with torch.no_grad():
        kv_cache.attend = compared
        try:
            v_bf16 = model(noise, t, text, frame_positions=positions)
            kv_cache.attend = fp8_everywhere
            v_fp8 = model(noise, t, text, frame_positions=positions)
        finally:
            kv_cache.attend = bf16_attend
        passes = kept_window_passes(model, cache, noise, text, positions)
    step = relative(v_fp8, v_bf16)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: a {args.chunk}-frame chunk over "
          f"{past} cached frames, {len(layers)} layers, random weights", flush=True)
    print("| layer | FP8 vs BF16 | FP8 vs float32 | BF16 vs float32 | amax/rms Q, K, V | max O / max V |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in layers:
        print(f"| {row['layer']} | {row['fp8_vs_bf16']:.4f} | {row['fp8_vs_fp32']:.4f} | {row['bf16_vs_fp32']:.4f} "
              f"| {row['q_peak']:.1f}, {row['k_peak']:.1f}, {row['v_peak']:.1f} | {row['o_of_v_amax']:.4f} |")
    print(f"| pass t (after {past} frames) | velocity, FP8 kept window vs BF16 | own K codes at +-448 | "
          "own V codes at +-448 |")
    print("|---:|---:|---:|---:|")
    for row in passes:
        print(f"| {row['t']:.0f} | {row['velocity_fp8_vs_bf16']:.4f} | {row['k_saturated']:.2e} | "
              f"{row['v_saturated']:.2e} |")
    worst = max(layers, key=lambda r: r["fp8_vs_bf16"])
    mean = sum(r["fp8_vs_bf16"] for r in layers) / len(layers)
    print(f"mean FP8 vs BF16 {mean:.4f}, worst {worst['fp8_vs_bf16']:.4f} (layer {worst['layer']}); the step's "
          f"velocity with FP8 attention in every layer against BF16's: {step:.4f}", flush=True)
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"layers": layers, "velocity_fp8_vs_bf16": step, "mean_fp8_vs_bf16": mean,
                                 "passes": passes}) + "\n")


if __name__ == "__main__":
    main()
