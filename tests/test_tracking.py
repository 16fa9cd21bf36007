import logging
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from longlive_core.tracking.mlflow_run import StageRun, TrackingConfig, flatten, redact_uri, resolve_store_uri

from .conftest import free_port


@pytest.fixture
def git_repo(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    return tmp_path, head


def store(root):
    return resolve_store_uri("sqlite:///mlflow.db", root)


def test_stage_run_records_params_metrics_lineage_and_artifacts(git_repo):
    root, head = git_repo
    (root / "manifest.parquet").write_bytes(b"PAR1")
    with StageRun(TrackingConfig(), "ingest", repo_root=root) as run:
        run.log_params({"ingest": {"source": "data/raw", "s3": {"endpoint_url": None}}})
        run.log_metrics({"videos": 3, "elapsed_s": 0.5, "flag": True, "bucket_>64s": 2})
        run.set_tags({"input.source.sha256": "ab" * 32})
        run.log_artifact(root / "manifest.parquet")
    client = MlflowClient(store(root))
    r = client.get_run(run.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.tags["dvc.stage"] == "ingest"
    assert r.data.tags["git.commit"] == head and r.data.tags["git.dirty"] == "false"
    assert r.data.tags["input.source.sha256"] == "ab" * 32
    assert r.data.params == {"ingest.source": "data/raw", "ingest.s3.endpoint_url": ""}
    assert r.data.metrics == {"videos": 3.0, "elapsed_s": 0.5, "bucket__64s": 2.0}  # booleans are not metrics
    assert [a.path for a in client.list_artifacts(run.run_id)] == ["manifest.parquet"]
    exp = client.get_experiment(r.info.experiment_id)
    assert exp.name == "longlive-pipeline" and exp.artifact_location == (root / "mlartifacts").as_uri()


def test_dirty_tree_and_failed_stage_are_recorded(git_repo):
    root, _ = git_repo
    (root / "code.py").write_text("x = 2\n")
    with pytest.raises(RuntimeError):
        with StageRun(TrackingConfig(), "ingest", repo_root=root) as run:
            raise RuntimeError("boom")
    r = MlflowClient(store(root)).get_run(run.run_id)
    assert r.info.status == "FAILED"
    assert r.data.tags["git.dirty"] == "true" and r.data.tags["error"] == "RuntimeError: boom"


def test_unreachable_store_warns_once_and_the_stage_goes_on(tmp_path, caplog):
    uri = f"http://user:hunter2@127.0.0.1:{free_port()}"
    cfg = TrackingConfig(tracking_uri=uri, timeout_s=2)
    with caplog.at_level(logging.WARNING):
        with StageRun(cfg, "ingest", repo_root=tmp_path) as run:
            run.log_params({"a": 1})
            run.log_metrics({"b": 2})
            run.set_tags({"c": 3})
            run.log_artifact(__file__)
            done = True
    assert done and run.run_id is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "goes on untracked" in warnings[0] and "***@127.0.0.1" in warnings[0] and "hunter2" not in warnings[0]


def test_a_failure_mid_run_switches_tracking_off_once(git_repo, caplog):
    root, _ = git_repo
    with caplog.at_level(logging.WARNING):
        with StageRun(TrackingConfig(), "ingest", repo_root=root) as run:
            run.log_params({"a": 1})
            run.log_params({"a": 2})  # MLflow refuses to change a logged param
            run.log_metrics({"b": 2})
    warnings = [r for r in caplog.records if "goes on untracked" in r.getMessage()]
    assert len(warnings) == 1 and "logging params" in warnings[0].getMessage()


def test_tracking_can_be_switched_off(tmp_path):
    with StageRun(TrackingConfig(enabled=False), "ingest", repo_root=tmp_path) as run:
        run.log_metrics({"a": 1})
    assert run.run_id is None and not (tmp_path / "mlflow.db").exists()


def test_helpers():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
    assert redact_uri("https://u:p@host/x") == "https://***@host/x"
    assert redact_uri("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def test_nested_runs_slurm_tag_resume_and_system_metrics(git_repo, monkeypatch):
    import time

    root, _ = git_repo
    with StageRun(TrackingConfig(), "pipeline", repo_root=root) as parent:
        monkeypatch.setenv("LONGLIVE_MLFLOW_PARENT_RUN_ID", parent.run_id)
        monkeypatch.setenv("SLURM_JOB_ID", "812")
        with StageRun(TrackingConfig(system_metrics_s=0.2), "ingest", repo_root=root) as child:
            time.sleep(0.8)
        with StageRun(TrackingConfig(), "pipeline", repo_root=root, resume_run_id=parent.run_id) as again:
            again.set_tags({"late": "yes"})
    client = MlflowClient(store(root))
    c = client.get_run(child.run_id)
    assert c.data.tags["mlflow.parentRunId"] == parent.run_id and c.data.tags["slurm.job_id"] == "812"
    assert any(k.startswith("system/cpu_utilization") for k in c.data.metrics), c.data.metrics
    p = client.get_run(parent.run_id)
    assert p.data.tags["late"] == "yes" and "mlflow.parentRunId" not in p.data.tags
