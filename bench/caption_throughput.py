"""Caption throughput (bench/RESULTS.md "caption: Qwen2.5-VL-7B on the GPU"): the caption stage's own
``CaptionModel.generate`` at production's caption settings (configs/production.yaml over params.yaml:
frames, pixels, batch, max_new_tokens, precision), on a Qwen2.5-VL-7B-architecture model with random
weights made on the GPU, and the GPU-hours the production run's shots need at that rate.

    PYTHONPATH=. python bench/caption_throughput.py [--repeats 3] [--json rows.jsonl]   # H200, a few minutes
    .venv/bin/python bench/caption_throughput.py --tiny                                 # CPU, seconds

Random weights never write the end token in practice, so every caption runs to ``max_new_tokens``: the
rate is the bound's (real captions that stop earlier are faster). Frames are random pixels of
``--size`` (the device has no PyAV to decode clips); the processor resizes them as it does real
frames. Each request holds ``--context`` earlier captions of ``max_new_tokens`` words, as a shot's
request in a video does. The tokenizer is tiny.py's word-level one (no download): the prompt's text
tokens differ a little from Qwen's BPE, the video tokens (most of the prompt) do not.

--tiny runs the same path with the demo's tiny model and params.yaml's caption settings on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longlive_core.caption.config import TINY, CaptionConfig  # noqa: E402
from longlive_core.caption.model import CaptionModel, resolve_dtype  # noqa: E402
from longlive_core.caption.text import prompt_words, shot_prompt, subjects_prompt  # noqa: E402
from longlive_core.caption.tiny import (  # noqa: E402
    TINY_TEXT,
    TINY_VISION,
    WORDS,
    build_tokenizer,
    make_processor,
    set_end_tokens,
    special_token_ids,
)
from longlive_core.config import from_mapping  # noqa: E402
from longlive_core.params_overlay import overlaid_params  # noqa: E402
from longlive_core.plan.capacity import caption_variant  # noqa: E402

# Qwen2.5-VL-7B-Instruct's dimensions (transformers' Qwen2_5_VLConfig defaults are another size's): the
# module shapes of the released model (embed 152064 x 3584, 28 decoder layers, q 3584 and k/v 512 wide,
# MLP 18944; a 32-block vision tower 1280 wide with MLP 3420, merged into 3584) and its config.json
# (rope theta 1e6, mrope sections 16/24/24, full attention in vision blocks 7/15/23/31, 112 px windows).
QWEN25_VL_7B_TEXT = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                     "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                     "rms_norm_eps": 1e-6,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [16, 24, 24]}}
QWEN25_VL_7B_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2}


def caption_settings(tiny: bool) -> CaptionConfig:
    """The caption section users run: params.yaml's (the demo) or production's overlay of it."""
    params = overlaid_params(REPO / "params.yaml", REPO / ("params.yaml" if tiny else "configs/production.yaml"))
    section = {**params["caption"], "source": "model"}
    # production's model folder is not on the bench machine: validated as tiny, then named for the record
    cfg = from_mapping(CaptionConfig, {**section, "model": TINY}, "caption")
    return dataclasses.replace(cfg, model=TINY if tiny else "random Qwen2.5-VL-7B")


def random_vlm(tokenizer, text: dict, vision: dict, device: torch.device, dtype: torch.dtype):
    """A Qwen2.5-VL of random weights made on ``device`` (a CPU init of 8B parameters takes minutes), its
    token ids the tokenizer's and its end token Qwen2.5-VL-Instruct's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    special, vision_ids = special_token_ids(tokenizer)
    config = Qwen2_5_VLConfig(text_config={"vocab_size": len(tokenizer), **text, **special}, vision_config=vision,
                              **vision_ids, **special)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    set_end_tokens(model, special)
    return model.to(device)  # a buffer made off the device context would stop generate: a no-op otherwise


def parameters_on_meta(text: dict, vision: dict) -> int:
    """The architecture's parameter count, built on the meta device (no memory): checks the dims construct."""
    model = random_vlm(build_tokenizer(prompt_words()), text, vision, torch.device("meta"), torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def fake_caption(words: int, rng: np.random.Generator) -> str:
    """``words`` words of the tokenizer's vocabulary (a token each), in sentences of 12."""
    vocab = [w for w in WORDS if w.isalpha()]
    picked = rng.choice(vocab, size=words)
    return " ".join(f"{w}." if (i + 1) % 12 == 0 or i + 1 == words else str(w) for i, w in enumerate(picked))


def requests(cfg: CaptionConfig, frames: int, size: tuple[int, int], context: int, seed: int = 0):
    """``batch_size`` shots of different videos, as caption_task batches them: (frames, request text)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(cfg.batch_size):
        earlier = [fake_caption(cfg.max_new_tokens, rng) for _ in range(context)]
        pixels = rng.integers(0, 256, (frames, *size, 3), dtype=np.uint8)
        out.append((pixels, shot_prompt(earlier, cfg.max_new_tokens)))
    return out


def mean_context(context_shots: int, shots_per_video: float) -> int:
    """Earlier captions a shot's request holds on average in a video of ``shots_per_video`` shots."""
    n = max(1, round(shots_per_video))
    return round(sum(min(i, context_shots) for i in range(n)) / n)


class Timer:
    """Wall time of a generate call, the GPU's work included, and the prompt length it ran."""

    def __init__(self, model: CaptionModel):
        self.prompt_tokens = 0
        inner = model.model.generate

        def spy(**kwargs):  # reads the processor's output; generate itself is untouched
            self.prompt_tokens = int(kwargs["input_ids"].shape[1])
            return inner(**kwargs)

        model.model.generate = spy

    @staticmethod
    def run(model: CaptionModel, items) -> tuple[float, list]:
        sync(model.device)
        t = time.perf_counter()
        out = model.generate(items)
        sync(model.device)
        return time.perf_counter() - t, out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny model and settings on the CPU")
    ap.add_argument("--repeats", type=int, default=3, help="timed batches after a warm-up batch")
    ap.add_argument("--frames", type=int, default=None, help="frames per shot (default: caption.max_frames)")
    ap.add_argument("--size", default=None, help="frame HxW before the processor resizes it (default 720x1280; "
                                                 "--tiny: 192x320)")
    ap.add_argument("--context", type=int, default=None,
                    help="earlier captions per request (default: the mean for --shots / --videos shots a video)")
    ap.add_argument("--shots", type=float, default=1.2e6, help="shots the run captions (default 1.2M)")
    ap.add_argument("--videos", type=float, default=120e3, help="videos they come from (default 120K)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None, help="append the row as a JSON line")
    args = ap.parse_args()

    cfg = caption_settings(args.tiny)
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = dataclasses.replace(cfg, device=device.type)
    frames = args.frames or cfg.max_frames
    size = tuple(int(v) for v in (args.size or ("192x320" if args.tiny else "720x1280")).split("x"))
    context = mean_context(cfg.context_shots, args.shots / args.videos) if args.context is None else args.context
    text_dims, vision_dims = (TINY_TEXT, TINY_VISION) if args.tiny else (QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION)
    params_7b = parameters_on_meta(QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION)

    t0 = time.perf_counter()
    tokenizer = build_tokenizer(prompt_words())
    dtype = resolve_dtype(cfg.precision, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vlm = random_vlm(tokenizer, text_dims, vision_dims, device, dtype)
    model = CaptionModel.from_parts(cfg, device, make_processor(tokenizer), vlm)
    first_token = CaptionModel.from_parts(dataclasses.replace(cfg, max_new_tokens=1), device, model.processor, vlm)
    timer = Timer(model)
    sync(device)
    init_s = time.perf_counter() - t0
    items = requests(cfg, frames, size, context)
    video_captions = [fake_caption(cfg.max_new_tokens, np.random.default_rng(i))
                      for i in range(max(1, round(args.shots / args.videos)))]

    Timer.run(model, items)  # warm-up: kernels chosen, allocator grown
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, outs = [], []
    for _ in range(args.repeats):
        dt, out = Timer.run(model, items)
        times.append(dt)
        outs += out
    prompt_tokens = timer.prompt_tokens
    prefill_s, _ = Timer.run(first_token, items)  # processor, vision tower, prefill and one token
    subjects_s, _ = Timer.run(model, [(None, subjects_prompt(video_captions))] * cfg.batch_size)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    batch_s = float(np.mean(times))
    captions_per_s = cfg.batch_size / batch_s
    tokens_per_s = sum(o.tokens for o in outs) / sum(times)
    shots_gpu_h = args.shots / captions_per_s / 3600
    subjects_gpu_h = args.videos / cfg.batch_size * subjects_s / 3600  # one subjects request per video
    row = {"bench": "caption_throughput", "model": "tiny" if args.tiny else "Qwen2.5-VL-7B (random weights)",
           "parameters_7b": params_7b, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": str(dtype).removeprefix("torch."), "attention": vlm.config._attn_implementation,
           "frames": frames, "frame_size": f"{size[0]}x{size[1]}", "max_pixels": cfg.max_pixels,
           "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens, "context_captions": context,
           "prompt_tokens": prompt_tokens, "repeats": args.repeats, "init_s": round(init_s, 2),
           "batch_s": round(batch_s, 3), "captions_per_s": round(captions_per_s, 4),
           "output_tokens_per_s": round(tokens_per_s, 2),
           "reached_bound": round(sum(o.reached_bound for o in outs) / len(outs), 3),
           "prefill_s": round(prefill_s, 3), "prefill_share": round(prefill_s / batch_s, 3),
           "subjects_batch_s": round(subjects_s, 3), "peak_gib": None if peak_gib is None else round(peak_gib, 1),
           "shots": args.shots, "videos": args.videos, "shots_gpu_h": round(shots_gpu_h, 1),
           "subjects_gpu_h": round(subjects_gpu_h, 1), "gpu_h": round(shots_gpu_h + subjects_gpu_h, 1),
           "node_h": round((shots_gpu_h + subjects_gpu_h) / args.gpus_per_node, 1),
           "gpus_per_node": args.gpus_per_node, "rates_variant": caption_variant(dataclasses.asdict(cfg)),
           "torch": torch.__version__,
           "transformers": __import__("transformers").__version__}
    print(f"# {row['model']} ({params_7b / 1e9:.2f}B parameters in the 7B architecture) on {row['device']}, "
          f"{row['dtype']}, {row['attention']}; {frames} frames of {row['frame_size']} (max_pixels {cfg.max_pixels}), "
          f"{context} earlier captions, {prompt_tokens} prompt tokens (padded), init {init_s:.1f} s; "
          f"bench/rates.yaml caption variant {row['rates_variant']}")
    print("| batch | new tokens | s/batch | captions/s | output tok/s | prefill share | peak GiB | "
          f"GPU-h {args.shots:,.0f} shots | + subjects | hours on a {args.gpus_per_node}-GPU node |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    peak = "-" if peak_gib is None else f"{peak_gib:.1f}"
    print(f"| {cfg.batch_size} | {cfg.max_new_tokens} | {batch_s:.2f} | {captions_per_s:.3f} | {tokens_per_s:.1f} | "
          f"{row['prefill_share']:.0%} | {peak} | {shots_gpu_h:,.1f} | {subjects_gpu_h:,.1f} | {row['node_h']:,.1f} |")
    if row["reached_bound"] < 1:
        print(f"# {1 - row['reached_bound']:.1%} of the captions ended before max_new_tokens: the rate is "
              "above the bound's")
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
