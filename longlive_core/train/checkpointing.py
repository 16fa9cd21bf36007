"""Training checkpoints with ``torch.distributed.checkpoint``, kept per run digest.

A stage's checkpoints live in ``<root>/<digest16>/`` (``root``: ``checkpoints/<stage>``): one folder
per run digest (what a checkpoint must match to be resumed: the params that shape the math, the data
drawn, the starting weights, the world layout and the numeric code), each holding ``run.json`` (the
digest's components and when the run was last used), ``history.jsonl`` (one JSON line per completed
step) and ``step-N/`` checkpoints. A run resumes from the newest intact checkpoint of its own digest
at or before its target step, or starts fresh; it never loads a later step. Checkpoints of other
digests stay where they are, so a params typo started and reverted finds its run again; the
``keep_runs`` most recently used digests are kept, older ones deleted with a log line of what was
freed.

Every rank writes its own shards of the model, the optimizer and the EMA, and hashes the files it
wrote; rank 0 then writes ``meta.json`` (the step, the digest, every file with its size and
SHA-256, the lineage of step ranges) and renames the folder into place, so a checkpoint without
``meta.json`` or still under its temporary name is from a killed save and is never read. Before a
resume, rank 0 checks every listed file: a checkpoint with a file missing, cut short or changed is
renamed ``damaged-step-N`` (kept for a look, never tried again) and the next older one is tried. The
RNG needs no saving: every draw of a step is keyed by (seed, step, slot) or reseeded from them. State
that differs from rank to rank and is not sharded model state (the error-recycling buffers) goes into
one safetensors file per rank beside the DCP shards; the digest holds the world layout, so a resumed
rank reads the file its predecessor wrote.

``resume: force`` resumes, when the run's own digest has no checkpoint, from the most recently used
run whose digest differs in the numeric code alone (a hotfix of a crash at hour 1,500); the lineage
records it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from longlive_core.io.atomic import TMP_PREFIX, write_bytes, write_json
from longlive_core.models.weights import CheckpointError
from longlive_core.tracking.lineage import CODE, digest_file, digest_json

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"step-(\d{8})")
META = "meta.json"
RUN = "run.json"
HISTORY = "history.jsonl"
DAMAGED = "damaged-"
RESUME_MODES = ("auto", "force")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Rank 0's decision, sent to every rank: where this run saves and what (if anything) it loads."""

    run_dir: str  # this run's folder: its checkpoints and history
    step: int = 0  # 0: a fresh start
    why: str = "no checkpoint: starting fresh"
    load_dir: str | None = None  # the folder holding step ``step`` (another run's under resume: force)
    lineage: tuple[dict, ...] = ()  # the step ranges the loaded checkpoint was trained over
    skipped_steps: int = 0


def _describe(paths: Iterable[Path], root: Path) -> dict[str, dict]:
    paths = list(paths)
    with concurrent.futures.ThreadPoolExecutor(min(8, max(1, len(paths)))) as pool:
        sums = list(pool.map(digest_file, paths))  # hashlib releases the GIL: files hash in parallel
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": s} for p, s in zip(paths, sums)}


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def read_history(path: Path) -> list[dict]:
    """The lines of a history file, the latest per step, in step order. A line that is not JSON (a
    write cut short by a full disk or a kill) is dropped with a warning."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            log.warning("%s: line %d is not a whole history line (a write cut short): dropped", path, n)
    return [by_step[s] for s in sorted(by_step)]


def write_history(path: Path, rows: list[dict]) -> None:
    """``rows`` as a history file, one JSON line each, written whole (atomically)."""
    write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode(), path)


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class CheckpointStore:
    """One stage's checkpoints. ``components`` (rank 0 only; None elsewhere): what the run digest is
    made of, by name; ``model_keys``: which of the model's state-dict keys a checkpoint holds
    (default all; a distillation keeps its adapters, not the frozen backbone it rebuilds)."""

    def __init__(self, root: str | Path, keep: int, keep_runs: int = 2, components: dict[str, str] | None = None,
                 model_keys: Callable[[str], bool] | None = None):
        self.root, self.keep, self.keep_runs, self.model_keys = Path(root), keep, keep_runs, model_keys
        self.components = components
        self.digest = digest_json(components) if components is not None else None
        self.point: ResumePoint | None = None
        self.lineage: list[dict] = []

    # ------------------------------------------------------------------ rank 0: where to resume
    def resume(self, target: int, force: bool = False) -> ResumePoint:
        """Rank 0: tidies the store, picks the newest intact checkpoint of this digest at or before
        ``target`` (with ``force``, of the newest run that differs in code alone when this digest has
        none), drops the history lines a killed run logged past it, and deletes runs beyond
        ``keep_runs``. Every rank gets the answer through ``agree``, then calls ``bind``."""
        if self.components is None:
            raise ValueError("the run digest's components are rank 0's: pass them to its store")
        self.root.mkdir(parents=True, exist_ok=True)
        self._migrate_old_layout()
        run_dir = self.root / self.digest[:16]
        run_dir.mkdir(exist_ok=True)
        self._tidy(run_dir)
        write_json({"digest": self.digest, "components": self.components, "last_used": time.time()}, run_dir / RUN)
        point = self._newest_intact(run_dir, target)
        source = run_dir
        if point is None and force:
            for other in self._runs_differing_in_code():
                point = self._newest_intact(other, target)
                if point is not None:
                    source = other
                    break
        if point is None:
            (run_dir / HISTORY).unlink(missing_ok=True)
            later = [s for s, _ in self._complete(run_dir) if s > target]
            why = (f"no checkpoint at or before step {target} (the newest is step {max(later)}): starting fresh"
                   if later else "no checkpoint: starting fresh")
            self._evict(keep=run_dir)
            return ResumePoint(str(run_dir), why=why)
        step, meta = point
        if source == run_dir:
            keep = max(step, *(s for s, _ in self._complete(run_dir)))  # later lines belong to later checkpoints
            write_history(run_dir / HISTORY, [r for r in read_history(run_dir / HISTORY) if r["step"] <= keep])
            why = f"resuming from {run_dir / _step_name(step)} (step {step})"
        else:
            write_history(run_dir / HISTORY, [r for r in read_history(source / HISTORY) if r["step"] <= step])
            why = (f"resume: force: resuming from {source / _step_name(step)} (step {step}), a run whose digest "
                   f"differs in its code alone ({source.name}); recorded in the lineage")
            log.warning("%s", why)
        self._evict(keep=run_dir, also=source)
        return ResumePoint(str(run_dir), step, why, str(source), tuple(meta.get("lineage", ())),
                           int(meta.get("skipped_steps", 0)))

    def _complete(self, run_dir: Path) -> list[tuple[int, Path]]:
        found = []
        for path in run_dir.iterdir() if run_dir.is_dir() else ():
            m = STEP_DIR.fullmatch(path.name)
            if m and (path / META).is_file():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def _tidy(self, run_dir: Path) -> None:
        """Removes what killed saves left: temporaries, and step folders renamed without meta.json."""
        for leftover in run_dir.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        for path in run_dir.iterdir():
            if STEP_DIR.fullmatch(path.name) and not (path / META).is_file():
                shutil.rmtree(path)

    def _newest_intact(self, run_dir: Path, target: int) -> tuple[int, dict] | None:
        for step, path in reversed(self._complete(run_dir)):
            if step > target:
                continue
            meta, problem = verify(path)
            if problem is None:
                return step, meta
            log.warning("%s is damaged (%s): renamed %s%s, trying the one before", path, problem, DAMAGED, path.name)
            self._set_damaged(path)
        return None

    def _set_damaged(self, path: Path) -> None:
        target = path.with_name(DAMAGED + path.name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(path, target)

    def _runs(self) -> list[tuple[float, Path, dict]]:
        """(last used, folder, run.json) of every run folder, the most recently used first."""
        runs = []
        for path in self.root.iterdir():  # a folder without run.json is not the store's: never touched
            info = _read_json(path / RUN) if path.is_dir() else None
            if info is not None:
                runs.append((float(info.get("last_used", 0.0)), path, info))
        return sorted(runs, key=lambda r: r[0], reverse=True)

    def _runs_differing_in_code(self) -> list[Path]:
        mine = {k: v for k, v in self.components.items() if k != CODE}
        return [path for _, path, info in self._runs() if path.name != self.digest[:16]
                and {k: v for k, v in (info.get("components") or {}).items() if k != CODE} == mine]

    def _evict(self, keep: Path, also: Path | None = None) -> None:
        kept = [keep, *([also] if also is not None and also != keep else [])]
        for _, path, _ in self._runs():
            if path in kept:
                continue
            if len(kept) < self.keep_runs:
                kept.append(path)
                continue
            freed = _bytes(path)
            shutil.rmtree(path)
            log.info("checkpoints of run digest %s deleted (keep_runs %d, the most recently used kept): %.2f GB freed",
                     path.name, self.keep_runs, freed / 1e9)

    def _migrate_old_layout(self) -> None:
        """Checkpoints written before they were kept per digest (``step-N`` at the top, other runs
        under ``set_aside/<digest16>``) move into their digest's folder, with their history."""
        top = [(s, p) for s, p in self._complete(self.root)]
        if top:
            digest = str((_read_json(top[-1][1] / META) or {}).get("digest", "unknown"))[:16]
            dest = self.root / digest
            dest.mkdir(exist_ok=True)
            for _, path in top:
                os.replace(path, dest / path.name)
            if (self.root / HISTORY).is_file():
                os.replace(self.root / HISTORY, dest / HISTORY)
            write_json({"digest": digest, "last_used": time.time() - 1}, dest / RUN)
        aside = self.root / "set_aside"
        if aside.is_dir():
            for path in aside.iterdir():
                if not (self.root / path.name).exists():
                    used = min(path.stat().st_mtime, time.time() - 2)  # used before the run at the top
                    os.replace(path, self.root / path.name)
                    write_json({"digest": path.name, "last_used": used}, self.root / path.name / RUN)
            shutil.rmtree(aside)

    # ------------------------------------------------------------------ every rank
    def bind(self, point: ResumePoint, schedule: dict[str, Any]) -> None:
        """Every rank, with rank 0's decision: where this run saves, and the lineage it continues
        (``schedule``: how this run computes, which does not change the math: a step range of its own)."""
        self.point = point
        segment = {"from_step": point.step, **schedule}
        if point.load_dir is not None and point.load_dir != point.run_dir:
            segment["resumed_across_code_change_from"] = Path(point.load_dir).name
        self.lineage = [*point.lineage, segment]

    @property
    def run_dir(self) -> Path:
        if self.point is None:
            raise RuntimeError("bind the store to rank 0's ResumePoint first")
        return Path(self.point.run_dir)

    @property
    def history(self) -> Path:
        return self.run_dir / HISTORY

    def lineage_until(self, step: int) -> list[dict]:
        return [*self.lineage[:-1], {**self.lineage[-1], "to_step": step}]

    def _model_state(self, model, optimizer) -> tuple[dict, dict]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if self.model_keys is not None:
            model_sd = {k: v for k, v in model_sd.items() if self.model_keys(k)}
        return model_sd, optim_sd

    def save(self, step: int, model, optimizer, extra_state: dict, meta: dict,
             rank_state: dict[str, torch.Tensor] | None = None) -> None:
        """Collective: every rank calls it. ``rank_state``: tensors of this rank alone (the
        error-recycling buffers), written as its own safetensors file."""
        rank = dist.get_rank()
        tmp = self.run_dir / f"{TMP_PREFIX}step-{step:08d}"
        model_sd, optim_sd = self._model_state(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, **extra_state}, checkpoint_id=str(tmp))
        mine = sorted(tmp.glob(f"__{rank}_*.distcp"))
        if rank_state is not None:
            save_file({k: v.contiguous() for k, v in rank_state.items()}, str(tmp / _rank_file(rank)))
            mine.append(tmp / _rank_file(rank))
        described: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(described, _describe(mine, tmp))
        if rank == 0:
            files = {k: v for d in described for k, v in d.items()}
            others = [p for p in sorted(tmp.rglob("*")) if p.is_file() and p.relative_to(tmp).as_posix() not in files]
            files.update(_describe(others, tmp))  # DCP's .metadata, and anything not named by rank
            final = self.run_dir / _step_name(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_json({**meta, "step": step, "digest": self.digest, "files": files,
                        "lineage": self.lineage_until(step)}, final / META)
            done = [(s, p) for s, p in self._complete(self.run_dir) if s <= step]
            for _, old in done[:-self.keep]:  # later steps (a target lowered) stay: the same run's
                shutil.rmtree(old)
        dist.barrier()

    def load(self, model, optimizer, extra_state: dict) -> None:
        """Collective: restores the model, the optimizer and ``extra_state``'s tensors in place from
        the bound checkpoint. A checkpoint that cannot be read although its files are whole is
        renamed damaged and the run fails with a CheckpointError: its rerun takes the one before."""
        point = self.point
        path = Path(point.load_dir) / _step_name(point.step)
        model_sd, optim_sd = self._model_state(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, **extra_state}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointException as exc:  # a BaseException: past every `except Exception`
            dist.barrier()
            if dist.get_rank() == 0:
                self._set_damaged(path)
            raise CheckpointError(f"{path} could not be loaded although its files are whole ({_first_line(exc)}): "
                                  f"renamed {DAMAGED}{path.name}; run again to resume from the checkpoint before it "
                                  "or start fresh") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=self.model_keys is None))

    def load_rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's own tensors of the bound checkpoint (``save``'s ``rank_state``)."""
        point = self.point
        path = Path(point.load_dir) / _step_name(point.step) / _rank_file(dist.get_rank())
        if not path.is_file():  # verify() found it listed: it went missing since
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; run again to resume from the "
                                  "checkpoint before it")
        return load_file(str(path))


def verify(path: Path) -> tuple[dict, str | None]:
    """(meta.json, None) when every file the checkpoint lists is there with its size and SHA-256;
    else (what could be read, what is wrong)."""
    meta = _read_json(path / META)
    if meta is None:
        return {}, f"{META} is not readable JSON"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return meta, f"{META} lists no files (written by an older version): it cannot be checked"
    for name, want in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return meta, f"{name} is missing"
        if file.stat().st_size != want.get("size"):
            return meta, f"{name} is {file.stat().st_size} bytes, not {want.get('size')}"
    sums = _describe([path / n for n in sorted(files)], path)
    for name, got in sums.items():
        if got["sha256"] != files[name].get("sha256"):
            return meta, f"{name}'s SHA-256 differs from the one written with it"
    return meta, None


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def agree(value: Any) -> Any:
    """Rank 0's value on every rank (a small object made by this job's rank 0)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
