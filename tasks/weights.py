"""DVC stage `weights`: the content digest of every pretrained weight a stage reads, one file per
reading stage in data/weights/. DVC cannot see a weights file replaced at the same path (a path in
params names it, not a dependency), so this stage runs on every `dvc repro` and rewrites a file
only when its digests changed: the stage that depends on it reruns then, and its caches, keyed
by the same digests, redo their work. Unchanged weights cost a stat per file (models/weights.py)."""
from __future__ import annotations

import dataclasses
import json

from longlive_core.config import stage_config
from longlive_core.io.atomic import write_json
from longlive_core.iqa.metrics import IQAConfig
from longlive_core.latents.encode import EncodeLatentsConfig
from longlive_core.models.weights import weights_identity
from tasks.paths import WEIGHTS
from tasks.stage import main_for


@dataclasses.dataclass(frozen=True)
class Prepared:
    paths: dict[str, dict[str, str]]  # reading stage -> {param: weights path}


def prepare(params) -> Prepared:
    iqa = stage_config(IQAConfig, "iqa_filter", params)
    enc = stage_config(EncodeLatentsConfig, "encode_latents", params)
    return Prepared({
        "iqa_filter": {"maniqa_checkpoint": iqa.maniqa_checkpoint} if iqa.metric == "maniqa" else {},
        "encode_latents": {"vae": enc.vae, "text_encoder": enc.text_encoder},
    })


def body(p: Prepared, run):
    changed = 0
    for stage, paths in p.paths.items():
        ids = {param: {"path": str(path), "sha256": weights_identity(path)} for param, path in paths.items()}
        target = WEIGHTS / f"{stage}.json"
        changed += not target.is_file() or json.loads(target.read_text()) != {"weights": ids}
        write_json({"weights": ids}, target)  # the same bytes when nothing changed: DVC reruns nothing
        run.set_tags({f"weights.{stage}.{param}": v["sha256"] for param, v in ids.items()})
    return {"stages": len(p.paths), "files_changed": changed,
            "weights": sum(1 for paths in p.paths.values() for path in paths.values() if path != "tiny")}


def one_line(s) -> str:
    return f"{s['weights']} weights on disk for {s['stages']} stages; {s['files_changed']} identity file(s) changed"


def main() -> None:
    main_for("weights", prepare, body, one_line)


if __name__ == "__main__":
    main()
