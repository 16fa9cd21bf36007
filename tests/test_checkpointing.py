"""The checkpoint store on a two-parameter module, in-process (one gloo rank): checkpoints per run
digest, a lowered target, damaged checkpoints and histories, the runs kept, `resume: force`, and the
layout older versions wrote."""
from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from longlive_core.models.weights import CheckpointError
from longlive_core.tracking.lineage import digest_json
from longlive_core.train.checkpointing import CheckpointStore, read_history

pytestmark = pytest.mark.usefixtures("gloo_world")
RUN_A = {"params": "a", "code": "c1"}


class Two(torch.nn.Module):
    def __init__(self, value: float = 0.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), value))
        self.b = torch.nn.Parameter(torch.full((2,), value))


def store(root: Path, components=RUN_A, keep: int = 2, keep_runs: int = 2) -> CheckpointStore:
    return CheckpointStore(root, keep, keep_runs, components)


def train(root: Path, steps: list[int], components=RUN_A, rank_state: bool = False, keep: int = 2,
          keep_runs: int = 2) -> CheckpointStore:
    """A run that saves a checkpoint after each of ``steps`` (its weights = the step number) and logs
    one history line per step."""
    s = store(root, components, keep, keep_runs)
    s.bind(s.resume(max(steps)), {"how": "test"})
    model = Two()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with s.history.open("a") as history:
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            history.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
            s.save(step, model, optimizer, {}, {"skipped_steps": 0},
                   {"buffer": torch.full((2,), float(step))} if rank_state else None)
    return s


def resume(root: Path, target: int, components=RUN_A, force: bool = False, keep_runs: int = 2
           ) -> tuple[CheckpointStore, float | None]:
    """(the store, the weight value it loads, or None for a fresh start)."""
    s = store(root, components, keep_runs=keep_runs)
    point = s.resume(target, force)
    s.bind(point, {"how": "test"})
    if not point.step:
        return s, None
    model = Two(-1.0)
    s.load(model, torch.optim.SGD(model.parameters(), lr=1.0), {})
    return s, float(model.w[0].detach())


def test_a_lowered_target_resumes_at_or_before_it_and_never_later(tmp_path):
    train(tmp_path, [2, 4])
    s, value = resume(tmp_path, 3)
    assert (s.point.step, value) == (2, 2.0)
    assert resume(tmp_path, 4)[1] == 4.0
    s, value = resume(tmp_path, 1)
    assert value is None and "the newest is step 4" in s.point.why
    # the later checkpoint is still the run's: raised again, the target finds it
    assert resume(tmp_path, 9)[1] == 4.0


def test_each_run_digest_keeps_its_own_checkpoints_and_a_reverted_typo_finds_them(tmp_path):
    train(tmp_path, [2, 4])
    typo = {**RUN_A, "params": "typo"}
    s, value = resume(tmp_path, 4, typo)
    assert value is None and s.point.why == "no checkpoint: starting fresh"
    train(tmp_path, [1], typo)
    assert resume(tmp_path, 4)[1] == 4.0  # the real run again
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([digest_json(RUN_A)[:16], digest_json(typo)[:16]])


def test_runs_beyond_keep_runs_are_deleted_least_recently_used_first(tmp_path, caplog):
    runs = [{**RUN_A, "params": str(i)} for i in range(3)]
    for r in runs:
        train(tmp_path, [1], r)
    assert len(list(tmp_path.iterdir())) == 2  # the third run's start deleted the first's
    assert not (tmp_path / digest_json(runs[0])[:16]).exists()
    resume(tmp_path, 1, runs[1])  # used again: now the most recent
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(tmp_path, [1], {**RUN_A, "params": "3"})
    assert (tmp_path / digest_json(runs[1])[:16]).exists() and not (tmp_path / digest_json(runs[2])[:16]).exists()
    freed = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
    assert len(freed) == 1 and digest_json(runs[2])[:16] in freed[0] and "GB freed" in freed[0]
    (tmp_path / "notes").mkdir()  # a folder of someone else's is never the store's to delete
    train(tmp_path, [1], {**RUN_A, "params": "4"})
    assert (tmp_path / "notes").is_dir()


def newest_shard(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return sorted(run.glob("step-*/__0_*.distcp"))[-1]


def test_a_truncated_newest_shard_falls_back_to_the_intact_checkpoint_before_it(tmp_path, caplog):
    train(tmp_path, [2, 4])
    shard = newest_shard(tmp_path)
    shard.write_bytes(shard.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        s, value = resume(tmp_path, 4)
    assert (s.point.step, value) == (2, 2.0)
    assert any("is damaged" in r.getMessage() and "bytes, not" in r.getMessage() for r in caplog.records)
    assert (s.run_dir / "damaged-step-00000004").is_dir() and not (s.run_dir / "step-00000004").exists()
    # same size, other bytes: the checksum sees it; with nothing intact left the run starts fresh
    shard = newest_shard(tmp_path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    s, value = resume(tmp_path, 4)
    assert value is None and s.point.step == 0


def test_a_missing_rank_file_is_a_damaged_checkpoint(tmp_path):
    train(tmp_path, [2, 4], rank_state=True)
    (run,) = [p for p in tmp_path.iterdir()]
    (run / "step-00000004" / "rank-00000.safetensors").unlink()
    s, value = resume(tmp_path, 4)
    assert (s.point.step, value) == (2, 2.0)
    assert s.load_rank_state()["buffer"].tolist() == [2.0, 2.0]


def test_a_checkpoint_unreadable_with_whole_files_fails_clearly_and_is_not_tried_again(tmp_path, monkeypatch):
    train(tmp_path, [2, 4])
    s = store(tmp_path)
    s.bind(s.resume(4), {})

    def broken(*args, **kwargs):
        raise CheckpointException("read failed", {0: (ValueError("bad"), traceback.extract_stack())})

    monkeypatch.setattr("torch.distributed.checkpoint.load", broken)
    model = Two()
    with pytest.raises(CheckpointError, match="could not be loaded although its files are whole"):
        s.load(model, torch.optim.SGD(model.parameters(), lr=1.0), {})
    monkeypatch.undo()
    assert resume(tmp_path, 4)[1] == 2.0  # the rerun takes the one before


def test_a_torn_history_line_is_dropped_and_lines_past_the_checkpoint_are_cut(tmp_path, caplog):
    s = train(tmp_path, [1, 2])
    with s.history.open("a") as h:
        h.write(json.dumps({"step": 3, "loss": 0.3}) + "\n")  # logged, then lost with a kill
        h.write('{"step": 4, "lo')  # a write cut short by a full disk
    with caplog.at_level(logging.WARNING):
        s, _ = resume(tmp_path, 5)
    assert [r["step"] for r in read_history(s.history)] == [1, 2]
    assert any("not a whole history line" in r.getMessage() for r in caplog.records)


def test_force_resumes_across_a_code_change_only(tmp_path):
    train(tmp_path, [2])
    hotfix = {**RUN_A, "code": "c2"}
    assert resume(tmp_path, 4, hotfix)[1] is None  # auto: another code is another run
    s, value = resume(tmp_path, 4, hotfix, force=True)
    assert value == 2.0 and "resume: force" in s.point.why
    assert s.lineage[-1]["resumed_across_code_change_from"] == digest_json(RUN_A)[:16]
    assert [r["step"] for r in read_history(s.history)] == [2]  # the history continues
    other_params = {"params": "b", "code": "c2"}
    assert resume(tmp_path, 4, other_params, force=True)[1] is None  # params differ: never forced


def test_the_lineage_lists_each_step_range_and_how_it_ran(tmp_path):
    train(tmp_path, [2])
    s = store(tmp_path)
    s.bind(s.resume(4), {"activation_checkpointing": "full"})
    model = Two()
    s.load(model, torch.optim.SGD(model.parameters(), lr=1.0), {})
    s.save(4, model, torch.optim.SGD(model.parameters(), lr=1.0), {}, {})
    meta = json.loads((s.run_dir / "step-00000004" / "meta.json").read_text())
    ranges = [(r["from_step"], r["to_step"], r.get("how"), r.get("activation_checkpointing")) for r in meta["lineage"]]
    assert ranges == [(0, 2, "test", None), (2, 4, None, "full")]
    assert set(meta["files"]) >= {".metadata", "__0_0.distcp"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in meta["files"].values())


def test_checkpoints_in_the_older_layout_move_into_their_digests_folder(tmp_path):
    s = train(tmp_path / "new", [2], {"params": "x"})
    old = tmp_path / "old"
    old.mkdir()
    step = s.run_dir / "step-00000002"
    meta = json.loads((step / "meta.json").read_text())
    meta["digest"] = "0123456789abcdef-rest"
    (step / "meta.json").write_text(json.dumps(meta))
    os.replace(step, old / "step-00000002")
    os.replace(s.history, old / "history.jsonl")
    (old / "set_aside" / "fedcba9876543210").mkdir(parents=True)
    resume(old, 2, {"params": "y"}, keep_runs=3)
    assert (old / "0123456789abcdef" / "step-00000002" / "meta.json").is_file()
    assert (old / "0123456789abcdef" / "history.jsonl").is_file()
    assert (old / "fedcba9876543210").is_dir() and not (old / "set_aside").exists()
