"""Every console script of pyproject.toml as a user runs it: `--help`, then a dry run or its smallest
real run, one subprocess each (the commands' own tests go further)."""
from __future__ import annotations

import tomllib

import pytest

from .conftest import REPO, VENV_BIN, copy_repo, run

SCRIPTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_answers_help(script):
    out = run([str(VENV_BIN / script), "--help"], REPO)
    assert out.stdout.startswith("usage:") and script in out.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("scripts") / "repo")


@pytest.mark.slow
def test_the_flows_dry_runs_print_what_would_run(repo, tmp_path):
    """longlive-retrain once died at start (its signal set-up called itself): both flows' commands,
    dry, on a fresh checkout where every stage is to run."""
    flow = run([str(VENV_BIN / "longlive-flow"), "--dry-run"], repo)
    assert flow.stdout.startswith("would run: ") and "demo_data, ingest, shots" in flow.stdout
    retrain = run([str(VENV_BIN / "longlive-retrain"), "--dry-run"], repo, PREFECT_HOME=str(tmp_path / "prefect"))
    assert '"dry_run": true' in retrain.stdout and '"demo_data"' in retrain.stdout


def test_the_other_scripts_smallest_real_runs(repo):
    plan = run([str(VENV_BIN / "longlive"), "plan", "--videos", "100", "--gpus", "1"], repo)
    assert "plan for 100 videos" in plan.stdout
    gb200 = run([str(VENV_BIN / "longlive"), "plan", "--videos", "100", "--gpus", "4", "--gpu", "gb200"], repo)
    assert "not measured (no GB200 is lent). Projected on paper by bench/ac_projection.py" in gb200.stdout
    check = run([str(VENV_BIN / "longlive-params"), "check", "configs/production.yaml"], repo)
    assert "gives every key of params.yaml" in check.stdout
    recorded = run([str(VENV_BIN / "longlive-record-pipeline")], repo)
    assert "pipeline run recorded" in recorded.stderr


def test_the_local_prefect_ui_on_another_port_points_at_its_own_api(tmp_path):
    """infra/local/prefect-ui.sh PORT: the page the browser loads asks /ui-settings where the API is;
    on a port other than 4200 it must be that port's (it once said 4200: "Can't connect to Server API")."""
    import json
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    from .conftest import cli_env, free_port

    port = free_port()
    proc = subprocess.Popen(["bash", str(REPO / "infra/local/prefect-ui.sh"), str(port)], cwd=REPO,
                            env=cli_env(PREFECT_HOME=str(tmp_path / "prefect")), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, settings = time.monotonic() + 120, None
        while settings is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=5) as reply:
                    settings = json.loads(reply.read())
            except OSError:
                time.sleep(1)
        assert settings is not None, "the server never answered"
        assert settings["api_url"] == f"http://127.0.0.1:{port}/api"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5) as reply:
            assert reply.status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
