"""The Wan2.2 DiT: shapes for both configs, parity with Diffusers' WanTransformer3DModel, per-frame
timesteps, both checkpoint layouts, and attention masks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from longlive_core.models.attention import attend, block_causal, dense_mask
from longlive_core.models.checkpoint import CheckpointError, load_dit, save_dit, to_wan_layout
from longlive_core.models.config import dit_config
from longlive_core.models.wan_dit import HIGH_PRECISION_MODULES, WanDiT

TINY = dit_config("tiny")


def diffusers_tiny():
    # diffusers is a dependency here; the GPU image lacks it, and there these tests skip
    WanTransformer3DModel = pytest.importorskip("diffusers").WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=TINY.num_heads, attention_head_dim=TINY.head_dim,
        in_channels=TINY.in_channels, out_channels=TINY.out_channels, text_dim=TINY.text_dim,
        freq_dim=TINY.freq_dim, ffn_dim=TINY.ffn_dim, num_layers=TINY.num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=TINY.eps).eval()


def inputs(b=2, f=3, h=8, w=6):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, TINY.in_channels, f, h, w, generator=g), torch.randn(b, 7, TINY.text_dim, generator=g))


def test_shapes_and_dtypes_for_both_configs():
    model = WanDiT(TINY)
    latents, text = inputs()
    out = model(latents, torch.tensor([10.0, 500.0]), text)
    assert out.shape == latents.shape and out.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(latents, torch.tensor([10.0, 500.0]), text).shape == latents.shape
    bf16 = WanDiT(TINY).to(torch.bfloat16)  # bf16 parameters (how training and benchmarks run it)
    out = bf16(latents.bfloat16(), torch.tensor([10.0, 500.0]), text.bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == latents.shape and out.isfinite().all()
    with torch.device("meta"):
        big = WanDiT(dit_config("wan2.2-ti2v-5b"))
    n = sum(p.numel() for p in big.parameters())
    assert 4.9e9 < n < 5.1e9, n  # "5B"
    assert big.blocks[0].self_attn.q.weight.shape == (3072, 3072) and big.blocks[0].ffn[0].weight.shape == (14336, 3072)
    assert big.head.head.weight.shape == (48 * 4, 3072) and len(big.blocks) == 30
    with pytest.raises(ValueError, match="frame_positions must be"):
        model(latents, torch.tensor([10.0, 500.0]), text, frame_positions=torch.arange(2))
    with pytest.raises(ValueError, match="unknown DiT config"):
        dit_config("wan9")


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_diffusers_wan_transformer(per_token):
    ref = diffusers_tiny()
    ours = WanDiT(TINY).eval()
    ours.load_state_dict(to_wan_layout(ref.state_dict()), strict=True)
    latents, text = inputs()
    h, w = 8, 6
    if per_token:  # Wan2.2 TI2V form: a timestep per token; ours takes one per latent frame
        per_frame = torch.tensor([[0.0, 250.0, 999.0], [40.0, 40.0, 700.0]])
        t_ref = per_frame.repeat_interleave((h // 2) * (w // 2), dim=1)
        t_ours = per_frame
    else:
        t_ref = t_ours = torch.tensor([10.0, 500.0])
    with torch.no_grad():
        want = ref(latents, t_ref, text, return_dict=False)[0]
        got = ours(latents, t_ours, text)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def test_per_frame_timesteps_reduce_to_one_timestep():
    model = WanDiT(TINY).eval()
    latents, text = inputs()
    with torch.no_grad():
        one = model(latents, torch.tensor([300.0, 300.0]), text)
        per_frame = model(latents, torch.full((2, 3), 300.0), text)
        mixed = model(latents, torch.tensor([[0.0, 300.0, 300.0], [300.0, 300.0, 300.0]]), text)
    # One timestep per frame runs the time embedding and the modulation over other shapes (a row per
    # frame), whose GEMMs may round otherwise: measured 2e-7 to 3.3e-7 of the output's largest value
    # (a float32 ulp or two; up to 8e-7 in absolute terms, too near an absolute 1e-6 to hold on every
    # CPU). 1e-5 of it leaves 30x; another timestep for one frame moves its sample by 0.15 or more.
    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    assert gap(per_frame, one) < 1e-5
    assert gap(mixed[0], one[0]) > 1e-2 and gap(mixed[1], one[1]) < 1e-5
    with pytest.raises(ValueError, match="timesteps must be"):
        model(latents, torch.zeros(2, 2), text)


def test_block_causal_mask_makes_earlier_frames_independent_of_later_ones():
    model = WanDiT(TINY).eval()
    latents, text = inputs(b=1, f=4)
    tokens = 4 * 3  # (8/2) x (6/2) per latent frame
    mask = block_causal(tokens, frames_per_block=2)
    changed = latents.clone()
    changed[:, :, 2:] += 1.0  # only the second block of frames
    with torch.no_grad():
        a = model(latents, torch.tensor([100.0]), text, mask_mod=mask)
        b = model(changed, torch.tensor([100.0]), text, mask_mod=mask)
        full = model(changed, torch.tensor([100.0]), text)
    assert torch.allclose(a[:, :, :2], b[:, :, :2], atol=1e-6)  # the first block never saw the change
    assert not torch.allclose(a[:, :, :2], full[:, :, :2], atol=1e-4)


def test_sdpa_with_the_dense_mask_matches_a_float64_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    mask_mod = block_causal(3, 2)
    dense = dense_mask(mask_mod, 12, 12, q.device)
    assert dense.dtype == torch.bool and dense[0, 6:].sum() == 0 and dense[11].all()
    logits = (q.double() @ k.double().transpose(-1, -2)) / 8**0.5
    want = torch.softmax(logits.masked_fill(~dense, float("-inf")), -1) @ v.double()
    assert torch.allclose(attend(q, k, v, mask_mod).double(), want, atol=1e-6)
    with pytest.raises(ValueError, match="attention backend"):
        attend(q, k, v, backend="xformers")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@needs_cuda
def test_flex_and_sdpa_agree_on_the_same_mask_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", generator=g) for _ in range(3))
    mask_mod = block_causal(64, 2)
    flex, sdpa = attend(q, k, v, mask_mod, backend="flex"), attend(q, k, v, mask_mod, backend="sdpa")
    assert (flex - sdpa).abs().max() < 1e-3
    # other lengths (recompiled once, dynamically) still agree; the block mask is built once per length
    from longlive_core.models.attention import block_mask_for

    for n in (384, 640, 896, 1152):
        q, k, v = (torch.randn(1, 4, n, 64, device="cuda", generator=g) for _ in range(3))
        hits = block_mask_for.cache_info().hits
        flex = attend(q, k, v, mask_mod, backend="flex")
        assert torch.equal(attend(q, k, v, mask_mod, backend="flex"), flex)
        assert block_mask_for.cache_info().hits == hits + 1
        assert (flex - attend(q, k, v, mask_mod, backend="sdpa")).abs().max() < 1e-3


@needs_cuda
def test_teacher_forcing_rows_match_flex_on_the_gpu():
    """The training default (the mask's dense rows on the fused SDPA kernels) against FlexAttention's
    block mask, in bf16: output and gradients."""
    from longlive_core.train.layout import TeacherForcingLayout

    mask_mod = TeacherForcingLayout(8, 2, 128, text_tokens=4).self_mask()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, 4, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    rows, flex = attend(q, k, v, mask_mod), attend(q, k, v, mask_mod, backend="flex")
    grads = zip(torch.autograd.grad(rows, (q, k, v), dout), torch.autograd.grad(flex, (q, k, v), dout))
    for a, b in [(rows, flex), *grads]:
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


def test_both_checkpoint_layouts_round_trip(tmp_path):
    ref = diffusers_tiny()
    ref.save_pretrained(tmp_path / "diffusers", max_shard_size="20KB")  # sharded, with an index
    assert len(list((tmp_path / "diffusers").glob("*.safetensors"))) > 1
    from_diffusers = load_dit(tmp_path / "diffusers", TINY)
    want = to_wan_layout(ref.state_dict())
    assert all(torch.equal(from_diffusers.state_dict()[k], v) for k, v in want.items())
    save_dit(from_diffusers, tmp_path / "wan", max_shard_bytes=40_000)
    assert len(list((tmp_path / "wan").glob("*.safetensors"))) > 1
    again = load_dit(tmp_path / "wan", TINY, dtype=torch.bfloat16)
    assert all(torch.equal(again.state_dict()[k], v.bfloat16()) for k, v in want.items())
    assert again.blocks[0].self_attn.q.weight.dtype == torch.bfloat16


def test_missing_or_mismatched_weights_say_what_to_fix(tmp_path):
    with pytest.raises(CheckpointError, match="no DiT weights at .*nowhere.*index.json"):
        load_dit(tmp_path / "nowhere", TINY)
    (tmp_path / "model.pt").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="only .safetensors"):
        load_dit(tmp_path / "model.pt", TINY)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="is not a weight index"):
        load_dit(tmp_path / "broken", TINY)
    save_dit(WanDiT(TINY), tmp_path / "tiny")
    bigger = dataclasses.replace(TINY, ffn_dim=256)
    with pytest.raises(CheckpointError, match=r"wrong shape: blocks.0.ffn.0.bias, blocks.0.ffn.0.weight, .*\(\+1"):
        load_dit(tmp_path / "tiny", bigger)


def test_save_dit_replaces_a_checkpoint_whole_or_not_at_all(tmp_path, monkeypatch):
    from longlive_core.models import checkpoint

    torch.manual_seed(0)
    old, new = WanDiT(TINY), WanDiT(TINY)
    save_dit(old, tmp_path / "ckpt", max_shard_bytes=40_000)
    calls = []

    def crash_on_second_shard(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, path)

    from safetensors.torch import save_file
    monkeypatch.setattr(checkpoint, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_dit(new, tmp_path / "ckpt", max_shard_bytes=40_000)
    monkeypatch.undo()
    kept = load_dit(tmp_path / "ckpt", TINY).state_dict()  # the old checkpoint, untouched
    assert all(torch.equal(kept[k], v) for k, v in old.state_dict().items())
    save_dit(new, tmp_path / "ckpt")  # one shard now: the old shards go with the old index
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging folders left
    assert all(torch.equal(load_dit(tmp_path / "ckpt", TINY).state_dict()[k], v) for k, v in new.state_dict().items())
    # a save that died between its two renames left the checkpoint aside: the next save puts it back
    # first, so even if that save fails too the checkpoint is there
    (tmp_path / "ckpt").rename(tmp_path / ".tmp-ckpt.replaced")
    calls.clear()
    monkeypatch.setattr(checkpoint, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_dit(old, tmp_path / "ckpt", max_shard_bytes=40_000)
    monkeypatch.undo()
    kept = load_dit(tmp_path / "ckpt", TINY).state_dict()
    assert all(torch.equal(kept[k], v) for k, v in new.state_dict().items())
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds other files \\(notes.txt\\)"):
        save_dit(new, tmp_path / "ckpt")


def test_high_precision_modules_are_what_quantization_skips():
    from longlive_core.quant import convert_linears

    model = WanDiT(TINY)
    report = convert_linears(model, "nvfp4", skip=HIGH_PRECISION_MODULES, overrides={"backend": "torch"})
    assert set(report.kept) == {"text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
                                "time_projection.1", "head.head"}
    assert "blocks.0.self_attn.q" in report.converted and "blocks.1.ffn.2" in report.converted
    latents, text = inputs(b=1)
    assert model(latents, torch.tensor([5.0]), text).shape == latents.shape
