"""Compile the NVFP4 Triton kernels for sm_90 on any machine (no GPU needed) and count what costs:
layout conversions (shared-memory round trips) in the TTGIR, PTX instructions per element, registers a
thread (and the programs an SM they allow), and the SASS instructions on the main path (up to the
last EXIT, so not the IEEE division's slow path) per element, split by the pipe they run on, with
the most frequent opcodes. The block kernel's codes
take one of two branches on S_enc (iteration 10: a +0.0 per element where products could underflow);
the main path counts both, so it overstates the branch the benches take (RHT codes: 21.8 printed,
19.9 on that branch). The RHT codes kernel
tracked the SASS figure in iterations 4-5 (0.074 -> 0.062 ms for 902 -> 768 instructions) but not in
iteration 8, where 0.2-0.8 fewer per element moved it by -1.5 to +2 us: a count is a lead, the GPU
decides (bench/RESULTS.md).

    .venv/bin/python bench/tools/kernel_asm.py [--out DIR]   # also writes the .ttgir/.ptx there

Pointers get 16-byte divisibility hints as the runtime gives them for fresh tensors; without them
the PTX would be misleadingly slow (scalar loads). The KV cache's window kernels (infer/kv_attention.py)
are counted too, their token counts and rows hinted as multiples of 16 as they are at 704x1280
(7,040 tokens a chunk), and the runtime then specializes them.
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

from longlive_core.infer import kv_attention as kv
from longlive_core.quant import triton_kernels as tk

ALIGNED = ("x_ptr", "codes_ptr", "scales_ptr", "part_ptr", "sxm", "M", "K", "spm")


def compile_kernel(fn, pointers: dict, constexprs: dict, num_warps: int, aligned: tuple[str, ...] = ALIGNED):
    names = fn.arg_names
    sig = {n: "i32" for n in names}
    sig.update(pointers)
    sig.update({k: "constexpr" for k in constexprs})
    idx = {n: i for i, n in enumerate(names)}
    attrs = {(idx[n],): [["tt.divisibility", 16]] for n in aligned if n in idx and n not in constexprs}
    src = ASTSource(fn, sig, {(idx[k],): v for k, v in constexprs.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False, "num_warps": num_warps})


def cases():
    f32, u8 = "*fp32", "*u8"
    # (name, use, RHT, AMAX_ONLY, TILE2D)
    for name, use, rht, amax_only, tile2d in (("blocks rht=False amax_only=False", "codes", False, False, False),
                                              ("blocks rht=False amax_only=True", "amaxes", False, True, False),
                                              ("blocks rht=True amax_only=False", "codes_rht", True, False, False),
                                              ("blocks rht=True amax_only=True", "amaxes", True, True, False),
                                              ("blocks 16x16 rht=False", "codes_16x16", False, False, True)):
        b = tk.BLOCK_TILES[use]
        yield (name, tk._block_kernel,
               {"x_ptr": "*bf16", "amax_ptr": f32, "codes_ptr": "*i64", "scales_ptr": u8,
                "max_ptr": "*i32" if amax_only else f32, "plain_max_ptr": "*i32" if amax_only else f32},
               dict(SCALE6=2688.0, BM=b["BM"], G=b["G"], RHT=rht, IS_BF16=True, AMAX_ONLY=amax_only, TILE2D=tile2d),
               b["num_warps"], b["BM"] * b["G"] * 16)
    for rht, fos in ((False, None), (True, None), (False, "mse")):  # mse: the NVFP4 KV cache's writes (4/6 scales)
        t = tk.FOS_TILE if fos else tk.TILE
        yield (f"rows codes rht={rht}" + (f" four_over_six={fos}" if fos else ""), tk._quant_kernel,
               {"x_ptr": "*bf16", "signs_ptr": f32, "amax_ptr": f32, "codes_ptr": u8, "scales_ptr": u8,
                "part_ptr": "*bf16", "dec_ptr": f32, "times_ptr": f32, "seed_ptr": "*i32"},
               dict(SCALE6=(tk.FOUR_OVER_SIX_E4M3_MAX if fos else 448.0) * 6.0, BM=t["BM"], BK=t["BK"], TILE2D=False,
                    RHT=rht, IS_BF16=True, SR=False, FOS=tk.FOS_CODES[fos],
                    WRITE_CODES=True, WRITE_PARTIAL=False, WRITE_DEC=False, TIMES=False, sxk=1),
               t["num_warps"], t["BM"] * t["BK"])
    s = tk.SLICE_TILE
    yield ("slices partial transposed RHT SR", tk._slice_kernel,
           {"x_ptr": "*bf16", "amax_ptr": f32, "codes_ptr": u8, "scales_ptr": u8, "part_ptr": "*bf16",
            "dec_ptr": f32, "times_ptr": f32, "max_ptr": f32, "plain_max_ptr": f32, "seed_ptr": "*i32"},
           dict(SCALE6=2688.0, BM=s["BM"], G=s["G"], RHT=True, IS_BF16=True, SR=True, WRITE_CODES=False,
                WRITE_PARTIAL=True, WRITE_DEC=True, TIMES=False, AMAX_ONLY=False),
           s["num_warps"], s["BM"] * s["G"] * 16)


def window_cases():
    """The KV cache's window kernels as ``kv_attention.window`` launches them (64 tokens a program, 4 warps)."""
    rows = ("N", "row0", "out_tokens")
    yield ("kv window nvfp4", kv._dequantize_rows, {"C": "*i32", "S": "*u8", "E": "*fp32", "Out": "*bf16"},
           dict(D=128, BN=kv.BLOCK_N), 4, kv.BLOCK_N * 128, ("C", "S", "E", "Out") + rows)
    yield ("kv window fp8", kv._dequantize_fp8_rows, {"C": "*u8", "S": "*fp32", "Out": "*bf16"},
           dict(D=128, BN=kv.BLOCK_N, CONVERT=True), 4, kv.BLOCK_N * 128, ("C", "S", "Out") + rows)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's ``flag`` listing of a cubin (cuobjdump ships with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def registers(cubin: bytes, warps: int) -> tuple[int, int, int]:
    """(registers a thread, spill stack bytes, programs an SM the register file allows: 64K registers,
    allocated 8 a thread at a time, at most 64 warps; shared memory not counted). The 4/6 row kernel at
    32 elements a thread used 208 registers, two programs of 4 warps an SM, and moved about 0.2 TB/s
    (bench/RESULTS.md)."""
    reg, stack = map(int, re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(cubin, "-res-usage")).groups())
    return reg, stack, min(65536 // (-(-reg // 8) * 8 * 32 * warps), 64 // warps)


def sass_main_path(cubin: bytes) -> list[str]:
    """The SASS instructions up to the last EXIT."""
    sass = cuobjdump(cubin, "-sass")
    ins = [line.split("*/")[1].strip() for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    last_exit = max(i for i, line in enumerate(ins) if "EXIT" in line)
    return ins[:last_exit + 1]


# the sm_90 pipes I take the opcodes to run on (my reading of the architecture, not a measurement): the
# integer/compare pipe takes 2 cycles per warp instruction per SMSP, the FMA pipe 1 (bench/RESULTS.md, iteration 8)
INT_PIPE = {"FMNMX", "FSETP", "LOP3", "SHF", "IADD3", "LEA", "ISETP", "SEL", "FSEL", "PRMT", "HMNMX2", "VIADD",
            "F2FP", "FCHK", "IMNMX", "VIMNMX"}
FMA_PIPE = {"FFMA", "FADD", "FMUL", "IMAD", "HFMA2", "HADD2", "HMUL2"}


def opcode(instruction: str) -> str:
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0].rstrip(";")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    print("| kernel | convert_layouts | PTX instructions | per element | SASS main path | per element | "
          "integer/compare pipe per element | FMA pipe per element | registers a thread (spill bytes) | "
          "programs an SM | top opcodes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, fn, pointers, constexprs, warps, elements, *aligned in (*cases(), *window_cases()):
        k = compile_kernel(fn, pointers, constexprs, warps, *aligned)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        instructions = sum(1 for line in ptx.splitlines() if re.match(r"\s+[a-z]", line))
        per_element = instructions * warps * 32 / elements
        sass = sass_main_path(k.asm["cubin"])
        counts = collections.Counter(map(opcode, sass))
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(6))
        per_sass = warps * 32 / elements
        int_pipe = sum(n for op, n in counts.items() if op in INT_PIPE) * per_sass
        fma_pipe = sum(n for op, n in counts.items() if op in FMA_PIPE) * per_sass
        reg, stack, programs = registers(k.asm["cubin"], warps)
        print(f"| {name} | {ttgir.count('convert_layout')} | {instructions} | {per_element:.1f} | {len(sass)} | "
              f"{len(sass) * per_sass:.1f} | {int_pipe:.1f} | {fma_pipe:.1f} | {reg} ({stack}) | {programs} | {top} |")
        if args.out:
            stem = Path(args.out) / re.sub(r"[^a-z0-9]+", "_", name.lower())
            stem.parent.mkdir(parents=True, exist_ok=True)
            stem.with_suffix(".ttgir").write_text(ttgir)
            stem.with_suffix(".ptx").write_text(ptx)


if __name__ == "__main__":
    main()
