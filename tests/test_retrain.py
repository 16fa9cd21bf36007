"""The scheduled retraining flow: its reading of evaluate's verdict, its dry run, its deployment."""
from __future__ import annotations

import json

import pytest
import yaml
from prefect.testing.utilities import prefect_test_harness

import flows.retrain as retrain_module
from flows.retrain import read_outcome, retrain
from longlive_core.tracking.lineage import digest_file

from .conftest import REPO


def _write(root, scores=None, package=None):
    if scores is not None:
        (root / "reports/evaluate").mkdir(parents=True, exist_ok=True)
        (root / "reports/evaluate/scores.json").write_text(json.dumps(scores))
    if package is not None:
        (root / "reports/package").mkdir(parents=True, exist_ok=True)
        (root / "reports/package/run.json").write_text(json.dumps(package))


PASSED = {"verdict": {"passed": True, "champion": "3", "reasons": ["temporal_flickering 0.981 >= 0.975"]}}
FAILED = {"verdict": {"passed": False, "champion": "3",
                      "reasons": ["shot_switch_accuracy 0.50 < champion 0.90 - margin 0.25"]}}


def test_outcomes_on_crafted_verdicts(tmp_path):
    assert "no verdict" in read_outcome(tmp_path, None).message
    _write(tmp_path, FAILED, {"verdict_passed": False, "registered_version": "4", "version": "v4"})
    out = read_outcome(tmp_path, None)
    assert not out.promoted and "champion stays" in out.message and "shot_switch_accuracy 0.50" in out.message
    _write(tmp_path, PASSED, {"verdict_passed": True, "registered_version": "5", "version": "v5", "promoted": True})
    out = read_outcome(tmp_path, None)
    assert out.promoted and out.version == "v5" and "new champion" in out.message
    _write(tmp_path, PASSED, {"verdict_passed": True, "registered_version": "5", "version": "v5", "promoted": False,
                              "promotion": "the champion changed since the verdict"})
    out = read_outcome(tmp_path, None)
    assert not out.promoted and "not promoted: the champion changed since the verdict" in out.message
    unchanged = digest_file(tmp_path / "reports/evaluate/scores.json")
    assert "no new model" in read_outcome(tmp_path, unchanged).message
    _write(tmp_path, PASSED, {"verdict_passed": True, "registered_version": None, "version": "v6"})
    assert "was not registered" in read_outcome(tmp_path, None).message
    _write(tmp_path, PASSED, {"verdict_passed": False, "registered_version": "7", "version": "v7"})
    assert "another verdict" in read_outcome(tmp_path, None).message


@pytest.mark.slow
def test_retrain_flow_dry_run_and_verdicts(repo_copy, monkeypatch):
    ran = []

    def pipeline(repo_root, executor=None):  # stands in for the whole chain: writes what evaluate and package write
        ran.append(executor)
        _write(repo_copy, *next(verdicts))

    verdicts = iter([(FAILED, {"verdict_passed": False, "registered_version": "2", "version": "v2"}),
                     (PASSED, {"verdict_passed": True, "registered_version": "3", "version": "v3", "promoted": True})])
    with prefect_test_harness(server_startup_timeout=120):
        dry = retrain(repo_root=str(repo_copy), dry_run=True)
        # a fresh checkout: every stage is pending, the graph's order
        assert dry["changed"][:3] == ["weights", "demo_data", "ingest"] and dry["changed"][-1] == "package"
        assert not (repo_copy / "dvc.lock").exists() and not (repo_copy / "data").exists()
        monkeypatch.setattr(retrain_module, "longlive_pipeline", pipeline)
        refused = retrain(repo_root=str(repo_copy), executor="local")
        promoted = retrain(repo_root=str(repo_copy))
    assert ran == ["local", None]
    assert not refused["promoted"] and "champion stays" in refused["message"]
    assert promoted["promoted"] and promoted["version"] == "v3"


def test_prefect_yaml_deploys_the_retraining_flow_on_a_cron_schedule():
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    weekly = deployments["weekly-retrain"]
    assert load_flow_from_entrypoint(str(REPO / weekly["entrypoint"])).name == "longlive-retrain"
    schedule = CronSchedule(cron=weekly["schedules"][0]["cron"], timezone=weekly["schedules"][0]["timezone"])
    assert schedule.cron == "0 3 * * 1"
    assert load_flow_from_entrypoint(str(REPO / deployments["pipeline"]["entrypoint"])).name == "longlive-pipeline"
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().split() if "==" in line)
    assert spec["prefect-version"] == pins["prefect"]
