"""cuDNN's FP8 SDPA forward (infer/attention_cudnn_fp8.py): without the frontend the module still imports
and says what is missing; on a Hopper GPU it is within FP8's error of float32 attention, at the 5B's heads
over the paper's window and at a small odd shape. The tolerance is 1.25x the recipe's emulated error (6.0%
at the window: E4M3 Q K^T, P, V and O, each rounding once; see the module docstring). No conftest import:
the GPU image runs this file with --noconftest."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.075  # relative L2 error of the output


def test_without_the_frontend_the_module_imports_and_names_what_is_missing():
    # a fresh interpreter: the module must not import cudnn itself, and with cudnn unimportable
    # (sys.modules[name] = None makes the import fail) it reports so instead of failing
    code = (
        "import json, sys, torch\n"
        "from longlive_core.infer import attention_cudnn_fp8 as m\n"
        "lazy = 'cudnn' not in sys.modules\n"
        "sys.modules['cudnn'] = None\n"
        "x = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)\n"
        "try:\n"
        "    m.attention_fp8(x, x, x)\n"
        "    error = None\n"
        "except RuntimeError as exc:\n"
        "    error = str(exc)\n"
        "got = {'lazy': lazy, 'available': m.available(), 'reason': m.unavailable_reason(), 'error': error}\n"
        "print(json.dumps(got))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["lazy"], "importing the module imported cudnn"
    assert got["available"] is False
    assert "nvidia-cudnn-frontend" in got["reason"]
    assert got["error"] is not None and "nvidia-cudnn-frontend" in got["error"], got["error"]
    assert "not a CUDA device" in got["error"]  # the CPU tensors are named too


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the tests below run the kernel")
def test_on_this_machine_it_is_unavailable():
    from longlive_core.infer import attention_cudnn_fp8 as m

    assert not m.available()
    with pytest.raises(RuntimeError, match="cuDNN FP8 attention is unavailable here"):
        m.attention_fp8(*(torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16),) * 3)


def draw(heads: int, queries: int, keys: int, dim: int, batch: int = 1, seed: int = 0):
    """N(0, 1) heads in bfloat16 on the GPU, the keys with a per-channel offset as real keys carry."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q = randn(batch, heads, queries, dim).to(torch.bfloat16)
    k = (randn(batch, heads, keys, dim) + 2 * randn(batch, heads, 1, dim)).to(torch.bfloat16)
    v = randn(batch, heads, keys, dim).to(torch.bfloat16)
    return q, k, v


def relative_error(q, k, v) -> float:
    from longlive_core.infer.attention_cudnn_fp8 import attention_fp8

    out = attention_fp8(q, k, v)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return float((out.float() - ref).norm() / ref.norm())


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@needs_gpu
def test_fp8_attention_is_within_its_tolerance_over_the_window():
    from longlive_core.infer.attention_cudnn_fp8 import unavailable_reason

    assert unavailable_reason() is None, unavailable_reason()
    # the 5B's 24 heads of 128, one chunk's 7,040 queries over a window of 32 latent frames (28,160 keys)
    error = relative_error(*draw(24, 7040, 28160, 128))
    print(f"relative L2 error over the window: {error:.4f}")
    assert error <= TOLERANCE


@needs_gpu
def test_fp8_attention_is_within_its_tolerance_at_an_odd_shape_and_reuses_its_graph():
    from longlive_core.infer import attention_cudnn_fp8 as m

    assert m.unavailable_reason() is None, m.unavailable_reason()
    q, k, v = draw(3, 77, 333, 64, batch=2, seed=1)
    error = relative_error(q, k, v)
    print(f"relative L2 error at (2, 3, 77 x 333, 64): {error:.4f}")
    assert error <= TOLERANCE
    graphs = len(m._graphs)
    first, second = m.attention_fp8(q, k, v), m.attention_fp8(q, k, v)
    assert torch.equal(first, second) and len(m._graphs) == graphs  # one graph per shape, the same bits


@needs_gpu
def test_values_that_share_an_offset_stay_within_the_tolerance_over_the_window():
    # past the DiT's first layer a block's V carries a per-channel offset its tokens share, under near-uniform
    # attention: summed over 28,160 keys, such a P V outgrows the FP8 accumulator's precision unless V is
    # smoothed (measured on the H200 before it was: every output row about half of BF16's)
    from longlive_core.infer.attention_cudnn_fp8 import unavailable_reason

    assert unavailable_reason() is None, unavailable_reason()
    q, k, v = draw(4, 1024, 28160, 128, seed=3)
    offset = torch.randn(1, 4, 1, 128, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda")
    error = relative_error(q * 0.05, k, (v.float() + 2 * offset).to(torch.bfloat16))
    print(f"relative L2 error with V offset, near-uniform attention: {error:.4f}")
    assert error <= TOLERANCE


@needs_gpu
def test_the_probabilities_fit_the_s_scale():
    # P_SCALE = 448 assumes the P the kernel rounds to E4M3 is at most 1 (exp of S minus a running max):
    # amax_s, which the kernel measures before scale_s, says whether it is
    from longlive_core.infer import attention_cudnn_fp8 as m

    assert m.unavailable_reason() is None, m.unavailable_reason()
    q, k, v = draw(4, 256, 1024, 128, seed=2)
    _, amax_s, amax_o = m._forward(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    print(f"amax_s {amax_s.item():.4f}, amax_o {amax_o.item():.4f} (float32 attention's {ref.abs().max().item():.4f})")
    assert 0 < amax_s.item() <= 1.001, f"amax_s {amax_s.item()}: P above 1 (or amax_s after scale_s) overflows P_SCALE"


@needs_gpu
def test_the_kv_cache_attends_through_it_on_the_gpu_when_generate_asks():
    # generate.attention: fp8: a chunk's cached self-attention over [the window; its own keys] goes through
    # cuDNN's FP8 attention, within its tolerance of the SDPA cache's; the window in E4M3 is made on the
    # chunk's first pass and kept: a later pass quantizes only its own rows, and the next write drops it
    from longlive_core.infer.attention_cudnn_fp8 import attention_fp8_window
    from longlive_core.infer.attention_fp8_io import FP8Window
    from longlive_core.infer.kv_cache import KVCache
    from longlive_core.infer.kv_quant import KVQuantConfig

    q, k, v = draw(2, 64, 64, 64, seed=5)  # one latent frame of 64 tokens
    noise = draw(2, 64, 64, 64, seed=6)
    # a later pass: fresh own rows of the same spread (the keys' offset kept), which a misplaced write would miss
    later = (noise[0], (k.float() + noise[1].float() - noise[1].float().mean(2, keepdim=True)).to(k.dtype), noise[2])
    plain, fp8 = KVCache(1, 64, window=4), KVCache(1, 64, window=4, attention="fp8")
    fp8_kv = KVCache(1, 64, window=4, quant=KVQuantConfig(format="fp8"), attention="fp8")  # K-smoothed keys
    for cache in (plain, fp8, fp8_kv):
        with cache.write(1):
            cache.for_layer(0)(q, k, v, None)
    out = fp8.for_layer(0)(q, k, v, None)
    held = fp8.fp8_windows[0][1]
    assert torch.equal(out, attention_fp8_window(q, FP8Window.of(torch.cat([k, k], 2), torch.cat([v, v], 2), 64)))
    outs = {"first": out, "later": fp8.for_layer(0)(*later, None)}
    assert fp8.fp8_windows[0][1] is held and held.cached == 64
    fp8_kv.for_layer(0)(q, k, v, None)
    outs["later, FP8 cache"] = fp8_kv.for_layer(0)(*later, None)
    for name, inputs in (("first", (q, k, v)), ("later", later), ("later, FP8 cache", later)):
        ref = plain.for_layer(0)(*inputs, None).float()
        error = float((outs[name].float() - ref).norm() / ref.norm())
        print(f"{name}: relative L2 error against the BF16 cache's SDPA {error:.4f}")
        assert error <= TOLERANCE, name
    with fp8.write(1):
        fp8.for_layer(0)(*later, None)
    assert fp8.fp8_windows[0] is None
