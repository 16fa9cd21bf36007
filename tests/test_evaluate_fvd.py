"""FVD: the Fréchet distance on crafted feature sets, and the clip features of videos through an I3D
stand-in saved as TorchScript (the real i3d_torchscript.pt is a local file in production)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longlive_core.config import ConfigError
from longlive_core.evaluate.fvd import FVD, frechet_distance, load_i3d
from longlive_core.video.synth import encode_frames


def test_the_frechet_distance_of_shifted_and_scaled_sets_is_the_closed_form():
    real = np.random.default_rng(0).normal(size=(400, 6))
    assert frechet_distance(real, real) == pytest.approx(0.0, abs=1e-6)
    shift = np.arange(6.0)
    assert frechet_distance(real + shift, real) == pytest.approx(float((shift ** 2).sum()), rel=1e-6)
    centred = real - real.mean(0)
    # S_g = 4 S_r: Tr(S_r + 4 S_r - 2 * 2 S_r) = Tr(S_r)
    assert frechet_distance(2 * centred, centred) == pytest.approx(np.trace(np.cov(centred, rowvar=False)), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 clips"):
        frechet_distance(real[:1], real)


class StandIn(torch.nn.Module):
    """I3D's call signature: clips (B, 3, 16, 224, 224) in [-1, 1] -> one feature row each."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3 * 16, 8)

    def forward(self, x: torch.Tensor, rescale: bool = False, resize: bool = False,
                return_features: bool = True) -> torch.Tensor:
        return self.proj(x.mean(dim=(3, 4)).flatten(1))


def video(path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    encode_frames(path, [rng.integers(0, 255, (32, 48, 3), dtype=np.uint8) for _ in range(n)], fps=24, width=48,
                  height=32, crf=0)


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # the stand-in is saved the way the real file was
def test_fvd_cuts_clips_inside_shots_and_compares_with_the_reference_folder(tmp_path):
    import av

    torch.manual_seed(0)
    i3d = tmp_path / "i3d_torchscript.pt"
    torch.jit.save(torch.jit.script(StandIn()), str(i3d))
    reference = tmp_path / "real"
    reference.mkdir()
    for k in range(3):
        video(reference / f"r{k}.mp4", 33, k)  # 2 clips each, one frame left over
    fvd = FVD(str(i3d), str(reference), torch.device("cpu"))
    assert fvd.real.shape == (6, 8) and fvd.weights["sha256"] and fvd.weights["reference_sha256"]
    generated = tmp_path / "g.mp4"
    video(generated, 40, 9)
    fvd.generated.start([0, 20])  # two shots of 20 frames: one clip each, the tails left out
    with av.open(str(generated)) as container:
        for frame in container.decode(video=0):
            fvd.generated.add(frame.to_ndarray(format="rgb24"))
    result = fvd.distance()
    assert (result["generated_clips"], result["real_clips"]) == (2, 6) and result["fvd"] >= 0
    (tmp_path / "not.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError, match="not a TorchScript file"):
        load_i3d(str(tmp_path / "not.pt"), torch.device("cpu"))
