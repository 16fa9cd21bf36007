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
import json
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
# VBench-Long's seconds per clip (it cuts 2 s clips in long_custom_input mode whatever these say, but
# reads them): handed to it as a file, because the 0.1.5 wheel ships without its configs/ folder
CLIP_SECONDS = {**{name: 2.0 for name in DIMENSIONS}, "human_action": 10.0, "temporal_style": 10.0,
                "overall_consistency": 10.0}
# VBench-Long fuses in-clip and clip-to-clip scores for these through configs/ files of its own
NEEDS_LONG_CONFIGS = ("subject_consistency", "background_consistency")
PROBE = ("import json, os, vbench, vbench2_beta_long as long; "
         "print(json.dumps([os.path.dirname(vbench.__file__), "
         "os.path.isfile(os.path.join(os.path.dirname(long.__file__), 'configs', 'slow_fast_params.yaml'))]))")


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


def environment(cfg: VBenchConfig) -> dict[str, str]:
    """Nothing of this project's environment leaks in (no PYTHONPATH: the interpreter's own
    site-packages), the weights come from the cache, and the hubs are offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update({"VBENCH_CACHE_DIR": str(Path(cfg.cache).resolve()), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TORCH_HOME": str(Path(cfg.cache).resolve() / "torch")})
    return env


def command(cfg: VBenchConfig, videos: Path, out: Path, dimensions: list[str], package_dir: str,
            clip_lengths: Path) -> list[str]:
    """VBench-Long's command. Its default prompt-info and clip-length files are missing from the
    0.1.5 wheel, so the one ``vbench`` ships (in ``package_dir``) and ours are named."""
    return [cfg.python, "-m", "vbench2_beta_long.eval_long", "--videos_path", str(videos), "--output_path", str(out),
            "--full_json_dir", str(Path(package_dir) / "VBench_full_info.json"), "--clip_length_config",
            str(clip_lengths), "--mode", "long_custom_input", "--load_ckpt_from_local", "True",
            "--dimension", *dimensions]


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
        env = environment(cfg)
        clip_lengths = Path(tmp) / "clip_lengths.yaml"
        clip_lengths.write_text("".join(f"{k}: {v}\n" for k, v in CLIP_SECONDS.items()))
        try:
            probe = subprocess.run([cfg.python, "-c", PROBE], cwd=tmp, env=env, capture_output=True, text=True,
                                   timeout=300)
            if probe.returncode != 0:
                return {"scores": {}, "aggregate": None, "not_run": {
                    **not_run, "vbench": f"official VBench not run: {cfg.python} cannot import vbench: "
                                         + " | ".join(probe.stderr.strip().splitlines()[-2:])}}
            package_dir, long_configs = json.loads(probe.stdout)
            if not long_configs:
                for name in set(dimensions) & set(NEEDS_LONG_CONFIGS):
                    not_run[name] = ("not run: the installed VBench lacks vbench2_beta_long/configs/ (the 0.1.5 "
                                     "wheel ships without it): install VBench from its source (infra/vbench)")
                dimensions = [d for d in dimensions if d not in NEEDS_LONG_CONFIGS]
                if not dimensions:
                    return {"scores": {}, "aggregate": None, "not_run": not_run}
            cmd = command(cfg, staged, out, dimensions, package_dir, clip_lengths)
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
