"""Official VBench on the generated videos, in its own Python environment, offline.

VBench 0.1.5 pins transformers 4.33.2 and numpy < 2, which this project's environment cannot hold,
so it runs as a subprocess of the environment ``infra/vbench/make_env.sh`` makes (params
``evaluate.vbench.python``), through its own VBench-Long command (``vbench2_beta_long.eval_long``,
mode ``long_custom_input``: it splits each video at its scene cuts into short clips, scores the
clips, and writes ``*_eval_results.json``). Its weights come from a local cache folder
(``evaluate.vbench.cache``, VBench's ``VBENCH_CACHE_DIR`` layout). VBench fetches a missing file
with wget when a dimension starts, so a dimension runs only when every file it needs is already
in the cache; the others are reported missing with the files they lack, never fetched, and never
scored as 0. Our prompt suite is not VBench's, so the semantic dimensions (which need its prompts)
are not run: Quality can be complete, Total cannot.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from longlive_core.config import ConfigError
from longlive_core.evaluate.vbench import DIMENSIONS, QUALITY, aggregate, read_results

# the files each dimension reads from VBench 0.1.5's cache folder (vbench/utils.py init_submodules)
CACHE_FILES = {
    "subject_consistency": ("dino_model/facebookresearch_dino_main/hubconf.py",
                            "dino_model/dino_vitbase16_pretrain.pth"),
    "background_consistency": ("clip_model/ViT-B-32.pt",),
    "temporal_flickering": (),
    "motion_smoothness": ("amt_model/amt-s.pth",),
    "dynamic_degree": ("raft_model/models/raft-things.pth",),
    "aesthetic_quality": ("aesthetic_model/emb_reader/sa_0_4_vit_l_14_linear.pth", "clip_model/ViT-L-14.pt"),
    "imaging_quality": ("pyiqa_model/musiq_spaq_ckpt-358bb6af.pth",),
}
QUALITY_DIMENSIONS = tuple(n for n, d in DIMENSIONS.items() if d.group == QUALITY)


@dataclasses.dataclass(frozen=True)
class VBenchConfig:
    """params ``evaluate.vbench``."""
    python: str | None = None  # the isolated environment's interpreter (infra/vbench/make_env.sh); null: not run
    cache: str | None = None  # VBench's weights, in its VBENCH_CACHE_DIR layout; never downloaded
    dimensions: tuple[str, ...] = QUALITY_DIMENSIONS  # VBench's 7 quality dimensions: its Quality score
    timeout_s: int = 7200

    def validate(self, where: str) -> None:
        unknown = sorted(set(self.dimensions) - set(CACHE_FILES))
        if unknown:
            raise ConfigError(f"{where}.dimensions: {unknown} cannot run on our prompt suite (custom input); "
                              f"choose from {sorted(CACHE_FILES)}")
        if self.timeout_s < 1:
            raise ConfigError(f"{where}.timeout_s must be >= 1")


def plan(cfg: VBenchConfig) -> tuple[list[str], dict[str, str]]:
    """(dimensions to run, {dimension not run: why})."""
    if cfg.python is None:
        return [], {"vbench": "official VBench not run: evaluate.vbench.python is null (make its environment with "
                              "infra/vbench/make_env.sh and set the interpreter's path)"}
    if not Path(cfg.python).is_file():
        return [], {"vbench": f"official VBench not run: {cfg.python} (evaluate.vbench.python) does not exist"}
    if cfg.cache is None or not Path(cfg.cache).is_dir():
        return [], {"vbench": f"official VBench not run: no weights cache at {cfg.cache!r} (evaluate.vbench.cache)"}
    run, missing = [], {}
    for name in cfg.dimensions:
        lacking = [f for f in CACHE_FILES[name] if not (Path(cfg.cache) / f).is_file()]
        if lacking:
            missing[name] = f"not run: the cache lacks {', '.join(lacking)} (VBench would download it)"
        else:
            run.append(name)
    return run, missing


def command(cfg: VBenchConfig, videos: Path, out: Path, dimensions: list[str]) -> tuple[list[str], dict[str, str]]:
    """The VBench-Long command and its environment: nothing of this project's environment leaks in
    (no PYTHONPATH, the interpreter's own site-packages), and the hubs are offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update({"VBENCH_CACHE_DIR": str(Path(cfg.cache).resolve()), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TORCH_HOME": str(Path(cfg.cache).resolve() / "torch")})
    cmd = [cfg.python, "-m", "vbench2_beta_long.eval_long", "--videos_path", str(videos), "--output_path", str(out),
           "--mode", "long_custom_input", "--load_ckpt_from_local", "True", "--dimension", *dimensions]
    return cmd, env


def run_vbench(cfg: VBenchConfig, videos: list[Path]) -> dict:
    """VBench's scores of ``videos`` (mp4 files): {"scores", "aggregate" (Quality/Semantic/Total,
    None where a dimension is missing), "not_run": {what: why}}. The videos are linked into a
    folder of VBench's own, where its clip splitting writes beside them."""
    dimensions, not_run = plan(cfg)
    if not dimensions:
        return {"scores": {}, "aggregate": None, "not_run": not_run or {"vbench": "no dimension to run"}}
    with tempfile.TemporaryDirectory(prefix="vbench-") as tmp:
        out, staged = Path(tmp) / "results", Path(tmp) / "videos"
        out.mkdir()
        staged.mkdir()
        for video in videos:
            try:
                os.link(video, staged / video.name)
            except OSError:  # another file system
                shutil.copyfile(video, staged / video.name)
        cmd, env = command(cfg, staged, out, dimensions)
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            return {"scores": {}, "aggregate": None,
                    "not_run": {**not_run, "vbench": f"official VBench ran past {cfg.timeout_s} s and was stopped"}}
        results = sorted(out.glob("*_eval_results.json"))
        if proc.returncode != 0 or not results:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            return {"scores": {}, "aggregate": None,
                    "not_run": {**not_run, "vbench": f"official VBench failed (exit {proc.returncode}): "
                                                     + " | ".join(tail)}}
        scores = read_results(results)
    return {"scores": scores, "aggregate": aggregate(scores), "not_run": not_run}
