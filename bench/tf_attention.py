"""Teacher-forcing self-attention alone at the 5B head dims: FlexAttention's block mask against the
mask's dense rows (one unmasked SDPA call per chunk's clean or noisy queries) on each SDPA kernel,
and rows of equal lengths stacked into one call ("rows-paired").

    PYTHONPATH=. python bench/tf_attention.py [--frames 16 32] [--sp 1 4] [--autotune]

Inputs are (1, 24 heads, 2 x 880 x F tokens, 128) bf16 with 8-frame chunks, as ``train_ar`` sees them
at 704x1280; ``--sp P`` gives one Balanced-SP rank's attention after the exchange (24/P heads, the
tokens in the ranks' order). Every variant's output and q/k/v gradients are checked against
FlexAttention's (relative Frobenius error). Times are medians of ``triton.testing.do_bench``; TFLOP/s count the
unmasked pairs only: 4 x pairs x 128 x heads forward, 2.5 times that backward.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from longlive_core.models.attention import attend
from longlive_core.train.layout import TeacherForcingLayout

HEAD_DIM, TOKENS_PER_FRAME, CHUNK = 128, 880, 8
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}


def variants(autotune: bool) -> dict:
    out = {"flex": functools.partial(attend, backend="flex"), "rows": functools.partial(attend, backend="rows")}
    for name, kernel in KERNELS.items():
        def run(q, k, v, mask_mod, kernel=kernel):
            with sdpa_kernel([kernel]):
                return attend(q, k, v, mask_mod, backend="rows")
        out[f"rows-{name}"] = run
    out["rows-paired"] = paired_rows
    if autotune:
        from torch.nn.attention.flex_attention import flex_attention

        from longlive_core.models.attention import block_mask_for
        tuned = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")

        def flex_tuned(q, k, v, mask_mod):
            return tuned(q, k, v, block_mask=block_mask_for(mask_mod, q.shape[2], k.shape[2], q.device))
        out["flex-autotuned"] = flex_tuned
    return out


def paired_rows(q, k, v, mask_mod):
    """Rows of equal query and key lengths stacked along the batch: fewer, larger SDPA calls."""
    def keys(x, ranges):
        return torch.cat([x[:, :, a:b] for a, b in ranges], dim=2)

    groups: dict = {}
    for q0, q1, ranges in mask_mod.dense_rows:
        groups.setdefault((q1 - q0, sum(b - a for a, b in ranges)), []).append((q0, q1, ranges))
    pieces = {}
    for rows in groups.values():
        qs = torch.cat([q[:, :, q0:q1] for q0, q1, _ in rows])
        ks = torch.cat([keys(k, r) for _, _, r in rows])
        vs = torch.cat([keys(v, r) for _, _, r in rows])
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
        for i, (q0, _, _) in enumerate(rows):
            pieces[q0] = out[i * q.shape[0]:(i + 1) * q.shape[0]]
    return torch.cat([pieces[q0] for q0 in sorted(pieces)], dim=2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(frames: int, sp: int, autotune: bool) -> list[dict]:
    layout = TeacherForcingLayout(frames, CHUNK, TOKENS_PER_FRAME, 512, sp)
    heads = 24 // sp
    mask = layout.self_mask()
    n = 2 * frames * TOKENS_PER_FRAME
    fwd_flops = 4 * layout.attended_pairs() * HEAD_DIM * heads
    g = torch.Generator(device="cuda").manual_seed(frames)
    q, k, v = (torch.randn(1, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = None
    rows = []
    for name, fn in variants(autotune).items():
        row = {"frames": frames, "sp": sp, "tokens": n, "variant": name}
        try:
            out = fn(q, k, v, mask)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            if ref is None:
                ref = (out.detach(), grads)
            else:
                row["err_out"] = round(rel(out, ref[0]), 5)
                row["err_grad"] = round(max(rel(a, b) for a, b in zip(grads, ref[1])), 5)

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(q, k, v, mask)

            def fwd_bwd(fn=fn):
                torch.autograd.grad(fn(q, k, v, mask), (q, k, v), dout)

            t_f = triton.testing.do_bench(fwd, warmup=100, rep=500, return_mode="median")
            t_fb = triton.testing.do_bench(fwd_bwd, warmup=100, rep=1000, return_mode="median")
            row.update({"fwd_ms": round(t_f, 2), "fwd_bwd_ms": round(t_fb, 2),
                        "fwd_tflops": round(fwd_flops / t_f / 1e9, 1),
                        "bwd_tflops": round(2.5 * fwd_flops / (t_fb - t_f) / 1e9, 1),
                        "fwd_bwd_tflops": round(3.5 * fwd_flops / t_fb / 1e9, 1)})
        except Exception as e:  # a kernel that refuses these shapes is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--sp", type=int, nargs="+", default=[1])
    ap.add_argument("--autotune", action="store_true", help="also FlexAttention compiled with max-autotune")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = [r for p in args.sp for f in args.frames for r in measure(f, p, args.autotune)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tf_attention.json").write_text(json.dumps(rows, indent=1))
    print("sp frames tokens  variant          fwd_ms  fwd_bwd_ms  fwd TF/s  bwd TF/s  err_out  err_grad")
    for r in rows:
        if "error" in r:
            print(f"{r['sp']:2} {r['frames']:6} {r['tokens']:6}  {r['variant']:15}  {r['error']}")
        else:
            print(f"{r['sp']:2} {r['frames']:6} {r['tokens']:6}  {r['variant']:15} {r['fwd_ms']:7} "
                  f"{r['fwd_bwd_ms']:10} "
                  f"{r['fwd_tflops']:9} {r['bwd_tflops']:9}  {r.get('err_out', '-')!s:7}  {r.get('err_grad', '-')}")


if __name__ == "__main__":
    main()
