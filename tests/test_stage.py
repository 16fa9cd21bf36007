"""The stage modules as DVC runs them: `python -m tasks.<stage>` in a directory with params.yaml."""
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from longlive_core.io.parts import PartTable
from longlive_core.shots.split import STATE_COLUMNS
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video

from .conftest import REPO, cli_env, free_port, run


def workdir(tmp_path, source, **ingest):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["ingest"]["source"] = str(source)
    params["ingest"].update(ingest)
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


def kill_stage_when(work, stage, progress, at_least) -> int:
    """Runs `python -m tasks.<stage>` and SIGKILLs it once progress() >= at_least (progress reads the
    stage's state as another process would); returns what it saw. Fails if the stage finished first."""
    proc = subprocess.Popen([sys.executable, "-m", f"tasks.{stage}"], cwd=work, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, seen = time.monotonic() + 120, 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            seen = progress()
        except Exception:  # noqa: BLE001 - only ever whole files, but one may go between listing and reading
            seen = 0
        if seen >= at_least:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"{stage} finished before it could be killed"
    return seen


def summary(work):
    return json.loads((work / "reports/ingest/run.json").read_text())


@pytest.mark.slow
def test_stage_finishes_when_the_tracking_store_is_down(demo_copy, tmp_path):
    raw, _ = demo_copy
    work = workdir(tmp_path, raw)
    proc = run([sys.executable, "-m", "tasks.ingest"], work, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}")
    assert proc.stderr.count("MLflow tracking failed") == 1
    assert "ingest: 10 videos: 5 ok, 4 quarantined, 1 duplicate" in proc.stderr
    assert summary(work)["mlflow_run_id"] is None
    assert len(pd.read_parquet(work / "data/ingest/manifest.parquet")) == 10


BAD_CONFIGS = [  # (stage, params changes, what the one line says)
    ("ingest", {"ingest": {"workers": 0}}, "ingest.workers must be >= 1, got 0"),
    ("ingest", {"ingest": {"source": "missing"}}, "is not a directory: put the raw videos there"),
    ("ingest", {"ingest": {"source": "http://example.com/videos"}}, "http:// sources are not supported"),
    ("ingest", {"ingest": {"source": "s3://"}}, "names no bucket: write s3://bucket/prefix"),
    ("iqa_filter", {"iqa_filter": {"metric": "maniqa", "maniqa_checkpoint": "models/none.pt"}},
     "maniqa_checkpoint 'models/none.pt' is not a file"),
    ("caption", {"caption": {"model": "models/no-vlm"}},
     "caption.model 'models/no-vlm' is not a model folder (config.json and safetensors weights)"),
    ("encode_latents", {"encode_latents": {"vae": "models/no-vae"}},
     "encode_latents.vae: no VAE at models/no-vae: put the Wan2.2 VAE there in the Diffusers layout"),
    ("encode_latents", {"encode_latents": {"text_encoder": "."}},  # a folder, but no model in it
     "encode_latents.text_encoder: no umT5 encoder at .: put google/umt5-xxl's encoder there"),
    ("train_ar", {"train_ar": {"max_latent_frames": 15}},
     "train_ar.max_latent_frames (15) must be a multiple of chunk_frames (4): windows end on a chunk boundary"),
    ("train_ar", {"train_ar": {"sp": 2}}, "train_ar.sp (2) must divide nproc (1): a sample's ranks are on one node"),
    ("train_ar", {"train_ar": {"init": "models/none"}}, "train_ar.init: no DiT weights at models/none: put the"),
    ("train_ar", {}, "data/latents/index.parquet is missing: run encode_latents first"),
    ("distill_dmd", {"distill_dmd": {"denoising_steps": [1000, 500]}},
     "distill_dmd.denoising_steps: steps must descend from at most 1000 to 0; got [1000, 500]"),
    ("distill_dmd", {"distill_dmd": {"shot_sink": -1}}, "window must be at least 1 (or null) and the sinks at least 0"),
    ("distill_dmd", {}, "models/ar/config.json is missing: run train_ar first (dvc repro train_ar)"),
    ("merge_w4a4", {"merge_w4a4": {"recipe": "bf16"}}, "merge_w4a4.recipe must be an NVFP4 recipe"),
    ("merge_w4a4", {}, "models/ar/config.json is missing: run train_ar first (dvc repro train_ar)"),
    ("evaluate", {"evaluate": {"suite": {"bad": "+a change before any shot"}}},
     "evaluate.suite.bad, line 1: a '+' line changes the prompt inside a shot"),
    ("evaluate", {"generate": {"window": 0}}, "generate: default_duration_s must be > 0 and window >= 1 (or null)"),
    ("evaluate", {}, "models/w4a4/config.json is missing: run merge_w4a4 first (dvc repro merge_w4a4)"),
    ("package", {"package": {"s3_uri": "s3:/models"}}, "package.s3_uri 's3:/models' is not s3://bucket/prefix"),
    ("package", {}, "models/w4a4/config.json is missing: run merge_w4a4 first (dvc repro merge_w4a4)"),
]


def bad_workdir(tmp_path, raw, changes) -> Path:
    work = workdir(tmp_path, raw)
    params = yaml.safe_load((work / "params.yaml").read_text())
    for section, values in changes.items():
        params[section].update(values)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    return work


def assert_failed_before_any_run(work, code, stderr, stage, changes, message):
    assert code == 2, (stage, changes, stderr)
    assert stderr.count(message) == 1 and "Traceback" not in stderr, (message, stderr)
    assert not (work / "mlflow.db").exists()  # no MLflow run was opened for a config that cannot run
    assert not (work / "data").exists() and not (work / "reports").exists()


@pytest.mark.slow
def test_bad_params_sources_and_model_paths_fail_in_one_line_before_any_run(demo_copy, tmp_path, monkeypatch, capsys):
    """Each stage's ``main`` as ``python -m tasks.<stage>`` runs it, in this process: 23 interpreters,
    each importing torch and the stage's libraries to exit at once, took 150 s of the suite. The first
    case runs as DVC runs it too (its exit status and stderr from a process of its own)."""
    raw, _ = demo_copy
    stage, changes, message = BAD_CONFIGS[0]
    work = bad_workdir(tmp_path / "own-process", raw, changes)
    proc = run([sys.executable, "-m", f"tasks.{stage}"], work, check=False)
    assert_failed_before_any_run(work, proc.returncode, proc.stderr, stage, changes, message)

    def opened(*args, **kwargs):
        raise AssertionError("an MLflow run was opened for params that cannot run")

    def launched(*args):
        raise AssertionError(f"ranks were launched ({args}) for params that cannot run")

    monkeypatch.setattr("tasks.stage.StageRun", opened)  # where every stage opens its run
    monkeypatch.setattr(os, "execvp", launched)  # a stage of several ranks starts torchrun so
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # as cli_env leaves a stage's process
    for i, (stage, changes, message) in enumerate(BAD_CONFIGS):
        work = bad_workdir(tmp_path / str(i), raw, changes)
        monkeypatch.chdir(work)
        with pytest.raises(SystemExit) as exited:
            importlib.import_module(f"tasks.{stage}").main()
        assert_failed_before_any_run(work, exited.value.code, capsys.readouterr().err, stage, changes, message)


@pytest.mark.slow
def test_a_killed_run_keeps_finished_work_and_the_rerun_does_the_rest(tmp_path):
    src = tmp_path / "many"
    n = 60
    for i in range(n):
        spec = VideoSpec(f"v{i:03d}.mp4", (ShotSpec(30, (i * 0.37) % 1.0, "circle", i),))
        write_video(src / spec.relpath, spec, 24, 64, 48)
    work = workdir(tmp_path, src, workers=1, checkpoint_every=1, min_duration_s=0.0, decode_check_frames=30)
    probes = PartTable(work / "data/ingest/state", "probes", ["video_id"])
    killed_at = kill_stage_when(work, "ingest", lambda: len(probes.read()), 5)
    assert not (work / "data/ingest/manifest.parquet").exists()  # no half-written output
    assert len(probes.files()) > 1  # checkpoints appended parts; only the end of a run folds them
    run([sys.executable, "-m", "tasks.ingest"], work)
    s = summary(work)
    assert s["hashed"] == 0  # hashing had finished and was checkpointed before the kill
    assert killed_at <= n - s["probed"] < n  # only what was not finished was probed again
    m = pd.read_parquet(work / "data/ingest/manifest.parquet")
    assert len(m) == n and (m["status"] == "ok").all()
    assert not list((work / "data/ingest").rglob(".tmp-*"))
    assert [p.name for p in probes.files()] == ["probes.parquet"] and len(probes.read()) == n


@pytest.mark.slow
def test_a_killed_shots_run_keeps_closed_shards_and_the_rerun_does_the_rest(tmp_path):
    src = tmp_path / "src"
    n = 12
    for i in range(n):
        spec = VideoSpec(f"v{i:02d}.mp4", (ShotSpec(30, (i * 0.37) % 1.0, "circle", i),
                                           ShotSpec(30, (i * 0.37 + 0.5) % 1.0, "square", i + 100)))
        write_video(src / spec.relpath, spec, 24, 160, 96)
    work = workdir(tmp_path, src)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["shots"].update(workers=1, shard_max_mb=0.001)  # a shard per video: committed one by one
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run([sys.executable, "-m", "tasks.ingest"], work)
    state = PartTable(work / "data/shots/state", "pieces", STATE_COLUMNS)
    done_before = kill_stage_when(work, "shots", lambda: state.read()["video_id"].nunique(), 2)
    assert not (work / "data/shots/state/pieces.parquet").exists()  # killed before the end of the run
    assert not (work / "data/shots/shots.parquet").exists()
    run([sys.executable, "-m", "tasks.shots"], work)
    s = json.loads((work / "reports/shots/run.json").read_text())
    assert s["videos_reused"] >= done_before and s["videos_split"] == n - s["videos_reused"] < n
    shots = pd.read_parquet(work / "data/shots/shots.parquet")
    assert shots["video_id"].nunique() == n and len(shots) == 2 * n
    assert not list((work / "data/shots/clips").glob(".tmp-*"))  # the open shard was cleaned up
    from longlive_core.shots.clips import iter_clip_frames, read_clip

    for r in shots.itertuples(index=False):  # every referenced clip is in a complete shard
        assert len(list(iter_clip_frames(read_clip(work / "data/shots/clips", r.clip_shard, r.clip_member)))) == 30


def test_the_stage_log_handler_follows_stderr_when_it_is_swapped(monkeypatch):
    """A handler bound to a stream that was later closed (pytest's capture of an earlier test) made
    every later log record in the process fail, Prefect's recursively."""
    import io
    import logging

    from longlive_core.progress import setup_logging

    first = io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    setup_logging()
    first.close()
    second = io.StringIO()
    monkeypatch.setattr("sys.stderr", second)
    logging.getLogger("longlive.test").warning("after the swap")
    assert "after the swap" in second.getvalue()


def test_a_refused_publish_ends_in_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    from longlive_core.package.bundle import BundleError
    from tasks.stage import run_stage

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("tracking: {enabled: false}\n")

    def body(cfg, run):
        raise BundleError("s3://b/p/v1/README.md already holds other bytes: a published version is never overwritten")

    assert run_stage("package", lambda params: None, body, str) == 2
    err = capsys.readouterr().err
    assert "package: s3://b/p/v1/README.md already holds other bytes" in err and "Traceback" not in err


def test_a_stage_process_freezes_its_heap_at_exit_after_every_other_handler():
    """setup_logging (every stage's first step) registers gc.freeze at exit once; a handler registered before
    it runs after it (atexit is last in, first out) and sees the heap frozen, so finalization skips it."""
    code = ("import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
            "from longlive_core.progress import setup_logging; setup_logging(); n = atexit._ncallbacks(); "
            "setup_logging(); print('again', atexit._ncallbacks() - n)")
    proc = run([sys.executable, "-c", code], REPO)
    assert proc.stdout.split() == ["again", "0", "frozen", "True"], proc.stdout
