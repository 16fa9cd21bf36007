"""Stages as Slurm jobs: crafted Slurm answers for the mapping, and a real single-node Slurm cluster
(infra/slurm/local_cluster.sh) for submission, completion, failure, cancellation, time limits and the
Prefect flow's stage run. Every test of that one cluster lives here (tests/conftest.py says why)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from flows.config import OrchestrationConfig, Placement, SlurmResources, orchestration_config
from flows.slurm_job import (
    SlurmError,
    SlurmJobFailed,
    check_schedulable,
    job_status,
    parse_sacct,
    parse_scontrol,
    render_job_script,
    run_stage_job,
)
from longlive_core.config import ConfigError, load_params
from longlive_core.distributed.launch import launch_command

from .conftest import REPO, cli_env

PRODUCTION = REPO / "configs/production.yaml"


# -- crafted Slurm answers ----------------------------------------------------------------------

class FakeSlurm:
    """Answers sbatch, scontrol and sacct as a cluster would, from a list of job states."""

    def __init__(self, states: list[str], sacct: str | None = None, log_lines: list[str] = ()):
        self.states, self.sacct, self.calls, self.log_lines = list(states), sacct, [], list(log_lines)
        self.log_path: Path | None = None

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if cmd[0] == "sbatch":
            script = Path(cmd[-1]).read_text()
            self.log_path = Path(next(ln.split("=", 1)[1] for ln in script.splitlines()
                                      if ln.startswith("#SBATCH --output=")))
            return subprocess.CompletedProcess(cmd, 0, "4242\n", "")
        if cmd[0] == "scontrol":
            if self.log_lines:
                with open(self.log_path, "a") as f:
                    f.write(self.log_lines.pop(0) + "\n")
            if not self.states:
                return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
            state, _, reason = self.states.pop(0).partition(":")
            return subprocess.CompletedProcess(
                cmd, 0, f"JobId=4242 JobName=longlive-x UserId=root(0) JobState={state} Reason={reason or 'None'} "
                        f"Dependency=(null) ExitCode={'0:0' if state == 'COMPLETED' else '0:9'}\n", "")
        if cmd[0] == "sacct":
            if self.sacct is None:
                return subprocess.CompletedProcess(cmd, 1, "", "sacct: error: Slurm accounting storage is disabled\n")
            return subprocess.CompletedProcess(cmd, 0, self.sacct, "")
        if cmd[0] == "scancel":
            return subprocess.CompletedProcess(cmd, 0, "", "")
        raise AssertionError(cmd)


def _placement(stage="train_ar", nodes=1, **res) -> Placement:
    return Placement(stage, "slurm", SlurmResources(**res), nodes)


def _run(tmp_path, fake, stage="train_ar") -> str:
    lines: list[str] = []
    cfg = OrchestrationConfig(poll_s=0.01)
    try:
        return run_stage_job(_placement(stage), cfg, tmp_path, lines.append, run=fake, sleep=lambda s: None)
    finally:
        _run.lines = lines


def test_completed_job_streams_its_log_and_returns_its_id(tmp_path):
    fake = FakeSlurm(["PENDING:Resources", "RUNNING", "RUNNING", "COMPLETED"], log_lines=["one", "two", "three"])
    assert _run(tmp_path, fake) == "4242"
    assert [c[0] for c in fake.calls] == ["sbatch", "scontrol", "scontrol", "scontrol", "scontrol"]
    assert _run.lines[0].startswith("train_ar: submitted as Slurm job 4242")
    assert _run.lines[1:] == ["one", "two", "three"]


@pytest.mark.parametrize("states, sacct, state, why, transient", [
    (["RUNNING", "OUT_OF_MEMORY:OutOfMemory"], None, "OUT_OF_MEMORY", "ran out of memory", False),
    (["RUNNING", "NODE_FAIL:NodeDown"], None, "NODE_FAIL", "a node of the job failed", True),
    (["RUNNING"], "NODE_FAIL|0:0|NodeDown\n", "NODE_FAIL", "reason NodeDown", True),  # purged: sacct knows
    (["RUNNING"], "OUT_OF_MEMORY|0:125|None\n", "OUT_OF_MEMORY", "exit code 0:125", False),
    (["TIMEOUT:TimeLimit"], None, "TIMEOUT", "raise orchestration.stages.<stage>.time", False),
])
def test_failure_states_are_mapped_with_their_reason_and_log_tail(tmp_path, states, sacct, state, why, transient):
    fake = FakeSlurm(states, sacct=sacct, log_lines=["step 1", "killed"])
    with pytest.raises(SlurmJobFailed) as err:
        _run(tmp_path, fake)
    assert err.value.state == state and err.value.transient is transient
    assert why in str(err.value) and "Slurm job 4242" in str(err.value)
    assert err.value.log_tail.splitlines()[-1] in ("killed", "step 1")


def test_a_job_slurm_forgot_without_accounting_is_an_error_not_a_success(tmp_path):
    with pytest.raises(SlurmError, match="no longer knows job 4242.*accounting storage is disabled"):
        _run(tmp_path, FakeSlurm(["RUNNING"]))


def test_leaving_early_cancels_the_job(tmp_path):
    fake = FakeSlurm(["RUNNING"] * 5)

    def interrupted(_s):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stage_job(_placement(), OrchestrationConfig(), tmp_path, lambda s: None, run=fake, sleep=interrupted)
    assert fake.calls[-1] == ["scancel", "4242"]


def test_parsers():
    s = parse_scontrol("JobId=7 JobName=a JobState=CANCELLED Reason=None ExitCode=0:15")
    assert (s.state, s.reason, s.exit_code, s.done) == ("CANCELLED", "", "0:15", True)
    assert not parse_scontrol("JobId=7 JobState=PENDING Reason=Priority ExitCode=0:0").done
    assert parse_sacct("CANCELLED by 0|0:0|None\n").state == "CANCELLED"
    assert parse_sacct("") is None


# -- placement and job scripts --------------------------------------------------------------------

def test_placement_merges_defaults_stage_keys_and_the_command_line():
    cfg = orchestration_config({"orchestration": {"executor": "local", "slurm": {"partition": "cpu", "time": "2:00:00"},
                                                  "stages": {"train_ar": {"executor": "slurm", "partition": "gpu",
                                                                          "gpus_per_node": 4}, "shots": "slurm"}}})
    params = {"train_ar": {"nnodes": 8, "nproc": 4}}
    p = cfg.placement("train_ar", params)
    assert (p.executor, p.resources.partition, p.resources.time, p.resources.gpus_per_node, p.nodes) == \
        ("slurm", "gpu", "2:00:00", 4, 8)
    assert cfg.placement("shots", params).executor == "slurm"
    assert cfg.placement("ingest", params).executor == "local"
    assert cfg.placement("train_ar", params, executor="local").executor == "local"
    with pytest.raises(ConfigError, match=r"orchestration.stages.shots.time: '2 hours' is not a Slurm time"):
        orchestration_config({"orchestration": {"stages": {"shots": {"time": "2 hours"}}}})
    with pytest.raises(ConfigError, match="orchestration.executor: 'k8s'"):
        orchestration_config({"orchestration": {"executor": "k8s"}})
    with pytest.raises(ConfigError, match=r"stages.train_ar: unknown key\(s\) \['gpus'\]"):
        orchestration_config({"orchestration": {"stages": {"train_ar": {"gpus": 4}}}})


def _production_params(tmp_path) -> dict:
    from longlive_core.params_overlay import overlaid_params

    return overlaid_params(REPO / "params.yaml", PRODUCTION)


def test_production_train_ar_job_script(tmp_path):
    params = _production_params(tmp_path)
    cfg = orchestration_config(params)
    p = cfg.placement("train_ar", params)
    script = render_job_script(p, cfg, Path("/shared/longlive"), Path("/shared/longlive/logs/slurm/x.log"),
                               python="/shared/longlive/.venv/bin/python")
    assert "#SBATCH --nodes=8\n" in script and "#SBATCH --gres=gpu:4\n" in script
    assert "#SBATCH --partition=gpu\n" in script and "#SBATCH --time=7-00:00:00\n" in script
    assert "--account" not in script  # empty: the user's default
    assert 'LONGLIVE_RDZV_ENDPOINT="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):29500"' in script
    assert script.rstrip().endswith("exec /shared/longlive/.venv/bin/python -m dvc repro --single-item train_ar")
    one = render_job_script(cfg.placement("assemble", params), cfg, Path("/r"), Path("/r/l.log"))
    assert "--gres" not in one and "RDZV" not in one and "#SBATCH --partition=cpu\n" in one


def test_multi_node_launch_runs_torchrun_on_every_node_through_srun(monkeypatch):
    monkeypatch.setenv("LONGLIVE_RDZV_ENDPOINT", "node01:29500")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launch_command("tasks.train_ar", 2, 4)[0] == sys.executable  # another launcher: plain torchrun
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    cmd = launch_command("tasks.train_ar", 2, 4)
    assert cmd[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL"]
    assert "--rdzv_endpoint=node01:29500" in cmd and "--nproc_per_node=4" in cmd and cmd[-1] == "tasks.train_ar"
    assert launch_command("tasks.train_ar", 1, 4)[0] == sys.executable  # one node: no srun
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    with pytest.raises(ConfigError, match="params ask for 2 nodes but this Slurm job holds 1"):
        launch_command("tasks.train_ar", 2, 4)


# -- a real Slurm cluster -----------------------------------------------------------------------

def _dvc_project(root: Path, cmd: str, time_limit: str = "5") -> Path:
    """A DVC project of one stage `work` that runs `cmd`, placed on the local Slurm partition."""
    root.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True, env=cli_env())
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"work": {"cmd": cmd, "outs": ["out.txt"]}}}))
    (root / "params.yaml").write_text(yaml.safe_dump({
        "tracking": {"enabled": False},
        "orchestration": {"executor": "slurm", "poll_s": 0.5, "retries": 0,
                          "slurm": {"partition": "local", "time": time_limit}}}))
    return root


def _wait_running(job_log_dir: Path, timeout: float = 60, flow: subprocess.Popen | None = None) -> str:
    """The id of the running job whose log goes to ``job_log_dir`` (this test's project: a job another test
    left is never taken); the failure says what the queue and the flow's process (sent SIGTERM then) showed."""
    deadline, out = time.time() + timeout, ""
    while time.time() < deadline and (flow is None or flow.poll() is None):
        out = subprocess.run(["squeue", "-h", "-O", "JobID:24,Name:40,State:16,STDOUT:2000"], capture_output=True,
                             text=True).stdout
        running = [f[0] for f in map(str.split, out.splitlines())
                   if f[1:3] == ["longlive-work", "RUNNING"] and len(f) > 3 and Path(f[3]).parent == job_log_dir]
        if running and any(job_log_dir.glob("work-*.log")):
            return running[0]
        time.sleep(0.5)
    said = ""
    if flow is not None:
        if flow.poll() is None:  # its handler cancels its jobs, and Prefect stops its temporary server as it exits
            flow.send_signal(signal.SIGTERM)
        try:
            said = flow.communicate(timeout=60)[0] or ""
        except subprocess.TimeoutExpired:  # the server, a child of its own, may still hold the output pipe
            flow.kill()
            said = "(the flow did not exit within 60 s of SIGTERM: killed, its output unread)"
        said = said if len(said) < 6000 else f"{said[:3000]}\n...\n{said[-3000:]}"
    raise AssertionError(f"the job never started running in {timeout:.0f} s; the queue: {out!r}; the flow "
                         f"(exit {flow.returncode if flow else None}): {said}")


def _state(job_id: str) -> str:
    return job_status(job_id).state


@pytest.mark.slow
def test_real_cluster_completes_fails_and_times_out(slurm, tmp_path):
    ok = _dvc_project(tmp_path / "ok", "echo made > out.txt && echo the stage ran")
    fail = _dvc_project(tmp_path / "fail", "echo 'work: params.yaml has no work section' >&2; exit 2")
    slow = _dvc_project(tmp_path / "slow", "sleep 300 && touch out.txt", time_limit="1")
    results: dict = {}

    def go(name, root):
        cfg = orchestration_config(load_params(root / "params.yaml"))
        lines: list[str] = []
        try:
            results[name] = run_stage_job(cfg.placement("work", {}), cfg, root, lines.append)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[name] = exc
        results[name + ".log"] = lines

    threads = [threading.Thread(target=go, args=a) for a in (("ok", ok), ("fail", fail), ("slow", slow))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert results["ok"].isdigit(), results["ok"]
    assert (ok / "out.txt").read_text() == "made\n" and (ok / "dvc.lock").is_file()
    assert "the stage ran" in results["ok.log"]
    exc = results["fail"]
    assert isinstance(exc, SlurmJobFailed) and exc.state == "FAILED" and not exc.transient
    # dvc exits 255 when a stage fails
    assert "params.yaml has no work section" in exc.log_tail and "exit code 255:0" in str(exc)
    exc = results["slow"]
    assert isinstance(exc, SlurmJobFailed) and exc.state == "TIMEOUT" and not exc.transient, exc


@pytest.mark.slow
def test_real_cluster_production_templates_are_accepted_by_sbatch_test_only(slurm, tmp_path):
    params = _production_params(tmp_path)
    cfg = orchestration_config(params)
    for stage in ("train_ar", "distill_dmd", "encode_latents", "evaluate"):
        p = cfg.placement(stage, params)
        script = tmp_path / f"{stage}.sbatch"
        script.write_text(render_job_script(p, cfg, tmp_path, tmp_path / f"{stage}.log"))
        assert "to start at" in check_schedulable(script), stage
    too_big = Placement("train_ar", "slurm", SlurmResources(partition="gpu", gpus_per_node=9), 2)
    script = tmp_path / "too_big.sbatch"
    script.write_text(render_job_script(too_big, cfg, tmp_path, tmp_path / "x.log"))
    with pytest.raises(SlurmError, match="Requested node configuration is not available"):
        check_schedulable(script)


@pytest.mark.slow
def test_sigterm_to_a_local_flow_run_cancels_its_job(slurm, tmp_path):
    root = _dvc_project(tmp_path / "p", "sleep 300 && touch out.txt")
    env = cli_env(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect"),
                  PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="true", SLURM_CONF=os.environ["SLURM_CONF"])
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--repo", str(root), "--executor", "slurm"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id = _wait_running(root / "logs/slurm", timeout=180, flow=proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    deadline = time.time() + 30
    while _state(job_id) not in ("CANCELLED",) and time.time() < deadline:
        time.sleep(0.5)
    assert _state(job_id) == "CANCELLED", out


@pytest.mark.slow
def test_cancelling_a_served_flow_run_cancels_its_slurm_job(slurm, tmp_path):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelling
    from prefect.testing.utilities import prefect_test_harness

    root = _dvc_project(tmp_path / "p", "sleep 300 && touch out.txt")
    parameters = {"repo_root": str(root), "executor": "slurm"}
    serve = ("from flows.pipeline import longlive_pipeline; "
             f"longlive_pipeline.serve(name='cancel-test', parameters={parameters!r})")
    with prefect_test_harness(server_startup_timeout=120):
        env = cli_env(PYTHONPATH=str(REPO), PREFECT_API_URL=PREFECT_API_URL.value(),
                      SLURM_CONF=os.environ["SLURM_CONF"], PREFECT_RUNNER_POLL_FREQUENCY="1")
        runner = subprocess.Popen([sys.executable, "-c", serve], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)

        async def start() -> str:
            async with get_client() as client:
                for _ in range(120):
                    try:
                        dep = await client.read_deployment_by_name("longlive-pipeline/cancel-test")
                        break
                    except Exception:  # noqa: BLE001 - not registered yet
                        await asyncio.sleep(0.5)
                run = await client.create_flow_run_from_deployment(dep.id)
                return run.id

        async def cancel(run_id) -> str:
            async with get_client() as client:
                await client.set_flow_run_state(run_id, Cancelling(), force=True)
                for _ in range(120):
                    state = (await client.read_flow_run(run_id)).state
                    if state.is_final():
                        return state.type.value
                    await asyncio.sleep(0.5)
                return state.type.value

        try:
            run_id = asyncio.run(start())
            job_id = _wait_running(root / "logs/slurm", timeout=180)
            final = asyncio.run(cancel(run_id))
            deadline = time.time() + 30
            while _state(job_id) != "CANCELLED" and time.time() < deadline:
                time.sleep(0.5)
            job_state = _state(job_id)
        finally:
            runner.terminate()
            out = runner.communicate(timeout=60)[0]
    assert final == "CANCELLED", out[-3000:]
    assert job_state == "CANCELLED", out[-3000:]


def test_a_container_image_runs_the_stage_through_pyxis_and_is_refused_for_multi_node_stages():
    cfg = orchestration_config({"orchestration": {"executor": "slurm",
                                                  "slurm": {"container_image": "registry#team/longlive-train:abc"}}})
    script = render_job_script(cfg.placement("assemble", {}), cfg, Path("/shared/repo"), Path("/shared/l.log"))
    assert ("exec srun --ntasks=1 --container-image=registry#team/longlive-train:abc "
            "--container-mounts=/shared/repo:/shared/repo") in script
    assert "python -m dvc repro --single-item assemble" in script and sys.executable not in script
    with pytest.raises(ConfigError, match="a 8-node stage starts its ranks with srun"):
        cfg.placement("train_ar", {"train_ar": {"nnodes": 8}})


def _mlflow_run(repo, run_id):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}").get_run(run_id)


@pytest.mark.slow
def test_flow_runs_a_stage_as_a_slurm_job_nested_under_the_pipeline_run(repo_copy, slurm):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import longlive_pipeline

    with prefect_test_harness(server_startup_timeout=120):
        state = longlive_pipeline(repo_root=str(repo_copy), targets=["demo_data"], executor="slurm",
                                  return_state=True)
        assert state.is_completed(), state

        async def artifacts():
            async with get_client() as client:
                return await client.read_artifacts()

        found = {a.key: a.data for a in asyncio.run(artifacts())}
    assert "Slurm job" in found["stage-demo-data"] and "| videos |" in found["stage-demo-data"]
    assert (repo_copy / "data/demo/truth.json").is_file() and (repo_copy / "dvc.lock").is_file()
    log = next((repo_copy / "logs/slurm").glob("demo_data-*.log")).read_text()
    assert "as Slurm job" in log and "demo_data" in log
    report = json.loads((repo_copy / "reports/demo_data/run.json").read_text())
    stage_run = _mlflow_run(repo_copy, report["mlflow_run_id"])
    assert stage_run.data.tags["slurm.job_id"].isdigit()
    parent = _mlflow_run(repo_copy, stage_run.data.tags["mlflow.parentRunId"])
    assert parent.info.run_name == "pipeline" and parent.info.status == "FINISHED"
    assert parent.data.tags["stage.demo_data.run_id"] == stage_run.info.run_id
