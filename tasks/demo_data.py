"""DVC stage `demo_data`: makes the demo's raw videos (see longlive_core.data.demo)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from longlive_core.config import stage_config
from longlive_core.data.demo import DemoDataConfig, make_demo_data
from longlive_core.tracking.lineage import digest_json
from tasks.stage import main_for

RAW_DIR = Path("data/demo/raw")
TRUTH = Path("data/demo/truth.json")


def prepare(params) -> DemoDataConfig:
    return stage_config(DemoDataConfig, "demo_data", params)


def body(cfg: DemoDataConfig, run):
    run.set_tags({"input.params.sha256": digest_json(dataclasses.asdict(cfg))})
    truth = make_demo_data(cfg, RAW_DIR, TRUTH)
    n_files = sum(1 for p in RAW_DIR.rglob("*") if p.is_file())
    summary = {"enabled": cfg.enabled, "videos": len(truth["videos"]), "files": n_files,
               "frames": sum(v["num_frames"] for v in truth["videos"]),
               "cuts": sum(len(v["cut_frames"]) for v in truth["videos"])}
    run.log_metrics({k: v for k, v in summary.items() if k != "enabled"})
    run.log_artifact(TRUTH)
    return summary


def one_line(s) -> str:
    if not s["enabled"]:
        return "disabled (demo_data.enabled: false): no demo videos written"
    return f"{s['videos']} videos with {s['cuts']} known cuts, {s['files']} files in {RAW_DIR}"


def main() -> None:
    main_for("demo_data", prepare, body, one_line)


if __name__ == "__main__":
    main()
