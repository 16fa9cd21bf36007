"""Balanced-SP chunk-halo encoding with the tiny Wan2.2 VAE: chunk plans, the derived halo, and
chunk latents equal to the full per-shot encode once the halo covers the receptive field."""
from __future__ import annotations

import pytest
import torch

from longlive_core.latents.halo import encode_chunked, plan_chunks, receptive_field_latents, split_latents
from longlive_core.models.vae import build_vae, encode_video, load_vae
from longlive_core.models.weights import CheckpointError


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return build_vae("tiny")


def test_chunk_plans_cover_every_latent_once_with_one_plus_4k_frames():
    for n, p, h in ((25, 2, 4), (25, 3, 0), (45, 4, 28), (7, 7, 2)):
        chunks = plan_chunks(n, p, h)
        assert [c.latent_start for c in chunks] == [s for s, _ in split_latents(n, p)]
        assert chunks[-1].latent_end == n and all(a.latent_end == b.latent_start for a, b in zip(chunks, chunks[1:]))
        for c in chunks:
            assert (c.raw_end - c.raw_start - 1) % 4 == 0  # the VAE's 1 + 4k
            assert 1 + (c.raw_end - c.raw_start - 1) // 4 == c.encoded_latents
            assert c.encoded_latents <= c.latent_end - c.latent_start + h + 1  # O(F/P + h), not O(F)
    with pytest.raises(ValueError, match="cannot split 3 latent frames over 4 ranks"):
        split_latents(3, 4)


def test_the_derived_halo_is_the_public_codes_for_the_real_architecture(vae):
    # counted from the encoder's layers: 112 raw frames = 28 latents, for the tiny and the real widths alike
    assert receptive_field_latents(vae) == 28


@pytest.mark.slow
def test_chunk_latents_match_the_full_encode_as_the_halo_grows(vae):
    torch.manual_seed(1)
    video = torch.rand(1, 3, 4 * 44 + 1, 32, 32) * 2 - 1  # 45 latent frames
    full = encode_video(vae, video)
    default = receptive_field_latents(vae)
    for ranks in (2, 3):
        errors = {}
        for halo in (0, 4, 8, 16, default):
            z = encode_chunked(vae, video, ranks, halo)
            assert z.shape == full.shape
            errors[halo] = ((z - full).abs().max() / full.abs().max()).item()
        assert errors[0] > 0.1 and errors[4] > errors[16]  # too little context shows
        assert errors[default] <= 1e-6, errors  # exact once the halo covers the receptive field


def test_missing_vae_weights_name_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="no VAE at .*nowhere.*config.json"):
        load_vae(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        encode_video(build_vae("tiny"), torch.zeros(1, 3, 6, 32, 32))


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2 via the device tool)")


@pytest.mark.slow  # two CPU ranks: the e2e's encode_latents with sp 2, through the stage, against sp 1
@pytest.mark.parametrize("ranks,device", [(3, "cpu"), pytest.param(2, "cuda", marks=two_gpus)])
def test_torchrun_ranks_assemble_the_full_encode(tmp_path, ranks, device):
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.conftest import REPO, cli_env

    out = tmp_path / "z.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "tests.helpers.sp_encode", str(out), "28", device]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    z = load_file(out)
    assert z["chunked"].shape == z["full"].shape == (48, 81, 2, 2)
    assert (z["chunked"] - z["full"]).abs().max() <= 1e-5 * z["full"].abs().max()
    assert int(z["max_rank"]) < 81  # no rank encoded the whole shot: O(F/P + h)
