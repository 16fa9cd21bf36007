"""``longlive generate`` as users run it: its ``Generator`` (the command's own code) with production's
``generate`` settings (configs/production.yaml over params.yaml: compile, async decode, the VAE in
bf16) on full-size model folders of random weights.

    python bench/generate_product.py make /tmp/llp [--w4a4]        # ~22 GB of folders, made on the GPU
    python bench/generate_product.py run /tmp/llp --model dit --precision bf16 --rows bf16:4,bf16:2,nvfp4:4
    python bench/generate_product.py run /tmp/llp --model dit --precision fp8 --rows bf16:4,fp8:4
    python bench/generate_product.py run /tmp/llp --model dit --precision fp8 --rows bf16:4,bf16:4:fp8  # FP8 attention
    python bench/generate_product.py run /tmp/llp --model w4a4 --rows nvfp4:4,bf16:4
    python bench/generate_product.py make /tmp/t --tiny && python bench/generate_product.py run /tmp/t --tiny ...

``make`` writes, under ROOT: ``dit/`` a few-step ``longlive-dit`` folder (the 5B DiT in bf16, sampled as
distill_dmd's folders are: the 4-step list, window 32 latent frames with sinks 8 + 8, chunks of 8,
704x1280 at 24 fps); ``w4a4/`` (``--w4a4``) the same weights packed in NVFP4 as a ``longlive-w4a4`` folder
(packed from the random DiT, not merged from an adapter: the same layout and config.json as
merge_w4a4 writes); ``vae/`` Wan2.2's VAE and ``umt5/`` an encoder of umT5-XXL's dims (5.7B, bf16) with a
word-level tokenizer built here (no vocabulary file is offline; the encoder reads 512 padded tokens
whatever the words); ``prompts.txt``, two shots of 10 s (480 frames). The folders record the
encoders' digests, as train_ar's do, and the user's digest memo is filled here, as any run after a
user's first finds it.

``run`` loads one folder per process (one weight precision, as ``evaluate`` loads it for a suite),
generates a warm-up of two shots (``write_warmup``: the window filled and rolled, then a new shot, so
no kernel a timed video runs is built inside it; its time to the first frame counts from the process's
start: imports, loading, umT5, compiling; a row with a KV format or attention not run yet gets one
more, unreported), then each row ``KV:STEPS[:ATTENTION]`` on the two-shot prompt file, and prints and
appends to ``--json`` what the sidecar says: the denoise loop's and end-to-end FPS (from the first
chunk to the last frame written: decode and H.264 included, the prompts' embedding not), the FPS of
the whole call (``call_fps``: umT5 loaded and the prompts embedded too), the load's time, time to the
first frame from the video's call and from its embedded prompts, peak memory until the prompts are
embedded and while generating. ``--profile-chunks N``: after each row, a video of about N chunks
(the window fills from the fourth) generated again with the row's settings under torch.profiler, its
kernels printed by device time with the shares of attention, of the KV cache's (de)quantization and
of the VAE's convolutions: where one row's time goes that another's does not. ``--host-profile-chunks N``:
the same video under cProfile (no torch profiler), the host's side: the calls the host spent longest in
(a wait on the GPU shows as the time of a synchronizing call) and the library's functions by their
cumulative time, e.g. the KV cache's reads and writes: whether the host keeps ahead of the GPU (on
Python 3.12 cProfile also sees the H.264 writer's thread, so own times may add up past the wall time;
a function's cumulative time is the wall time its thread spent in it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_setup import print_kernels  # noqa: E402
from bench.nvfp4_quant import load_tiles  # noqa: E402
from longlive_core.config import from_mapping  # noqa: E402
from longlive_core.infer.engine import GenerateConfig  # noqa: E402
from longlive_core.infer.generate import Generator  # noqa: E402
from longlive_core.models.encoders import user_memo  # noqa: E402
from longlive_core.models.folder import (  # noqa: E402
    DiTFolder,
    Encoder,
    LatentGeometry,
    MultiShot,
    PrecisionRules,
    Sampling,
    VideoFormat,
    write_config,
)
from longlive_core.models.weights import weights_identity  # noqa: E402
from longlive_core.params_overlay import overlaid_params  # noqa: E402
from longlive_core.quant import triton_kernels  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FOUR_STEPS = (1000, 946, 854, 681, 0)


@dataclasses.dataclass(frozen=True)
class Size:
    dit: str
    vae: str
    latent: tuple[int, int]  # latent height, width
    chunk: int
    window: int
    sink: int
    text: dict  # UMT5Config's dims
    text_max_length: int
    shot_seconds: float


FULL = Size("wan2.2-ti2v-5b", "wan2.2", (44, 80), 8, 32, 8,
            dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, tie_word_embeddings=False), 512, 10.0)
TINY = Size("tiny", "tiny", (4, 4), 2, 6, 2,
            dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=8), 16, 0.5)
SENTENCE = ("a red kite over the beach at sunset city street at night rain neon lights crowd walks camera pans "
            "slowly forest path in fog waves breaking on black rocks the scene transitions")


def tokenizer(max_length: int):
    """A word-level tokenizer of umT5's special tokens (pad 0, eos 1, unk 2) and a few words, saved as
    transformers saves any fast tokenizer, so ``AutoTokenizer.from_pretrained`` reads it as a user's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(SENTENCE.split()))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def make_text_encoder(path: Path, size: Size, device: str) -> None:
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device(device):
        model = UMT5EncoderModel(UMT5Config(**size.text, dropout_rate=0.0))
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(path)
    tokenizer(size.text_max_length).save_pretrained(path)
    del model


def make_vae(path: Path, size: Size, device: str) -> None:
    from longlive_core.models.vae import build_vae

    with torch.device(device):  # the real VAE's 0.7B parameters initialised on the GPU, not on 16 CPU cores
        vae = build_vae(size.vae)
    vae.save_pretrained(path)


def folder_config(root: Path, size: Size) -> DiTFolder:
    from longlive_core.models.config import dit_config
    from longlive_core.quant.recipe import DEFAULT_SKIP

    dit = dit_config(size.dit)
    h, w = size.latent
    memo = user_memo()
    memo.parent.mkdir(parents=True, exist_ok=True)

    def encoder(path: Path, **more) -> Encoder:
        return Encoder(str(path), weights_identity(path, memo), **more)

    return DiTFolder(
        format="longlive-dit", stage="bench", dit={"name": size.dit, **dataclasses.asdict(dit)},
        latent=LatentGeometry(dit.in_channels, size.chunk, h, w), video=VideoFormat(24.0, 16 * h, 16 * w),
        vae=encoder(root / "vae"), text_encoder=encoder(root / "umt5", max_length=size.text_max_length),
        sampling=Sampling("few-step", FOUR_STEPS, 1000, 5.0, window=size.window, chunk_frames=size.chunk,
                          global_sink=size.sink, shot_sink=size.sink),
        multi_shot=MultiShot(8), precision=PrecisionRules("bf16", DEFAULT_SKIP),
        weights_dtype="bfloat16" if size is FULL else "float32", lineage={"made_by": "bench/generate_product.py"})


def make(root: Path, size: Size, device: str, w4a4: bool) -> None:
    from safetensors.torch import save_file

    from bench.gpu_setup import random_dit_on_gpu
    from longlive_core.infer.model_folder import W4A4_WEIGHTS
    from longlive_core.models.checkpoint import save_dit
    from longlive_core.models.config import dit_config
    from longlive_core.models.folder import as_json
    from longlive_core.models.wan_dit import WanDiT
    from longlive_core.quant.recipe import RECIPES, convert_linears
    from longlive_core.quant.w4a4 import quantization_config, w4a4_state_dict

    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (root / "vae").is_dir():
        make_vae(root / "vae", size, device)
    if not (root / "umt5").is_dir():
        make_text_encoder(root / "umt5", size, device)
    print(f"encoders: {time.perf_counter() - t0:.0f}s", flush=True)
    folder = folder_config(root, size)
    torch.manual_seed(0)
    cfg = dit_config(size.dit)
    model = random_dit_on_gpu(cfg) if device == "cuda" else WanDiT(cfg)
    dtype = torch.bfloat16 if size is FULL else torch.float32
    model = model.to(dtype).eval()
    if not (root / "dit").is_dir():
        save_dit(model, root / "dit", config=as_json(folder))
    if w4a4 and not (root / "w4a4").is_dir():
        rules = folder.precision
        convert_linears(model, "nvfp4", skip=rules.skip, keep_last_blocks=rules.keep_last_blocks, packed=True)
        staging = root / "w4a4.part"
        staging.mkdir(exist_ok=True)
        save_file({k: v.cpu() for k, v in w4a4_state_dict(model, dtype).items()}, str(staging / W4A4_WEIGHTS),
                  metadata={"format": "pt"})
        write_config(dataclasses.replace(folder, format="longlive-w4a4",
                                         precision=dataclasses.replace(rules, recipe="nvfp4"),
                                         **quantization_config(model, RECIPES["nvfp4"])), staging)
        staging.rename(root / "w4a4")
    shot = size.shot_seconds
    (root / "prompts.txt").write_text(f"{shot}\ta red kite over the beach at sunset\n"
                                      f"{shot}\tcity street at night rain neon lights camera pans slowly\n")
    print(f"made {root} in {time.perf_counter() - t0:.0f}s", flush=True)


def write_warmup(path: Path, size: Size) -> Path:
    """A warm-up prompt file that runs every kernel a timed video runs: a shot long enough to fill the
    window and drop its oldest frames (each window length's attention, the cache's writes and reads,
    cuDNN's graph per key length), then a second shot (the shot sink moved)."""
    per_chunk = 4 * size.chunk / 24  # seconds of a chunk at 24 fps
    path.write_text(f"{(size.window // size.chunk + 1) * per_chunk}\ta red kite over the beach\n"
                    f"{per_chunk}\tcity street at night\n")
    return path


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), so time to the first frame counts the imports too."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return time.time() - (boot + int(fields[19]) / os.sysconf("SC_CLK_TCK"))


def production_generate(overrides: dict) -> GenerateConfig:
    section = overlaid_params(REPO / "params.yaml", REPO / "configs/production.yaml")["generate"]
    return from_mapping(GenerateConfig, {**section, **overrides}, "generate")


ROW_KEYS = ("model", "precision", "recipe", "kv", "attention", "decode", "steps", "frames", "denoise_fps",
            "end_to_end_fps", "call_fps", "load_s", "first_frame_s", "first_frame_after_prompt_s", "peak_memory_gib",
            "load_peak_memory_gib", "wall_s")


ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_calls() -> dict[str, int]:
    """The CUDA caching allocator's calls to the driver so far: a video that makes any (cudaMalloc, cudaFree,
    a retry after freeing the cache: each of the last two waits for the whole GPU) runs slower for it."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_KEYS}


def row_of(side: dict, model: str, precision: str, **more) -> dict:
    gib = 2 ** 30
    row = {"model": model, "precision": precision, "recipe": side["recipe"], "kv": side["kv"],
           "attention": side["attention"],
           "steps": len(side["steps"]) - 1, "frames": side["frames"], "denoise_fps": side["denoise_fps"],
           "end_to_end_fps": side["end_to_end_fps"], "call_fps": side["frames"] / side["wall_s"],
           "load_s": side["load_s"], "first_frame_s": side["first_frame_s"],
           "first_frame_after_prompt_s": side["first_frame_after_prompt_s"],
           "peak_memory_gib": side["peak_memory_bytes"] / gib,
           "load_peak_memory_gib": (side["load_peak_memory_bytes"] or 0) / gib, "wall_s": side["wall_s"],
           "vae_dtype": side["vae_dtype"], "decode": side["decode"], "window": side["window"], **more}
    return row


# A profile's kernels, each in the first group whose words its name holds, so the order matters: compiled Triton
# kernels first (inductor names them for the ops they fuse: "triton_poi_fused_convolution_..."), cuDNN's attention
# before the convolutions (its kernels are named "..._sdpa_..._fprop_..."), the convolutions before the GEMMs
# (cuDNN's are implicit GEMMs), FP8 GEMMs (their names hold "e4m3") before the quantization passes (the KV cache's
# reads and writes, FP8 attention's, the linears').
KERNEL_GROUPS = {"Triton (compiled)": ("triton",),
                 "attention": ("flash", "fmha", "attention", "sdpa"),
                 "convolutions": ("conv", "fprop", "dgrad", "implicit"),
                 "GEMMs": ("gemm", "nvjet", "cutlass", "xmma"),
                 "quantization": ("quant", "e4m3", "fp8_rows", "shifted_rows", "channel_stats"),
                 "copies": ("memcpy", "memset", "copy")}


def profile_prompts(root: Path, chunks: int, chunk: int) -> tuple[Path, float]:
    """A one-shot prompt file of about ``chunks`` chunks, and its seconds."""
    prompts, seconds = root / "profile.txt", 4 * chunk * chunks / 24
    prompts.write_text(f"{seconds}\ta red kite over the beach\n")
    return prompts, seconds


def profile_row(generator: Generator, root: Path, steps: int, cfg: GenerateConfig, chunks: int, chunk: int) -> None:
    """A video of about ``chunks`` chunks generated under torch.profiler: its kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    prompts, seconds = profile_prompts(root, chunks, chunk)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        generator.generate(prompts, root / "profile.mp4", steps, cfg)
    wall = time.perf_counter() - t0  # against the kernels' device time: how long the GPU waited on the host
    print(f"# profile: a {seconds:.2f} s video (about {chunks} chunks), kv {cfg.kv}, {steps} steps, "
          f"decode {cfg.decode}, {wall:.2f} s under the profiler", flush=True)
    print_kernels(prof, 20, KERNEL_GROUPS)


def host_profile_row(generator: Generator, root: Path, steps: int, cfg: GenerateConfig, chunks: int, chunk: int,
                     top: int = 14) -> None:
    """A video of about ``chunks`` chunks generated under cProfile: the calls the host spent longest in
    (its own time: a synchronizing call's is the host waiting on the GPU) and the library's functions by
    cumulative time, each with its calls and microseconds a call."""
    import cProfile
    import pstats

    prompts, seconds = profile_prompts(root, chunks, chunk)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.runcall(generator.generate, prompts, root / "profile.mp4", steps, cfg)
    wall = time.perf_counter() - t0
    entries = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, _)
    print(f"# host profile: a {seconds:.2f} s video (about {chunks} chunks), kv {cfg.kv}, {steps} steps, "
          f"decode {cfg.decode}, {wall:.2f} s under cProfile", flush=True)

    def line(where: tuple, calls: int, total: float) -> str:
        name = where[2] if where[0] == "~" else f"{Path(where[0]).name}:{where[1]}({where[2]})"
        return f"  {total:8.3f} s {calls:7d}x {1e6 * total / max(calls, 1):9.1f} us  {name[:100]}"

    print("  own time:")
    for where, (_, calls, own, _, _) in sorted(entries.items(), key=lambda e: -e[1][2])[:top]:
        print(line(where, calls, own))
    print("  the library's functions, cumulative:")
    ours = [(w, v) for w, v in entries.items() if "longlive_core" in w[0]]
    for where, (_, calls, _, total, _) in sorted(ours, key=lambda e: -e[1][3])[:top]:
        print(line(where, calls, total))


def run(root: Path, model: str, precision: str, rows: list[tuple[str, int, str]], device: str, tiny: bool,
        out: Path | None, profile_chunks: int = 0, decode: str | None = None,
        host_profile_chunks: int = 0) -> list[dict]:
    # the tiny models run on the CPU, where nothing is compiled (compiling the decoder there took 70 s of a 95 s run)
    base = {"device": device, "precision": precision, **({"compile": False, "vae_compile": False} if tiny else {}),
            **({"decode": decode} if decode else {})}
    started = time.perf_counter() - process_age()  # perf_counter's reading at the process's start
    first: list[float] = []

    def stamp(_rgb) -> None:
        if not first:
            first.append(time.perf_counter())

    results = []
    warmup = write_warmup(root / "warmup.txt", TINY if tiny else FULL)
    with Generator(root / model, production_generate({**base, "kv": rows[0][0], "attention": rows[0][2]}),
                   keep_text_encoder=True) as generator:  # as evaluate's suite loads it
        side = generator.generate(warmup, root / "warmup.mp4", rows[0][1], on_frame=stamp)
        results.append(row_of(side, model, precision, warmup=True, first_frame_from_process_s=first[0] - started))
        report(results[-1], out)
        warmed = {(rows[0][0], rows[0][2])}  # (KV format, attention) run so far
        for kv, steps, attention in rows:
            settings = production_generate({**base, "kv": kv, "attention": attention})
            if (kv, attention) not in warmed:  # a row's first kernels (Triton's, cuDNN's graphs) stay out of its video
                warmed.add((kv, attention))
                generator.generate(warmup, root / "warmup.mp4", steps, settings)
                print(f"warm-up again: kv {kv}, attention {attention}", flush=True)
            before = allocator_calls()
            side = generator.generate(root / "prompts.txt", root / f"{model}-{precision}-{kv}-{attention}-{steps}.mp4",
                                      steps, settings)
            results.append(row_of(side, model, precision, **{k: v - before[k] for k, v in allocator_calls().items()}))
            report(results[-1], out)
            if profile_chunks:
                profile_row(generator, root, steps, settings, profile_chunks,
                            (TINY if tiny else FULL).chunk)
            if host_profile_chunks:
                host_profile_row(generator, root, steps, settings, host_profile_chunks, (TINY if tiny else FULL).chunk)
    return results


def report(row: dict, out: Path | None) -> None:
    keys = ROW_KEYS + tuple(k for k in ALLOCATOR_KEYS if k in row)
    print(" | ".join(f"{k} {row[k]:.2f}" if isinstance(row[k], float) else f"{k} {row[k]}" for k in keys)
          + (f" | warm-up, first frame {row['first_frame_from_process_s']:.1f}s from the process's start"
             if row.get("warmup") else ""), flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("make", "run"))
    ap.add_argument("root", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the tiny models on the CPU: the code path, anywhere")
    ap.add_argument("--w4a4", action="store_true", help="make: also the W4A4 folder")
    ap.add_argument("--model", default="dit", choices=("dit", "w4a4"))
    ap.add_argument("--precision", default="auto", help="bf16 | fp8 | nvfp4 | auto (the folder's own)")
    ap.add_argument("--rows", default="bf16:4", help="KV:STEPS[:ATTENTION],...: the KV cache's format, the step "
                    "count and the cached attention (sdpa, the default, or fp8)")
    ap.add_argument("--decode", choices=("sync", "async"),
                    help="generate's decode setting (default: production's async); sync times the DiT's loop "
                    "without the VAE decoding beside it on its GPU")
    ap.add_argument("--json", type=Path, help="append each row as a JSON line")
    ap.add_argument("--profile-chunks", type=int, default=0,
                    help="after each row, profile a video of this many chunks (0: none)")
    ap.add_argument("--host-profile-chunks", type=int, default=0,
                    help="after each row, a video of this many chunks under cProfile: the host's time (0: none)")
    ap.add_argument("--quant-tiles", help="the NVFP4 quantize kernels' tiles from bench/nvfp4_quant.py --best-out "
                    "(default: the library's)")
    args = ap.parse_args(argv)
    if args.quant_tiles:
        load_tiles(args.quant_tiles)
        print(f"# quantize tiles from {args.quant_tiles}: 4/6 rows {triton_kernels.FOS_TILE}", flush=True)
    size = TINY if args.tiny else FULL
    device = "cpu" if args.tiny else "cuda"
    if args.action == "make":
        make(args.root, size, device, args.w4a4)
        return
    rows = [(kv, int(steps), attention or "sdpa")
            for kv, steps, attention in ((r.split(":") + [""])[:3] for r in args.rows.split(","))]
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    run(args.root, args.model, args.precision, rows, device, args.tiny, args.json, args.profile_chunks, args.decode,
        args.host_profile_chunks)


if __name__ == "__main__":
    main()
