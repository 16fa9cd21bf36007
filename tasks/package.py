"""DVC stage `package`: models/w4a4/ + models/dmd/ + reports/evaluate/scores.json -> dist/, the model
bundle: the W4A4 model, the LoRA, the params each stage of the chain ran with (configs/<stage>.yaml,
from reports/<stage>/params.yaml), with ``package.include_encoders`` the VAE and the text encoder
(encoders/, checked against the model's digests), a model card with the evaluation and the lineage,
VERSION (git describe + the weights' digest) and SHA256SUMS, verified after writing; published to
``package.s3_uri``/<version>/ when set (never over an existing version) and registered in the MLflow
model registry (alias candidate; champion only when evaluate's verdict passed)."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from longlive_core.config import ConfigError, stage_config
from longlive_core.evaluate.verdict import SETTINGS_TAG
from longlive_core.models.folder import read_adapter_folder, read_dit_folder
from longlive_core.package.config import PackageConfig
from tasks.paths import DIST, DMD_MODEL, EVALUATE_SCORES, W4A4_IDENTITY, W4A4_MODEL
from tasks.stage import main_for, params_path, report_path

STAGE = "package"
log = logging.getLogger(f"stage.{STAGE}")
LINEAGE_STAGES = ("encode_latents", "train_ar", "distill_dmd", "merge_w4a4", "evaluate")
# whose params go into configs/: the stages that made the model and judged it. The curation stages'
# params describe the data, which the latents' DVC hashes in the lineage identify, and are mostly where
# and how fast (sources, caches, workers, executors): bundling them would rerun package on such edits.
CONFIG_STAGES = LINEAGE_STAGES


@dataclasses.dataclass(frozen=True)
class Prepared:
    cfg: PackageConfig
    registered_model: str


def prepare(params: dict[str, Any]) -> Prepared:
    cfg = stage_config(PackageConfig, STAGE, params)
    read_dit_folder(W4A4_MODEL, "merge_w4a4")
    read_adapter_folder(DMD_MODEL, "distill_dmd")
    if not EVALUATE_SCORES.is_file():
        raise ConfigError(f"{EVALUATE_SCORES} is missing: run evaluate first (dvc repro evaluate)")
    for stage in CONFIG_STAGES:
        if not params_path(stage).is_file():
            raise ConfigError(f"{params_path(stage)} is missing (the params {stage} ran with, for the bundle's "
                              f"configs/): rerun it (dvc repro {stage})")
    return Prepared(cfg, params.get("evaluate", {}).get("registered_model", "longlive-2.0"))


def lineage() -> dict:
    from longlive_core.tracking.lineage import dvc_out_hashes, git_describe, git_state

    runs = {}
    for stage in LINEAGE_STAGES:
        path = report_path(stage)
        runs[stage] = json.loads(path.read_text()).get("mlflow_run_id") if path.is_file() else None
    return {**git_state("."), "git.describe": git_describe("."), "dvc.outs.md5": dvc_out_hashes("dvc.lock",
            LINEAGE_STAGES), "mlflow.run_ids": runs}


def body(p: Prepared, run) -> dict:
    from longlive_core.data.s3_mirror import s3_client
    from longlive_core.infer.model_folder import W4A4_WEIGHTS
    from longlive_core.io.atomic import atomic_dir
    from longlive_core.models.folder import write_config
    from longlive_core.models.identity import identity_digest
    from longlive_core.models.weights import MEMO
    from longlive_core.package.bundle import VERSION, file_sha256, upload, verify_dir, write_sums
    from longlive_core.package.card import model_card
    from longlive_core.package.config import promotion
    from longlive_core.package.encoders import MODEL, bundle_encoders, verify_bundle_encoders
    from longlive_core.tracking.mlflow_run import RegistryError

    scores = json.loads(EVALUATE_SCORES.read_text())
    model_config = read_dit_folder(W4A4_MODEL, "merge_w4a4")
    origin = lineage()
    version = f"{origin['git.describe']}-w{file_sha256(W4A4_MODEL / W4A4_WEIGHTS)[:12]}"
    with atomic_dir(DIST) as staging:
        shutil.copytree(W4A4_MODEL, staging / MODEL)
        shutil.copytree(DMD_MODEL, staging / "lora")
        (staging / "configs").mkdir()
        for stage in CONFIG_STAGES:
            shutil.copyfile(params_path(stage), staging / f"configs/{stage}.yaml")
        if p.cfg.include_encoders:  # the training repository's digest memo: the weights stage has read them
            model_config = bundle_encoders(model_config, W4A4_MODEL, staging, MEMO)
            write_config(model_config, staging / MODEL)
        (staging / "README.md").write_text(model_card(p.registered_model, version, model_config, scores, origin,
                                                      CONFIG_STAGES), encoding="utf-8")
        (staging / VERSION).write_text(version + "\n", encoding="utf-8")
        sums = write_sums(staging)
    verify_dir(DIST)  # what landed, after the swap into place
    # as a deployer checks it; no memo: the copies are read once, and their paths change with every bundle
    log.info("%s: %s", DIST, verify_bundle_encoders(DIST, memo_path=None))
    published = None
    if p.cfg.s3_uri:
        published = upload(s3_client(p.cfg.s3), DIST, p.cfg.s3_uri)
        log.info("published %s (verified by reading it back)", published)
    else:
        log.info("package.s3_uri is not set: the bundle stays in %s/, not published", DIST)
    run.log_metrics(scores["aggregate"])  # the champion's scores, for the next evaluate's verdict
    run.set_tags({"bundle.version": version, SETTINGS_TAG: json.dumps(scores["settings"], sort_keys=True),
                  **({"bundle.uri": published} if published else {})})
    registered, why, aliases = None, "package.register is false", []
    if p.cfg.register:
        identity = identity_digest(W4A4_IDENTITY)
        try:
            found, failure = run.registered_alias(p.registered_model, "champion"), None
        except RegistryError as exc:
            found, failure = None, str(exc)
        aliases, why = promotion(scores, identity, found.version if found else None, failure)
        registered = run.register(p.registered_model, DIST, aliases, {"bundle.version": version}, identity)
        if registered:
            log.info("registered %s version %s, aliases %s: %s", p.registered_model, registered, ", ".join(aliases),
                     why)
    return {"version": version, "files": len(sums), "bytes": sum(f.stat().st_size for f in Path(DIST).rglob("*")
                                                                  if f.is_file()),
            "published": published, "registered_version": registered, "verdict_passed": scores["verdict"]["passed"],
            "promoted": bool(registered) and "champion" in aliases, "promotion": why}


def one_line(s) -> str:
    where = s["published"] or "not published (package.s3_uri unset)"
    reg = f"registered as version {s['registered_version']}" if s["registered_version"] else "not registered"
    return f"bundle {s['version']}: {s['files']} files, {s['bytes'] / 2**20:.2f} MiB, verified; {where}; {reg}"


def main() -> None:
    main_for(STAGE, prepare, body, one_line)


if __name__ == "__main__":
    main()
