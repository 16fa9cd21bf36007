"""The params a stage ran with, written by the stage to reports/<stage>/params.yaml: the keys its
dvc.yaml entry reads, so `package` bundles and depends on those, not on params.yaml whole."""
from __future__ import annotations

import pytest
import yaml

from longlive_core.config import ConfigError, load_params
from tasks import package
from tasks.stage import params_path, run_stage, stage_params

from .conftest import REPO

DVC_YAML = """
stages:
  train:
    cmd: python -m tasks.train
    params:
      - train
      - encode.vae
      - params.yaml:
          - encode.clip.fps
    outs:
      - models/ar
      - reports/train/params.yaml
  ingest:
    cmd: python -m tasks.ingest
    params:
      - ingest
    outs:
      - data/manifest.parquet
"""
PARAMS = {"tracking": {"enabled": False}, "train": {"lr": 0.001, "steps": 3, "nested": {"b": 2, "a": 1}},
          "encode": {"vae": "tiny", "workers": 4, "clip": {"fps": 24.0, "height": 64}},
          "ingest": {"workers": 2}, "orchestration": {"retries": 2}}


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    return tmp_path


def test_a_stage_records_exactly_the_params_its_dvc_yaml_entry_reads(work):
    assert stage_params("train", PARAMS) == {"train": PARAMS["train"],
                                             "encode": {"vae": "tiny", "clip": {"fps": 24.0}}}
    assert stage_params("ingest", PARAMS) is None  # it does not declare reports/ingest/params.yaml
    assert stage_params("unknown", PARAMS) is None
    with pytest.raises(ConfigError, match=r"params.yaml has no encode.vae, which dvc.yaml's train stage reads"):
        stage_params("train", {**PARAMS, "encode": {"clip": {"fps": 24.0}}})
    (work / "dvc.yaml").unlink()
    assert stage_params("train", PARAMS) is None  # run outside the repository: nothing to record


def test_run_stage_writes_the_file_after_its_body_and_the_same_values_give_the_same_bytes(work):
    calls = []

    def body(cfg, run):
        calls.append(params_path("train").exists())  # the old file is DVC's to delete; this run writes after
        return {"ok": True}

    assert run_stage("train", lambda params: None, body, str) == 0
    written = params_path("train").read_bytes()
    assert yaml.safe_load(written) == {"train": PARAMS["train"], "encode": {"vae": "tiny", "clip": {"fps": 24.0}}}
    assert calls == [False] and not params_path("ingest").exists()
    # unrelated edits (orchestration, ingest.workers, encode.workers, another key order) change no byte
    other = {"orchestration": {"retries": 5}, "ingest": {"workers": 8},
             "encode": {"clip": {"height": 32, "fps": 24.0}, "workers": 1, "vae": "tiny"},
             "train": {"nested": {"a": 1, "b": 2}, "steps": 3, "lr": 0.001}, "tracking": {"enabled": False}}
    (work / "params.yaml").write_text(yaml.safe_dump(other, sort_keys=False))
    assert run_stage("train", lambda params: None, body, str) == 0
    assert params_path("train").read_bytes() == written
    (work / "params.yaml").write_text(yaml.safe_dump({**PARAMS, "train": {**PARAMS["train"], "lr": 0.01}}))
    assert run_stage("train", lambda params: None, body, str) == 0
    assert yaml.safe_load(params_path("train").read_text())["train"]["lr"] == 0.01


def test_a_failed_body_writes_no_params_and_a_missing_key_stops_before_the_run(work, capsys):
    def failing(cfg, run):
        raise ConfigError("the body found something wrong")

    assert run_stage("train", lambda params: None, failing, str) == 2
    assert not params_path("train").exists()
    (work / "params.yaml").write_text(yaml.safe_dump({**PARAMS, "encode": {"clip": {"fps": 24.0}}}))
    started = []
    assert run_stage("train", lambda params: None, lambda cfg, run: started.append(1) or {}, str) == 2
    err = capsys.readouterr().err
    assert "train: params.yaml has no encode.vae, which dvc.yaml's train stage reads: add it" in err
    assert not started and "Traceback" not in err


def test_package_bundles_and_depends_on_the_params_files_of_the_stages_that_made_the_model():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    files = [params_path(stage).as_posix() for stage in package.CONFIG_STAGES]
    assert [d for d in stages["package"]["deps"] if str(d).endswith("params.yaml")] == files  # not params.yaml whole
    assert stages["package"]["params"] == ["package", "evaluate.registered_model"]
    params = load_params(REPO / "params.yaml")
    for stage in package.CONFIG_STAGES:
        assert params_path(stage).as_posix() in stages[stage]["outs"], stage
        recorded = stage_params(stage, params, REPO / "dvc.yaml")
        assert recorded is not None and stage in recorded  # every key it reads is in params.yaml
    # data stages: no record, see tasks/package.py
    for stage in ("ingest", "shots", "iqa_filter", "caption", "assemble"):
        assert stage_params(stage, params, REPO / "dvc.yaml") is None
