"""Official VBench as a subprocess of its own environment: what runs, what is reported missing and
why, and its results read back. A stand-in interpreter plays VBench's command here (the real one
needs its environment, its weights and a GPU); it checks what VBench would be given."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from longlive_core.config import from_mapping
from longlive_core.evaluate.vbench_run import CACHE_FILES, QUALITY_DIMENSIONS, VBenchConfig, plan, run_vbench

STAND_IN = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[0] == "-c":  # where the vbench package is, and whether VBench-Long has its configs
    print(json.dumps([os.environ["VBENCH_CACHE_DIR"], not os.environ.get("STAND_IN_NO_CONFIGS")]))
    sys.exit(0)
assert args[args.index("--full_json_dir") + 1] == os.environ["VBENCH_CACHE_DIR"] + "/VBench_full_info.json"
assert "human_action: 10.0" in Path(args[args.index("--clip_length_config") + 1]).read_text()
assert args[:2] == ["-m", "vbench2_beta_long.eval_long"] and "long_custom_input" in args, args
assert os.environ["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in os.environ
assert Path(os.environ["VBENCH_CACHE_DIR"]).is_dir()
videos = Path(args[args.index("--videos_path") + 1])
assert sorted(p.name for p in videos.iterdir()) == ["a.mp4", "b.mp4"], list(videos.iterdir())
if os.environ.get("STAND_IN_FAIL"):
    sys.exit("CUDA out of memory")
dims = args[args.index("--dimension") + 1:]
out = Path(args[args.index("--output_path") + 1])
(out / "results_x_eval_results.json").write_text(json.dumps({{d: [0.9, []] for d in dims}}))
"""


def setup(tmp_path, files: set[str] | None = None) -> tuple[VBenchConfig, list[Path]]:
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(0o755)
    cache = tmp_path / "cache"
    for needed in CACHE_FILES.values():
        for f in needed:
            if files is None or f in files:
                (cache / f).parent.mkdir(parents=True, exist_ok=True)
                (cache / f).write_bytes(b"w")
    cache.mkdir(exist_ok=True)
    videos = []
    for name in ("a", "b"):
        videos.append(tmp_path / f"{name}.mp4")
        videos[-1].write_bytes(b"mp4")
    return from_mapping(VBenchConfig, {"python": str(python), "cache": str(cache)}, "evaluate.vbench"), videos


def test_not_configured_or_absent_is_said_never_run(tmp_path):
    assert "evaluate.vbench.python is null" in plan(VBenchConfig())[1]["vbench"]
    assert "does not exist" in plan(VBenchConfig(python=str(tmp_path / "nope")))[1]["vbench"]
    cfg, videos = setup(tmp_path, files={"amt_model/amt-s.pth"})
    run, missing = plan(cfg)
    assert run == ["temporal_flickering", "motion_smoothness"]  # needs nothing / has its one file
    assert "clip_model/ViT-B-32.pt" in missing["background_consistency"] and len(missing) == 5


def test_a_full_cache_runs_the_quality_dimensions_and_reads_their_scores(tmp_path):
    cfg, videos = setup(tmp_path)
    result = run_vbench(cfg, videos)
    assert set(result["scores"]) == set(QUALITY_DIMENSIONS) and not result["not_run"]
    agg = result["aggregate"]
    assert agg["quality"] is not None and agg["semantic"] is None and agg["total"] is None  # never a partial Total
    assert "object_class" in agg["missing"]


def test_a_vbench_without_vbench_longs_configs_runs_the_dimensions_that_do_without(tmp_path, monkeypatch):
    cfg, videos = setup(tmp_path)
    monkeypatch.setenv("STAND_IN_NO_CONFIGS", "1")
    result = run_vbench(cfg, videos)
    assert set(result["not_run"]) == {"subject_consistency", "background_consistency"}
    assert "configs" in result["not_run"]["subject_consistency"] and result["aggregate"]["quality"] is None
    assert set(result["scores"]) == set(QUALITY_DIMENSIONS) - {"subject_consistency", "background_consistency"}


def test_a_failing_vbench_is_reported_with_its_last_words(tmp_path, monkeypatch):
    cfg, videos = setup(tmp_path)
    monkeypatch.setenv("STAND_IN_FAIL", "1")
    result = run_vbench(cfg, videos)
    assert result["aggregate"] is None and "failed (exit 1)" in result["not_run"]["vbench"]
    assert "CUDA out of memory" in result["not_run"]["vbench"]
    assert json.dumps(result)  # goes into scores.json as it is
