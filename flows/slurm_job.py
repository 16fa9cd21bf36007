"""A DVC stage as one Slurm job: the job script rendered from `infra/slurm/stage.sbatch.j2`, submitted
with `sbatch --parsable`, its state polled (`scontrol show job`, then `sacct` once the controller has
forgotten the job), its log streamed line by line, and every way it can end mapped to an outcome.

No Prefect here: the flow passes a log function and decides on retries from `SlurmJobFailed.transient`.
"""
from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from flows.config import OrchestrationConfig, Placement

TEMPLATES = Path(__file__).resolve().parents[1] / "infra" / "slurm"
RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
           "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
# the cluster's fault, not the stage's: the same job may well succeed when submitted again
TRANSIENT = {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL"}
WHY = {
    "FAILED": "the stage exited with an error",
    "TIMEOUT": "the job ran past its time limit: raise orchestration.stages.<stage>.time",
    "OUT_OF_MEMORY": "the job ran out of memory: raise orchestration.stages.<stage>.mem or lower the stage's batch",
    "NODE_FAIL": "a node of the job failed",
    "CANCELLED": "the job was cancelled",
    "PREEMPTED": "the job was preempted",
    "BOOT_FAIL": "a node of the job failed to boot",
    "DEADLINE": "the job reached its deadline",
}
LOG_TAIL_LINES = 30

Run = Callable[..., subprocess.CompletedProcess]
_ACTIVE: set[str] = set()  # jobs this process submitted and has not seen end
_ACTIVE_LOCK = threading.Lock()


class SlurmError(RuntimeError):
    """Slurm itself refused or could not be reached (sbatch, scontrol)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class SlurmJobFailed(RuntimeError):
    def __init__(self, stage: str, job_id: str, state: str, detail: str, log_tail: str):
        self.stage, self.job_id, self.state, self.log_tail = stage, job_id, state, log_tail
        self.transient = state in TRANSIENT
        why = WHY.get(state, f"the job ended in state {state}")
        super().__init__(f"{stage}: Slurm job {job_id} {state}: {why}{f' ({detail})' if detail else ''}\n"
                         f"--- last lines of its log\n{log_tail}")


@dataclass(frozen=True)
class JobStatus:
    state: str
    reason: str = ""
    exit_code: str = ""
    source: str = "scontrol"

    @property
    def done(self) -> bool:
        return self.state not in RUNNING


def render_job_script(placement: Placement, cfg: OrchestrationConfig, repo: Path, log_path: Path,
                      python: str | None = None) -> str:
    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined, keep_trailing_newline=True)
    python = python or sys.executable
    return env.get_template("stage.sbatch.j2").render(
        stage=placement.stage, r=placement.resources, nodes=placement.nodes, repo=shlex.quote(str(repo)),
        log_path=str(log_path), python=shlex.quote(python), bin_dir=shlex.quote(str(Path(python).parent)),
        rdzv_port=cfg.rdzv_port)


def _slurm(cmd: list[str], run: Run, what: str) -> subprocess.CompletedProcess:
    try:
        proc = run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise SlurmError(f"{cmd[0]} is not installed here: run the flow on a Slurm login node, or start "
                         "infra/slurm/local_cluster.sh") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{what}: {cmd[0]} did not answer in 60 s", transient=True) from exc
    return proc


def _unreachable(stderr: str) -> bool:
    return any(s in stderr for s in ("Unable to contact slurm controller", "Socket timed out",
                                     "Connection refused", "Zero Bytes were transmitted"))


def submit(script: Path, run: Run = subprocess.run) -> str:
    proc = _slurm(["sbatch", "--parsable", str(script)], run, "sbatch")
    if proc.returncode != 0:
        raise SlurmError(f"sbatch refused {script}: {proc.stderr.strip()}", transient=_unreachable(proc.stderr))
    job_id = proc.stdout.strip().split(";")[0]  # `id;cluster` on federated clusters
    if not job_id.isdigit():
        raise SlurmError(f"sbatch --parsable printed {proc.stdout!r}, not a job id")
    with _ACTIVE_LOCK:
        _ACTIVE.add(job_id)
    return job_id


def check_schedulable(script: Path, run: Run = subprocess.run) -> str:
    """`sbatch --test-only`: Slurm's own check that the job could be scheduled (nothing is submitted)."""
    proc = _slurm(["sbatch", "--test-only", str(script)], run, "sbatch --test-only")
    if proc.returncode != 0:
        raise SlurmError(f"Slurm would not accept {script}: {proc.stderr.strip()}")
    return proc.stderr.strip() or proc.stdout.strip()


def parse_scontrol(text: str) -> JobStatus:
    """`scontrol show job -o ID`: one line of Key=Value pairs."""
    fields = dict(tok.split("=", 1) for tok in text.split() if "=" in tok)
    if "JobState" not in fields:
        raise SlurmError(f"scontrol printed no JobState: {text[:200]!r}")
    reason = fields.get("Reason", "")
    return JobStatus(fields["JobState"], "" if reason == "None" else reason, fields.get("ExitCode", ""))


def parse_sacct(text: str) -> JobStatus | None:
    """`sacct -j ID -X -n -P -o State,ExitCode,Reason`: the allocation's line; None when it lists nothing."""
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 2 and parts[0]:
            state = parts[0].split()[0]  # "CANCELLED by 0"
            reason = parts[2] if len(parts) > 2 and parts[2] != "None" else ""
            return JobStatus(state, reason, parts[1], source="sacct")
    return None


def job_status(job_id: str, run: Run = subprocess.run) -> JobStatus:
    proc = _slurm(["scontrol", "show", "job", "-o", job_id], run, "scontrol show job")
    if proc.returncode == 0 and "JobState=" in proc.stdout:
        return parse_scontrol(proc.stdout)
    if _unreachable(proc.stderr):
        raise SlurmError(f"scontrol could not reach the controller: {proc.stderr.strip()}", transient=True)
    # purged from the controller's memory (MinJobAge): accounting, where it is on, still knows
    acct = _slurm(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,Reason"], run, "sacct")
    status = parse_sacct(acct.stdout) if acct.returncode == 0 else None
    if status is None:
        raise SlurmError(f"Slurm no longer knows job {job_id} (scontrol: {proc.stderr.strip()}; sacct: "
                         f"{(acct.stderr or acct.stdout).strip() or 'nothing listed'}): its outcome is lost; "
                         "raise the cluster's MinJobAge above orchestration.poll_s or turn accounting on, "
                         f"then look for the job's log under orchestration.log_dir")
    return status


def cancel(job_id: str, run: Run = subprocess.run) -> None:
    _slurm(["scancel", job_id], run, "scancel")
    with _ACTIVE_LOCK:
        _ACTIVE.discard(job_id)


def cancel_active(run: Run = subprocess.run) -> list[str]:
    """Cancels every job this process submitted and has not seen end (SIGINT/SIGTERM of a local run)."""
    with _ACTIVE_LOCK:
        jobs = sorted(_ACTIVE)
    for job_id in jobs:
        with contextlib.suppress(SlurmError):  # best effort on the way out
            cancel(job_id, run)
    return jobs


class LogFollower:
    """New complete lines of a file that another machine appends to (the job's log on shared storage)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial, self.tail = path, 0, b"", []

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = b"" if final else lines.pop()
        out = [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines if ln or not final]
        self.tail = (self.tail + out)[-LOG_TAIL_LINES:]
        return out


def run_stage_job(placement: Placement, cfg: OrchestrationConfig, repo: Path, log: Callable[[str], None],
                  run: Run = subprocess.run, sleep: Callable[[float], None] = time.sleep) -> str:
    """Submits the stage's job, streams its log into `log`, returns the job id once it COMPLETED;
    raises SlurmJobFailed (with the state's reason and the log's tail) for any other end. Leaving
    early (an exception, SIGINT, Prefect's cancellation) cancels the job."""
    log_dir = (repo / cfg.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    script = log_dir / f"{placement.stage}-{stamp}.sbatch"
    log_path = log_dir / f"{placement.stage}-{stamp}.log"
    script.write_text(render_job_script(placement, cfg, repo.resolve(), log_path))
    job_id = submit(script, run)
    log(f"{placement.stage}: submitted as Slurm job {job_id} (partition {placement.resources.partition}, "
        f"{placement.nodes} node(s)); log {log_path}")
    follower = LogFollower(log_path)
    try:
        while True:
            status = job_status(job_id, run)
            for line in follower.read():
                log(line)
            if status.done:
                break
            sleep(cfg.poll_s)
        for line in follower.read(final=True):
            log(line)
    except BaseException:
        cancel(job_id, run)
        log(f"{placement.stage}: cancelled Slurm job {job_id}")
        raise
    with _ACTIVE_LOCK:
        _ACTIVE.discard(job_id)
    if status.state != "COMPLETED":
        detail = ", ".join(x for x in (f"reason {status.reason}" if status.reason else "",
                                       f"exit code {status.exit_code}" if status.exit_code else "") if x)
        raise SlurmJobFailed(placement.stage, job_id, status.state, detail, "\n".join(follower.tail))
    return job_id
