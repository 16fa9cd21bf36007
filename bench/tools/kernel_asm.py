"""Compile the NVFP4 Triton kernels for sm_90 on any machine (no GPU needed) and count what costs:
layout conversions (shared-memory round trips) in the TTGIR, PTX instructions per element, and the
SASS instructions on the main path (up to the last EXIT, so not the IEEE division's slow path) per
element, with the most frequent opcodes. The kernels that are issue-bound on the H200 (the RHT
codes) track the SASS figure: session 4 measured 0.074 -> 0.072 ms for 902 -> 885, session 5
0.0705 -> 0.0638 -> 0.062 ms for 885 -> 781 -> 768 (time falls a little less than the count).

    .venv/bin/python bench/tools/kernel_asm.py [--out DIR]   # also writes the .ttgir/.ptx there

Pointers get 16-byte divisibility hints as the runtime gives them for fresh tensors; without them
the PTX would be misleadingly slow (scalar loads).
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from longlive_core.quant import triton_kernels as tk

ALIGNED = ("x_ptr", "codes_ptr", "scales_ptr", "part_ptr", "sxm", "M", "K", "spm")


def compile_kernel(fn, pointers: dict, constexprs: dict, num_warps: int):
    names = fn.arg_names
    sig = {n: "i32" for n in names}
    sig.update(pointers)
    sig.update({k: "constexpr" for k in constexprs})
    idx = {n: i for i, n in enumerate(names)}
    attrs = {(idx[n],): [["tt.divisibility", 16]] for n in ALIGNED if n in idx and n not in constexprs}
    src = ASTSource(fn, sig, {(idx[k],): v for k, v in constexprs.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False, "num_warps": num_warps})


def cases():
    f32, u8 = "*fp32", "*u8"
    for rht in (False, True):
        for amax_only in (False, True):
            b = tk.BLOCK_TILES["amaxes" if amax_only else "codes_rht" if rht else "codes"]
            yield (f"blocks rht={rht} amax_only={amax_only}", tk._block_kernel,
                   {"x_ptr": "*bf16", "amax_ptr": f32, "codes_ptr": "*i32", "scales_ptr": u8,
                    "max_ptr": "*i32" if amax_only else f32, "plain_max_ptr": "*i32" if amax_only else f32},
                   dict(SCALE6=2688.0, BM=b["BM"], G=b["G"], RHT=rht, IS_BF16=True, AMAX_ONLY=amax_only),
                   b["num_warps"], b["BM"] * b["G"] * 16)
    t = tk.TILE
    for rht in (False, True):
        yield (f"rows codes rht={rht}", tk._quant_kernel,
               {"x_ptr": "*bf16", "signs_ptr": f32, "amax_ptr": f32, "codes_ptr": u8, "scales_ptr": u8,
                "part_ptr": "*bf16", "dec_ptr": f32, "times_ptr": f32, "seed_ptr": "*i32"},
               dict(SCALE6=2688.0, BM=t["BM"], BK=t["BK"], TILE2D=False, RHT=rht, IS_BF16=True, SR=False, FOS=0,
                    WRITE_CODES=True, WRITE_PARTIAL=False, WRITE_DEC=False, TIMES=False, sxk=1),
               t["num_warps"], t["BM"] * t["BK"])
    s = tk.SLICE_TILE
    yield ("slices partial transposed RHT SR", tk._slice_kernel,
           {"x_ptr": "*bf16", "amax_ptr": f32, "codes_ptr": u8, "scales_ptr": u8, "part_ptr": "*bf16",
            "dec_ptr": f32, "times_ptr": f32, "max_ptr": f32, "plain_max_ptr": f32, "seed_ptr": "*i32"},
           dict(SCALE6=2688.0, BM=s["BM"], G=s["G"], RHT=True, IS_BF16=True, SR=True, WRITE_CODES=False,
                WRITE_PARTIAL=True, WRITE_DEC=True, TIMES=False, AMAX_ONLY=False),
           s["num_warps"], s["BM"] * s["G"] * 16)


def sass_main_path(cubin: bytes) -> list[str]:
    """The SASS instructions up to the last EXIT (cuobjdump ships with Triton)."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = [line.split("*/")[1].strip() for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    last_exit = max(i for i, line in enumerate(ins) if "EXIT" in line)
    return ins[:last_exit + 1]


def opcode(instruction: str) -> str:
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0].rstrip(";")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    print("| kernel | convert_layouts | PTX instructions | per element | SASS main path | per element | top opcodes |")
    print("|---|---|---|---|---|---|---|")
    for name, fn, pointers, constexprs, warps, elements in cases():
        k = compile_kernel(fn, pointers, constexprs, warps)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        instructions = sum(1 for line in ptx.splitlines() if re.match(r"\s+[a-z]", line))
        per_element = instructions * warps * 32 / elements
        sass = sass_main_path(k.asm["cubin"])
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(map(opcode, sass)).most_common(6))
        print(f"| {name} | {ttgir.count('convert_layout')} | {instructions} | {per_element:.1f} | {len(sass)} | "
              f"{len(sass) * warps * 32 / elements:.1f} | {top} |")
        if args.out:
            stem = Path(args.out) / re.sub(r"[^a-z0-9]+", "_", name.lower())
            stem.parent.mkdir(parents=True, exist_ok=True)
            stem.with_suffix(".ttgir").write_text(ttgir)
            stem.with_suffix(".ptx").write_text(ptx)


if __name__ == "__main__":
    main()
