"""DMD's maths on toy cases where the real and fake scores are known functions: the gradient's sign
and per-chunk normalisation, the generator loss's gradient, the guidance, the shifted and clamped
timesteps, the generator-update cadence."""
from __future__ import annotations

import pytest
import torch

from longlive_core.distill.dmd import (
    critic_loss,
    dmd_gradient,
    dmd_timesteps,
    generator_loss,
    guided,
    is_generator_step,
)


def test_gradient_points_from_real_to_fake_and_is_normalised_per_chunk():
    """Real score: the target A; fake score: the sample itself. The DMD gradient is (x - A) divided,
    chunk by chunk, by that chunk's mean |x - A|, so a step against it moves every chunk toward A by
    a comparable amount, however far each was."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 3, 4, 2, 2, generator=g)
    x = target.clone()
    x[:, :, :2] += 10.0  # chunk 0 far from the real distribution's sample, chunk 1 near
    x[:, :, 2:] += 0.1 * torch.randn(2, 3, 2, 2, 2, generator=g)
    grad = dmd_gradient(x, fake_x0=x, real_x0=target, chunk_frames=2)
    diff = (x - target).double()
    for c in range(2):
        part = slice(2 * c, 2 * c + 2)
        for b in range(2):
            norm = diff[b, :, part].abs().mean()
            torch.testing.assert_close(grad[b, :, part], diff[b, :, part] / norm)
            assert grad[b, :, part].abs().mean() == pytest.approx(1.0)  # every chunk the same size of step
    x_req = x.clone().requires_grad_(True)
    generator_loss(x_req, grad).backward()
    torch.testing.assert_close(x_req.grad.double(), grad / x.numel())  # d loss / dx = grad / numel
    stepped = x - 0.1 * grad.float()
    assert ((stepped - target).abs().view(2, 3, 2, 2, 2, 2).mean(dim=(1, 3, 4, 5))
            < (x - target).abs().view(2, 3, 2, 2, 2, 2).mean(dim=(1, 3, 4, 5))).all()
    # fake = real: nothing to learn
    assert not dmd_gradient(x, target, target, 2).any()
    with pytest.raises(ValueError, match="whole number"):
        dmd_gradient(x, x, target, 3)


def test_guidance_and_critic_loss():
    cond, uncond = torch.tensor([2.0]), torch.tensor([1.0])
    assert guided(cond, uncond, 3.0).item() == 5.0 and guided(cond, uncond, 0.0).item() == 2.0
    x0, noise = torch.zeros(1, 1, 2, 1, 1), torch.ones(1, 1, 2, 1, 1)
    assert critic_loss(noise - x0, x0, noise).item() == 0.0
    assert critic_loss(torch.zeros_like(noise), x0, noise).item() == 1.0


def test_timesteps_are_shifted_and_clamped():
    u = torch.tensor([0.0, 0.01, 0.2, 0.5, 0.999])
    t = dmd_timesteps(u, shift=5.0)
    expected = [20.0, 1000 * 5 * 0.01 / (1 + 4 * 0.01), 1000 * 5 * 0.2 / (1 + 4 * 0.2), 1000 * 2.5 / 3, 980.0]
    assert t.tolist() == pytest.approx(expected, rel=1e-6)
    assert dmd_timesteps(torch.rand(1000)).min() >= 20 and dmd_timesteps(torch.rand(1000)).max() <= 980


def test_generator_steps_once_every_five_critic_steps():
    assert [s for s in range(20) if is_generator_step(s, 5)] == [4, 9, 14, 19]
    assert all(is_generator_step(s, 1) for s in range(5))


def test_a_rollout_of_a_two_shot_sample_starts_the_second_shot_in_the_cache(monkeypatch):
    """The generator's rollout hands each chunk its own shot's caption and shot index (the cache
    starts a shot where the sample does, as inference), with the distilled window and sinks."""
    import types

    from longlive_core.distill import trainer as trainer_module
    from longlive_core.distill.config import DistillDMDConfig
    from longlive_core.distributed.ulysses import WHOLE
    from longlive_core.train.data import TrainSample

    seen = {}

    def fake_rollout(model, noise, texts, cfg, generator, positions, exit_index, grad_from, dtype, shard, shots):
        seen.update(texts=texts, cfg=cfg, shots=shots, grad_from=grad_from)
        return noise

    monkeypatch.setattr(trainer_module, "rollout", fake_rollout)
    cfg = DistillDMDConfig(latent_frames=8, grad_frames=4, window=8, global_sink=2, shot_sink=2)
    shot_of_frame = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # two shots of two 2-frame chunks each
    text = torch.stack([torch.full((3, 4), 0.0), torch.full((3, 4), 1.0)])
    sample = TrainSample("s", torch.zeros(48, 8, 2, 2), text, shot_of_frame, torch.arange(8), 8)
    prompt = trainer_module.Prompt(sample, torch.zeros(1, 48, 8, 2, 2))
    me = types.SimpleNamespace(chunk=2, cfg=cfg, device=torch.device("cpu"), dtype=torch.float32, shard=WHOLE,
                               rollout_cfg=cfg.rollout(2))
    trainer_module.DMDTrainer.generate(me, None, prompt, ("k",), grad=True)
    assert seen["shots"] == [0, 0, 1, 1] and [float(t.mean()) for t in seen["texts"]] == [0.0, 0.0, 1.0, 1.0]
    assert (seen["cfg"].window, seen["cfg"].global_sink, seen["cfg"].shot_sink) == (8, 2, 2)
    assert seen["grad_from"] == 2  # the last grad_frames (two chunks) carry the gradient


def test_the_memory_comparison_measures_budget_as_full():
    """A budget plan fills the GPU to its limit whatever the weights, so the stage's memory comparison
    measures it as `full`; every other policy as configured, one iteration a generator and a critic step."""
    from longlive_core.distill.config import DistillDMDConfig
    from longlive_core.distill.trainer import comparison_config

    for configured, measured in (("budget", "full"), ("full", "full"), ("none", "none"), ("selective", "selective")):
        cfg = DistillDMDConfig(activation_checkpointing=configured, generator_every=5, stats_every=10)
        one = comparison_config(cfg)
        assert (one.activation_checkpointing, one.generator_every, one.stats_every) == (measured, 1, 0)


def test_the_stage_line_gives_the_memory_comparison_its_own_peaks():
    """Under budget the run's peak is its plan's, so the comparison's ratio is told with the peaks it compares."""
    from tasks.distill_dmd import one_line

    summary = {"steps_run": 2, "steps": 2, "resume": "fresh", "skipped_steps": 0, "peak_memory_mb": 120000.0,
               "conversion": "nvfp4"}
    assert "full-weight" not in one_line(summary)
    summary["memory_comparison"] = {"measured": True, "peak_mb": 18000.0, "bf16_full_weights_peak_mb": 48000.0,
                                    "ratio": 0.375, "activation_checkpointing": "full"}
    line = one_line(summary)
    assert "peak memory 120000 MiB; one iteration with full checkpointing 18000 MiB, 0.38x BF16 full-weight" in line
    assert line.endswith("distillation's 48000 MiB; nvfp4")
