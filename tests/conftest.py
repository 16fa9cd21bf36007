from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

# Under pytest-xdist (scripts/test.sh) the workers share the cores: each worker's torch, and every
# process a test starts, gets its share of them (test_quant_triton's pool reads it too). Two processes of
# torch's default two threads on two cores spin against each other (a small model's step ran 20x slower
# beside another). Set before torch loads; a user's own OMP_NUM_THREADS stands.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402

from longlive_core.data.demo import DemoDataConfig, make_demo_data  # noqa: E402

from .helpers.gloo import gloo_world  # noqa: E402, F401  (a fixture; tests.helpers: freeze_at_exit)

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
DEMO_FILE = "tests/test_pipeline_e2e.py"  # one `dvc repro` of the demo shared by its tests
SLURM_FILE = "tests/test_slurm_job.py"


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs a file's tests on one pytest-xdist worker (``--dist loadfile``), the files in
    this order: its module fixtures are made once, the one local Slurm cluster (fixed ports) is used by one
    file, and the demo's end-to-end file, the longest, starts first so that the others share the rest
    beside it; then the files with slow tests, and the quick ones last, to even out the workers' ends."""
    def file(item) -> str:
        return item.nodeid.split("::", 1)[0]
    elsewhere = [item.nodeid for item in items if "slurm" in item.fixturenames and file(item) != SLURM_FILE]
    if elsewhere:
        raise pytest.UsageError(f"{elsewhere} use the local Slurm cluster: move them to {SLURM_FILE}, where "
                                "every test of it runs on one worker")
    slow = {file(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (file(item) != DEMO_FILE, file(item) not in slow))  # stable within


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=cli_env(**env), capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{cmd} failed with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def launch_worker(worker: str, tmp_path: Path, specs: list[dict], nproc: int) -> Path:
    """Runs ``tests.helpers.<worker>`` on ``nproc`` ranks under torchrun over ``specs`` (its runs, in
    order, one launch for all); returns the folder it wrote each run's results into."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / f"spec-{specs[0]['name']}.json"
    config.write_text(json.dumps({"runs": specs}))
    out = tmp_path / "out"
    run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         "-m", f"tests.helpers.{worker}", str(config), str(out)], cwd=REPO)
    return out


def run_worker_here(worker: str, tmp_path: Path, specs: list[dict]) -> Path:
    """``launch_worker``'s runs on one rank, in this process (the ``gloo_world`` of one rank): the
    worker's own ``run_one``, without a torchrun start."""
    import importlib

    run_one = importlib.import_module(f"tests.helpers.{worker}").run_one
    out = tmp_path / "out"
    for spec in json.loads(json.dumps(specs)):  # as launch_worker's workers read them
        run_one(spec, out / spec["name"])
    return out


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory) -> tuple[Path, dict]:
    """The demo's raw data, made once per session (read-only: copy before changing it)."""
    root = tmp_path_factory.mktemp("demo")
    truth = make_demo_data(DemoDataConfig(), root / "raw", root / "truth.json")
    return root / "raw", truth


@pytest.fixture
def demo_copy(demo_set, tmp_path) -> tuple[Path, dict]:
    raw, truth = demo_set
    dst = tmp_path / "raw"
    shutil.copytree(raw, dst)
    return dst, truth


def copy_repo(dst: Path) -> Path:
    """The repository's files (tracked and not ignored) in a new git repository with one commit."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if rel == "dvc.lock":  # this checkout's last run; a fresh clone has none
            continue
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    subprocess.run([*git, "init", "-q"], cwd=dst, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dst, check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], cwd=dst, check=True)
    return dst


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    return copy_repo(tmp_path / "repo")


@pytest.fixture(scope="session")
def demo_repro(tmp_path_factory) -> Path:
    """A copy of the repository after one `dvc repro` of the whole demo pipeline, shared by the
    end-to-end tests: read it, or change a ``workspace_copy`` of it and rerun only what changed."""
    repo = copy_repo(tmp_path_factory.mktemp("demo_repro") / "repo")
    run([sys.executable, "-m", "dvc", "repro"], repo)
    return repo


def workspace_copy(repo: Path, dst: Path) -> Path:
    """The whole workspace (git, DVC cache, outputs, MLflow store) copied, for a variant to change."""
    shutil.copytree(repo, dst, symlinks=True)
    return dst


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The local single-node cluster (started once; installs slurm-wlm and munge when missing)."""
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, LONGLIVE_SLURM_DIR=str(state), LONGLIVE_SLURMCTLD_PORT="16817",
               LONGLIVE_SLURMD_PORT="16818")
    proc = subprocess.run(["bash", str(REPO / "infra/slurm/local_cluster.sh"), "start"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    yield state
    subprocess.run(["bash", str(REPO / "infra/slurm/local_cluster.sh"), "stop"], env=env, capture_output=True)
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


@pytest.fixture
def demo_shots(demo_copy, tmp_path):
    """The demo's videos split into shots (the `shots` stage's code, one process): (shots, clips dir)."""
    from longlive_core.config import from_mapping
    from longlive_core.data.ingest import IngestConfig, IngestState, ingest
    from longlive_core.data.sources import LocalSource
    from longlive_core.parallel import make_executor
    from longlive_core.shots.detect import ShotsConfig
    from longlive_core.shots.split import split_videos

    raw, _ = demo_copy
    m = ingest(LocalSource(raw).list(), from_mapping(IngestConfig, {"source": str(raw)}, "ingest"),
               IngestState(tmp_path / "is"), str(raw)).manifest
    cfg = from_mapping(ShotsConfig, {"min_scene_len": 4, "min_shot_s": 0.5, "max_shot_s": 2.0, "clip_crf": 0,
                                     "workers": 1}, "shots")
    out = split_videos(m, raw, cfg, tmp_path / "ss", tmp_path / "clips", make_executor("local", 1))
    return out.shots, tmp_path / "clips"
