"""DVC stage `weights`: the content digest of every pretrained weight a stage reads, one file per
reading stage in data/weights/. DVC cannot see a weights file replaced at the same path (a path in
params names it, not a dependency), so this stage runs on every `dvc repro` and rewrites a file
only when its digests changed: the stage that depends on it reruns then, and its caches, keyed
by the same digests, redo their work. Unchanged weights cost a stat per file (models/weights.py).

It reads only the weight paths: whether the rest of a stage's params are right is that stage's
own check, so curation runs on a machine that lacks the latent encoders' weights. A path with
nothing there is recorded as missing; the stage that reads it stops with its own message."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from longlive_core.config import ConfigError
from longlive_core.io.atomic import write_json
from longlive_core.models.weights import weights_identity
from tasks.paths import WEIGHTS
from tasks.stage import main_for

# the params, per reading stage, that name weights ("tiny": the built-in random models, no file);
# a dotted key is nested (evaluate.weights.musiq)
WEIGHT_PARAMS = {"iqa_filter": ("maniqa_checkpoint",), "caption": ("model",), "encode_latents": ("vae", "text_encoder"),
                 "train_ar": ("init",),
                 "evaluate": ("weights.musiq", "weights.dino", "weights.i3d", "weights.fvd_reference", "vbench.cache")}
OPTIONAL = {"evaluate"}  # stages whose weights may be null: the metric is skipped, and the scores say so


@dataclasses.dataclass(frozen=True)
class Prepared:
    paths: dict[str, dict[str, str]]  # reading stage -> {param: weights path}


def prepare(params) -> Prepared:
    paths: dict[str, dict[str, str]] = {}
    for stage, keys in WEIGHT_PARAMS.items():
        section = params.get(stage) or {}
        if stage == "iqa_filter" and section.get("metric") != "maniqa":
            keys = ()  # only MANIQA has weights
        paths[stage] = {}
        for key in keys:
            value = section
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is None and stage in OPTIONAL:
                continue
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{stage}.{key} must name the weights' path, got {value!r}")
            paths[stage][key] = value
    generate = params.get("generate") or {}
    if generate.get("enhance"):  # evaluate's videos then start from the enhancement model's rewrites
        value = generate.get("enhance_model")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"generate.enhance_model must name the weights' path, got {value!r}")
        paths["evaluate"]["generate.enhance_model"] = value
    return Prepared(paths)


def body(p: Prepared, run):
    changed = 0
    for stage, paths in p.paths.items():
        ids = {param: {"path": path, "sha256": weights_identity(path) if _present(path) else "missing"}
               for param, path in paths.items()}
        target = WEIGHTS / f"{stage}.json"
        changed += not target.is_file() or json.loads(target.read_text()) != {"weights": ids}
        write_json({"weights": ids}, target)  # the same bytes when nothing changed: DVC reruns nothing
        run.set_tags({f"weights.{stage}.{param}": v["sha256"] for param, v in ids.items()})
    return {"stages": len(p.paths), "files_changed": changed,
            "weights": sum(1 for paths in p.paths.values() for path in paths.values()
                           if path != "tiny" and _present(path))}


def _present(path: str) -> bool:
    return path == "tiny" or Path(path).is_file() or (Path(path).is_dir() and any(Path(path).iterdir()))


def one_line(s) -> str:
    return f"{s['weights']} weights on disk for {s['stages']} stages; {s['files_changed']} identity file(s) changed"


def main() -> None:
    main_for("weights", prepare, body, one_line)


if __name__ == "__main__":
    main()
