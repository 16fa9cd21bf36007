"""The W4A4 merge (``merge_w4a4``, what the stage runs and a notebook can call): the generator's LoRA
merged into the AR weights in float32, then every eligible linear layer quantized to packed NVFP4 (no
high-precision copy kept), calibrated and checked on disjoint fixed inputs against the BF16 merged
model (within ``max_rel_error``, or the merge fails) and against the generator as distilled. Each
input is a chunk as generation runs it: after its sample's earlier chunks, written into the
inference KV cache with the adapter's window and sinks by the model under test."""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from longlive_core.config import ConfigError
from longlive_core.distill.config import MergeW4A4Config
from longlive_core.distill.lora import merge_adapter
from longlive_core.infer.config import RolloutConfig
from longlive_core.infer.kv_cache import KVCache, SinkConfig
from longlive_core.infer.rollout import write_chunk
from longlive_core.io.atomic import atomic_dir
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.folder import DiTFolder, read_adapter_folder, read_dit_folder, write_config
from longlive_core.models.wan_dit import WanDiT
from longlive_core.models.weights import CheckpointError
from longlive_core.quant.recipe import convert_linears
from longlive_core.train.data import LatentSamples, generator_for


def merged_model(ar_dir: Path, ar_config: DiTFolder, dmd_dir: Path) -> WanDiT:
    """The AR weights with the generator's adapter merged in, in float32."""
    base = load_dit(ar_dir, ar_config.dit_config, dtype=torch.float32)
    return merge_adapter(base, dmd_dir).eval()


@dataclasses.dataclass(frozen=True)
class CleanChunk:
    """A chunk the KV cache holds: clean latents, the caption and frame positions it was written with."""

    x0: torch.Tensor  # (1, C, F_c, h, w)
    text: torch.Tensor  # (1, T, D)
    positions: torch.Tensor  # (F_c,)
    new_shot: bool  # it begins a shot (the cache's shot sink moves to it)


@dataclasses.dataclass(frozen=True)
class ChunkInput:
    """One chunk as generation feeds the model: a (sample, chunk) of the latent cache noised to a
    sampling step, its own shot's caption and frame positions, after the sample's earlier chunks."""

    key: tuple[str, int]  # (sample, chunk index)
    x_t: torch.Tensor  # (1, C, F_c, h, w)
    t: torch.Tensor  # (1,)
    text: torch.Tensor  # (1, T, D)
    positions: torch.Tensor  # (F_c,)
    new_shot: bool = False
    context: tuple[CleanChunk, ...] = ()  # the sample's chunks before it, in order


def merge_inputs(latents: Path, chunk: int, shot_offset: int, steps: list[int], calibration: int, evaluation: int,
                 seed: int) -> tuple[list[ChunkInput], list[ChunkInput], str]:
    """Calibration and evaluation inputs on disjoint (sample, chunk) pairs of the val split (the train
    split when val has none), drawn by ``seed``, each with its sample's earlier chunks as KV context;
    where there are fewer pairs than asked, both shrink and the note says so."""
    data = LatentSamples(latents, "val", chunk, shot_offset)
    if not len(data):
        data = LatentSamples(latents, "train", chunk, shot_offset)
    pairs = [(sid, k) for sid in data.sample_ids for k in range(data.frames(sid) // chunk)]
    if len(pairs) < 2:
        raise ConfigError(f"{latents} holds {len(pairs)} whole {chunk}-frame chunk(s): calibrating and checking "
                          "the merge needs two, on different chunks")
    note = f"{calibration} calibration and {evaluation} evaluation inputs on disjoint (sample, chunk) pairs"
    if calibration + evaluation > len(pairs):
        evaluation = max(1, len(pairs) * evaluation // (calibration + evaluation))
        calibration = len(pairs) - evaluation
        note = (f"only {len(pairs)} (sample, chunk) pairs in the latent cache: {calibration} calibrate and "
                f"{evaluation} evaluate, disjoint")
    order = torch.randperm(len(pairs), generator=generator_for(seed, "merge-pairs")).tolist()
    chosen = [pairs[i] for i in order[:calibration + evaluation]]
    whole = {sid: data.load(sid, data.frames(sid), None) for sid in {sid for sid, _ in chosen}}
    def clean(s, j: int) -> CleanChunk:
        lo = j * chunk
        new_shot = j > 0 and bool(s.shot_of_frame[lo] != s.shot_of_frame[lo - chunk])
        return CleanChunk(s.latents[None, :, lo:lo + chunk], s.text[int(s.shot_of_frame[lo])][None],
                          s.positions[lo:lo + chunk], new_shot)

    inputs = []
    for i, (sid, k) in enumerate(chosen):
        s, here = whole[sid], clean(whole[sid], k)
        g = generator_for(seed, "merge-input", sid, k)
        t = float(steps[i % (len(steps) - 1)])  # the steps before the final 0
        x_t = (1 - t / 1000) * here.x0 + (t / 1000) * torch.randn(here.x0.shape, generator=g)
        inputs.append(ChunkInput((sid, k), x_t, torch.tensor([t]), here.text, here.positions, here.new_shot,
                                 tuple(clean(s, j) for j in range(k))))
    return inputs[:calibration], inputs[calibration:], note


@torch.no_grad()
def outputs(model: WanDiT, inputs: list[ChunkInput], dtype: torch.dtype, device: torch.device,
            sampling: RolloutConfig) -> torch.Tensor:
    """The model's predictions for ``inputs``, flattened and concatenated (float32, on the CPU): each
    after the model wrote its input's context into a KV cache of ``sampling``'s window and sinks."""
    dit = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft wrapper's WanDiT
    _, ph, pw = dit.cfg.patch_size
    ys = []
    for i in inputs:
        _, _, _, h, w = i.x_t.shape
        cache = KVCache(len(dit.blocks), (h // ph) * (w // pw), sampling.window,
                        sink=SinkConfig(sampling.global_sink, sampling.shot_sink))
        saved, dit.attention_fn = dit.attention_fn, cache
        try:
            for c in i.context:
                if c.new_shot:
                    cache.start_shot()
                write_chunk(model, cache, c.x0.to(device, dtype), c.text.to(device, dtype), c.positions.to(device),
                            dtype)
            if i.new_shot:
                cache.start_shot()
            ys.append(model(i.x_t.to(device, dtype), i.t.to(device), i.text.to(device, dtype),
                            frame_positions=i.positions.to(device)).float().cpu().flatten())
        finally:
            dit.attention_fn = saved
    return torch.cat(ys)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y - reference).norm() / reference.norm().clamp_min(1e-30))


def distilled_generator(ar_dir: Path, ar: DiTFolder, dmd_dir: Path, recipe: str) -> WanDiT:
    """The generator as distillation trained it: the AR weights packed under ``recipe`` (the
    backbone's skip list kept), the adapter applied unmerged on top."""
    from peft import PeftModel

    base = load_dit(ar_dir, ar.dit_config, dtype=torch.float32)
    convert_linears(base, recipe, skip=ar.precision.skip, keep_last_blocks=ar.precision.keep_last_blocks, packed=True)
    return PeftModel.from_pretrained(base, str(dmd_dir), is_trainable=False).eval()


class MergeError(CheckpointError):
    """The merged model is further from its reference than ``merge_w4a4.max_rel_error`` allows."""


def merge_w4a4(ar_dir: Path, dmd_dir: Path, latents: Path, cfg: MergeW4A4Config, out_dir: Path,
               folder: Callable[[dict], DiTFolder], device: torch.device) -> dict:
    """The AR model with the distilled generator's adapter merged in float32, every eligible linear
    packed in NVFP4 (compressed-tensors' layout), written to ``out_dir`` (``folder(quantization)``: its
    config.json) once it is loaded back through the inference loader and its output error against
    the BF16 merged model is within ``cfg.max_rel_error``; otherwise a MergeError and ``out_dir`` is
    left as it was. The folder also holds prompt enhancement's example bank, made from ``latents``'
    train captions (``cfg.example_captions`` at most), so the bundle copied from it carries it.
    Returns the metrics: sizes, the errors (also against the generator as distilled, NVFP4 base and
    adapter, and of BF16 against float32), the inputs used, the example captions kept."""
    from safetensors.torch import save_file

    from longlive_core.infer.model_folder import W4A4_WEIGHTS, load_w4a4
    from longlive_core.latents.example_bank import example_bank
    from longlive_core.quant.recipe import RECIPES
    from longlive_core.quant.w4a4 import calibrate, packed_layers, quantization_config, w4a4_state_dict

    dtype = getattr(torch, cfg.dtype)
    ar, dmd = read_dit_folder(ar_dir, "train_ar"), read_adapter_folder(dmd_dir, "distill_dmd")
    calibration, evaluation, note = merge_inputs(latents, ar.latent.chunk_frames, ar.multi_shot.shot_rope_offset,
                                                 list(dmd.sampling.steps), cfg.calibration_inputs, cfg.eval_inputs,
                                                 cfg.seed)
    examples = example_bank(latents, cfg.example_captions)  # before the work: a bad cache fails at once
    own = dmd.sampling  # the window and sinks the generator was distilled with, as generation runs it
    sampling = RolloutConfig(ar.latent.chunk_frames, tuple(own.steps), own.window, own.global_sink or 0,
                             own.shot_sink or 0)
    model = merged_model(ar_dir, ar, dmd_dir).to(device)
    y_fp32 = outputs(model, evaluation, torch.float32, device, sampling)
    reference = copy.deepcopy(model).to(torch.bfloat16)  # the BF16 merged model
    y_bf16 = outputs(reference, evaluation, torch.bfloat16, device, sampling)
    bf16_bytes = sum(t.numel() * 2 for t in reference.state_dict().values())
    del reference
    distilled = distilled_generator(ar_dir, ar, dmd_dir, dmd.distillation.get("recipe", cfg.recipe)).to(device)
    y_distilled = outputs(distilled, evaluation, torch.float32, device, sampling)  # its masters are float32
    del distilled
    report = convert_linears(model, cfg.recipe, skip=ar.precision.skip, keep_last_blocks=ar.precision.keep_last_blocks,
                             packed=True)
    layers = packed_layers(model)
    amax = calibrate(model, lambda: outputs(model, calibration, torch.float32, device, sampling))
    state = {k: v.cpu() for k, v in w4a4_state_dict(model, dtype, amax).items()}
    packed_bytes = sum(layer.packed_bytes() for layer in layers.values())
    packed_bf16_bytes = sum(layer.in_features * layer.out_features * 2 for layer in layers.values())
    with atomic_dir(out_dir) as staging:
        save_file(state, str(staging / W4A4_WEIGHTS), metadata={"format": "pt"})
        write_config(folder(quantization_config(model, RECIPES[cfg.recipe])), staging)
        # its embeddings are a *.safetensors of the folder, which the folder's identity covers
        # (models/identity.py): a new bank reaches evaluate and package as new weights would
        if examples is not None:
            examples.save(staging)
        loaded = load_w4a4(staging, read_dit_folder(staging), device)  # what inference will load
        y_w4a4 = outputs(loaded, evaluation, dtype, device, sampling)
        disk = (staging / W4A4_WEIGHTS).stat().st_size
        metrics = {
            "disk_bytes": disk, "bf16_bytes": bf16_bytes, "size_ratio": round(bf16_bytes / disk, 4),
            "quantized_packed_bytes": packed_bytes, "quantized_bf16_bytes": packed_bf16_bytes,
            "quantized_size_ratio": round(packed_bf16_bytes / packed_bytes, 4), "packed_layers": len(layers),
            "kept_linears": len(report.kept),
            "rel_error_w4a4_vs_bf16": relative_error(y_w4a4, y_bf16),
            "rel_error_w4a4_vs_distilled": relative_error(y_w4a4, y_distilled),
            "rel_error_bf16_vs_fp32": relative_error(y_bf16, y_fp32),
            "max_rel_error": cfg.max_rel_error, "eval_inputs": len(evaluation),
            "calibration_inputs": len(calibration), "inputs": note, "conversion": report.summary(),
            "example_captions": len(examples.captions) if examples is not None else 0,
            "kv_context": {"window": sampling.window, "global_sink": sampling.global_sink,
                           "shot_sink": sampling.shot_sink,
                           "eval_context_chunks": [len(i.context) for i in evaluation]},
        }
        if metrics["rel_error_w4a4_vs_bf16"] > cfg.max_rel_error:
            raise MergeError(f"the W4A4 model's output error against the BF16 merged model is "
                             f"{metrics['rel_error_w4a4_vs_bf16']:.4f}, over merge_w4a4.max_rel_error "
                             f"{cfg.max_rel_error}: {out_dir} keeps the model it held (try nvfp4-4over6, more "
                             "calibration inputs, or keep more layers in high precision)")
    return metrics
