"""Lineage facts a run is tagged with: the code's git commit, whether the tree was dirty, and
content digests of what a stage read."""
from __future__ import annotations

import ast
import hashlib
import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def git_state(repo_root: str | Path = ".") -> dict[str, str]:
    """{'git.commit': sha or 'unknown', 'git.dirty': 'true'/'false'/'unknown'}; never raises."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo_root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    # Tracked files only (DVC keeps data out of git), and not dvc.lock: `dvc repro` rewrites it
    # after every stage, so it would mark every stage after the first as dirty.
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                 ":(exclude,glob)**/dvc.lock")
    return {"git.commit": commit.strip() if commit else "unknown",
            "git.dirty": "unknown" if status is None else str(bool(status.strip())).lower()}


def git_describe(repo_root: str | Path = ".") -> str:
    """``git describe --tags --always`` (the nearest tag and the commits since, or the short commit),
    with ``-dirty`` when tracked files other than dvc.lock changed (``git_state``'s rule); never raises."""
    try:
        out = subprocess.run(["git", "describe", "--tags", "--always"], cwd=repo_root, capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0 or not out.stdout.strip():
        return "unknown"
    return out.stdout.strip() + ("-dirty" if git_state(repo_root)["git.dirty"] == "true" else "")


def runtime_versions() -> dict[str, str]:
    """The versions of what turns the code into numbers: torch (and its CUDA), Triton where installed."""
    import torch

    versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        import triton
    except ImportError:
        versions["triton"] = "none"
    else:
        versions["triton"] = triton.__version__
    return versions


def dvc_out_hashes(lock_path: str | Path, stages: Iterable[str]) -> dict[str, str]:
    """{output path: its md5 in dvc.lock} for the outputs of ``stages`` (what DVC knows them by)."""
    import yaml

    lock = Path(lock_path)
    recorded = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.is_file() else {}
    return {out["path"]: out.get("md5", "") for stage in stages for out in recorded.get(stage, {}).get("outs", [])}


def digest_lines(lines: Iterable[str]) -> str:
    """SHA-256 over newline-terminated lines: a content digest of a listing, order included."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()


def digest_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def digest_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# Modules that read params, write files atomically, log and record runs, or start a stage's ranks:
# what a stage computes never depends on them, so they are not part of any stage's code (in
# dvc.yaml or in a reuse key).
RECORD_KEEPING = frozenset({
    "longlive_core.config", "longlive_core.progress", "longlive_core.io.atomic", "longlive_core.parallel",
    "longlive_core.tracking.lineage", "longlive_core.tracking.mlflow_run", "tasks.stage",
    "longlive_core.train.flops",  # FLOPs and MFU: logged numbers only
    "longlive_core.distributed.launch",  # the torchrun (or srun) command line
})
# Modules that change how fast the math runs, or how its state is kept between runs, never a number
# it computes: not part of any stage's code either (a launcher edit does not retrain the model). A
# module joins only with the test that shows it bit-identical to a reference path, named here
# (tests/test_stage_inputs.py checks that each test exists).
SPEED_ONLY = {
    "longlive_core.quant.triton_launch":  # the cached launch picks the very kernel Triton's own launch picks
        "tests/test_quant_triton.py::test_cached_launch_picks_the_kernel_triton_picks_on_the_gpu",
    "longlive_core.train.checkpointing":  # a resumed run's losses are an uninterrupted run's, bit for bit
        "tests/test_train_ar.py::test_resume_redoes_the_lost_step_exactly_from_the_run_digests_folder",
}
CODE = "code"  # the run digest's component of the numeric code: what `resume: force` lets differ
PACKAGES = ("longlive_core", "tasks")
REPO_ROOT = Path(__file__).resolve().parents[2]


def _module_file(name: str) -> Path | None:
    base = REPO_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    """Project modules ``path`` imports anywhere in it (function-level imports too)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from pkg import mod` imports the module pkg.mod when there is one
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and _module_file(name) is not None:
                found.add(name)
    return found


def code_closure(module: str) -> list[Path]:
    """The project's source files ``module`` runs: itself and what it imports, transitively, with
    their packages' __init__ files, less the record-keeping and speed-only modules and files with no
    code (paths relative to the repository)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen or name in RECORD_KEEPING or name in SPEED_ONLY:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages run first
        path = _module_file(name)
        if path is not None:
            todo.extend(_imports(path, name))
    files = {_module_file(n) for n in seen}
    return sorted(p.relative_to(REPO_ROOT) for p in files if p is not None and _has_code(p))


def _has_code(path: Path) -> bool:
    """False for a file of nothing but a docstring (most __init__ files): it runs nothing."""
    return bool(_without_docstrings(ast.parse(path.read_text(encoding="utf-8"))).body)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or ([] if isinstance(node, ast.Module) else [ast.Pass()])
    return tree


def code_digest(module: str) -> str:
    """A digest of the code ``module`` runs (``code_closure``), as parsed and written back out:
    comments, docstrings and layout do not count, so editing them reruns a stage under DVC without
    redoing its cached work (``ast.unparse``'s text rather than ``ast.dump``'s, which changes with
    Python versions)."""
    h = hashlib.sha256()
    for rel in code_closure(module):
        tree = _without_docstrings(ast.parse((REPO_ROOT / rel).read_text(encoding="utf-8")))
        h.update(rel.as_posix().encode() + b"\0" + ast.unparse(tree).encode() + b"\0")
    return h.hexdigest()
