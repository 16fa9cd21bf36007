"""The teacher-forcing layout: the mask against its definition, per-shot captions against a loop
over shots, timesteps and positions, and the FLOP count's pair total against the dense mask."""
from __future__ import annotations

import itertools

import pytest
import torch

from longlive_core.models.attention import attend, dense_mask, with_dense_rows
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.flow import FlowMatching
from longlive_core.train.layout import TeacherForcingLayout


def allowed(q_frame: int, kv_frame: int, frames: int, chunk: int) -> bool:
    """The issue's words, one pair at a time: clean chunk i sees clean chunks <= i; noisy chunk i sees
    itself and the clean chunks before i; nothing sees another noisy chunk."""
    q_noisy, kv_noisy = q_frame >= frames, kv_frame >= frames
    qc, kc = (q_frame % frames) // chunk, (kv_frame % frames) // chunk
    if not q_noisy:
        return not kv_noisy and kc <= qc
    return (kv_noisy and kc == qc) or (not kv_noisy and kc < qc)


@pytest.mark.parametrize("frames,chunk,tpf", [(2, 1, 1), (4, 2, 3), (6, 2, 2), (6, 3, 1), (8, 8, 2)])
def test_mask_allows_exactly_the_defined_pairs(frames, chunk, tpf):
    layout = TeacherForcingLayout(frames, chunk, tpf, text_tokens=4)
    n = 2 * frames * tpf
    mask = dense_mask(layout.self_mask(), n, n, torch.device("cpu"))
    for q, kv in itertools.product(range(n), range(n)):
        assert bool(mask[q, kv]) == allowed(q // tpf, kv // tpf, frames, chunk), (q, kv)
    assert int(mask.sum()) == layout.attended_pairs()


@pytest.mark.parametrize("frames,chunk,tpf,sp", [(2, 1, 1, 1), (4, 2, 3, 1), (6, 3, 1, 1), (8, 8, 2, 1), (8, 2, 2, 2),
                                                 (8, 1, 1, 4), (12, 2, 3, 3), (12, 3, 2, 2)])
def test_dense_rows_are_exactly_the_mask(frames, chunk, tpf, sp):
    """The rectangles attention runs by cover the mask's allowed pairs, each once, in every SP order."""
    mask_mod = TeacherForcingLayout(frames, chunk, tpf, text_tokens=4, sp=sp).self_mask()
    n = 2 * frames * tpf
    covered = torch.zeros(n, n, dtype=torch.long)
    for q0, q1, ranges in mask_mod.dense_rows:
        for a, b in ranges:
            covered[q0:q1, a:b] += 1
    assert torch.equal(covered, dense_mask(mask_mod, n, n, torch.device("cpu")).long())


def test_attention_by_dense_rows_equals_the_masked_softmax_forward_and_backward():
    layout = TeacherForcingLayout(6, 2, 3, text_tokens=4, sp=3)
    mask_mod, n = layout.self_mask(), 2 * 6 * 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64)
    by_rows = attend(q, k, v, mask_mod)  # the default wherever the mask has rows
    masked = attend(q, k, v, mask_mod, backend="sdpa")
    torch.testing.assert_close(by_rows, masked, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(by_rows, (q, k, v), dout), torch.autograd.grad(masked, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cover 36 queries and keys"):
        attend(q[:, :, :30], k, v, mask_mod)
    with pytest.raises(ValueError, match="36 queries and 30 keys"):
        attend(q, k[:, :, :30], v[:, :, :30], mask_mod)
    with pytest.raises(ValueError, match="tile the queries"):
        with_dense_rows(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, ((0, 4, ((0, 4),)), (5, 8, ((0, 8),))))


def test_layout_timesteps_and_positions():
    layout = TeacherForcingLayout(4, 2, 1, 3)
    t = layout.timesteps(torch.tensor([[700.0, 300.0]]))
    assert t.tolist() == [[0, 0, 0, 0, 700, 700, 300, 300]]
    assert layout.frame_positions(torch.tensor([0, 1, 10, 11])).tolist() == [0, 1, 10, 11, 0, 1, 10, 11]
    with pytest.raises(ValueError, match="whole number"):
        TeacherForcingLayout(5, 2, 1, 3)


def test_per_shot_captions_equal_a_loop_over_shots():
    """Frames of shot s read caption s only: the masked cross-attention over the concatenated
    captions equals running each frame's tokens against its own shot's caption alone."""
    torch.manual_seed(0)
    cfg = DIT_CONFIGS["tiny"]
    block = WanDiT(cfg).blocks[0].eval()
    tokens, tpf = 5, 8
    layout = TeacherForcingLayout(frames=2, chunk=1, tokens_per_frame=tpf, text_tokens=tokens)
    x = torch.randn(1, 4 * tpf, cfg.dim)  # [clean 0, clean 1, noisy 0, noisy 1]
    captions = torch.randn(1, 2 * tokens, cfg.dim)
    with torch.no_grad():
        together = block.cross_attn(x, captions, mask_mod=layout.cross_mask(torch.tensor([[0, 1]]), 2))
        expected = torch.cat([block.cross_attn(x[:, i * tpf:(i + 1) * tpf], captions[:, s * tokens:(s + 1) * tokens])
                              for i, s in enumerate([0, 1, 0, 1])], dim=1)
    torch.testing.assert_close(together, expected)


def test_whole_model_reads_each_frames_own_caption():
    """Changing shot 1's caption changes no output of shot 0's frames when the mask keeps shot 0's
    frames from attending to shot 1's (clean frames only see earlier chunks)."""
    torch.manual_seed(0)
    cfg = DIT_CONFIGS["tiny"]
    model = WanDiT(cfg).eval()
    frames, tokens = 4, 3
    layout = TeacherForcingLayout(frames, 2, 2 * 2, tokens)
    latents = torch.randn(1, cfg.in_channels, 2 * frames, 4, 4)
    shots = torch.tensor([[0, 0, 1, 1]])
    text = torch.randn(1, 2 * tokens, cfg.text_dim)
    changed = text.clone()
    changed[:, tokens:] = torch.randn(1, tokens, cfg.text_dim)
    t = layout.timesteps(torch.tensor([[500.0, 200.0]]))
    kwargs = dict(frame_positions=layout.frame_positions(torch.arange(frames)), mask_mod=layout.self_mask(),
                  cross_mask_mod=layout.cross_mask(shots, 2))
    with torch.no_grad():
        a = model(latents, t, text, **kwargs)
        b = model(latents, t, changed, **kwargs)
    # clean chunk 0 (frames 0-1) and noisy chunk 0 (frames 4-5) only ever see shot 0
    torch.testing.assert_close(a[:, :, :2], b[:, :, :2])
    torch.testing.assert_close(a[:, :, 4:6], b[:, :, 4:6])
    assert not torch.allclose(a[:, :, 6:], b[:, :, 6:])


def test_flow_matching_schedule():
    flow = FlowMatching(1000, 5.0)
    sig = flow.sigmas(torch.tensor([0, 500, 999]))
    assert sig[0] == pytest.approx(1.0)
    assert sig[1] == pytest.approx(5 * 0.5 / (1 + 4 * 0.5))
    assert 0 < sig[2] < 0.01
    x0, noise = torch.ones(3), torch.zeros(3)
    assert flow.noised(x0, noise, torch.tensor(0.25)).tolist() == [0.75] * 3
    assert flow.target(x0, noise).tolist() == [-1.0] * 3
