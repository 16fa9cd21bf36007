"""The inference engine and ``longlive generate`` on a tiny model folder, on the CPU."""
from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import statistics
import weakref
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from longlive_core.cli import main as longlive
from longlive_core.config import ConfigError, from_mapping
from longlive_core.infer import generate as generate_module
from longlive_core.infer import text_encoder
from longlive_core.infer.decode import FrameStream, ShotDecoder
from longlive_core.infer.engine import GenerateConfig, generate
from longlive_core.infer.generate import Generator, generate_file
from longlive_core.infer.model_folder import load_model_folder
from longlive_core.infer.prompts import parse_prompts, plan_shots
from longlive_core.infer.rollout import teacher_schedule
from longlive_core.infer.sampling import FOLDER, PARAMS, run_sampling
from longlive_core.models.config import dit_config
from longlive_core.models.folder import read_dit_folder, write_config
from longlive_core.models.text import text_encoder_from
from longlive_core.models.vae import vae_from
from longlive_core.video.writer import VideoWriter

from .helpers.ar_model import folder_config, make_ar_model

CHUNK = 2  # latent frames per chunk: 8 video frames, 1/3 s at 24 fps
TWO_SHOTS = "0.6\tA red kite over a beach\n+0.3\tThe kite dives\n0.4\tA city street at night\n"


def config(**overrides) -> GenerateConfig:
    # the tiny AR folder samples its own schedule: 4 steps of it here
    base = {"window": 6, "global_sink": 2, "shot_sink": 2, "ar_steps": 4, "device": "cpu", "default_duration_s": 0.4}
    return from_mapping(GenerateConfig, {**base, **overrides}, "generate")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_ar_model(tmp_path_factory.mktemp("generate") / "ar", chunk_frames=CHUNK)


def frames_of(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_a_shot_decoded_chunk_by_chunk_equals_the_shot_decoded_at_once():
    vae = vae_from("tiny")
    z = torch.randn(48, 6, 4, 4, generator=torch.Generator().manual_seed(0))
    whole = vae.decode(z[None]).sample  # the VAE's own decode; latents_std 1 and latents_mean 0 for tiny
    expected = ((whole.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[0].permute(1, 2, 3, 0)
    decoder = ShotDecoder(vae)
    for _ in range(2):  # the second shot starts on a fresh cache, so it decodes the same again
        decoder.start_shot()
        parts = [decoder.decode(z[:, :2]), decoder.decode(z[:, 2:4]), decoder.decode(z[:, 4:])]
        assert [len(p) for p in parts] == [5, 8, 8]  # 1 + 4 (F - 1) for the shot's first chunk, then 4 F
        assert torch.equal(torch.cat(parts), expected)
    # channels-last weights and input: the same frames up to float32's order of summation (one level)
    decoder = ShotDecoder(vae_from("tiny"), channels_last=True)
    decoder.start_shot()
    parts = [decoder.decode(z[:, :2]), decoder.decode(z[:, 2:4]), decoder.decode(z[:, 4:])]
    assert (torch.cat(parts).int() - expected.int()).abs().max() <= 1


@pytest.mark.parametrize("frames_per_call", [1, 3])
def test_a_warmed_decoder_meets_no_new_graph_in_a_video_and_decodes_it_as_a_fresh_one(frames_per_call):
    """``warm`` runs every decoder call a video's chunks make (what a compiled call guards on: its
    input's shape and strides, whether it is a shot's first, the feature cache's), so compiling is done
    before a decode thread runs beside the DiT; it leaves no feature cache behind."""
    z = torch.randn(48, 8, 4, 4, generator=torch.Generator().manual_seed(0))
    videos = {}
    for warmed in (False, True):
        decoder = ShotDecoder(vae_from("tiny"), frames_per_call=frames_per_call)
        seen: set = set()

        def recorded(x, first, decoder=decoder, frame=decoder.frame, seen=seen):
            cache = tuple(c if c is None or isinstance(c, str) else (tuple(c.shape), c.stride())
                          for c in decoder.vae._feat_map)
            seen.add((tuple(x.shape), x.stride(), first, cache))
            return frame(x, first)

        decoder.frame = recorded
        if warmed:
            decoder.warm(48, 4, 4, chunk_frames=2)
            warm_graphs = set(seen)
        frames = []
        for _ in range(2):  # two shots of four chunks
            decoder.start_shot()
            frames += [decoder.decode(z[:, i:i + 2]) for i in (0, 2, 4, 6)]
        videos[warmed] = torch.cat(frames)
        if warmed:
            assert seen == warm_graphs
    assert torch.equal(videos[True], videos[False])


@pytest.mark.parametrize("frames_per_call", [2, 3])
def test_several_latent_frames_per_decoder_call_decode_the_frames_of_one_per_call(frames_per_call):
    """After a shot's first frame (always alone), ``frames_per_call`` frames per call, a call crossing
    no chunk's end: float32 frames within 1e-5 of one frame per call, 8-bit frames within one level."""
    vae = vae_from("tiny")
    z = torch.randn(48, 7, 4, 4, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for n in (1, frames_per_call):
        decoder = ShotDecoder(vae, frames_per_call=n)
        decoder.start_shot()
        x = (z * decoder.std + decoder.mean)[None]  # as decode() prepares it, to compare before rounding
        x = vae.post_quant_conv(x)
        with torch.no_grad():
            raw = [decoder.frame(x[:, :, :1], True)] + [decoder.frame(x[:, :, i:i + n], False) for i in range(1, 7, n)]
        outputs[n] = torch.cat(raw, dim=2)
        decoder.start_shot()
        outputs[n, "uint8"] = torch.cat([decoder.decode(z[:, :4]), decoder.decode(z[:, 4:])])
    assert outputs[1].shape == outputs[frames_per_call].shape
    assert (outputs[frames_per_call] - outputs[1]).abs().max() <= 1e-5
    assert (outputs[frames_per_call, "uint8"].int() - outputs[1, "uint8"].int()).abs().max() <= 1
    with pytest.raises(ValueError, match="frames_per_call must be at least 1"):
        ShotDecoder(vae, frames_per_call=0)


def test_the_folder_says_how_it_is_sampled_unless_params_or_flags_say_otherwise():
    """A distilled folder runs its own step list, window and sinks (not generate's first list); a step
    count it lacks comes from generate.step_lists; an AR folder runs its own schedule with ar_steps;
    a params value wins over the folder's, and each setting says where it came from."""
    import dataclasses

    from longlive_core.config import ConfigError
    from longlive_core.models.folder import Sampling

    distilled = dataclasses.replace(folder_config(CHUNK), format="longlive-dit", sampling=Sampling(
        "few-step", (1000, 500, 0), window=8, chunk_frames=CHUNK, global_sink=2, shot_sink=2))
    plain = GenerateConfig(device="cpu")
    run = run_sampling(distilled, plain)
    assert (run.rollout.steps, run.rollout.window, run.rollout.global_sink, run.rollout.shot_sink) == (
        (1000, 500, 0), 8, 2, 2)
    assert set(run.source.values()) == {FOLDER}
    assert run_sampling(distilled, plain, 2).rollout.steps == (1000, 500, 0)  # its own 2-step list
    assert run_sampling(distilled, plain, 4).rollout.steps == plain.step_lists[0]
    with pytest.raises(ConfigError, match="add a 3-step list"):
        run_sampling(distilled, plain, 3)
    wider = run_sampling(distilled, dataclasses.replace(plain, window=12, step_list=(1000, 0)))
    assert (wider.rollout.window, wider.rollout.global_sink, wider.rollout.steps) == (12, 2, (1000, 0))
    assert wider.source == {"steps": PARAMS, "window": PARAMS, "global_sink": FOLDER, "shot_sink": FOLDER}
    with pytest.raises(ConfigError, match="at least 6"):
        run_sampling(distilled, dataclasses.replace(plain, window=5))
    ar = run_sampling(folder_config(CHUNK), dataclasses.replace(plain, ar_steps=6))
    assert ar.rollout.steps == teacher_schedule(6, 5.0) and len(ar.rollout.steps) == 7
    assert run_sampling(folder_config(CHUNK), plain, 3).rollout.steps == teacher_schedule(3, 5.0)
    for folder in (distilled, folder_config(CHUNK)):  # no step count outside what the folder can take
        with pytest.raises(ConfigError, match="--steps must be at least 1; got 0"):
            run_sampling(folder, plain, 0)
    with pytest.raises(ConfigError, match="--steps 2000: this AR folder's schedule has 1000 timesteps"):
        run_sampling(folder_config(CHUNK), plain, 2000)
    with pytest.raises(ConfigError, match="generate.ar_steps is 1001"):
        run_sampling(folder_config(CHUNK), dataclasses.replace(plain, ar_steps=1001))


def test_two_shots_with_durations_give_their_frames_and_a_sidecar(model_dir, tmp_path):
    prompts = tmp_path / "story.txt"
    prompts.write_text(TWO_SHOTS)
    out = tmp_path / "story.mp4"
    made = []
    side = generate_file(model_dir, prompts, out, config(), on_frame=made.append)
    # 0.6 s -> 2 chunks, + 0.3 s -> 1 chunk: 6 latent frames, 21 video frames; 0.4 s -> 1 chunk: 5 frames
    assert [s["latent_frames"] for s in side["shots"]] == [6, 2]
    written = frames_of(out)
    assert side["frames"] == 21 + 5 == len(written) == len(made)
    luma = np.array([0.299, 0.587, 0.114])  # 4:2:0 keeps luma at full resolution; the random model's noise
    error = np.abs(written @ luma - np.stack(made) @ luma).mean()  # has no chroma that survives subsampling
    assert error < 10, error  # 6 measured; a frame shifted by one pixel: 24
    assert side["shots"][1]["prompts"] == ["The scene transitions. A city street at night"]
    assert json.loads((tmp_path / "story.mp4.json").read_text())["frames"] == 26
    assert side["denoise_fps"] > 0 and side["end_to_end_fps"] > 0 and side["peak_memory_bytes"] > 0
    assert side["recipe"] == "bf16" and side["kv_bytes_per_token"] > 0
    # the first frame comes after the prompts are embedded, and both after the call began
    assert 0 < side["first_frame_after_prompt_s"] < side["first_frame_s"] < side["wall_s"] and side["load_s"] > 0
    assert side["load_peak_memory_bytes"] is None  # a GPU's alone: the CPU's peak is the process's RSS
    assert side["steps"] == list(teacher_schedule(4, 5.0)) and side["window"] == 6  # what ran, and from where
    assert side["sampling_from"]["window"] == PARAMS and "ar_steps 4" in side["sampling_from"]["steps"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_same_seed_same_frames_and_async_decoding_equals_sync(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    videos = {}
    for name, cfg in (("a", config()), ("b", config()), ("sync", config(decode="sync")), ("seed", config(seed=1))):
        videos[name] = []
        generate_file(model_dir, prompts, tmp_path / f"{name}.mp4", cfg,
                      on_frame=lambda rgb, name=name: videos[name].append(hashlib.sha256(rgb).hexdigest()))
    assert len(videos["a"]) == 26
    assert videos["a"] == videos["b"] == videos["sync"]
    assert all(x != y for x, y in zip(videos["seed"], videos["a"]))


def test_one_generator_makes_many_videos_on_one_load_as_generate_file_makes_each(model_dir, tmp_path, monkeypatch):
    """evaluate's suite and the product bench load a model folder once for many videos, umT5 kept in host
    memory (never loaded again from its folder): each video's frames are generate_file's (umT5 loaded for
    the file); the KV cache and the steps may change per video, the precision may not; closed, the
    generator lets the model and the encoder go."""
    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)

    def hashes(into: list):
        return lambda rgb: into.append(hashlib.sha256(rgb).hexdigest())

    alone: list[str] = []
    generate_file(model_dir, prompts, tmp_path / "alone.mp4", config(), on_frame=hashes(alone))
    loads = []
    real = generate_module.prepare_model
    monkeypatch.setattr(generate_module, "prepare_model", lambda *a: loads.append(a) or real(*a))
    monkeypatch.setattr(text_encoder, "text_encoder_from", lambda *a: pytest.fail("umT5 loaded again"))
    videos: list[list[str]] = [[], []]
    with Generator(model_dir, config(), keep_text_encoder=True) as generator:
        for i, video in enumerate(videos):
            side = generator.generate(prompts, tmp_path / f"{i}.mp4", on_frame=hashes(video))
        other = generator.generate(prompts, tmp_path / "kv.mp4", 2, config(kv="nvfp4"))
        ready = generator.prepare(prompts, 2, config(kv="nvfp4"))  # run twice: each on a cache of its own

        class Latents(list):
            def put(self, z, new_shot):
                self.append(z.clone())

        first, second = Latents(), Latents()
        ready.run(stream=first)
        ready.run(stream=second)
        assert len(first) == sum(sum(shot.chunks) for shot in ready.plan) == len(second) > 1
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        del ready  # a prepared generation holds the model
        with pytest.raises(ConfigError, match="precision is 'fp8' for this video"):
            generator.generate(prompts, tmp_path / "fp8.mp4", cfg=config(precision="fp8"))
        model = weakref.ref(generator.model)
    assert len(loads) == 1 and videos[0] == videos[1] == alone
    assert side["load_s"] > 0 and side["first_frame_s"] < side["wall_s"]
    assert other["kv"] == "nvfp4" and len(other["steps"]) == 3
    assert model() is None and generator.text is None and not (tmp_path / "fp8.mp4").exists()
    with pytest.raises(RuntimeError, match="closed"):
        generator.generate(prompts, tmp_path / "late.mp4")


def test_the_vae_decodes_in_bfloat16_close_to_float32(model_dir, tmp_path):
    """generate.vae_dtype: the decoder's weights and activations in bfloat16 (the GPU default) make
    the float32 decoder's frames up to bfloat16's rounding; the sidecar says which ran."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("0.4\ta red kite\n")
    frames, sides = {}, {}
    for dtype in ("float32", "bfloat16"):
        made: list[np.ndarray] = []
        sides[dtype] = generate_file(model_dir, prompts, tmp_path / f"{dtype}.mp4", config(vae_dtype=dtype),
                                     on_frame=made.append)
        frames[dtype] = np.stack(made).astype(int)
    assert sides["bfloat16"]["vae_dtype"] == "bfloat16" and sides["float32"]["vae_dtype"] == "float32"
    diff = np.abs(frames["bfloat16"] - frames["float32"])
    # 0.39 levels on average measured here (the tiny random VAE); a decoder fed other latents: tens
    assert frames["bfloat16"].shape == frames["float32"].shape and 0 < diff.mean() < 2.0, diff.mean()


def test_quantized_caches_nvfp4_and_fp8_weights_run_and_the_cache_is_smaller(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    plain = generate_file(model_dir, prompts, tmp_path / "plain.mp4", config())
    packed = generate_file(model_dir, prompts, tmp_path / "fp4.mp4",
                           config(kv="nvfp4", precision="nvfp4", kv_four_over_six="mse"))
    fp8 = generate_file(model_dir, prompts, tmp_path / "fp8.mp4",
                        config(kv="fp8", precision="fp8", kv_four_over_six="mse"))
    assert packed["recipe"] == "nvfp4" and fp8["recipe"] == "fp8" and fp8["kv"] == "fp8"
    # the sidecar says how the cache was quantized: 4/6 block scales are the NVFP4 cache's only
    assert plain["kv_quant"] is None
    assert packed["kv_quant"] == {"smooth_keys": True, "four_over_six": "mse", "format": "nvfp4"}
    assert fp8["kv_quant"] == {"smooth_keys": True, "four_over_six": None, "format": "fp8"}
    assert packed["frames"] == fp8["frames"] == plain["frames"]
    # float32 activations on the CPU: 4 bytes an element against NVFP4's 0.5 + 1/16 and FP8's 1 + 4/32
    assert plain["kv_bytes_per_token"] / packed["kv_bytes_per_token"] > 7
    assert plain["kv_bytes_per_token"] / fp8["kv_bytes_per_token"] == pytest.approx(4 / (1 + 4 / 32))


def test_nvfp4_packs_a_folder_under_the_nvfp4_recipe_it_trained_with(model_dir, tmp_path):
    import dataclasses
    import shutil

    from longlive_core.models.folder import read_dit_folder
    from longlive_core.quant.packed import PackedNVFP4Linear

    folder = tmp_path / "ar-4over6"
    shutil.copytree(model_dir, folder)
    config_of = read_dit_folder(folder)
    write_config(dataclasses.replace(config_of, precision=dataclasses.replace(config_of.precision,
                                                                              recipe="nvfp4-4over6")), folder)
    model, _, recipe = generate_module.prepare_model(folder, "nvfp4", torch.device("cpu"))
    packed = [m for m in model.modules() if isinstance(m, PackedNVFP4Linear)]
    assert recipe == "nvfp4-4over6" and packed and all(m.recipe.four_over_six == "mse" for m in packed)
    _, _, plain = generate_module.prepare_model(model_dir, "nvfp4", torch.device("cpu"))  # a BF16-trained folder
    assert plain == "nvfp4"


def test_the_scene_transition_prefix_follows_the_folder(model_dir, tmp_path):
    import dataclasses
    import shutil

    from longlive_core.models.folder import read_dit_folder

    folder = tmp_path / "no-prefix"
    shutil.copytree(model_dir, folder)
    config_of = read_dit_folder(folder)
    write_config(dataclasses.replace(config_of, multi_shot=dataclasses.replace(
        config_of.multi_shot, scene_transition_prefix=False)), folder)
    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    shots = {}
    for name, path in (("prefixed", model_dir), ("plain", folder)):
        with Generator(path, config()) as generator:
            shots[name] = [seg.prompt for shot in generator.prepare(prompts).plan for seg in shot.segments]
    assert shots["prefixed"][2] == "The scene transitions. A city street at night"
    assert shots["plain"] == ["A red kite over a beach", "The kite dives", "A city street at night"]


def test_fp8_attention_goes_through_the_cache_and_is_refused_where_cudnn_cannot_run(model_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    from longlive_core.infer import kv_cache

    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    out = tmp_path / "fp8-attention.mp4"
    real_prepare = generate_module.prepare_model

    def no_load(*args):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(generate_module, "prepare_model", no_load)  # refused before the model loads
    assert longlive(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                     "--attention", "fp8", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "generate.attention is fp8" in err and "not a CUDA device" in err and not out.exists()
    from longlive_core.distributed.ulysses import SequenceShard

    with pytest.raises(ConfigError, match="--sp 3: the model's .* attention heads and 2-frame chunks must both split"):
        generate_file(model_dir, prompts, out, config(), shard=SequenceShard(0, 3))
    monkeypatch.setattr(generate_module, "prepare_model", real_prepare)
    with pytest.raises(ConfigError, match="attention must be one of"):
        config(attention="fp4")
    # where cuDNN could run it, every cached attention of the video goes to cuDNN's FP8 attention over a window
    # in E4M3 (here SDPA over the dequantized window stands in), the window quantized once a chunk a layer
    windows = []

    def stand_in(q, held):
        windows.append(held)
        k = held.k8.float() * held.descale_k + held.k_mean
        v = held.v8.float() * held.descale_v + held.v_mean
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v).to(q.dtype)

    monkeypatch.setattr(kv_cache, "attention_fp8_window", stand_in)
    monkeypatch.setattr(generate_module.attention_cudnn_fp8, "unavailable_reason", lambda device=None: None)
    frames, sides, routed = {"sdpa": [], "fp8": []}, {}, {}
    for name in frames:
        before = len(windows)
        hashed = frames[name]
        sides[name] = generate_file(model_dir, prompts, tmp_path / f"{name}.mp4", config(attention=name),
                                    on_frame=lambda rgb, hashed=hashed: hashed.append(hashlib.sha256(rgb).hexdigest()))
        routed[name] = len(windows) - before
    assert sides["fp8"]["attention"] == "fp8" and sides["sdpa"]["attention"] == "sdpa"
    assert routed["sdpa"] == 0 and routed["fp8"] > 0
    assert len(frames["fp8"]) == len(frames["sdpa"]) == 26
    # one window a layer a chunk, read by every pass of its chunk: the steps, the last at t = 0 writing the
    # cache (the video's last chunk writes none); the first of the 4 chunks has no cached rows and makes
    # one a pass
    passes, layers = len(sides["fp8"]["steps"]), dit_config(read_dit_folder(model_dir).dit["name"]).num_layers
    uses = collections.Counter(id(held) for held in windows)
    assert sorted(uses.values()) == [1] * passes * layers + [passes - 1] * layers + [passes] * 2 * layers, uses


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_in_use() -> int:
    """Bytes the process's heap holds for live allocations, every arena (glibc's mallinfo2): torch's
    CPU tensors and numpy's arrays both come from it. Resident memory would not show a leak that
    reuses pages freed earlier."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_memory_stays_flat_as_the_video_grows(model_dir, tmp_path):
    """Heap memory in use sampled after every chunk of a 50 s video: after the first chunks it stops
    growing. Holding the frames would add 96 KB a chunk (about 10 MB between the two windows compared)."""
    model, folder = load_model_folder(model_dir)
    encoder = text_encoder_from("tiny", 16)
    texts = [encoder.encode(["a long take"])]
    plan = plan_shots(parse_prompts("50\ta long take", 5.0), 24.0, CHUNK)
    cfg = config()
    used = []
    with VideoWriter(tmp_path / "long.mp4", 24, 64, 64) as writer:
        stream = FrameStream(ShotDecoder(vae_from("tiny")), writer.write)
        try:
            sampling = run_sampling(folder, cfg).rollout
            stats = generate(model, plan, texts, cfg.cache(model, 4, sampling), sampling.steps, stream, (48, 4, 4),
                             8, 0, torch.float32, on_chunk=lambda _: used.append(heap_in_use()))
        finally:
            stream.close()
    assert stats.chunks == 150 and stream.frames == 1 + 4 * (300 - 1)
    # medians, so a sample taken while the decoder's activations are alive does not count as growth
    growth = statistics.median(used[120:]) - statistics.median(used[20:50])
    assert growth < 3 * 2**20, f"heap memory in use grew {growth / 2**20:.1f} MiB over 100 chunks"


def test_bad_prompt_lines_and_a_bf16_run_of_a_w4a4_folder_are_refused(model_dir, tmp_path, capsys):
    prompts = tmp_path / "bad.txt"
    prompts.write_text("a shot\nfast\tanother\n")
    out = tmp_path / "x.mp4"
    assert longlive(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                     "--device", "cpu"]) == 2
    assert "line 2" in capsys.readouterr().err and not out.exists()
    prompts.write_text("a shot\n")
    assert longlive(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path),
                     "--device", "cpu"]) == 2
    assert f"--out {tmp_path} is a folder: give the video's file name" in capsys.readouterr().err
    folder = tmp_path / "w4a4"
    folder.mkdir()
    write_config(folder_config(format="longlive-w4a4", stage="merge_w4a4", quantization_config={},
                               longlive_quantization={"weight_tile": [16, 16]}), folder)
    prompts.write_text("a shot\n")
    assert longlive(["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out),
                     "--precision", "bf16", "--device", "cpu"]) == 2
    assert "run it with --precision nvfp4" in capsys.readouterr().err
    assert longlive([]) == 2 and longlive(["nope"]) == 2


def test_a_video_that_fails_its_last_check_leaves_the_earlier_video_and_sidecar(model_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    """The frame count is checked before the video takes out's place: a short stream raises and the
    earlier video and its sidecar stay as they were. A prompt file that is not UTF-8 is one line."""
    prompts, out = tmp_path / "p.txt", tmp_path / "v.mp4"
    prompts.write_text("0.4\tA red kite\n")
    generate_file(model_dir, prompts, out, config())
    video, sidecar = out.read_bytes(), out.with_name("v.mp4.json").read_text()
    write = FrameStream._write
    monkeypatch.setattr(FrameStream, "_write", lambda self, frames: write(self, frames[:-1]))
    with pytest.raises(RuntimeError, match="frames where the plan makes"):
        generate_file(model_dir, prompts, out, config(seed=7))
    assert out.read_bytes() == video and out.with_name("v.mp4.json").read_text() == sidecar
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "v.mp4", "v.mp4.json"]
    prompts.write_bytes("0.4\tA caf\u00e9 at dusk\n".encode("latin-1"))
    assert longlive(["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                     "--device", "cpu"]) == 2
    assert "is not UTF-8 text (byte 9): save the prompt file as UTF-8" in capsys.readouterr().err


@pytest.mark.slow
def test_two_sequence_parallel_ranks_make_the_latents_of_one(model_dir, tmp_path):
    """Sequence parallelism over 2 ranks under torchrun on the CPU (gloo): each rank runs one of a chunk's
    two latent frames, every block's attention exchanges heads for tokens, and the x0 every chunk hands
    to the frame stream is the one process's, up to float32 rounding. Then `longlive generate --sp 2`
    as users run it: rank 0 decodes and writes, and each rank cached half the heads."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from .conftest import REPO, cli_env, launch_worker

    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    section = {"window": 6, "global_sink": 2, "shot_sink": 2, "ar_steps": 4}
    worker = launch_worker("generate_worker", tmp_path / "worker", [
        {"name": "story", "model": str(model_dir), "prompts": str(prompts), "generate": {**section, "device": "cpu"}},
        {"name": "broken", "model": str(model_dir), "prompts": str(prompts), "generate": {**section, "device": "cpu"},
         "embedding_fails": True},
    ], nproc=2)
    # rank 0 alone embeds: its failure is raised there and told to rank 1, which would otherwise wait for the tensor
    assert (worker / "broken/rank0.txt").read_text() == "ValueError: a prompt the tokenizer cannot take"
    assert (worker / "broken/rank1.txt").read_text().startswith("RuntimeError: rank 1: rank 0 failed to embed")
    got = worker / "story"
    latents, stats = load_file(got / "latents.safetensors"), json.loads((got / "stats.json").read_text())
    one, two = latents["sp1"], latents["sp2"]
    assert one.shape == two.shape == (4, 48, CHUNK, 4, 4)  # 2 + 1 chunks, then 1: (C, F_c, h, w) each
    assert stats["sp1"]["new_shots"] == stats["sp2"]["new_shots"] == [True, False, False, True]
    # A rank runs each GEMM over half the chunk's tokens, whose sums may round otherwise than the one
    # process's (x264 then turns a 1-level change of a decoded pixel into several). Measured, max
    # |sp2 - sp1| / max |sp1| (max |sp1| is 3.3): 0 on a 2-core AVX-512 EPYC, bit-equal; between other
    # kernel paths of torch and MKL (ATEN_CPU_CAPABILITY=avx2; =default with MKL_ENABLE_INSTRUCTIONS=
    # SSE4_2) at most 3.6e-7, as far as a float32 run lies from a float64 one (4.0e-7): a few float32
    # ulps over the whole rollout. 1e-4 leaves ~300x for other CPUs and libraries, and a wrong shard
    # lands 100x or more above it: a rank's frames swapped in the gather 1.4, one rank's q heads
    # attending the other rank's keys 3.7e-2, the second rank drawing the first frame's noise 1.3e-2.
    error = float((two - one).abs().max() / one.abs().max())
    assert error <= 1e-4, error

    out = tmp_path / "sp2.mp4"
    (tmp_path / "params.yaml").write_text(json.dumps({"generate": section}))
    proc = subprocess.run([sys.executable, "-m", "longlive_core.cli", "generate", "--model", str(model_dir),
                           "--prompts", str(prompts), "--out", str(out), "--device", "cpu", "--sp", "2",
                           "--params", str(tmp_path / "params.yaml")],
                          cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_name("sp2.mp4.json").read_text())
    assert side["sp"] == 2 and side["frames"] == 21 + 5 == len(frames_of(out))
    # each rank caches half the heads: the engine's figure and the CLI's are half one process's
    assert stats["sp2"]["kv_bytes_per_token"] * 2 == stats["sp1"]["kv_bytes_per_token"]
    assert side["kv_bytes_per_token"] * 2 == stats["sp1"]["kv_bytes_per_token"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool)")
def test_the_vae_on_another_device_decodes_the_same_frames(model_dir, tmp_path):
    """The DiT on the GPU, the VAE elsewhere (the CPU here; a second GPU where one is lent): the latents
    cross over as they are handed to the decoder, and the frames are those the VAE makes beside the
    DiT, up to the two devices' float rounding."""
    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    frames = {}
    for vae in ("", "cpu"):
        out = tmp_path / f"v{vae or 'same'}.mp4"
        made: list[np.ndarray] = []
        side = generate_file(model_dir, prompts, out, config(device="cuda", vae_device=vae), on_frame=made.append)
        assert side["vae_device"] == ("cpu" if vae else "cuda:0")
        frames[vae] = np.stack(made)
    diff = np.abs(frames[""].astype(int) - frames["cpu"].astype(int))
    assert frames[""].shape == frames["cpu"].shape and diff.mean() < 1.0, diff.mean()


def test_a_damaged_model_folder_is_one_line_that_says_what_to_fix(model_dir, tmp_path, capsys):
    """A truncated config.json, a truncated weights file, latents the DiT cannot read, an encoder that
    is not the one the model was made with: each refused in one line before anything runs (they once
    ended in a JSONDecodeError, SafetensorError, conv error; the encoder was never checked)."""
    import shutil

    prompts = tmp_path / "p.txt"
    prompts.write_text("a shot\n")
    cases = {
        "config": (lambda d: (d / "config.json").write_text((d / "config.json").read_text()[:40]),
                   "is not readable JSON"),
        "weights": (lambda d: [p.write_bytes(p.read_bytes()[:1000]) for p in d.glob("*.safetensors")],
                    "cannot be read as safetensors"),
        "channels": (lambda d: (d / "config.json").write_text(
            (d / "config.json").read_text().replace('"channels": 48', '"channels": 16')),
            "latent.channels is 16 but DiT tiny reads 48"),
        "encoder": (lambda d: ((d / "vae.safetensors").write_bytes(b"not the VAE"), (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()),
                        "vae": {"path": "vae.safetensors", "sha256": "0" * 64}}))),
            "it is not the VAE the model was made with"),
    }
    for name, (damage, message) in cases.items():
        folder = tmp_path / name
        shutil.copytree(model_dir, folder)
        damage(folder)
        assert longlive(["generate", "--model", str(folder), "--prompts", str(prompts), "--out",
                         str(tmp_path / f"{name}.mp4"), "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_enhance_rewrites_the_prompt_file_or_keeps_it_with_the_reason(model_dir, tmp_path, monkeypatch):
    """generate.enhance: the tiny (random) model's reply breaks the file's structure, so the file is used
    as given and the sidecar says why; a model that answers as asked changes the prompts the video is
    made from, shown the folder's example caption nearest the prompts."""
    import shutil

    from longlive_core.caption import model as caption_model
    from longlive_core.infer.enhance import ExampleBank, pooled

    prompts = tmp_path / "p.txt"
    prompts.write_text(TWO_SHOTS)
    # as a user runs it: the console script with --enhance
    assert longlive(["generate", "--model", str(model_dir), "--prompts", str(prompts),
                     "--out", str(tmp_path / "tiny.mp4"), "--device", "cpu", "--enhance"]) == 0
    e = json.loads((tmp_path / "tiny.mp4.json").read_text())["prompt_enhancement"]
    assert not e["rewritten"] and e["enhanced"] == e["original"] == TWO_SHOTS and e["reason"] and e["model"] == "tiny"
    assert (tmp_path / "tiny.mp4").is_file()

    folder = tmp_path / "with_bank"
    shutil.copytree(model_dir, folder)
    captions = ("a red kite over the sea at noon", "a night street with neon signs")
    embedded = text_encoder_from("tiny", 16, torch.device("cpu")).encode(list(captions)).numpy()
    ExampleBank(captions, np.stack([pooled(x, np.abs(x).sum(axis=1) > 0) for x in embedded])).save(folder)
    requests = []

    class Answering:  # answers as asked: every numbered prompt in capitals
        def __init__(self, cfg, device):
            pass

        def generate(self, items):
            (_, request), = items
            requests.append(request)
            lines = [line.split(". ", 1) for line in request.splitlines() if line[:1].isdigit()]
            return [caption_model.Generated("\n".join(f"{n}. {p.upper()}" for n, p in lines), 0, False)]

    monkeypatch.setattr(caption_model, "CaptionModel", Answering)
    side = generate_file(folder, prompts, tmp_path / "rewritten.mp4", config(enhance=True, enhance_examples=1))
    e = side["prompt_enhancement"]
    assert e["rewritten"] and e["original"] == TWO_SHOTS and len(e["examples"]) == 1 and e["examples"][0] in captions
    assert f"Example of the style: {e['examples'][0]}" in requests[0]
    assert side["shots"][0]["prompts"] == ["A RED KITE OVER A BEACH", "THE KITE DIVES"]
    # under --sp rank 0 embeds for the others, which hold no text encoder and refuse enhance on their own
    from longlive_core.distributed.ulysses import SequenceShard

    with pytest.raises(ConfigError, match="generate.enhance with --sp > 1"):  # before the model loads
        Generator(model_dir, config(enhance=True), SequenceShard(1, 2))
    with Generator(model_dir, config(), SequenceShard(1, 2)) as other_rank:
        assert other_rank.text is None and other_rank.decoder is None
        with pytest.raises(ConfigError, match="generate.enhance with --sp > 1"):  # a video's own settings
            other_rank.prepare(prompts, cfg=config(enhance=True))
