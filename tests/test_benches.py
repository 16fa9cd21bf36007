"""The inference benches' code paths on the CPU with their tiny models: bench/generate_product.py's
folders load through the product's own checks and every row reports what bench/RESULTS.md quotes;
bench/vae_decode.py compares each variant with float32; bench/generate_sp_projection.py runs a rank of P;
bench/caption_throughput.py runs the caption stage's generate and reports its row; bench/ac_projection.py
plans the production step from the committed H200 block profile; bench/memory_peak.py finds a recorded
step's peak and what it held; bench/fp8_accumulation.py models FP8 attention's accumulator on a dump."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from longlive_core.models.folder import read_dit_folder

from .conftest import REPO


@pytest.mark.slow
def test_the_product_bench_makes_its_folders_and_reports_each_row(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    bench = [sys.executable, str(REPO / "bench/generate_product.py")]
    root, rows = tmp_path / "root", tmp_path / "rows.jsonl"
    subprocess.run([*bench, "make", str(root), "--tiny", "--w4a4"], check=True, env=env, cwd=tmp_path,
                   capture_output=True)
    dit, w4a4 = read_dit_folder(root / "dit"), read_dit_folder(root / "w4a4")
    assert (dit.format, w4a4.format) == ("longlive-dit", "longlive-w4a4") and dit.vae.sha256 == w4a4.vae.sha256
    assert (dit.sampling.window, dit.sampling.global_sink) == (6, 2)  # the tiny stand-in for 32 with sinks 8 + 8
    assert (tmp_path / "cache/longlive/weights_sha256.json").is_file()  # a user's later runs read no weights again
    tiles = tmp_path / "tiles.json"  # as bench/nvfp4_quant.py --best-out writes them (older files lack FOS_TILE)
    tiles.write_text(json.dumps({"TILE": {"BM": 32}, "SLICE_TILE": {}, "FOS_TILE": {"BM": 32, "num_warps": 4}}))
    proc = subprocess.run([*bench, "run", str(root), "--tiny", "--model", "w4a4", "--rows", "nvfp4:4,bf16:2", "--json",
                           str(rows), "--profile-chunks", "2", "--host-profile-chunks", "2",
                           "--quant-tiles", str(tiles)], check=True, env=env, cwd=tmp_path, capture_output=True,
                          text=True)
    assert "4/6 rows {'BM': 32, 'BK': 128, 'num_warps': 4}" in proc.stdout  # not the library's 16x128, 8 warps
    assert proc.stdout.count("# profile: ") == 2 and proc.stdout.count("  kernels: ") == 2  # one a row
    assert proc.stdout.count("# host profile: ") == 2 and proc.stdout.count("library's functions, cumulative") == 2
    assert proc.stdout.count("warm-up again: ") == 1  # the bf16 row's cache is new to the process
    got = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r["kv"], r["steps"], r.get("warmup", False)) for r in got] == [("nvfp4", 4, True), ("nvfp4", 4, False),
                                                                             ("bf16", 2, False)]
    # the warm-up fills the window and rolls it (4 chunks of a 6-frame window of 2-frame chunks), then a shot more
    assert {r["recipe"] for r in got} == {"nvfp4"} and got[0]["frames"] > got[1]["frames"] == got[2]["frames"]
    assert got[0]["first_frame_from_process_s"] > got[0]["load_s"] > 0
    assert all(r["end_to_end_fps"] > 0 and r["first_frame_after_prompt_s"] < r["first_frame_s"] for r in got)
    assert all(0 < r["call_fps"] < r["end_to_end_fps"] for r in got)  # the call embeds the prompts too


def test_the_vae_decode_bench_compares_its_variants_with_float32():
    proc = subprocess.run([sys.executable, str(REPO / "bench/vae_decode.py"), "--tiny", "--device", "cpu", "--chunks",
                           "2", "--variants", "bf16,bf16-cl-sp-f2", "--content", "demo", "--profile"],
                          capture_output=True, text=True, cwd=REPO, check=True)
    assert "latents: demo" in proc.stdout  # a demo shot encoded by the same VAE
    assert proc.stdout.count("  kernels: ") == 2  # a steady chunk profiled per variant (no device kernels on the CPU)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("bf16")]
    assert [r.split(":")[0] for r in rows] == ["bf16", "bf16-cl-sp-f2"]  # -f2: two latent frames per decoder call
    assert "upsamplings sub-pixel" not in rows[0] and "; 3 upsamplings sub-pixel" in rows[1]  # -sp: the decoder's 3
    assert all("PSNR" in r and "FPS" in r for r in rows)


def test_the_sequence_parallel_projection_runs_a_rank_of_p_on_one_device():
    proc = subprocess.run([sys.executable, str(REPO / "bench/generate_sp_projection.py"), "--tiny", "--device", "cpu",
                           "--sp", "1", "2", "--chunks", "4"], capture_output=True, text=True, cwd=REPO, check=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("P = ")]
    assert [r.split(":")[0] for r in rows] == ["P = 1", "P = 2"]
    assert all("projected" in r and "exchange" in r for r in rows)
    assert "exchange 0.0 ms (0.00 GB)" in rows[0]  # one rank exchanges nothing


def test_the_checkpointing_projection_plans_production_from_the_committed_h200_profile():
    """bench/ac_projection.py as RESULTS.md runs it: every plan within its limit, between full's MFU and
    no recomputation's, more memory never slower; the profile's own shape planned beside."""
    proc = subprocess.run([sys.executable, str(REPO / "bench/ac_projection.py"), "--memory-gb", "186", "141"],
                          capture_output=True, text=True, cwd=REPO, check=True, env={"PYTHONPATH": str(REPO)})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    gb200, h200, *checks = rows
    assert (gb200["memory_gb"], gb200["blocks"], gb200["tokens_per_rank"]) == (186.0, 30, 42240)
    assert [c["check_limit_gib"] for c in checks] == [47.0, 65.0] and checks[0]["tokens_per_rank"] == 56320
    for r in rows:
        assert r["floor_gib"] < r["predicted_peak_gib"] <= r["limit_gib"]
        assert r["full_mfu"] < r["mfu_low"] <= r["mfu_high"] <= 0.516
    assert gb200["mfu_low"] >= h200["mfu_low"] and gb200["kept_gib"] > h200["kept_gib"]
    assert "a projection, not a measurement" in proc.stdout


def test_the_caption_bench_runs_the_stage_generate_and_reports_its_row(tmp_path):
    rows = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "bench/caption_throughput.py"), "--tiny", "--repeats", "1",
                           "--json", str(rows)], capture_output=True, text=True, cwd=REPO, check=True)
    row = json.loads(rows.read_text())
    assert 8.2e9 < row["parameters_7b"] < 8.4e9  # the 7B architecture's dims build (on the meta device)
    assert (row["batch_size"], row["max_new_tokens"], row["frames"]) == (4, 24, 4)  # params.yaml's caption
    assert row["captions_per_s"] > 0 and row["output_tokens_per_s"] > 0 and row["prompt_tokens"] > 0
    assert row["gpu_h"] == pytest.approx(row["shots_gpu_h"] + row["subjects_gpu_h"], abs=0.11)
    assert row["rates_variant"] == "bs4-4f-24tok"
    assert "| 4 | 24 |" in proc.stdout


def test_the_memory_peak_replays_the_trace_to_its_peak_and_names_what_it_held():
    from bench.memory_peak import peak_allocations

    ours = [{"filename": "/x/longlive_core/models/wan_dit.py", "line": 7, "name": "forward"}]
    theirs = [{"filename": "/torch/nn/functional.py", "line": 1, "name": "linear"}]
    snapshot = {  # at the end: a (allocated before recording, no stack) and d (ours) are live
        "segments": [{"device": 0, "blocks": [{"address": 0, "size": 100, "state": "active_allocated", "frames": []},
                                              {"address": 300, "size": 40, "state": "active_allocated",
                                               "frames": ours},
                                              {"address": 400, "size": 999, "state": "inactive"}]}],
        "device_traces": [[{"action": "alloc", "addr": 100, "size": 50, "frames": ours},
                           {"action": "alloc", "addr": 200, "size": 70, "frames": theirs},
                           {"action": "free_requested", "addr": 100, "size": 50, "frames": ours},
                           {"action": "free_completed", "addr": 100, "size": 50, "frames": ours},
                           {"action": "alloc", "addr": 300, "size": 40, "frames": ours},
                           {"action": "free_completed", "addr": 200, "size": 70, "frames": theirs}]]}
    report = peak_allocations(snapshot)
    assert report["peak_gib"] * 2**30 == 220  # a, b and c at once
    held = {row["where"]: row["bytes"] for row in report["at_peak"]}
    assert held == {"before recording": 100, "outside this project": 70,
                    "longlive_core/models/wan_dit.py:7 forward": 50}
    assert report["peak_made_by"] == ["torch/nn/functional.py:1 linear"]  # b's allocation made the peak


def test_the_fp8_accumulation_model_reads_a_dump_and_finds_the_offset_that_the_accumulator_loses(tmp_path):
    """A dump as bench/fp8_attention_layers.py --dump writes it (split over two files, as the device tool
    brings them back), of a head whose V shares an offset under near-uniform attention, the kernel's output
    standing in as half of BF16's: the modelled accumulator is far off float64 where V is not smoothed,
    and smoothing V brings it back."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 1, 32, 64, generator=g) * 0.05).to(torch.bfloat16)
    k = torch.randn(1, 1, 4096, 64, generator=g).to(torch.bfloat16)
    v = (torch.randn(1, 1, 4096, 64, generator=g) + 2 * torch.randn(1, 1, 1, 64, generator=g)).to(torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(torch.bfloat16)
    amax = torch.stack([q.float().abs().amax(), (k.float() - k.float().mean(2, keepdim=True)).abs().amax(),
                        v.float().abs().amax()])
    save_file({"q": q, "bf16": out, "fp8": (out.float() / 2).to(torch.bfloat16), "amax": amax}, tmp_path / "a.st")
    save_file({"k": k, "v": v}, tmp_path / "b.st")
    result = subprocess.run([sys.executable, str(REPO / "bench/fp8_accumulation.py"), str(tmp_path / "a.st"),
                             str(tmp_path / "b.st"), "--queries", "8", "--bits", "10"],
                            check=True, capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): float(line.split("|")[3])
            for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| model")}
    assert rows[("exact sums", "no")] < 0.05 and rows[("exact sums", "yes")] < 0.05
    assert rows[("10-bit accumulator, 32 keys a step", "no")] > 0.2  # 4,096 offset rows outgrow 10 bits
    assert rows[("10-bit accumulator, 32 keys a step", "yes")] < 0.05


def test_a_profiles_kernels_fall_each_in_the_first_group_naming_them(capsys):
    """The product bench's profile shares: cuDNN's attention (named "..._sdpa_..._fprop_...") counted as
    attention, a cuDNN convolution (an implicit GEMM) as a convolution, an FP8 GEMM (named for E4M3) as a
    GEMM, a compiled Triton kernel fused around a convolution as Triton, and the groups with "other" adding
    up to the device time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.generate_product import KERNEL_GROUPS
    from bench.gpu_setup import print_kernels

    def kernel(key, us):
        return SimpleNamespace(key=key, device_time_total=us, count=1, device_type=DeviceType.CUDA)

    events = [kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 2000),
              kernel("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", 4000),
              kernel("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", 1000),
              kernel("nvjet_tst_128x256_h_bz_coopA_NNT", 2000), kernel("_dequantize_rows", 1000),
              kernel("void at::native::elementwise_kernel", 1000),
              kernel("triton_poi_fused_convolution_constant_pad_nd_3", 1000),
              SimpleNamespace(key="aten::mm", device_time_total=3000, count=1, device_type=DeviceType.CPU)]
    print_kernels(SimpleNamespace(key_averages=lambda: events), 2, KERNEL_GROUPS)
    head = capsys.readouterr().out.splitlines()[0]
    assert head == ("  kernels: 12 ms of device time, Triton (compiled) 8% (1 ms), attention 17% (2 ms), "
                    "convolutions 33% (4 ms), GEMMs 25% (3 ms), quantization 8% (1 ms), copies 0% (0 ms), "
                    "other 8% (1 ms)"), head
